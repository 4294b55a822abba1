"""Failures planted on purpose: the bugs people hit with sharded training, reproduced on real ranks
(chapter 11, ``demo --fault NAME --fault-rank R``) so that the flight recorder and the doctor
can be seen to catch them.

    skip-collective  rank R skips the gradient reduction of the last step, and every collective
                     after it — a rank that holds only frozen parameters (LoRA) believes it has
                     nothing to reduce. The others wait in it until the collective timeout.
    reorder          rank R's forward gathers blocks.1 before blocks.0 (its prefetch list says
                     so; the others gather in order). The two units are the same size, so the
                     gathers pair up across units and nothing hangs: the model is silently wrong.
    unsynced-init    rank R builds its model from another seed, and the strategy does not make
                     the ranks start from rank 0's weights (as FSDP2's ``fully_shard`` does not).
    no-master        the weights are bfloat16 and the optimizer steps them: no fp32 master copy,
                     so an update smaller than half a bf16 step is rounded away.
    local-clip       the gradient norm's all-reduce is skipped on every rank: each clips by the
                     norm of its own gradient shards, not the global norm.

A fault is planted by the objects that would make the mistake: the communicator's ``skip``
predicate (the collectives a rank never issues), the seed a rank builds from, the prefetch list
of one rank's root, the dtype the weights are trained in. Nothing else in the engine knows.
"""
from __future__ import annotations

from typing import Callable

import torch

FAULTS = {
    "skip-collective": "rank R skips the last step's gradient reduction and every collective after it",
    "reorder": "rank R's forward gathers blocks.1 before blocks.0 (FSDP)",
    "unsynced-init": "rank R starts from other weights and no rank broadcasts rank 0's",
    "no-master": "bf16 weights stepped in bf16: no fp32 master",
    "local-clip": "every rank clips by the norm of its own gradient shards",
}
# the gradient collectives a rank with nothing to reduce would skip
REDUCTIONS = ("all_reduce", "reduce_scatter")
GRADIENT_PHASES = ("backward", "sync_gradients")     # (naive DDP reduces after backward)


def seed(config, rank: int) -> int:
    """The seed this rank builds its model from."""
    if config.fault == "unsynced-init" and rank == config.fault_rank:
        return config.seed + 1
    return config.seed + (rank if config.rank_seeds else 0)


def synced_start(config) -> bool:
    """Do the strategies broadcast rank 0's weights at the start?"""
    return config.fault != "unsynced-init"


def weights_dtype(config) -> torch.dtype | None:
    """The dtype the whole model is cast to before wrapping (no-master), or None."""
    return torch.bfloat16 if config.fault == "no-master" else None


def skip(config, rank: int, last_step: int) -> Callable[[str, str, int | None, str | None], bool] | None:
    """The communicator's ``skip(op, tag, step, phase)``: which collectives this rank never issues."""
    if config.fault == "local-clip":
        return lambda op, tag, step, phase: tag == "grad_norm"
    if config.fault != "skip-collective" or rank != config.fault_rank:
        return None
    skipping = []

    def skipped(op, tag, step, phase) -> bool:
        if not skipping and step == last_step and phase in GRADIENT_PHASES and op in REDUCTIONS:
            skipping.append((op, tag))
        return bool(skipping)
    return skipped


def arm(config, rank: int, comms, last_step: int) -> None:
    """Give every communicator of this rank its ``skip`` (None: it skips nothing)."""
    skipping = skip(config, rank, last_step)
    for c in comms:
        c.skip = skipping


def plant_after_build(config, rank: int, built) -> None:
    """What is planted in the wrapped model: the reordered prefetch list of one rank's root."""
    if config.fault != "reorder" or rank != config.fault_rank:
        return
    blocks = list(built.model.blocks)      # (at least two: TrainConfig checked the model)
    if built.strategy.instrumented:
        from minishard.strategies.fsdp import set_modules_to_forward_prefetch
        set_modules_to_forward_prefetch(built.model, [blocks[1], blocks[0]])
    else:                                  # FSDP2: the same list, on its own API
        built.model.set_modules_to_forward_prefetch([blocks[1], blocks[0]])
