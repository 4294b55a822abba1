"""A flight recorder: every rank keeps its last collectives, to say what it was doing when a
run hung or died.

PyTorch's c10d keeps one for NCCL (``TORCH_FR_BUFFER_SIZE``) and writes it on a timeout; its
``fr_trace`` tool then names the rank and the collective that diverged. minishard's
:class:`~minishard.core.comm.Comm` keeps its own, the same idea in the course's words: a ring buffer
of the last ``capacity`` collectives, each with

    seq        this group's collective number (ranks issue collectives in the same order,
               so the k-th one must be the same collective everywhere); ``group`` is named
               by its members where it is not the world ("shard[0, 1]")
    op, group, shapes, dtypes, bytes, tag (the unit or bucket), step, phase
    state      "issued" until the collective completed on this rank, then "completed"
    where      the engine's line that issued it; caller: the first line outside minishard
               and torch (the user's code, a notebook cell, a test)
    t_issued, t_completed   seconds on the rank's trace clock

and, beside the entries, ``run``: the run's id, which the ranks agreed as it started
(:mod:`minishard.core.run_id`: the doctor refuses files of different runs read as one), and
``facts``: what else must agree across ranks or tells a cause — the
run's config, a fingerprint of the weights each rank built and started from, whether the start
was broadcast from rank 0, each step's gradient norm and the precision the optimizer steps in,
and every few steps the replicas' fingerprints and the optimizer's settings
(``instruments/replicas.py``: records, :meth:`FlightRecorder.note`, kept in the ring too).

:meth:`FlightRecorder.dump` writes ``flight_rank{r}.json`` next to the rank's trace: on an
exception (a collective timing out raises one; the dump says where it was raised), on SIGTERM
(torchrun stopping the others when one rank fails) and at the end of a run, with the trace
clock's time (``t``: how long a collective still issued had waited). On an exception and on
SIGTERM the rank's trace is written beside it too (``dumping(..., tracer=)``): the events of a
rank that never returns are collected by nobody else. A rank that dies without reaching Python
again writes none; :meth:`FlightRecorder.fly_to` keeps the same entries on disk as they are issued
(``flight_rank{r}.ring``, :mod:`minishard.core.flight_file`), which the doctor reads instead.
``python -m minishard doctor DIR`` reads them.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import signal
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .flight_file import FlightFile
from .words import dtype_name

if TYPE_CHECKING:
    from .trace import Tracer

FORMAT_VERSION = 1
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # minishard/
_TORCH = os.sep + "torch" + os.sep
_HERE = tuple(os.path.join(_PACKAGE, "core", f) for f in ("comm.py", "flight.py"))
# Python's own library: a rank process's multiprocessing frames are nobody's code to fix
_LIBRARIES = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})


def call_sites(depth: int = 2, issuer: type = object,
               library: tuple[str, ...] | None = None) -> tuple[str, str]:
    """(the engine's line that issued the collective, the first line outside minishard and
    torch), each as ``file:line in function``. ``issuer``: the communicator's class; its methods
    are not the call site, in whichever file a subclass of it lives. ``library``: another
    training library whose collectives a watch records (DeepSpeed) — its folder, then the files
    or folders of its plumbing (its communicator, its decorators): its other lines are the
    engine's line, and none of its lines is the caller."""
    own = _methods(issuer)
    f, where, caller = sys._getframe(0), "", ""
    for _ in range(depth):                     # (a shallow stack: a script's top level)
        f = f.f_back or f
    while f is not None and not caller:
        path = f.f_code.co_filename
        if path not in _HERE and f.f_code not in own and _TORCH not in path and not path.startswith("<frozen"):
            site = f"{_short(path)}:{f.f_lineno} in {f.f_code.co_name}"
            if library is None:
                where = where or site
            elif path.startswith(library[0]):   # the library's own lines: never the caller
                if not path.startswith(library[1:]):
                    where = where or site
                f = f.f_back
                continue
            if not path.startswith(_PACKAGE):
                caller = site
        f = f.f_back
    # (a collective the user's own line issued through the library: that line is both)
    return where or caller, caller


@functools.cache
def _methods(cls: type) -> frozenset:
    """The code of every method of ``cls`` and its bases: looked up once per class, so that a
    collective's call site costs a set lookup per frame."""
    return frozenset(v.__code__ for c in cls.__mro__ for v in vars(c).values() if hasattr(v, "__code__"))


