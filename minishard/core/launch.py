"""Run N real ranks from Python, a notebook or a test — and keep them warm.

Starting a rank costs seconds (each process imports torch, then the ranks rendezvous), so
:class:`Ranks` starts N processes once and then runs many *tasks* on them::

    from minishard.training.loop import TrainConfig, train

    with Ranks(4) as ranks:
        out = ranks.run(train, TrainConfig(strategy="ddp", steps=3))   # one result per rank
        out = ranks.run(train, TrainConfig(strategy="ddp", steps=5))   # same warm processes

A task is any importable function ``fn(rank: RankContext, *args, **kwargs)``; it runs on every
rank at once and returns a picklable result. ``RankContext`` carries the rank, the world size,
the device and a :class:`~minishard.core.trace.Tracer` whose events come back with the results, or
live through ``on_event`` while the task runs. Under ``torchrun`` (``torchrun --nproc-per-node 4
-m minishard demo``), :func:`context_from_env` builds the same context, so the same task runs
on a cluster.

How the plumbing works, and why:

* The parent owns a ``TCPStore`` on port 0 (the OS picks a free port: no races between parallel
  notebooks or tests); ranks join it as clients. gloo on CPU, NCCL when CUDA is present.
* Processes come from a *forkserver* that has already imported torch, so a new pool is up in a
  couple of seconds rather than ten.
* A rank that raises reports its own traceback on the result queue *before* anything else; its
  peers then die of "connection closed", but the caller gets the first failure, as
  :class:`RankError`. A failed or timed-out pool is torn down (no orphans) and must be
  recreated: its process group may be stuck mid-collective.
"""
from __future__ import annotations

import importlib
import itertools
import os
import queue as queue_mod
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import c10d
from .c10d import init_group
from .trace import Tracer

INIT_TIMEOUT_S = 60.0


