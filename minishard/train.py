"""The training loop every chapter runs, on one rank, under any strategy.

``train(rank, TrainConfig(strategy=..., steps=...))`` is a task for :class:`minishard.launch.Ranks`
(and the body of ``python -m minishard demo`` under torchrun). It builds the GPT from its config,
wraps it with the strategy (``minishard.strategies``), trains on this rank's slice of each global
batch with :func:`train_step`, and returns what the course shows: losses, step times, the
measured ledger (peak, per phase, by category), the bytes every collective moved — recorded by
``comm`` and counted by the OS (``minishard.meter``) — and, on request, the final parameters.

``train_step`` is the one training step of the project: the loop below, the lessons and the
tests all call it, so that every chapter compares like with like.
"""
from __future__ import annotations

import contextlib
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch

from . import model as model_mod
from . import strategies
from .comm import Comm
from .config import OPTIMIZERS, PRECISIONS, WRAPS, TrainConfig
from .launch import RankContext
from .ledger import LiveLedger, estimate, gpt_activation_bytes
from .meter import Meter
from .strategies import Built, build, wrap_targets
from .trace import Tracer

__all__ = ["TrainConfig", "train", "train_step", "build", "Built", "wrap_targets",
           "OPTIMIZERS", "PRECISIONS", "WRAPS"]


def train_step(built: Built, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
               clip: float | None = None, ledger: LiveLedger | None = None,
               tracer: Tracer | None = None, track_activations: bool = True) -> float:
    """One optimizer step over ``batches`` (one ``(x, y)`` per micro-batch): forward and
    backward each, the gradients synchronised once (``no_sync`` around all but the last), the
    gradient clipped by its global norm, the optimizer step, the gradients zeroed. Returns the
    step's loss (the mean over its micro-batches)."""
    accum = len(batches)
    loss_sum = 0.0
    with _phase(None, tracer, "step"):
        for k, (x, y) in enumerate(batches):
            quiet = built.no_sync is not None and k < accum - 1
            with built.no_sync() if quiet else nullcontext():
                with _phase(ledger, tracer, "forward"):
                    with ledger.activations() if (ledger is not None and track_activations) else nullcontext():
                        loss = built.model(x, y) / accum
                with _phase(ledger, tracer, "backward"):
                    loss.backward()
            loss_sum += loss.item()
        if built.sync_gradients is not None:          # naive DDP: after backward, not during
            with _phase(None, tracer, "sync_gradients"):
                built.sync_gradients()
        with _phase(ledger, tracer, "optimizer"):
            if clip is not None:
                built.clip_grad_norm(clip)
            built.optimizer.step()
            if ledger is not None and built.track_state is not None:
                built.track_state(ledger)             # the moments the first step created
            built.optimizer.zero_grad(set_to_none=False)   # (DDP's grads are views into buckets)
    return loss_sum


