"""The training loop every chapter runs, on one rank, under any strategy.

``train(rank, TrainConfig(strategy=..., steps=...))`` is a task for :class:`minishard.core.launch.Ranks`
(and the body of ``python -m minishard demo`` under torchrun). It builds the GPT from its config,
wraps it with the strategy (``minishard.strategies``), trains on this rank's micro-batch of each global
batch with :func:`train_step`, and returns what the course shows: losses, step times, the
measured ledger (peak, per phase, by category), the bytes every collective moved — recorded by
``comm`` and counted by the OS (``minishard.training.meter``) — and, on request, the final parameters.

The step itself is :func:`minishard.training.step.train_step`; this module is the run around it.
"""
from __future__ import annotations

import contextlib
from contextlib import nullcontext
from typing import Any, Callable

import torch

from minishard import strategies
from minishard.core import model as model_mod
from minishard.core import run_id
from minishard.core.comm import Comm
from minishard.core.flight import dumping
from minishard.core.launch import RankContext
from minishard.core.ledger import LiveLedger
from minishard.core.trace import Tracer
from minishard.instruments import health, replicas
from minishard.instruments.watching import watch
from minishard.strategies.fsdp import wrap_targets
from minishard.strategies.registry import Built, build
from . import report
from .config import OPTIMIZERS, PRECISIONS, WRAPS, TrainConfig
from .hooks import RunHooks
from .meter import Meter
from .step import train_step

__all__ = ["TrainConfig", "train", "train_step", "build", "Built", "wrap_targets",
           "OPTIMIZERS", "PRECISIONS", "WRAPS"]


def train(rank: RankContext | None = None, config: TrainConfig = TrainConfig(),
          on_step: Callable[[dict], None] | None = None, *, hooks: RunHooks | None = None) -> dict[str, Any]:
    """Train ``config.steps`` optimizer steps; each sees ``config.accum`` micro-batches of
    ``config.micro_batch`` sequences per rank. Returns this rank's measurements. ``on_step``
    is called after every step with ``{rank, step, first, steps, loss, loss_resolution, seconds,
    peak}`` (progress; ``step`` counts on from a resumed checkpoint's). ``hooks``: what wraps the
    run's objects (``minishard.training.hooks``)."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train(rank, config) takes a TrainConfig, got {type(config).__name__}: "
                        f"train(rank, TrainConfig(strategy='ddp', steps=3))")
    hooks = RunHooks() if hooks is None else hooks
    alone = rank is None                       # plain single process: no launcher, no group
    rank = RankContext(0, 1, torch.device("cpu"), Tracer(), "none") if alone else rank
    tracer = rank.tracer
    tracer.enabled = config.trace
    strategy = strategies.get(config.strategy)
    cfg = model_mod.config(config.model, **config.model_overrides)
    ledger = LiveLedger(tracer, budget=config.device_budget) if strategy.instrumented else None
    hooks.check(config, rank.world_size)
    comm = hooks.comm(tracer, ledger, alone)
    facts = comm.flight.facts if config.flight_dir is not None else None   # for the doctor
    if config.flight_dir is not None:       # in every file the run leaves: its dumps, rings, traces
        tracer.run = comm.flight.run = run_id.new() if alone else run_id.agree(rank.device)
    built = _build_noted(config, cfg, rank, comm, ledger, facts, hooks)
    first_step, ckpt = 0, {}
    if config.resume_from is not None:
        from minishard import checkpoint
        ckpt["load"] = checkpoint.load(built.model, built.optimizer, config.resume_from, comm=comm)
        first_step = ckpt["load"]["step"]
    hooks.starting([comm, *built.comms], config, rank.rank, first_step, first_step + config.steps - 1)

    meter = Meter(built.comms, built.units)
    saves: list[tuple[int, Any]] = []           # (step, what save returned)
    with _flight(comm, config), _noting(built, facts, tracer, comm, config) as noted, \
            _watching(built, config, tracer, alone, comm) as w:
        for step in range(first_step, first_step + config.steps):
            tracer.step = step
            batches = _batches(cfg, config, step, rank)
            with meter.step():
                loss = train_step(built, batches, clip=config.clip, ledger=ledger,
                                  tracer=None if w else tracer,
                                  track_activations=config.track_activations)
            if w:
                w.step()
            if noted is not None:
                noted.ended(step)
            meter.loss(loss)
            if on_step is not None:
                on_step({"rank": rank.rank, "step": step, "first": step == first_step,
                         "steps": first_step + config.steps, "loss": loss, "loss_resolution":
                         report.loss_resolution(loss, config), "seconds": meter.steps["step_times"][-1],
                         "peak": ledger.peak if ledger else w.peak if w else 0})
            if config.save_every is not None and (step + 1) % config.save_every == 0:
                saves.append((step + 1, _save(config, built, comm, step + 1)))
    if config.save_to is not None:      # (a last save the loop did not make: of the last step)
        ckpt["save"] = _saved(config, built, comm, first_step + config.steps, saves)
    tracer.step = None
    out = report.outputs(rank, config, cfg, meter, built, first_step, w, ledger, comm, ckpt)
    return out | ({"run": tracer.run} if config.flight_dir is not None else {})


def _save(config: TrainConfig, built: Built, comm: Comm, step: int):
    """A checkpoint of ``step`` to ``config.save_to`` (replacing the one before); in the
    background, the next save or the end of the run waits for it."""
    from minishard import checkpoint
    return checkpoint.save(built.model, built.optimizer, config.save_to, comm=comm, step=step,
                           background=config.save_background)


def _saved(config: TrainConfig, built: Built, comm: Comm, last: int, saves: list) -> dict:
    """The last step saved too, and every background save waited for: a run does not end before
    its checkpoint is on disk. This rank's numbers of the last save, and how long each save held
    up training (``stalls``: step, seconds)."""
    from minishard import checkpoint
    if not saves or saves[-1][0] != last:
        saves.append((last, _save(config, built, comm, last)))
    checkpoint.wait_for_saves(comm)
    done = [(s, out.wait() if isinstance(out, checkpoint.PendingSave) else out) for s, out in saves]
    return {**done[-1][1], "stalls": [(s, out["stall_seconds"]) for s, out in done]}


def _build_noted(config: TrainConfig, cfg, rank: RankContext, comm: Comm, ledger, facts: dict | None,
                 hooks: RunHooks) -> Built:
    """The model built and wrapped, with what ``hooks`` change in each; ``facts`` (for the
    doctor): the weights as built and — replicas — as training starts from them."""
    net = hooks.model(_model(config, cfg, rank.device, rank.rank), config, rank.rank)
    if facts is not None:
        health.note_run(facts, config, rank.world_size)
        facts["weights_built"] = health.fingerprint(net.named_parameters())
    built = build(net, config, comm, ledger)
    hooks.wrapped(built, config, rank.rank)
    if facts is not None and built.strategy.stage < 3:
        facts["weights_start"] = health.fingerprint(net.named_parameters())
    return built


def _batches(cfg, config: TrainConfig, step: int, rank: RankContext) -> list:
    """This rank's ``config.accum`` micro-batches of the global batch of ``step``."""
    return [(x.to(rank.device), y.to(rank.device)) for x, y in (
        model_mod.batch(cfg, step * config.accum + k, config.micro_batch, rank.rank,
                        rank.world_size, config.data_seed) for k in range(config.accum))]


