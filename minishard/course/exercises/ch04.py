"""Chapter 04 exercise: ZeRO-2's reduce-scatter bucket hook.

Under ZeRO-2 a rank never keeps the whole gradient. As backward produces each parameter's
gradient, a hook copies it into its bucket's buffer and drops it; when the bucket's last
gradient has arrived, the bucket is reduce-scattered — still during backward — and the rank
keeps only the averaged shard it will update.

Write the hook factory. The check registers your hooks on a small model on 2 and 4 real ranks,
runs backward, and compares each rank's shards with the averaged gradient that a DDP-style
all-reduce gives; it also checks that no full gradient is left behind and that every bucket was
reduced *during* backward.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from . import at_world_sizes, attempt, expect, portable, run_on_rank


def make_bucket_hook(comm, params: list, offsets: list[int], chunk: int, out: torch.Tensor):
    """Return ``hook(p)``; it is registered with ``p.register_post_accumulate_grad_hook`` on every
    parameter of one bucket, and is called when ``p.grad`` is complete.

    * ``params`` — the bucket's parameters; ``offsets[i]`` — where ``params[i]`` starts in it;
    * the bucket holds ``comm.world_size * chunk`` elements (zero padding at the end);
    * ``out`` — this rank's gradient shard of the bucket (``chunk`` elements): *add* the averaged
      shard to it (gradients accumulate).

    Copy each gradient into the bucket's buffer and set ``p.grad = None`` (no full gradient
    stays). Once all of the bucket's gradients are in: ``comm.reduce_scatter(mine, buffer)``
    gives the *sum* over ranks of chunk ``comm.rank``; divide by N, add to ``out``, drop the buffer.
    """
    raise NotImplementedError("make_bucket_hook: your code here")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 7), nn.Tanh(), nn.Linear(7, 3))


def _task(ctx, spec: dict) -> dict:
    from minishard.core.comm import Comm

    N, r = ctx.world_size, ctx.rank
    model, reference = _model(), _model()
    params = list(model.parameters())
    buckets = [params[4:], params[:4]]                  # backward reaches the last layer first
    comm = Comm(None)
    shards, reduced_at = [], []
    backward_done = [False]
    for k, bucket in enumerate(buckets):
        offsets = [sum(p.numel() for p in bucket[:i]) for i in range(len(bucket))]
        chunk = math.ceil(sum(p.numel() for p in bucket) / N)
        out = torch.zeros(chunk)
        shards.append((out, chunk))
        hook = run_on_rank(spec, comm, bucket, offsets, chunk, out)

        def watched(p, hook=hook, k=k):
            before = comm.totals["calls"]
            hook(p)
            if comm.totals["calls"] > before:           # this call reduced the bucket
                reduced_at.append((k, backward_done[0]))

        for p in bucket:
            p.register_post_accumulate_grad_hook(watched)
    x = torch.randn(4, 13, generator=torch.Generator().manual_seed(r))
    model(x).pow(2).mean().backward()
    backward_done[0] = True
    leftover = [i for i, p in enumerate(params) if p.grad is not None]
    # the reference: full gradients, averaged with an all-reduce, cut into the same shards
    reference(x).pow(2).mean().backward()
    ref_comm = Comm(None)
    want = []
    rparams = list(reference.parameters())
    for bucket_ref, (out, chunk) in zip([rparams[4:], rparams[:4]], shards):
        flat = torch.zeros(N * chunk)
        torch.cat([p.grad.reshape(-1) for p in bucket_ref], out=flat[:sum(p.numel() for p in bucket_ref)])
        ref_comm.all_reduce(flat)
        want.append((flat / N)[r * chunk:(r + 1) * chunk])
    return {"rank": r, "got": [o.clone() for o, _ in shards], "want": want, "leftover": leftover,
            "reduced_at": reduced_at, "by_op": dict(comm.by_op)}


@attempt
def check_make_bucket_hook(fn=None, ranks=None) -> None:
    spec = portable(fn or make_bucket_hook)
    for n, out in at_world_sizes(_task, spec, ranks, (1, 2, 4)):
        for o in out:
            gaps = [(g - w).abs().max().item() for g, w in zip(o["got"], o["want"])]
            print(f"N={n} rank {o['rank']}: shards within {max(gaps):.1e} of the all-reduced "
                  f"gradient; collectives {o['by_op']}; buckets reduced {o['reduced_at']}")
            expect(not o["leftover"], f"N={n}: parameters {o['leftover']} still hold a full "
                   f"gradient after backward — set p.grad = None once it is in the bucket")
            expect(max(gaps) <= 1e-6, f"N={n} rank {o['rank']}: your shards are "
                   f"{max(gaps):.2e} away from the averaged gradient — copy each grad to its "
                   f"offset, reduce-scatter the whole bucket, divide by N, add to out")
            expect(sorted(k for k, _ in o["reduced_at"]) == [0, 1] and
                   not any(after for _, after in o["reduced_at"]),
                   f"N={n}: each bucket must be reduced exactly once, from the hook, during "
                   f"backward (got {o['reduced_at']})")
            expect(set(o["by_op"]) == {"reduce_scatter"},
                   f"N={n}: use a reduce-scatter (you ran {sorted(o['by_op'])})")