def _death(code: int, at_start: bool) -> str:
    """Why a rank's process ended without a word: a signal (it could not run Python to report),
    or an exit at start-up (most often a script that starts ranks outside its main guard)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (f"process killed by {name} without reporting (os.abort(), an abort in C++ such as "
                f"gloo's on collectives whose sizes differ, SIGKILL, the kernel's OOM killer)")
    hint = (": a script that starts ranks must do so under `if __name__ == \"__main__\":`"
            if at_start else "")
    return f"process exited with code {code} without reporting{hint}"


class RankError(RuntimeError):
    """A rank raised; carries the rank, its exception text and its own traceback."""

    def __init__(self, rank: int, error: str, tb: str):
        super().__init__(f"rank {rank} failed first: {error}\n\n--- traceback on rank {rank} ---\n{tb}")
        self.rank, self.error, self.rank_traceback = rank, error, tb


@dataclass
class RankContext:
    """What a task function receives on each rank. ``report(obj)`` hands ``obj`` to the caller
    while the task runs (``Ranks.run(..., on_report=)`` receives it in the caller's process, so a
    rank's progress lines reach a notebook's output); under torchrun, and without a caller that
    listens, it is dropped."""
    rank: int
    world_size: int
    device: torch.device
    tracer: Tracer
    backend: str
    report: Callable[[Any], None] = lambda obj: None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _resolve(fn_ref: str) -> Callable:
    module, _, name = fn_ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _fn_ref(fn: Callable | str) -> str:
    if isinstance(fn, str):
        return fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__") or "<locals>" in name:
        raise ValueError(
            f"task {fn!r} must be a module-level function of an importable module (rank "
            f"processes import it by name); define it in a .py file, not in a notebook or a closure")
    return f"{module}:{name}"


def _worker(rank: int, world_size: int, port: int, backend: str, threads: int, sys_path: list,
            tasks, results, collective_timeout: float = INIT_TIMEOUT_S) -> None:
    sys.path[:] = sys_path
    torch.set_num_threads(threads)
    # what torchrun tells each rank it starts, so that a library that reads it (DeepSpeed asks
    # for LOCAL_RANK) runs on a warm rank as under torchrun; the group itself is made below
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=INIT_TIMEOUT_S))
        init_group(backend, store=store, rank=rank, world_size=world_size,
                   timeout=timedelta(seconds=collective_timeout))
        device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" \
            else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        results.put(("ready", rank, None))
    except BaseException as e:
        results.put(("error", rank, (-1, repr(e), traceback.format_exc(), time.time())))
        return
    # DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear with its own for good (its
    # "memory-efficient linear": the same values, not the same bits); a warm rank puts torch's
    # back after every task, so that a task computes as it would in a fresh process
    linear = torch.nn.functional.linear
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn_ref, args, kwargs, stream, reports, origin = task
        sink = (lambda ev: results.put(("event", rank, ev))) if stream else None
        report = (lambda obj: results.put(("report", rank, obj))) if reports else (lambda obj: None)
        tracer = Tracer(rank, world_size, origin=origin, sink=sink, keep=not stream)
        try:
            out = _resolve(fn_ref)(RankContext(rank, world_size, device, tracer, backend, report),
                                   *args, **kwargs)
            results.put(("result", rank, (task_id, out, tracer.events)))
        except BaseException as e:
            # report first: the peers are about to fail with "connection closed" and the caller
            # must see this rank's error, not theirs
            results.put(("error", rank, (task_id, repr(e), traceback.format_exc(), time.time())))
            break
        finally:
            torch.nn.functional.linear = linear
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class Ranks:
    """A warm pool of ``world_size`` rank processes that runs tasks (see the module docstring)."""

    _ids = itertools.count()

    def __init__(self, world_size: int, *, backend: str | None = None, threads: int = 1,
                 timeout: float = 120.0, start_method: str = "forkserver",
                 collective_timeout: float = INIT_TIMEOUT_S):
        """``timeout``: seconds a task may take; ``collective_timeout``: seconds a collective
        may wait for its peers before it raises (the process group's timeout: a hang ends
        there, and each rank's flight recorder is written)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if not collective_timeout > 0:
            raise ValueError(f"collective_timeout must be a positive number of seconds, got "
                             f"{collective_timeout!r}")
        self.world_size, self.timeout = world_size, timeout
        self.backend = backend or default_backend()
        if self.backend == "nccl" and torch.cuda.device_count() < 1:
            raise ValueError("backend 'nccl' needs CUDA devices; use 'gloo' on CPU")
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # the forkserver imports these once; every rank forked from it starts warm
            # (torch._dynamo: init_group imports it before the group exists)
            ctx.set_forkserver_preload(["torch", c10d.DYNAMO, "torch.distributed", "minishard"])
        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=INIT_TIMEOUT_S))
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True, name=f"minishard-rank{r}",
                                   args=(r, world_size, self._store.port, self.backend, threads,
                                         list(sys.path), self._tasks[r], self._results,
                                         collective_timeout))
                       for r in range(world_size)]
        self.broken: str | None = None
        for p in self._procs:
            p.start()
        ready = set()
        deadline = time.monotonic() + INIT_TIMEOUT_S
        while len(ready) < world_size:
            kind, rank, payload = self._get(deadline, "starting the ranks")
            if kind == "ready":
                ready.add(rank)
            elif kind == "error":
                self.close()
                raise RankError(rank, payload[1], payload[2])

    # ---- running tasks
    def run(self, fn: Callable | str, *args, on_event: Callable[[dict], None] | None = None,
            on_report: Callable[[int, Any], None] | None = None, timeout: float | None = None,
            **kwargs) -> list:
        """Run ``fn(rank_ctx, *args, **kwargs)`` on every rank; return the results by rank.

        The events each rank traced are in :attr:`last_events` (merged, time-ordered);
        with ``on_event`` they are also delivered one by one while the task runs, and with
        ``on_report`` what a rank passes to ``rank_ctx.report(obj)``, as ``on_report(rank, obj)``.
        """
        if self.broken:
            raise RuntimeError(f"this pool of ranks is closed ({self.broken}); start a new Ranks")
        task_id = next(self._ids)
        origin = time.time()
        for q in self._tasks:
            q.put((task_id, _fn_ref(fn), args, kwargs, on_event is not None, on_report is not None,
                   origin))
        results: dict[int, Any] = {}
        events: list[dict] = []
        deadline = time.monotonic() + (timeout or self.timeout)
        errors = []
        while len(results) < self.world_size:
            try:
                kind, rank, payload = self._get(deadline, f"task {_fn_ref(fn)}",
                                                pending=set(range(self.world_size)) - set(results))
            except BaseException:
                self.close(reason="timed out or interrupted")
                raise
            if kind == "event":
                events.append(payload)
                if on_event is not None:
                    on_event(payload)
            elif kind == "report":
                on_report(rank, payload)
            elif kind == "result":
                _, out, evs = payload
                results[rank] = out
                events.extend(evs)
            elif kind == "error":
                errors.append((payload[3], rank, payload[1], payload[2]))
                # give the other ranks a moment: if one failed *earlier*, report that one
                self._collect_errors(errors, 1.0)
                self.close(reason="a rank failed")
                t, r, err, tb = min(errors)
                raise RankError(r, err, tb)
        from .trace import merge
        self.last_events = merge(events)
        return [results[r] for r in range(self.world_size)]

    def _collect_errors(self, errors: list, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                kind, rank, payload = self._results.get(timeout=0.05)
            except queue_mod.Empty:
                continue
            if kind == "error":
                errors.append((payload[3], rank, payload[1], payload[2]))

    def _get(self, deadline: float, what: str, pending: set | None = None):
        while True:
            try:
                return self._results.get(timeout=0.1)
            except queue_mod.Empty:
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs)
                    if p.exitcode is not None and (pending is None or r in pending)]
            if dead:
                # a rank that died without reporting (killed, segfault): nothing will come
                self._collect_errors(errs := [], 0.5)
                self.close(reason="a rank died")
                if errs:
                    t, r, err, tb = min(errs)
                    raise RankError(r, err, tb)
                r, code = dead[0]
                raise RankError(r, _death(code, at_start=what.startswith("starting")), "")
            if time.monotonic() > deadline:
                self.close(reason="timeout")
                raise TimeoutError(f"{what}: no answer from ranks "
                                   f"{sorted(pending) if pending else 'all'} in time")

    # ---- teardown
    def close(self, reason: str = "closed") -> None:
        if self.broken:
            return
        self.broken = reason
        if reason == "closed":
            for q in self._tasks:
                try:
                    q.put(None)
                except Exception:
                    pass
            for p in self._procs:
                p.join(timeout=5)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in [self._results, *self._tasks]:
            q.close()
            q.cancel_join_thread()

    @property
    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Pools:
    """Warm pools of ranks, one per world size: ``pools(n)`` is a live pool of n ranks — one
    handed in (a notebook's ``R2``) or one started here and kept for the next call — and
    ``close()`` closes those started here. As a context manager it closes them on exit:
    ``with Pools(R2) as pools: pools(4).run(...)``. The test session and the exercises share it."""

    def __init__(self, *given: Ranks, timeout: float = 300.0):
        self.given = {p.world_size: p for p in given}
        self.started: dict[int, Ranks] = {}
        self.timeout = timeout

    def __call__(self, world_size: int) -> Ranks:
        for held in (self.given, self.started):
            pool = held.get(world_size)
            if pool is not None and pool.alive:
                return pool
        pool = self.started[world_size] = Ranks(world_size, timeout=self.timeout)
        return pool

    def close(self) -> None:
        for pool in self.started.values():
            pool.close()
        self.started.clear()

    def __enter__(self) -> "Pools":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def run(fn: Callable | str, world_size: int, *args, on_event=None, on_report=None,
        timeout: float | None = None, **kwargs) -> list:
    """Start ``world_size`` ranks, run one task on them, shut them down."""
    with Ranks(world_size) as ranks:
        return ranks.run(fn, *args, on_event=on_event, on_report=on_report, timeout=timeout, **kwargs)


# --------------------------------------------------------------------------- torchrun

def context_from_env(trace_sink=None, collective_timeout: float = INIT_TIMEOUT_S) -> RankContext:
    """Inside ``torchrun``: join the process group from the environment and build the context
    (``collective_timeout``: seconds a collective waits for its peers before it raises)."""
    backend = default_backend()
    if not dist.is_initialized():
        init_group(backend, timeout=timedelta(seconds=INIT_TIMEOUT_S))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # agree on one time origin so the ranks' timelines line up
    from .comm import Comm
    origin = torch.tensor([time.time()], dtype=torch.float64, device=device)
    Comm().broadcast(origin, 0)
    # a short collective timeout counts from here: torchrun starts processes seconds apart on a
    # busy machine, and the first collective above waited for the last of them
    if collective_timeout != INIT_TIMEOUT_S:
        dist.group.WORLD.set_timeout(timedelta(seconds=collective_timeout))
    return RankContext(rank, world_size, device, Tracer(rank, world_size, origin=origin.item(),
                                                        sink=trace_sink), backend)
