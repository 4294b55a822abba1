"""Watch PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2 jobs in minishard's trace.

Two lines in anyone's training script, on every rank; ``python -m minishard view traces/mine``
then replays it as it replays minishard's own runs::

    with minishard.watch(model, optimizer, trace="traces/mine") as w:
        for x, y in loader:
            loss = model(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()
            w.step()

Supported, on gloo: torch's ``DistributedDataParallel`` (any ``torch.optim`` optimizer, or a
``ZeroRedundancyOptimizer``) and FSDP2 ``fully_shard`` (any wrapping, ``reshard_after_forward``
True or False, ``MixedPrecisionPolicy``). Not yet: NCCL timing (times are taken on the host),
``reshard_after_forward=int`` (drawn as ``sharded``), a DDP that already has a comm hook, FSDP2
modules with several parameter groups. Each rank streams ``rank{r}.jsonl`` (``trace.py``), a
line per event as it happens: a rank that dies leaves a trace readable to its last event. The
instruments (docs/watch-spike.md measured them; these cost ~1 % of a step):

* **Phases**: the root's forward pre-hook begins ``step`` and ``forward``, its forward hook
  ``backward``, the optimizer's step pre-hook ``optimizer``; ``w.step()`` ends the step.
* **Collectives**: ``op``, ``payload`` (minishard's convention: the reduced, or the whole
  gathered/scattered buffer), ``wire`` (what this rank sends **by the ring model**,
  ``comm.ring_wire_bytes``, as minishard's comm layer counts it; gloo runs a reduce-scatter as a
  full all-reduce, twice that), ``dtype``, ``group`` (its size), ``t``/``t_end``, ``tag``. FSDP2:
  subclasses of its default all-gather and reduce-scatter, tag = the unit's module name (a
  backward prefetch is named after the unit it gathers). DDP: a comm hook around DDP's own
  ``allreduce_hook``, tag = ``bucket{index}`` (step 0 runs other buckets: DDP then rebuilds them
  in gradient-ready order). The rest (ZeRO's broadcasts, a user's own): wrappers on
  ``torch.distributed``'s Python functions, with a re-entrancy guard so that what a hook records
  is not recorded twice. What C++ issues alone (DDP's rebuild broadcasts) is not seen.
* **FSDP2 units** by module name (the root: ``root``, as in minishard's FSDP), in minishard's
  states: ``unsharding`` when its all-gather is issued, ``unsharded``/``sharded`` when its
  parameter group changes memory state. FSDP2 **reshards before it reduce-scatters** (it keeps
  the unsharded gradients, not the parameters): no ``reduce_scattering``; the reduce-scatter
  follows ``sharded``.
* **Memory** by the ledger's categories, in storage bytes (FSDP2's padding included), each
  storage once, freed when it dies (``weakref.finalize``). *Exact*: ``params`` (local shards
  under FSDP2), ``unsharded`` (the gathered parameters a unit holds), ``comm_buffers`` (FSDP2's
  all-gather output and reduce-scatter input, DDP's buckets), ``exp_avg``/``exp_avg_sq``/
  ``momentum`` (ZeRO's: ``opt.optim.state``; FSDP2's: local shards); the ``step`` counters are
  left out, as minishard's ledger leaves them. *Approximate* (tags say ``approx``): ``grads``
  (DDP: each ``.grad`` storage when autograd accumulates it; FSDP2: the reduce-scatter output
  the sharded gradients are views of — the unsharded gradients before it are missing) and
  ``activations`` (what autograd saves, minishard's rule, minus parameters and gathered
  parameters, freed when autograd lets go; what the loop also keeps, its inputs, stays).

What ``watch`` patches it patches on the objects it is given (model and optimizer hooks, FSDP2's
comms and parameter groups) and restores on exit; the ``torch.distributed`` wrappers live only
inside the ``with``. DDP's exception: a DDP model keeps its one comm hook for good, so after
exit it stays, doing DDP's default ``allreduce_hook`` and recording nothing. Engine code: it
never imports ``minishard.course`` or ``minishard.viz``.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from .comm import ring_wire_bytes
from .trace import Tracer

SUPPORTED = ("torch.nn.parallel.DistributedDataParallel (any torch.optim optimizer, or "
             "ZeroRedundancyOptimizer), or FSDP2 torch.distributed.fsdp.fully_shard")

# optimizer state keys -> the ledger's categories (other keys, e.g. Adam's `step`, not counted)
OPTIMIZER_STATE = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum_buffer": "momentum"}

# torch.distributed's Python entry points that are wrapped: the op each one is, and the argument
# that holds the payload (minishard's convention: the whole gathered / scattered buffer)
WRAPPED = {"all_reduce": ("all_reduce", "tensor"), "broadcast": ("broadcast", "tensor"),
           "all_gather_into_tensor": ("all_gather", "output_tensor"),
           "reduce_scatter_tensor": ("reduce_scatter", "input")}


def _fsdp2_comms():
    """FSDP2's default all-gather and reduce-scatter, subclassed to record each call under its
    unit (subclasses, so FSDP2's own isinstance checks on its defaults still hold). Built on
    first use: importing FSDP2's internals costs half a second that a DDP job need not pay."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllGather,
                                                                       DefaultReduceScatter)

    class WatchedAllGather(DefaultAllGather):
        """FSDP2's own all-gather, recorded under the unit it gathers (also a prefetch)."""

        def __init__(self, w, unit):
            self.w, self.unit, self.n = w, unit, 0

        def allocate(self, size, *, dtype, device):
            out, w = super().allocate(size, dtype=dtype, device=device), self.w
            w._track("comm_buffers", out.untyped_storage(), f"all_gather_out:{self.unit}")
            return out

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            w = self.w
            w._emit("unit", name=self.unit, state="unsharding")
            t0, step = w.tracer.now(), w.tracer.step
            with w._recording():
                work = super().__call__(output_tensor, input_tensor, group, async_op)
            w._when_done(work if async_op else None, lambda t1: w._collective(
                "all_gather", _bytes(output_tensor), _dtype(output_tensor), group, t0, t1,
                self.unit, step))
            return work

    class WatchedReduceScatter(DefaultReduceScatter):
        """FSDP2's own reduce-scatter; its output holds the unit's sharded gradients."""

        __init__ = WatchedAllGather.__init__

        def allocate(self, size, *, dtype, device):
            out, w = super().allocate(size, dtype=dtype, device=device), self.w
            # FSDP2 allocates the input (the unit's full gradients) first, then the output
            self.n += 1
            if self.n % 2:
                w._track("comm_buffers", out.untyped_storage(), f"reduce_scatter_in:{self.unit}")
            else:
                w._track("grads", out.untyped_storage(),
                         f"grads:{self.unit} (approx: the reduce-scatter output)")
            return out

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            w = self.w
            t0, step = w.tracer.now(), w.tracer.step
            with w._recording():
                work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            w._when_done(work if async_op else None, lambda t1: w._collective(
                "reduce_scatter", _bytes(input_tensor), _dtype(input_tensor), group, t0, t1,
                self.unit, step))
            return work

    return WatchedAllGather, WatchedReduceScatter


