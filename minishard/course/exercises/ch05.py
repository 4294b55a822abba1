"""Chapter 05 exercise: gather one parameter from its shards (ZeRO-3's all-gather).

Under ZeRO-3 (per-parameter sharding, as FSDP2) a parameter of shape ``(rows, ...)`` is cut
along dim 0 into N blocks of ``ceil(rows / N)`` rows; rank r keeps block r, and the last blocks
are padded with zeros so that all have the same size. Write the *unshard* of one parameter:
all-gather the blocks and rebuild the full tensor, padding dropped.

The check shards the nano GPT with ``fully_shard`` on 1, 2 and 3 real ranks (3 does not divide
every dimension: padding), runs your function on every shard, and compares the result with
minishard's own gather (``fsdp.full_parameters``) — and your bytes on the wire with the
all-gather formula.
"""
from __future__ import annotations

import torch

from . import at_world_sizes, attempt, expect, portable, run_guarded


def unshard_param(comm, shard: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The full parameter of shape ``shape`` from this rank's ``shard`` (``ceil(shape[0] / N)``
    rows, zero-padded). ``comm.all_gather(out, inp)``: ``out`` (N × inp.numel() elements)
    receives every rank's ``inp`` in rank order. A 0-d parameter counts as one row."""
    raise NotImplementedError("unshard_param: your code here")


def _task(ctx, spec: dict) -> dict:
    from minishard.strategies import fsdp
    from minishard.core.comm import Comm
    from minishard.core.model import GPT

    net = GPT("nano", seed=0)
    comm = Comm(None)
    fsdp.apply_fsdp(net, comm=comm)
    want = fsdp.full_parameters(net)                  # minishard's gather, unit by unit
    names = {id(m): n for n, m in net.named_modules()}
    comm.reset_counters()
    got, wrong, error = {}, [], None
    for unit in fsdp.units(net):
        for slot, shard in zip(unit.layout.slots, unit.layout.sharded):
            prefix = names[id(slot.module)]
            name = f"{prefix}.{slot.name}" if prefix else slot.name
            full, error = run_guarded(spec, comm, shard.detach(), tuple(slot.shape))
            if error is not None:
                error = (name, tuple(shard.shape), tuple(slot.shape), error)
                break
            got[name] = full
            if tuple(full.shape) != tuple(want[name].shape) or not torch.equal(full, want[name]):
                wrong.append(name)
        if error is not None:
            break
    padded = sum(unit.layout.per_rank for unit in fsdp.units(net)) * 4 * ctx.world_size
    return {"rank": ctx.rank, "wrong": wrong, "error": error, "n": len(got), "wire": comm.totals["wire"],
            "calls": comm.totals["calls"], "padded_bytes": padded,
            "example": next(iter(wrong), None) and (tuple(got[wrong[0]].shape), tuple(want[wrong[0]].shape))}


@attempt
def check_unshard_param(fn=None, ranks=None) -> None:
    spec = portable(fn or unshard_param)
    for n, out in at_world_sizes(_task, spec, ranks, (1, 2, 3)):
        for o in out:
            if o["error"] is not None:
                name, shard, shape, error = o["error"]
                expect(False, f"N={n}: for {name} (shard {shard}, full shape {shape}) your function "
                       f"raised {error}. The all-gather returns N blocks of ceil(rows / N) rows, "
                       f"the last ones zero-padded: keep the first {shape[0] if shape else 1} "
                       f"rows, then reshape to {shape}")
            ring = (n - 1) * o["padded_bytes"] // n
            print(f"N={n} rank {o['rank']}: {o['n'] - len(o['wrong'])} of {o['n']} parameters "
                  f"equal minishard's gather; you sent {o['wire']:,} bytes in {o['calls']} "
                  f"all-gathers (the ring: (N-1)/N of the padded size = {ring:,})")
            expect(not o["wrong"], f"N={n}: {o['wrong'][:3]} differ from minishard's gather "
                   f"(your shape, its shape: {o['example']}) — gather N blocks, stack them "
                   f"along dim 0, drop the padding rows, reshape")
            expect(abs(o["wire"] - ring) <= 4 * o["calls"] * n,
                   f"N={n}: you sent {o['wire']:,} bytes; one all-gather per parameter of the "
                   f"shard sends {ring:,} in all")