@contextlib.contextmanager
def _flight(comm: Comm, config: TrainConfig):
    """The rank's last collectives, written to ``config.flight_dir`` however the run ends; a rank
    that raised or was sent SIGTERM also leaves its trace there (``rank{r}.jsonl``: the player's,
    and the doctor reads its ledger), since whoever collects the ranks' events on success never
    gets them."""
    if not config.flight_dir:
        yield
        return
    with dumping(comm.flight, config.flight_dir, torch_recorder=config.torch_flight, tracer=comm.tracer):
        yield


@contextlib.contextmanager
def _noting(built: Built, facts: dict | None, tracer: Tracer, comm: Comm, config: TrainConfig):
    """For the doctor (``facts``: the flight recorder's), a note of every optimizer step — the
    precision it stepped in, the norm it was clipped by — through the optimizer's step hooks; and
    what it yields, the replicas' fingerprints and the optimizer's settings every
    ``config.fingerprint_every`` steps (the loop says when a step ended) and after the last."""
    if facts is None:
        yield None
        return
    removers = health.note_steps(built.optimizer, facts, lambda: tracer.step, lambda: built.last_grad_norm)
    noted = replicas.ReplicaNotes(built.model, getattr(built.optimizer, "optimizer", built.optimizer),
                                  comm.flight, config.fingerprint_every)
    try:
        yield noted
        noted.finished()
    finally:
        noted.close()
        for remove in removers:
            remove()


def _watching(built: Built, config: TrainConfig, tracer: Tracer, alone: bool, comm: Comm):
    """PyTorch's own strategies record nothing themselves: the watch traces them (phases too)
    and keeps their collectives in this rank's flight recorder."""
    if built.strategy.instrumented or not (config.trace or config.flight_dir) or alone:
        return nullcontext()
    return watch(built.model, built.optimizer, trace=tracer, flight=comm.flight)


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


