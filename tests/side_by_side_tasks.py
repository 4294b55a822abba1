"""Rank tasks for tests/test_side_by_side.py: one job under minishard's strategy and the same job
under PyTorch's, both traced, on the same ranks.

The two sides share everything but the strategy: the model (``TrainConfig.model``, the same
seed), the wrapping (each block a unit, then the root), the precision, the batches and the loop
(``minishard.training.loop.train_step``). minishard's side records into its own tracer (``train``);
torch's is built by ``minishard.strategies`` (``torch_fsdp`` / ``torch_ddp`` / ``torch_zero1``)
and recorded by ``minishard.watch``. A scenario is ``(mine, theirs, knobs)``: strategy names and
the ``TrainConfig`` fields both sides take.
"""
from __future__ import annotations

import torch

import minishard
from minishard.core import model as model_mod
from minishard.core.comm import Comm
from minishard.core.launch import RankContext
from minishard.core.trace import Tracer, load
from minishard.training.loop import TrainConfig, build, train, train_step

STEPS = 2                                # step 0 and one step after DDP's bucket rebuild


def _mine(rank, strategy: str, knobs: dict) -> list[dict]:
    """minishard's run, into a tracer of its own (events of one scenario only)."""
    tracer = Tracer(rank.rank, rank.world_size, origin=rank.tracer.origin)
    train(RankContext(rank.rank, rank.world_size, rank.device, tracer, rank.backend),
          TrainConfig(strategy=strategy, steps=STEPS, trace=True, **knobs))
    return load(tracer.events)


def _theirs(rank, strategy: str, knobs: dict, plant=None) -> list[dict]:
    """torch's run of the same job under ``minishard.watch``. ``plant(model)``: a test's change
    to torch's job before it runs (a planted difference the comparison must catch)."""
    config = TrainConfig(strategy=strategy, steps=STEPS, **knobs)
    cfg = model_mod.config(config.model)
    net = model_mod.GPT(cfg, seed=config.seed).to(rank.device)   # train()'s model, train()'s seed
    built = build(net, config, Comm())     # torch_fsdp runs minishard's prefetch schedule
    if plant is not None:
        plant(built.model)
    tracer = Tracer(rank.rank, rank.world_size, origin=rank.tracer.origin)
    with minishard.watch(built.model, built.optimizer, trace=tracer) as w:
        for step in range(STEPS):
            batch = model_mod.batch(cfg, step, config.micro_batch, rank.rank, rank.world_size,
                                    config.data_seed)
            train_step(built, [batch])
            w.step()
    return load(tracer.events)


def pair(rank, scenarios: list[tuple]) -> list:
    """Each scenario's ``(mine, theirs)`` events on this rank. A scenario is ``(minishard's
    strategy, torch's, knobs, plant on torch's model, plant on minishard's)``; a plant is the
    name of a function below (tests of the comparison itself), undone after its scenario."""
    out = []
    for mine, theirs, knobs, plant_theirs, plant_mine in scenarios:
        undo = globals()[plant_mine]() if plant_mine else None
        try:
            m = _mine(rank, mine, knobs)
        finally:
            if undo is not None:
                undo()
        out.append((m, _theirs(rank, theirs, knobs, globals()[plant_theirs] if plant_theirs else None)))
    return out


# ---------------------------------------------------------------------------- planted changes

def plant_no_backward_prefetch():
    """minishard's units gather no unit ahead in backward (FSDP2 still does: an empty explicit
    list means its default, ``_fsdp_state.py``: ``default_prefetch = len(...) == 0``). Returns
    the undo."""
    from minishard.strategies.fsdp.unit import FSDPUnit
    orig = FSDPUnit._prefetch_targets
    FSDPUnit._prefetch_targets = lambda self, forward: orig(self, forward) if forward else []
    return lambda: setattr(FSDPUnit, "_prefetch_targets", orig)


def plant_reversed_buckets():
    """minishard's DDP fills its buckets first layers first (torch's reducer: gradient-ready
    order, last layers first). Returns the undo."""
    from minishard.strategies import buckets
    orig = buckets.plan_buckets
    buckets.plan_buckets = lambda *a, **k: orig(*a, **k)[::-1]
    return lambda: setattr(buckets, "plan_buckets", orig)