def _short(path: str) -> str:
    root = os.path.dirname(_PACKAGE)
    return os.path.relpath(path, root) if path.startswith(root) else path


def raised_at(tb) -> dict[str, str]:
    """Where an exception was raised, from its traceback: ``at``, the line that raised it (the
    traceback's last frame: the ``raise``, or a library's line under the user's call), and
    ``caller``, the innermost line of the user's own code — outside minishard, torch, Python's
    standard library (a rank process's ``multiprocessing`` frames) and installed packages; ""
    when none is (minishard's demo raising in its own code); each ``file:line in function``."""
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    sites = [(code.co_filename, f"{_short(code.co_filename)}:{line} in {code.co_name}") for code, line in frames]
    users = [site for path, site in sites if not _not_users(path)]
    return {"at": sites[-1][1] if sites else "", "caller": users[-1] if users else ""}


@functools.cache
def _not_users(path: str) -> bool:
    return (path.startswith(_PACKAGE) or _TORCH in path or path.startswith("<")
            or path.startswith(_LIBRARIES) or any(p in path for p in ("site-packages", "dist-packages")))


class FlightRecorder:
    """One rank's last ``capacity`` collectives, over every group it communicates in."""

    def __init__(self, rank: int = 0, world_size: int = 1, capacity: int = 256,
                 clock: Callable[[], float] | None = None):
        self.rank, self.world_size = rank, world_size
        self.entries: collections.deque[dict] = collections.deque(maxlen=capacity)
        self._seq: dict[str, int] = {}
        # what the doctor compares across ranks besides the collectives (train() and the
        # communicator note them): the run's config, the weights' fingerprints, whether the
        # start was replicated from rank 0, each step's gradient norm and parameter precision
        self.facts: dict = {}
        self._lock = threading.RLock()   # (SIGTERM's handler may dump while this thread holds it)
        self.file: FlightFile | None = None   # on disk as it flies (fly_to), once a run has a folder
        # the clock of the entries' t_issued (the rank's trace clock): a dump says its time on it
        self.clock = clock
        self._run: str | None = None

    @property
    def run(self) -> str | None:
        """The run's id (``run_id.py``), once the ranks agreed it; written into the dump and the ring."""
        return self._run

    @run.setter
    def run(self, run: str) -> None:
        with self._lock:
            self._run = run
            if self.file is not None and run is not None:
                self.file.mark_run(run)

    def fly_to(self, directory: str | os.PathLike) -> Path:
        """From now on write every collective into ``flight_rank{r}.ring`` in ``directory`` as
        it is issued, and mark it there when it completes (``flight_file.py``): what a rank that
        dies without reaching Python again leaves. The collectives held already go in first."""
        with self._lock:
            if self.file is None:
                self.file = FlightFile(directory, self.rank, self.world_size, self.entries.maxlen,
                                       self._run)
                for e in self.entries:
                    n = self.file.issued(e)
                    if e["state"] == "completed":
                        self.file.completed(n, e["t_completed"])
            return self.file.path

    def issued(self, op: str, group: str, group_size: int, tensors, nbytes: int, tag: str,
               step: int | None, phase: str | None, t: float, *, issuer: type = object,
               sites: tuple[str, str] | None = None, **extra) -> dict:
        """Enter a collective as it is issued; the entry is completed in place. ``issuer``: the
        class of the communicator that issues it (see :func:`call_sites`); ``sites``: (where,
        caller) when the issuer found them itself (a watch of another library). ``extra``: what
        else must agree across ranks (a broadcast's ``src``)."""
        where, caller = sites or call_sites(3, issuer)
        with self._lock:
            seq = self._seq[group] = self._seq.get(group, -1) + 1
            entry = {"seq": seq, "op": op, "group": group, "group_size": group_size,
                     "shapes": [list(x.shape) for x in tensors],
                     "dtypes": [dtype_name(x.dtype) for x in tensors],
                     "bytes": nbytes, "tag": tag, "step": step, "phase": phase,
                     "state": "issued", "where": where, "caller": caller,
                     "t_issued": round(t, 7), "t_completed": None, **extra}
            self.entries.append(entry)
            if self.file is not None:
                self.file.issued(entry)
        return entry

    def completed(self, entry: dict, t: float) -> None:
        entry["state"], entry["t_completed"] = "completed", round(t, 7)
        if self.file is not None and "n" in entry:
            self.file.completed(entry["n"], entry["t_completed"])

    def note(self, key: str, record: dict, ring: dict | None = None) -> None:
        """Append ``record`` to ``facts[key]`` (a list: one record a step, e.g. the replicas'
        fingerprints) and, where the recorder flies, ``ring`` — the record cut to fit a slot —
        to its ring, where a rank that dies without a dump keeps it."""
        with self._lock:
            self.facts.setdefault(key, []).append(record)
            if self.file is not None and ring is not None:
                self.file.noted(key, ring)

    def dump(self, directory: str | os.PathLike, reason: str, error: str | None = None,
             raised: dict[str, str] | None = None) -> Path:
        """Write ``flight_rank{r}.json`` in ``directory`` (whole or not at all). ``raised``: where
        the exception ``error`` quotes was raised (:func:`raised_at`)."""
        path = Path(directory) / f"flight_rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            body = {"v": FORMAT_VERSION, "run": self._run, "rank": self.rank,
                    "world_size": self.world_size, "capacity": self.entries.maxlen,    # a full ring has dropped older ones
                    "reason": reason, "error": error, "raised": raised, "time": time.time(),
                    "t": None if self.clock is None else round(self.clock(), 7),
                    "entries": list(self.entries), "facts": self.facts}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, path)
        return path