class WatchError(RuntimeError):
    """``watch`` cannot watch this job (unsupported wrapper, no process group, no trace file)."""


def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
          trace: str | os.PathLike | Tracer | None = None) -> "Watch":
    """Watch a torch DDP / ZeroRedundancyOptimizer / FSDP2 job; see the module's docstring.

    ``trace``: a directory (``rank{r}.jsonl`` is streamed into it), a :class:`Tracer` (e.g. a
    ``Ranks`` task's ``rank.tracer``), or None (the events stay in ``w.tracer.events``)."""
    return Watch(model, optimizer, trace)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters and their optimizer state), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _kind(model: torch.nn.Module) -> str:
    """"ddp" or "fsdp2", or a WatchError naming what is supported. (FSDP's classes are looked up
    only if imported: a job that never imported them cannot hold one.)"""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for name, m in model.named_modules():
        where = f"{type(m).__name__}" + (f" (module {name!r})" if name else "")
        if any(c.__module__.startswith("deepspeed") for c in type(m).__mro__):
            raise WatchError(f"minishard.watch: {where} is DeepSpeed's; supported are {SUPPORTED}")
        if fsdp and isinstance(m, fsdp.FullyShardedDataParallel):
            raise WatchError(f"minishard.watch: FSDP1 {where} is not supported; supported are "
                             f"{SUPPORTED} (FSDP2: fully_shard each block, then the root)")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if fsdp and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        return "fsdp2"
    raise WatchError(f"minishard.watch: {type(model).__name__} is wrapped by nothing watch "
                     f"knows; supported are {SUPPORTED}")


