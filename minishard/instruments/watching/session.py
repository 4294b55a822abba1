"""The watch itself: checks, phases and memory; the wrappers' own files attach the rest."""
from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from minishard.core import run_id
from minishard.core.comm import ring_wire_bytes
from minishard.core.flight import FlightRecorder, raised_at
from minishard.core.trace import Tracer
from minishard.instruments import replicas
from .basics import WatchError

SUPPORTED = ("torch.nn.parallel.DistributedDataParallel (any torch.optim optimizer, or "
             "ZeroRedundancyOptimizer), FSDP2 torch.distributed.fsdp.fully_shard, DeepSpeed's "
             "engine (deepspeed.initialize, ZeRO stages 0-3), or minishard's own DDP, "
             "ZeroOptimizer and fully_shard")

# optimizer state keys -> the ledger's categories (other keys, e.g. Adam's `step`, not counted)
OPTIMIZER_STATE = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum_buffer": "momentum"}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters and their optimizer state), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _kind(model: torch.nn.Module, optimizer) -> str:
    """"ddp", "fsdp2", "deepspeed" or "minishard", or a WatchError naming what is supported.
    (FSDP's classes are looked up only if imported: a job that never imported them cannot hold
    one.)"""
    from .deepspeed import is_engine
    from .own import recorders
    if is_engine(model):
        return "deepspeed"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for name, m in model.named_modules():
        where = f"{type(m).__name__}" + (f" (module {name!r})" if name else "")
        if any(c.__module__.startswith("deepspeed") for c in type(m).__mro__):
            raise WatchError(f"minishard.watch: {where} is DeepSpeed's but not its data-parallel "
                             f"engine (DeepSpeedEngine, ZeRO stages 0-3: watch the engine "
                             f"deepspeed.initialize returned). Supported are {SUPPORTED}")
        if fsdp and isinstance(m, fsdp.FullyShardedDataParallel):
            raise WatchError(f"minishard.watch: FSDP1 {where} is not supported; supported are "
                             f"{SUPPORTED} (FSDP2: fully_shard each block, then the root)")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if fsdp and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        return "fsdp2"
    if recorders(model, optimizer)[0]:
        return "minishard"
    raise WatchError(f"minishard.watch: {type(model).__name__} is wrapped by nothing watch "
                     f"knows; supported are {SUPPORTED}")


def _group_name(group) -> str:
    """The same name on every rank: "world" for the default group (however it is passed)."""
    if group is None or group is dist.group.WORLD:
        return "world"
    return f"pg{group.group_name}"


def _stepped(optimizer, model=None):
    """The torch optimizer whose ``step`` marks the optimizer phase: minishard's
    ShardedOptimizer steps the one it wraps, DeepSpeed's ZeRO optimizer too (and a DeepSpeed
    engine watched without its optimizer has one)."""
    from .deepspeed import is_engine, optimizer_of
    if optimizer is None and model is not None and is_engine(model):
        return optimizer_of(model)
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise WatchError(f"minishard.watch: optimizer must be a torch.optim.Optimizer, got "
                     f"{type(optimizer).__name__}")


