"""The training loop every chapter runs, on one rank, under any strategy.

``train(rank, TrainConfig(strategy=..., steps=...))`` is a task for :class:`minishard.core.launch.Ranks`
(and the body of ``python -m minishard demo`` under torchrun). It builds the GPT from its config,
wraps it with the strategy (``minishard.strategies``), trains on this rank's slice of each global
batch with :func:`train_step`, and returns what the course shows: losses, step times, the
measured ledger (peak, per phase, by category), the bytes every collective moved — recorded by
``comm`` and counted by the OS (``minishard.training.meter``) — and, on request, the final parameters.

The step itself is :func:`minishard.training.step.train_step`; this module is the run around it.
"""
from __future__ import annotations

import contextlib
import math
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch

from minishard.instruments import health
from minishard.core import model as model_mod
from minishard import strategies
from minishard.planner.analytic import estimate, gpt_activation_bytes
from minishard.core.comm import Comm
from minishard.core.flight import dumping
from .config import OPTIMIZERS, PRECISIONS, WRAPS, TrainConfig
from .hooks import RunHooks
from minishard.core.launch import RankContext
from minishard.core.ledger import STATE_CATEGORIES, LiveLedger
from .meter import Meter
from .step import train_step
from minishard.strategies.fsdp import wrap_targets
from minishard.strategies.registry import Built, build
from minishard.core.trace import Tracer
from minishard.instruments.watching import watch

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
    built = _build_noted(config, cfg, rank, comm, ledger, facts, hooks)
    first_step, ckpt = 0, {}
    if config.resume_from is not None:
        from minishard import checkpoint
        ckpt["load"] = checkpoint.load(built.model, built.optimizer, config.resume_from, comm=comm)
        first_step = ckpt["load"]["step"]
    hooks.starting([comm, *built.comms], config, rank.rank, first_step, first_step + config.steps - 1)

    meter = Meter(built.comms, built.units)
    saves: list[tuple[int, Any]] = []           # (step, what save returned)
    with _flight(comm, config), _noting(built, facts, tracer), \
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
            meter.loss(loss)
            if on_step is not None:
                on_step({"rank": rank.rank, "step": step, "first": step == first_step,
                         "steps": first_step + config.steps, "loss": loss, "loss_resolution":
                         _loss_resolution(loss, config), "seconds": meter.steps["step_times"][-1],
                         "peak": ledger.peak if ledger else w.peak if w else 0})
            if config.save_every is not None and (step + 1) % config.save_every == 0:
                saves.append((step + 1, _save(config, built, comm, step + 1)))
    if config.save_to is not None:      # (a last save the loop did not make: of the last step)
        ckpt["save"] = _saved(config, built, comm, first_step + config.steps, saves)
    tracer.step = None
    return _outputs(rank, config, cfg, meter, built, first_step, w, ledger, comm, ckpt)


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
    checkpoint.wait_for_saves()
    done = [(s, out.wait() if isinstance(out, checkpoint.PendingSave) else out) for s, out in saves]
    return {**done[-1][1], "stalls": [(s, out["stall_seconds"]) for s, out in done]}


def _outputs(rank: RankContext, config: TrainConfig, cfg, meter: Meter, built: Built, first_step: int,
             w, ledger: LiveLedger | None, comm: Comm, ckpt: dict) -> dict[str, Any]:
    """After the last step: the measurements, the ledger against its formula, the checkpoints
    loaded and saved, the parameters and state asked for."""
    strategy = built.strategy
    out = _measurements(rank, config, cfg, meter, built, first_step, w)
    if ledger is not None:
        out["ledger"] = _ledger_report(ledger, config, cfg, strategy, rank.world_size, built)
    if ckpt:
        out["checkpoint"] = ckpt
    if config.return_params:
        out["params"] = built.full_parameters()
    if config.return_state:
        out["optimizer_state"] = built.optimizer.state_dict()
    if ledger is not None:
        out["ledger"]["by_device"] = ledger.by_device()
    for unit in built.units:            # the disk tier's files go with the run
        unit.release_tier()
    return out


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
    that raised also leaves its trace there (``rank{r}.jsonl``: the doctor reads its ledger),
    since whoever collects the ranks' events on success never gets them."""
    if not config.flight_dir:
        yield
        return
    with dumping(comm.flight, config.flight_dir, torch_recorder=config.torch_flight):
        try:
            yield
        except BaseException:
            if comm.tracer is not None and comm.tracer.events:
                comm.tracer.write_jsonl(f"{config.flight_dir}/rank{comm.flight.rank}.jsonl")
            raise