class _Relay:
    """The state of the one comm hook a DDP model takes: the watch on now, or None."""
    watch = None


def _watched_allreduce_hook(relay: _Relay, bucket):
    """DDP's default all-reduce of a bucket (``allreduce_hook``), recorded while a watch is on."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    if relay.watch is None:
        return default_hooks.allreduce_hook(None, bucket)
    return relay.watch._bucket(bucket, default_hooks.allreduce_hook)


class Watch:
    """The context manager :func:`watch` returns; ``w.step()`` ends a training step."""

    def __init__(self, model, optimizer=None, trace=None):
        self.model, self.optimizer, self._trace = model, optimizer, trace
        self.kind = _kind(model)                 # refuse an unsupported wrapper at once
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise WatchError(f"minishard.watch: optimizer must be a torch.optim.Optimizer, got "
                             f"{type(optimizer).__name__}")
        self.tracer: Tracer | None = None
        self._lock = threading.RLock()           # DDP's and ZeRO's completions run in gloo's threads
        self._guard = threading.local()          # re-entrancy: inside a hook that records
        self._undo: list = []                    # what to restore on exit, last first
        self._live: dict[int, tuple[str, int, str]] = {}   # storage ptr -> (category, bytes, tag)
        self._gathered: set[int] = set()         # storages of gathered FSDP2 parameters
        self._phase: str | None = None
        self._in_step = self._closed = False
        self._file = None

    # ------------------------------------------------------------------ enter: checks first
    def __enter__(self) -> "Watch":
        if not (dist.is_available() and dist.is_initialized()):
            raise WatchError("minishard.watch: torch.distributed's process group is not "
                             "initialised; call dist.init_process_group(...) (or run under "
                             "torchrun) before entering watch")
        rank, world = dist.get_rank(), dist.get_world_size()
        problem = self._open_trace(rank)
        # one collective, before anything is patched: every rank learns whether every rank can
        # write its trace (so they fail together, not hang), and rank 0's clock is everyone's
        # origin (minishard's rule: ranks started together share one origin)
        t = torch.tensor([0.0 if rank else time.time(), 1.0 if problem else 0.0],
                         dtype=torch.float64)
        dist.all_reduce(t)
        if problem or t[1] > 0:
            self._detach()
            raise WatchError(problem or f"minishard.watch: {int(t[1])} other rank(s) could not "
                                        f"open their trace file in {self._trace}")
        self.tracer = self._trace if isinstance(self._trace, Tracer) else Tracer(
            rank, world, origin=float(t[0]), keep=self._file is None,
            sink=self._write if self._file else None)
        self.tracer.step = 0
        try:
            for name, p in self.model.named_parameters():     # FSDP2: this rank's shard
                self._track("params", _local(p).untyped_storage(), f"param:{name}")
            self._attach_fsdp2() if self.kind == "fsdp2" else self._attach_ddp()
            self._attach_dist()
            self._attach_phases()
            self._attach_optimizer()
            self._attach_activations()
        except BaseException:
            self._detach()
            raise
        return self

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
        self._file.write(json.dumps(ev) + "\n")

    def _emit(self, kind: str, **fields) -> None:
        with self._lock:
            self.tracer.emit(kind, **fields)

    # ------------------------------------------------------------------ memory, by storage
    def _track(self, category: str, storage, tag: str) -> None:
        """Enter a storage once under ``category``; free it when the storage dies."""
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._live:
            return
        nbytes = storage.nbytes()
        self._live[ptr] = (category, nbytes, tag)
        self._emit("alloc", category=category, bytes=nbytes, tag=tag, device="host")
        # the callback holds the watch and numbers, never the storage (that would keep it alive)
        weakref.finalize(storage, self._untrack, ptr, category, nbytes, tag)

    def _untrack(self, ptr: int, category: str, nbytes: int, tag: str) -> None:
        if self._live.pop(ptr, None) is not None and not self._closed:
            self._emit("free", category=category, bytes=nbytes, tag=tag, device="host")

    # ------------------------------------------------------------------ collectives
    def _collective(self, op: str, payload: int, dtype: str, group, t: float, t_end: float,
                    tag: str, step, src: int | None = None) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        src = dist.get_group_rank(group, src) if src is not None and group is not None else src
        self._emit("collective", t=t, t_end=round(t_end, 7), op=op, payload=payload,
                   wire=ring_wire_bytes(op, payload, size, rank, src or 0), dtype=dtype,
                   group=size, tag=tag, step=step)

    def _when_done(self, work, record) -> None:
        """Call ``record(t_end)`` when ``work`` completes: from its future (in gloo's thread),
        or now if the call was synchronous or its work has no future (gloo's reduce-scatter)."""
        try:
            fut = work.get_future() if work is not None else None
        except RuntimeError:
            fut = None
        record(self.tracer.now()) if fut is None else fut.then(lambda f: record(self.tracer.now()))

    def _attach_fsdp2(self) -> None:
        from torch.distributed.fsdp import FSDPModule
        WatchedAllGather, WatchedReduceScatter = _fsdp2_comms()
        for name, m in self.model.named_modules():
            if not isinstance(m, FSDPModule):
                continue
            unit = name or "root"
            groups = m._get_fsdp_state()._fsdp_param_groups
            if len(groups) > 1:
                raise WatchError(f"minishard.watch: FSDP2 module {unit!r} has {len(groups)} "
                                 f"parameter groups (shard_placement_fn); one per module is "
                                 f"supported")
            for pg in groups:
                ag, rs = pg._all_gather_comm, pg._reduce_scatter_comm
                self._undo.append(lambda m=m, ag=ag, rs=rs: (m.set_custom_all_gather(ag),
                                                            m.set_custom_reduce_scatter(rs)))
                m.set_custom_all_gather(WatchedAllGather(self, unit))
                m.set_custom_reduce_scatter(WatchedReduceScatter(self, unit))
                self._wrap_unit(pg, unit)

    def _wrap_unit(self, pg, unit: str) -> None:
        """Memory-state changes of one FSDP2 parameter group (internal methods, patched on this
        instance — FSDPMemTracker patches the same ones), as minishard's unit states."""
        w = self
        held = [0]                               # the gathered bytes this unit holds now
        for method, state in (("_to_unsharded", "unsharded"), ("_to_sharded", "sharded"),
                              ("_to_sharded_post_forward", "sharded")):
            orig = getattr(pg, method)

            def wrapped(orig=orig, state=state):
                before = pg._sharded_state
                orig()
                if pg._sharded_state == before:  # the root asked again: nothing changed
                    return
                w._emit("unit", name=unit, state=state)
                if state == "unsharded":
                    storages = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
                                for fp in pg.fsdp_params for o in fp.all_gather_outputs}
                    w._gathered |= set(storages)
                    held[0] = sum(storages.values())
                    w._emit("alloc", category="unsharded", bytes=held[0], tag=f"unsharded:{unit}",
                            device="host")
                elif held[0]:
                    w._emit("free", category="unsharded", bytes=held[0], tag=f"unsharded:{unit}",
                            device="host")
                    held[0] = 0
            setattr(pg, method, wrapped)
            self._undo.append(lambda method=method: pg.__dict__.pop(method, None))

    def _attach_ddp(self) -> None:
        model = self.model
        relay = getattr(model, "_minishard_watch_hook", None)
        if relay is None:
            if model._comm_hooks:
                raise WatchError("minishard.watch: this DistributedDataParallel already has a comm "
                                 "hook (DDP takes one); watch it without the hook")
            relay = _Relay()                     # the hook's state: which watch records
            model.register_comm_hook(relay, _watched_allreduce_hook)
            model._minishard_watch_hook = relay
        relay.watch = self
        self._undo.append(lambda: setattr(relay, "watch", None))
        # gradients: each .grad storage when autograd accumulates it (a view of a bucket buffer,
        # gradient_as_bucket_view=True, is already counted there)
        for name, p in model.named_parameters():
            if p.requires_grad:
                h = p.register_post_accumulate_grad_hook(
                    lambda p, name=name: self._track("grads", p.grad.untyped_storage(),
                                                     f"grad:{name} (approx: at accumulation)"))
                self._undo.append(h.remove)

    def _bucket(self, bucket, allreduce_hook):
        """One DDP bucket: DDP's own all-reduce, timed to its future's completion."""
        buf = bucket.buffer()
        self._track("comm_buffers", buf.untyped_storage(), f"bucket{bucket.index()}")
        t0, step, payload = self.tracer.now(), self.tracer.step, _bytes(buf)
        with self._recording():
            fut = allreduce_hook(None, bucket)

        def done(f):
            self._collective("all_reduce", payload, _dtype(buf), None, t0, self.tracer.now(),
                             f"bucket{bucket.index()}", step)
            return f.value()
        return fut.then(done)

    # ------------------------------------------------------------------ torch.distributed
    @contextlib.contextmanager
    def _recording(self):
        """Inside: a hook is recording this collective; the dist wrappers stay quiet."""
        self._guard.depth = getattr(self._guard, "depth", 0) + 1
        try:
            yield
        finally:
            self._guard.depth -= 1

    def _attach_dist(self) -> None:
        for fname, (op, payload_arg) in WRAPPED.items():
            orig = getattr(dist, fname)
            if getattr(orig, "__minishard_watch__", False):
                raise WatchError("minishard.watch: another watch is already on in this process; "
                                 "one at a time")
            sig = inspect.signature(orig)

            def wrapped(*args, fname=fname, orig=orig, op=op, sig=sig, arg=payload_arg, **kwargs):
                if getattr(self._guard, "depth", 0):      # a hook above records this one
                    return orig(*args, **kwargs)
                a = sig.bind(*args, **kwargs).arguments
                t, group, src = a[arg], a.get("group"), a.get("src")
                if op == "broadcast" and src is None and group is not None:
                    src = dist.get_global_rank(group, a.get("group_src") or 0)
                t0, step = self.tracer.now(), self.tracer.step
                with self._recording():
                    work = orig(*args, **kwargs)
                self._when_done(work if a.get("async_op") else None, lambda t1: self._collective(
                    op, _bytes(t), _dtype(t), group, t0, t1, f"dist.{fname}", step, src))
                return work
            wrapped.__minishard_watch__ = True
            wrapped.__wrapped__ = orig
            setattr(dist, fname, wrapped)
            self._undo.append(lambda fname=fname, orig=orig: setattr(dist, fname, orig))

    # ------------------------------------------------------------------ phases
    def _attach_phases(self) -> None:
        self._undo += [
            self.model.register_forward_pre_hook(lambda m, a: self._begin("forward"),
                                                 prepend=True).remove,
            self.model.register_forward_hook(lambda m, a, o: self._begin("backward")).remove]

    def _begin(self, name: str) -> None:
        """End the phase that is open, begin ``name`` (and the step, if none is open)."""
        if not self._in_step:
            self._emit("phase", name="step", edge="begin")
            self._in_step = True
        if self._phase:
            self._emit("phase", name=self._phase, edge="end")
        self._emit("phase", name=name, edge="begin")
        self._phase = name

    def _end_step(self) -> None:
        if self._phase:
            self._emit("phase", name=self._phase, edge="end")
            self._phase = None
        if self._in_step:
            self._emit("phase", name="step", edge="end")
            self._in_step = False

    def step(self) -> None:
        """The training step is over: close its phases; the next events belong to the next."""
        self._end_step()
        self.tracer.step += 1

    # ------------------------------------------------------------------ optimizer state
    def _attach_optimizer(self) -> None:
        if self.optimizer is not None:
            self._undo += [self.optimizer.register_step_pre_hook(
                               lambda o, a, k: self._begin("optimizer")).remove,
                           self.optimizer.register_step_post_hook(
                               lambda o, a, k: self._optimizer_state()).remove]
            self._optimizer_state()              # a watch entered after the first step

    def _optimizer_state(self) -> None:
        """Enter new optimizer-state storages (created lazily by the first step), exactly.
        ZeroRedundancyOptimizer keeps its partition's state in the optimizer it wraps."""
        opt = self.optimizer
        state = opt.optim.state if hasattr(opt, "optim") and hasattr(opt.optim, "state") else opt.state
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
    def __exit__(self, *exc) -> None:
        self._end_step()
        self._detach()

    def _detach(self) -> None:
        while self._undo:
            self._undo.pop()()
        self._closed = True                      # storages that die later are not this trace's
        if self._file is not None:
            self._file.close()