def train(rank: RankContext | None = None, config: TrainConfig = TrainConfig(),
          on_step: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Train ``config.steps`` optimizer steps; each sees ``config.accum`` micro-batches of
    ``config.micro_batch`` sequences per rank. Returns this rank's measurements. ``on_step``
    is called after every step with ``{rank, step, steps, loss, seconds, peak}`` (progress)."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train(rank, config) takes a TrainConfig, got {type(config).__name__}: "
                        f"train(rank, TrainConfig(strategy='ddp', steps=3))")
    alone = rank is None                       # plain single process: no launcher, no group
    rank = RankContext(0, 1, torch.device("cpu"), Tracer(), "none") if alone else rank
    tracer = rank.tracer
    tracer.enabled = config.trace
    strategy = strategies.get(config.strategy)
    cfg = model_mod.config(config.model, **config.model_overrides)
    ledger = LiveLedger(tracer, budget=config.device_budget) if strategy.instrumented else None
    comm = Comm(tracer, ledger=ledger, alone=alone)
    built = build(_model(config, cfg, rank.device, rank.rank), config, comm, ledger)
    first_step, ckpt = 0, {}
    if config.resume_from is not None:
        from . import checkpoint
        ckpt["load"] = checkpoint.load(built.model, built.optimizer, config.resume_from, comm=comm)
        first_step = ckpt["load"]["step"]

    meter = Meter(built.comms, built.units)
    for step in range(first_step, first_step + config.steps):
        tracer.step = step
        batches = [model_mod.batch(cfg, step * config.accum + k, config.micro_batch, rank.rank,
                                   rank.world_size, config.data_seed) for k in range(config.accum)]
        batches = [(x.to(rank.device), y.to(rank.device)) for x, y in batches]
        with meter.step():
            loss = train_step(built, batches, clip=config.clip, ledger=ledger, tracer=tracer,
                              track_activations=config.track_activations)
        meter.loss(loss)
        if on_step is not None:
            on_step({"rank": rank.rank, "step": step - first_step, "steps": config.steps, "loss": loss,
                     "seconds": meter.steps["step_times"][-1], "peak": ledger.peak if ledger else 0})
    tracer.step = None

    out: dict[str, Any] = {"rank": rank.rank, "world_size": rank.world_size,
                           "strategy": strategy.name, **meter.steps, "by_op": meter.by_op(),
                           "n_params": model_mod.GPT(cfg, device="meta").num_params()}
    if hasattr(built.optimizer, "layout"):
        out["layout"] = built.optimizer.layout()
    if ledger is not None:
        out["ledger"] = _ledger_report(ledger, config, cfg, strategy, rank.world_size)
    if config.save_to is not None:
        from . import checkpoint
        ckpt["save"] = checkpoint.save(built.model, built.optimizer, config.save_to, comm=comm,
                                       step=first_step + config.steps)
    if ckpt:
        out["checkpoint"] = ckpt
    if config.return_params:
        out["params"] = built.full_parameters()
    if config.return_state:
        out["optimizer_state"] = built.optimizer.state_dict()
    if ledger is not None:
        out["ledger"]["by_device"] = ledger.by_device()
    if built.tier is not None:
        built.tier.cleanup()
    return out


def _model(config: TrainConfig, cfg, device, rank: int = 0) -> torch.nn.Module:
    """The GPT this rank starts from (the same seed everywhere, unless ``rank_seeds``), its
    memory knobs set and the frozen parameters' gradients switched off."""
    net = model_mod.GPT(cfg, seed=config.seed + (rank if config.rank_seeds else 0)).to(device)
    net.recompute_activations = config.recompute
    net.loss_chunk_tokens = config.loss_chunk_tokens
    for name, p in net.named_parameters():
        if config.freeze and name.startswith(config.freeze):
            p.requires_grad_(False)
    return net


def _ledger_report(ledger: LiveLedger, config: TrainConfig, cfg, strategy, world_size: int) -> dict:
    """The measured ledger, next to the analytic estimate for the same run."""
    act = 0
    if config.track_activations:
        act = gpt_activation_bytes(cfg, config.micro_batch,
                                   dtype_bytes=2 if config.precision == "bf16_mixed" else 4)
    trainable = model_mod.GPT(cfg, device="meta")
    for name, p in trainable.named_parameters():
        if config.freeze and name.startswith(config.freeze):
            p.requires_grad_(False)
    est = estimate(trainable, world_size=world_size, strategy=strategy.name,
                   precision=strategy.ledger_precision(config.precision), optimizer=config.optimizer,
                   activation_bytes=act)
    return {"peak": ledger.peak, "peak_snapshot": ledger.peak_snapshot,
            "category_peaks": {c: b for (c, d), b in ledger.category_peaks.items() if d == ledger.device},
            "phase_peaks": ledger.phase_peaks, "final": ledger.current(), "estimate": est.per_rank}


def _phase(ledger: LiveLedger | None, tracer: Tracer | None, name: str):
    if ledger is not None:
        return ledger.phase(name)
    return tracer.phase(name) if tracer is not None else contextlib.nullcontext()
