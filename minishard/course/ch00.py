"""Small task functions for the course's "how to run" chapter.

A task is a module-level function ``fn(rank: RankContext, ...)``: the rank processes import it by
name, which is why it lives in a ``.py`` file and not in a notebook cell. Run one with
:class:`minishard.core.launch.Ranks`::

    with Ranks(2) as ranks:
        ranks.run(hello, payload_mb=1.0)        # one result per rank
        ranks.run(fail_on_rank, bad_rank=1)     # raises RankError: rank 1 failed first

Both trace what they do, so a notebook can replay them in the player like a training run.
"""
from __future__ import annotations

import os

import torch

from minishard.core.comm import Comm
from minishard.core.launch import RankContext


def hello(rank: RankContext, payload_mb: float = 1.0) -> dict:
    """Every rank contributes ``rank + 1`` to one all-reduce: everyone gets 1 + 2 + ... + N.

    Returns what this rank saw and sent, so the caller can check the sum and the wire bytes.
    """
    comm = Comm(rank.tracer)
    numel = int(payload_mb * 2**20) // 4
    x = torch.full((numel,), float(rank.rank + 1), device=rank.device)
    with rank.tracer.phase("step"):
        comm.all_reduce(x, tag="hello")
    return {"rank": rank.rank, "world_size": rank.world_size, "pid": os.getpid(),
            "value": x[0].item(), "wire": comm.totals["wire"]}


def fail_on_rank(rank: RankContext, bad_rank: int = 1, steps: int = 3) -> dict:
    """A job where one rank crashes in the middle of training.

    Every rank runs ``steps`` all-reduces; at step 1, rank ``bad_rank`` raises *instead of*
    joining the collective. Its peers are left waiting in that all-reduce and then fail with
    "Connection closed by peer" — symptoms, not the cause. The launcher reports the rank that
    failed first, with its own traceback, and the pool of ranks must be recreated (its process
    group died mid-collective).
    """
    if not 0 <= bad_rank < rank.world_size:
        raise ValueError(f"bad_rank {bad_rank} is not a rank of a world of {rank.world_size}")
    comm = Comm(rank.tracer)
    x = torch.ones(1024, device=rank.device)
    for step in range(steps):
        rank.tracer.step = step
        with rank.tracer.phase("step"):
            if step == 1 and rank.rank == bad_rank:
                raise RuntimeError(f"simulated crash on rank {rank.rank} at step {step}")
            comm.all_reduce(x, tag=f"step{step}")
    return {"rank": rank.rank, "value": x[0].item()}

