"""Clipping by the global gradient norm when no rank holds the whole gradient.

``torch.nn.utils.clip_grad_norm_`` scales every gradient by max_norm / ‖g‖ (at most 1), where ‖g‖
is the norm of the *whole* gradient. Under ZeRO-2/3 and FSDP each rank holds shards of it, and a
norm of its own shards would differ from rank to rank (chapter 11 plants exactly that). So each
rank sums the squares of its shards (padding is zero), one all-reduce of that single number over
the shard group adds the ranks up (hybrid sharding: each replica group holds the same shards),
the gradients every rank holds whole (FSDP's replicated parameters) are added once, after it,
and every rank scales by the same factor. ZeRO and FSDP both clip here.
"""
from __future__ import annotations

from typing import Iterable

import torch


# the tag of the squared norm's all-reduce in traces and flight dumps (the doctor looks for it)
NORM_TAG = "grad_norm"


@torch.no_grad()
def clip_sharded_grad_norm_(shards: Iterable[torch.Tensor], comm, max_norm: float, *,
                            whole: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scale ``shards`` (this rank's part of the gradient) and ``whole`` (gradients every rank
    holds in full) in place by ``max_norm`` over the global norm; returns that norm."""
    shards, whole = list(shards), list(whole)
    first = next(iter(shards + whole), None)
    sq = torch.zeros(1, dtype=torch.float64, device=None if first is None else first.device)
    for g in shards:
        sq += g.double().pow(2).sum()
    comm.all_reduce(sq, tag=NORM_TAG)
    for g in whole:
        sq += g.double().pow(2).sum()
    total = sq.sqrt().to(torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in shards + whole:
        g.mul_(coef.to(g.dtype))
    return total