class dumping:
    """``with dumping(recorder, directory):`` — the recorder is written on the way out: reason
    ``end``, ``exception`` (with the error and where it was raised; the exception goes on) or
    ``sigterm`` (torchrun stopping this rank because another failed: written, then the default
    handler runs). ``tracer``: on an exception and on SIGTERM its events are written beside, as
    ``rank{r}.jsonl`` — whoever collects a rank's events when it returns never gets them — so
    that a run stopped by a failure still has every rank's trace (the player, the doctor's
    ledger findings). A tracer that keeps no events (it streams them to a file) writes nothing.

    A SIGTERM that arrives while the way-out dump is being written waits for it (torchrun sends
    one to every rank as soon as the first exits, and ranks that time out together exit
    together): the handler stays ours until the file is whole, then the signal is sent again."""

    def __init__(self, recorder: FlightRecorder, directory, *, torch_recorder: bool = False,
                 tracer: Tracer | None = None):
        self.recorder, self.directory, self._old = recorder, directory, None
        self.torch_recorder, self.tracer = torch_recorder, tracer
        self._writing = self._pending = False

    def __enter__(self) -> FlightRecorder:
        self.recorder.fly_to(self.directory)
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self.recorder

    def _on_sigterm(self, signum, frame) -> None:
        if self._writing:                        # the way-out dump is on its way: after it
            self._pending = True
            return
        self._writing = True
        self._write("sigterm")
        signal.signal(signal.SIGTERM, self._old or signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _write(self, reason: str, error: str | None = None, raised: dict | None = None) -> None:
        self.recorder.dump(self.directory, reason, error, raised)
        if self.torch_recorder:
            write_torch_recorder(self.directory, self.recorder.rank)
        if reason != "end" and self.tracer is not None and self.tracer.events:
            self.tracer.write_jsonl(Path(self.directory) / f"rank{self.recorder.rank}.jsonl")

    def __exit__(self, kind, error, tb) -> None:
        self._writing = True
        try:
            if error is None:
                self._write("end")
            else:
                if hasattr(error, "held") and hasattr(error, "budget"):   # the ledger's OOM: its
                    self.recorder.facts["out_of_memory"] = {             # exact count, for the doctor
                        "category": error.category, "tag": error.tag, "nbytes": error.nbytes,
                        "budget": error.budget, "held": error.held}
                self._write("exception", f"{kind.__name__}: {error}", raised_at(tb))
        finally:
            if self._old is not None:
                signal.signal(signal.SIGTERM, self._old)
            if self._pending:
                os.kill(os.getpid(), signal.SIGTERM)


def write_torch_recorder(directory, rank: int) -> Path | None:
    """PyTorch's own flight recorder (c10d's ring of each group's last collectives, kept on gloo
    too, by default, in torch 2.13; its size is PyTorch's ``TORCH_FR_BUFFER_SIZE``) as
    ``torch_fr_trace_rank_{rank}`` — the pickle c10d writes for NCCL on a timeout, with each
    collective's Python stack; ``minishard doctor`` reads it (``instruments/torch_flight.py``).
    Nothing is written when no process group is up."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return None
    from .c10d import dump_flight_recorder                # (no public call dumps it on gloo)
    body = dump_flight_recorder()
    path = Path(directory) / f"torch_fr_trace_rank_{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, path)
    return path