class Watch:
    """The context manager :func:`minishard.watch` returns; ``w.step()`` ends a training step."""

    def __init__(self, model, optimizer=None, trace=None, flight: FlightRecorder | None = None,
                 built: dict[str, str] | None = None, fingerprint_every: int | None = replicas.EVERY):
        replicas.check_every(fingerprint_every)
        self.model, self.optimizer, self._trace = model, optimizer, trace
        self._given_flight, self.built = flight, built
        self.fingerprint_every = fingerprint_every
        self.replicas: replicas.ReplicaNotes | None = None   # (facts.py: with its own recorder)
        self.kind = _kind(model, optimizer)      # refuse an unsupported wrapper at once
        self._stepped = _stepped(optimizer, model)
        self.tracer: Tracer | None = None
        self._lock = threading.RLock()           # DDP's and ZeRO's completions run in gloo's threads
        self._guard = threading.local()          # re-entrancy: inside a hook that records
        self._undo: list = []                    # what to restore on exit, last first
        self._live: dict[int, tuple[str, int, str]] = {}   # id(storage) -> (category, bytes, tag)
        self._gathered: set[int] = set()         # storages of gathered FSDP2 parameters
        self._phase: str | None = None
        self._sweeps: list = []                  # what re-reads a library's holdings at each phase
        self._in_step = self._closed = False
        self._file = None
        # what a run report shows, folded as events go by (minishard's own strategies have
        # their ledger; this covers what the watch itself enters)
        self.held: dict[str, int] = {}           # category -> bytes on the device now
        self.peak, self.peak_snapshot = 0, {}    # the most the device held, and its categories then
        self.wire: dict[int, int] = {}           # step -> bytes this rank sent (the ring model)

    # ------------------------------------------------------------------ enter: checks first
    def __enter__(self) -> "Watch":
        from . import calls, ddp, deepspeed, facts, fsdp2, own
        if not (dist.is_available() and dist.is_initialized()):
            raise WatchError("minishard.watch: torch.distributed's process group is not "
                             "initialised; call dist.init_process_group(...) (or run under "
                             "torchrun) before entering watch")
        rank, world = dist.get_rank(), dist.get_world_size()
        self._accelerated = dist.get_backend() != "gloo"
        # torch's collectives, as minishard's Comm keeps its own (train() lends the Comm's)
        self.flight = self._given_flight or FlightRecorder(rank, world)
        problem = self._open_trace(rank)
        if problem is None and self._file is not None and self._given_flight is None:
            self.flight.fly_to(self._trace)      # on disk as it flies: what a rank that dies leaves
        # one collective, before anything is patched: every rank learns whether every rank can
        # write its trace (so they fail together, not hang), rank 0's clock is everyone's
        # origin (minishard's rule: ranks started together share one origin), and rank 0's new
        # run id everyone's (48 bits: exact in a float64)
        t = torch.tensor([0.0 if rank else time.time(), 1.0 if problem else 0.0,
                          0.0 if rank else float(run_id.as_number(run_id.new()))], dtype=torch.float64)
        dist.all_reduce(t)
        if problem or t[1] > 0:
            self._detach()
            raise WatchError(problem or f"minishard.watch: {int(t[1])} other rank(s) could not "
                                        f"open their trace file in {self._trace}")
        self.tracer = self._trace if isinstance(self._trace, Tracer) else Tracer(
            rank, world, origin=float(t[0]), keep=self._file is None,
            sink=self._write if self._file else None)
        self._join_run(t[2])
        if self.tracer.step is None:
            self.tracer.step = 0
        if self.flight.clock is None:            # (the clock of its entries' times)
            self.flight.clock = self.tracer.now
        try:
            comms, ledgers = own.recorders(self.model, self.optimizer)
            own.attach(self, comms, ledgers)
            if self.kind == "fsdp2":
                fsdp2.attach(self, self.model)
            elif self.kind == "ddp":
                ddp.attach(self, self.model)
            elif self.kind == "deepspeed":       # (holds its parameters in its own containers)
                deepspeed.attach(self, self.model)
            calls.attach(self)
            self._attach_phases()
            if self._given_flight is None:       # (under train() its recorder has them already)
                facts.attach(self)
            if ledgers:                          # minishard's ledger counts every byte itself
                own.activations(self, ledgers)
                own.optimizer_state(self, ledgers)
            else:
                if self.kind != "deepspeed":
                    for name, p in self.model.named_parameters():     # FSDP: this rank's shard
                        self._track("params", _local(p).untyped_storage(), f"param:{name}")
                self._attach_optimizer_state()
                self._attach_activations()
        except BaseException:
            self._detach()
            raise
        return self

    def _join_run(self, number) -> None:
        """Rank 0's run id (from the all-reduce) on the recorder and the tracer, and the trace's
        first line. Under train() the run has its id already: the recorder and tracer it lends
        carry it."""
        if self.flight.run is None:
            self.flight.run = run_id.as_text(int(number))
        if self.tracer.run is None:
            self.tracer.run = self.flight.run
        if self._file is not None:
            self._write(self.tracer.header())

    def _open_trace(self, rank: int) -> str | None:
        """Open ``rank{r}.jsonl`` for streaming; the problem in words, or None."""
        if self._trace is None or isinstance(self._trace, Tracer):
            return None
        path = Path(self._trace) / f"rank{rank}.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "w", buffering=1)     # line-buffered: one event, one write
        except OSError as e:
            return (f"minishard.watch: cannot write the trace {path} ({e.strerror or e}); pass "
                    f"trace= a directory every rank can write")
        return None

    def _write(self, ev: dict) -> None:                  # line-buffered: on disk at once
        self._file.write(json.dumps(ev, separators=(",", ":")) + "\n")

    def _emit(self, kind: str, **fields) -> None:
        with self._lock:
            self.tracer.emit(kind, **fields)
            if kind in ("alloc", "free") and fields["device"] == "device":
                c = fields["category"]
                self.held[c] = self.held.get(c, 0) + (fields["bytes"] if kind == "alloc" else -fields["bytes"])
                if (total := sum(self.held.values())) > self.peak:
                    self.peak, self.peak_snapshot = total, {k: b for k, b in self.held.items() if b}
            elif kind == "collective" and fields.get("step") is not None:
                self.wire[fields["step"]] = self.wire.get(fields["step"], 0) + fields["wire"]

    # ------------------------------------------------------------------ memory, by storage
    def _track(self, category: str, storage, tag: str) -> None:
        """Enter a storage once under ``category``; free it when the storage dies. Keyed by the
        storage object (torch keeps one per storage while it lives), not by its address: a
        storage resized to nothing (FSDP frees gathered parameters so) keeps its object, and
        its old address goes to the next tensor."""
        key = id(storage)
        if storage.data_ptr() == 0 or key in self._live:
            return
        nbytes = storage.nbytes()
        # a job computing on an accelerator keeps host storages off the device (FSDP2's
        # CPUOffloadPolicy shards); on gloo the CPU is the device
        device = "host" if self._accelerated and storage.device.type == "cpu" else "device"
        self._live[key] = (category, nbytes, tag)
        self._emit("alloc", category=category, bytes=nbytes, tag=tag, device=device)
        # the callback holds the watch and numbers, never the storage (that would keep it alive)
        weakref.finalize(storage, self._untrack, key, category, nbytes, tag, device)

    def _untrack(self, key: int, category: str, nbytes: int, tag: str, device: str) -> None:
        if self._live.pop(key, None) is not None and not self._closed:
            self._emit("free", category=category, bytes=nbytes, tag=tag, device=device)

    # ------------------------------------------------------------------ collectives
    def _issued(self, op: str, tensor, nbytes: int, group, tag: str, t: float,
                sites: tuple[str, str] | None = None) -> dict:
        """Enter a collective in the flight recorder as it is issued (a hang leaves it so);
        ``sites``: its (where, caller), if the recorder taking it found them already."""
        return self.flight.issued(op, _group_name(group), dist.get_world_size(group), (tensor,),
                                  nbytes, tag, self.tracer.step, self._phase, t, sites=sites)

    def _collective(self, op: str, payload: int, dtype: str, group, t: float, t_end: float,
                    tag: str, step, src: int | None = None, entry: dict | None = None) -> None:
        if entry is not None:
            self.flight.completed(entry, t_end)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        src = dist.get_group_rank(group, src) if src is not None and group is not None else src
        # a group smaller than the world names its members, as minishard's Comm does
        members = ({"members": dist.get_process_group_ranks(group)}
                   if group is not None and size < dist.get_world_size() else {})
        self._emit("collective", t=t, t_end=round(t_end, 7), op=op, payload=payload,
                   wire=ring_wire_bytes(op, payload, size, rank, src or 0), dtype=dtype,
                   group=size, tag=tag, step=step, **members)

    def _when_done(self, work, record) -> None:
        """Call ``record(t_end)`` when ``work`` completes: from its future (in gloo's thread),
        or now if the call was synchronous or its work has no future (gloo's reduce-scatter).
        A future that completes with an error (a peer that died, a timeout) records nothing:
        the collective stays issued, never completed, where the rank waited in it."""
        try:
            fut = work.get_future() if work is not None else None
        except RuntimeError:
            fut = None
        if fut is None:
            record(self.tracer.now())
            return

        def done(f):
            try:
                f.value()
            except Exception:                    # (the waiter raises it; the record stays open)
                return
            record(self.tracer.now())
        fut.then(done)

    @contextlib.contextmanager
    def _recording(self):
        """Inside: a hook is recording this collective; the torch.distributed wrappers stay quiet."""
        self._guard.depth = getattr(self._guard, "depth", 0) + 1
        try:
            yield
        finally:
            self._guard.depth -= 1

    def _quiet(self) -> bool:
        return getattr(self._guard, "depth", 0) > 0

    # ------------------------------------------------------------------ phases
    def _attach_phases(self) -> None:
        self._undo += [
            self.model.register_forward_pre_hook(lambda m, a: self._begin("forward"),
                                                 prepend=True).remove,
            self.model.register_forward_hook(lambda m, a, o: self._begin("backward")).remove]
        if self._stepped is not None:
            self._undo.append(self._stepped.register_step_pre_hook(
                lambda o, a, k: self._begin("optimizer")).remove)

    def _begin(self, name: str) -> None:
        """End the phase that is open, begin ``name`` (and the step, if none is open)."""
        for sweep in self._sweeps:
            sweep()
        if not self._in_step:
            self._emit("phase", name="step", edge="begin")
            self._in_step = True
        if self._phase:
            self._emit("phase", name=self._phase, edge="end")
        self._emit("phase", name=name, edge="begin")
        self._phase = name

    def _end_step(self) -> None:
        for sweep in self._sweeps:
            sweep()
        if self._phase:
            self._emit("phase", name=self._phase, edge="end")
            self._phase = None
        if self._in_step:
            self._emit("phase", name="step", edge="end")
            self._in_step = False

    def step(self) -> None:
        """The training step is over: close its phases; the next events belong to the next."""
        self._end_step()
        if self.replicas is not None:
            self.replicas.ended(self.tracer.step)
        self.tracer.step += 1

    # ------------------------------------------------------------------ optimizer state
    def _attach_optimizer_state(self) -> None:
        if self._stepped is not None:
            self._undo.append(self._stepped.register_step_post_hook(
                lambda o, a, k: self._optimizer_state()).remove)
            self._optimizer_state()              # a watch entered after the first step

    def _optimizer_state(self) -> None:
        """Enter new optimizer-state storages (created lazily by the first step), exactly.
        ZeroRedundancyOptimizer (``.optim``) and minishard's ZeroOptimizer (``.optimizer``) keep
        their partition's state in the optimizer they wrap."""
        opt = self._stepped
        inner = getattr(opt, "optim", None) or getattr(opt, "optimizer", None)
        state = inner.state if isinstance(inner, torch.optim.Optimizer) else opt.state
        for i, st in enumerate(state.values()):
            for key, v in st.items():
                if key in OPTIMIZER_STATE and torch.is_tensor(v):
                    self._track(OPTIMIZER_STATE[key], _local(v).untyped_storage(), f"opt:{key}:{i}")

    # ------------------------------------------------------------------ activations
    def _attach_activations(self) -> None:
        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                st = t.untyped_storage()
                if st.data_ptr() not in self._gathered:
                    self._track("activations", st, "activation (approx: what autograd saves)")
            return t
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        hooks.__enter__()
        self._undo.append(lambda: hooks.__exit__(None, None, None))

    # ------------------------------------------------------------------ exit
    def __exit__(self, kind, error, tb) -> None:
        open_step = self._in_step                # (a last step the loop did not end with step())
        self._end_step()
        if self.replicas is not None and error is None and self.tracer is not None:
            self.replicas.finished(self.tracer.step if open_step else self.tracer.step - 1)
        self._detach()
        if self._file is not None:               # a trace directory: the flight recorder beside it
            self.flight.dump(self._trace, "end" if error is None else "exception",
                             None if error is None else f"{kind.__name__}: {error}",
                             None if error is None else raised_at(tb))

    def _detach(self) -> None:
        while self._undo:
            self._undo.pop()()
        self._closed = True                      # storages that die later are not this trace's
        if self._file is not None:
            self._file.close()