@contextlib.contextmanager
def _noting(built: Built, facts: dict | None, tracer: Tracer):
    """For the doctor (``facts``: the flight recorder's), a note of every optimizer step — the
    precision it stepped in, the norm it was clipped by — through the optimizer's step hooks."""
    removers = [] if facts is None else health.note_steps(
        built.optimizer, facts, lambda: tracer.step, lambda: built.last_grad_norm)
    try:
        yield
    finally:
        for remove in removers:
            remove()


def _watching(built: Built, config: TrainConfig, tracer: Tracer, alone: bool, comm: Comm):
    """PyTorch's own strategies record nothing themselves: the watch traces them (phases too)
    and keeps their collectives in this rank's flight recorder."""
    if built.strategy.instrumented or not (config.trace or config.flight_dir) or alone:
        return nullcontext()
    return watch(built.model, built.optimizer, trace=tracer, flight=comm.flight)


def _measurements(rank: RankContext, config: TrainConfig, cfg, meter: Meter, built: Built,
                  first_step: int, watched=None) -> dict[str, Any]:
    """What every run returns: the meter's per-step lists, and what they are (PyTorch's own
    strategies: what the watch measured, too)."""
    out: dict[str, Any] = {"rank": rank.rank, "world_size": rank.world_size,
                           "strategy": built.strategy.name, **meter.steps, "by_op": meter.by_op(),
                           "n_params": model_mod.GPT(cfg, device="meta").num_params(),
                           "first_step": first_step,
                           "loss_resolution": [_loss_resolution(x, config) for x in meter.steps["losses"]],
                           "exposed_comm_measured": bool(built.units)}   # (only FSDP's units time it)
    if hasattr(built.optimizer, "layout"):
        out["layout"] = built.optimizer.layout()
    if watched is not None:
        steps = range(first_step, first_step + config.steps)
        out["watched"] = {"peak": watched.peak, "peak_snapshot": watched.peak_snapshot,
                          "wire": [watched.wire.get(s, 0) for s in steps]}
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


def _ledger_report(ledger: LiveLedger, config: TrainConfig, cfg, strategy, world_size: int,
                   built: Built) -> dict:
    """The measured ledger, next to the analytic estimate for the same run: every knob it used
    (hybrid shard groups, recomputation, a chunked loss, offload) and the strategy's layout."""
    trainable = model_mod.GPT(cfg, device="meta")
    for name, p in trainable.named_parameters():
        if config.freeze and name.startswith(config.freeze):
            p.requires_grad_(False)
    act = 0
    if config.track_activations:
        act = gpt_activation_bytes(cfg, config.micro_batch,
                                   dtype_bytes=2 if config.precision == "bf16_mixed" else 4,
                                   recompute=config.recompute, loss_chunk_tokens=config.loss_chunk_tokens,
                                   train_embedding=trainable.tok_emb.weight.requires_grad)
    est = estimate(trainable, world_size=world_size, strategy=strategy.name,
                   precision=strategy.ledger_precision(config.precision), optimizer=config.optimizer,
                   activation_bytes=act, shard_group=config.shard_size if strategy.hybrid else None,
                   **_layout_numel(built))
    formula: dict[str, dict[str, int]] = {}   # offload: FSDP's sharded state moves to the tier together
    for c, nbytes in est.per_rank.items():
        formula.setdefault(config.offload if config.offload and c in STATE_CATEGORIES else "device", {})[c] = nbytes
    out = {"peak": ledger.peak, "peak_snapshot": ledger.peak_snapshot,
           "category_peaks": {c: b for (c, d), b in ledger.category_peaks.items() if d == ledger.device},
           "phase_peaks": ledger.phase_peaks, "final": ledger.current(), "estimate": est.per_rank,
           "formula": formula, "shard_group": est.shard_group}
    if config.offload is not None:
        out["transfer_formula"] = _transfer_formula(built, config)
    if config.track_activations and (config.recompute or config.loss_chunk_tokens):
        out["unseen"] = _recomputed_bytes(cfg, config)
    return out


