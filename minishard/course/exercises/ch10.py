"""Chapter 10 exercise: a tensor-parallel MLP forward — split the matmul, never the weight's use.

FSDP stores 1/N of every weight but computes each layer whole, after gathering the weight.
Tensor parallelism never builds the full weight: rank r keeps columns ``[r·h_ff/N, (r+1)·h_ff/N)`` of
the first matrix W in Y = X W (and those entries of its bias) and the same rows of the second,
computes its part of the hidden layer, and one all-reduce sums the partial outputs. (Columns and
rows of W, Megatron's naming; ``nn.Linear.weight`` is W transposed, so below they are the rows
of the first Linear's weight and the columns of the second's.)

Write the forward. The check runs it on 1, 2 and 4 real ranks with the tiny GPT's first MLP,
compares the output with the whole MLP computed on one process and with minishard's
``TensorParallelMLP``, and checks what crossed the wire: activations (one all-reduce of the
output), never a weight.
"""
from __future__ import annotations

import torch

from . import at_world_sizes, attempt, expect, portable, run_on_rank


def tp_mlp_forward(comm, x: torch.Tensor, fc_w: torch.Tensor, fc_b: torch.Tensor,
                   proj_w: torch.Tensor, proj_b: torch.Tensor) -> torch.Tensor:
    """The MLP ``proj(gelu(fc(x)))`` with this rank's parts: ``x`` (b, s, h) on every rank;
    ``fc_w`` (h_ff/N, h) and ``fc_b`` (h_ff/N,): this rank's rows of the first Linear's weight and bias;
    ``proj_w`` (h, h_ff/N): this rank's columns of the second Linear's weight; ``proj_b`` (h,): the
    second bias, whole (add it once). ``comm.all_reduce(t)`` sums ``t`` over ranks in place.
    Return the full output (b, s, h), the same on every rank."""
    raise NotImplementedError("tp_mlp_forward: your code here")


def _task(ctx, spec: dict) -> dict:
    from minishard.core.comm import Comm
    from minishard.core.model import GPT, config
    from minishard.strategies.tp import TensorParallelMLP

    cfg = config("tiny")
    full = GPT(cfg, seed=0).blocks[0].mlp
    x = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = full(x)
        theirs = TensorParallelMLP(full, Comm(None))(x)
    N, r = ctx.world_size, ctx.rank
    F_ = full.fc.out_features
    part = slice(r * F_ // N, (r + 1) * F_ // N)
    comm = Comm(None)
    with torch.no_grad():
        y = run_on_rank(spec, comm, x.clone(), full.fc.weight[part].clone(), full.fc.bias[part].clone(),
                        full.proj.weight[:, part].clone(), full.proj.bias.clone())
    return {"rank": r, "gap": (y - want).abs().max().item(), "gap_tp": (y - theirs).abs().max().item(),
            "by_op": {op: v["wire"] for op, v in comm.by_op.items()},
            "activation_bytes": x.numel() * 4,
            "weight_bytes": sum(p.numel() * 4 for p in full.parameters())}


@attempt
def check_tp_mlp_forward(fn=None, ranks=None) -> None:
    spec = portable(fn or tp_mlp_forward)
    for n, out in at_world_sizes(_task, spec, ranks, (1, 2, 4)):
        for o in out:
            print(f"N={n} rank {o['rank']}: output within {o['gap']:.1e} of the whole MLP "
                  f"({o['gap_tp']:.1e} of TensorParallelMLP); on the wire {o['by_op'] or 'nothing'} "
                  f"— the MLP's weights are {o['weight_bytes']:,} B, its input {o['activation_bytes']:,} B")
            expect(o["gap"] <= 1e-4, f"N={n} rank {o['rank']}: your output is {o['gap']:.2e} "
                   f"away from the whole MLP's — each rank computes gelu(x @ fc_w.T + fc_b), "
                   f"multiplies by proj_w.T, the partial outputs are summed, the bias added once")
            expect(set(o["by_op"]) <= {"all_reduce"},
                   f"N={n}: you ran {sorted(o['by_op'])}; tensor parallelism needs one "
                   f"all-reduce of the output and never gathers a weight")
            ring = 2 * (n - 1) * o["activation_bytes"] // n
            expect(n == 1 or o["by_op"].get("all_reduce", 0) == ring,
                   f"N={n}: sum the (b, s, h) partial outputs with one all-reduce "
                   f"({ring:,} bytes on the wire), you sent {o['by_op']}")