def _recomputed_bytes(cfg, config: TrainConfig) -> dict[str, int]:
    """What backward recomputes lives outside the ledger's saved-tensor hooks: its size, by the
    same formula (a real device holds it on top of the measured peak)."""
    from dataclasses import replace
    x = 2 if config.precision == "bf16_mixed" else 4
    out = {}
    if config.recompute:
        one = [gpt_activation_bytes(replace(cfg, n_layer=n), config.micro_batch, dtype_bytes=x) for n in (0, 1)]
        out["one block's activations, while backward recomputes them"] = one[1] - one[0]
    if config.loss_chunk_tokens:
        tokens = min(config.loss_chunk_tokens, config.micro_batch * cfg.seq_len)
        out["one loss chunk's log-probabilities, while backward recomputes them"] = tokens * cfg.vocab_size * x
    return out


def _layout_numel(built: Built) -> dict:
    """What the strategy laid out on this rank: ``numel`` — (elements a replicated category
    holds, elements a sharded one holds) of the trainable parameters, padding included (absent:
    unpadded) — and ``frozen``, the elements of frozen weights it keeps."""
    buckets = getattr(built.optimizer, "buckets", None)
    if buckets and hasattr(buckets[0], "shard_numel"):   # ZeRO: each bucket N equal shards (frozen
        # parameters stay plain replicas, outside its buffers and outside its ledger)
        return {"numel": (sum(b.size for b in buckets), sum(b.shard_numel for b in buckets))}
    if built.units:                                        # FSDP: the shards the units keep
        shards = [t for u in built.units for t in u.layout.shard_tensors()]
        n = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
        return {"numel": (n, sum(t.numel() for t in shards if t.requires_grad)),
                "frozen": sum(t.numel() for t in shards if not t.requires_grad)}
    return {"frozen": sum(p.numel() for p in built.model.parameters() if not p.requires_grad)}


def _transfer_formula(built: Built, config: TrainConfig) -> dict[str, int]:
    """Offload's bytes per step: every gather brings the unit's shard over (h2d) — once in
    forward, once more in backward if it was freed after forward (not if it kept its part for
    a gather inside k ranks: ``reshard_after_forward=k`` keeps it on the device) — and every
    reduce-scatter sends the reduced gradient slice to the tier (d2h); both once per micro-batch."""
    h2d = d2h = 0
    for u in built.units:
        shards = u.layout.shard_tensors()
        again = bool(u.reshard_after_forward) and u.post_forward_comm is None
        h2d += sum(t.numel() * t.element_size() for t in shards) * (1 + again)
        dtype = u.mp_policy.reduce_dtype or u.mp_policy.param_dtype or u.layout.reduce_dtype
        d2h += sum(t.numel() for t in shards if t.requires_grad) * dtype.itemsize
    return {"h2d_bytes": h2d * config.accum, "d2h_bytes": d2h * config.accum}


def _loss_resolution(loss: float, config: TrainConfig) -> float:
    """The spacing of the numbers the loss is computed in, near this loss: a change smaller than
    this does not show (bf16 keeps 8 significant bits: steps of 1/16 near 8)."""
    eps = torch.finfo(torch.bfloat16 if config.precision == "bf16_mixed" else torch.float32).eps
    per_micro = abs(loss) / config.accum                   # each micro-batch's loss / accum is rounded
    return eps * 2.0 ** math.floor(math.log2(per_micro)) if per_micro > 0 else 0.0
