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

and, beside the entries, ``facts``: what else must agree across ranks or tells a cause — the
run's config, a fingerprint of the weights each rank built and started from, whether the start
was broadcast from rank 0, each step's gradient norm and the precision the optimizer steps in,
and every few steps the replicas' fingerprints and the optimizer's settings
(``instruments/replicas.py``: records, :meth:`FlightRecorder.note`, kept in the ring too).

:meth:`FlightRecorder.dump` writes ``flight_rank{r}.json`` next to the rank's trace: on an
exception (a collective timing out raises one), on SIGTERM (torchrun stopping the others when
one rank fails) and at the end of a run. A rank that dies without reaching Python again writes
none; :meth:`FlightRecorder.fly_to` keeps the same entries on disk as they are issued
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
import threading
import time
from pathlib import Path

from .flight_file import FlightFile
from .words import dtype_name

FORMAT_VERSION = 1
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # minishard/
_TORCH = os.sep + "torch" + os.sep
_HERE = tuple(os.path.join(_PACKAGE, "core", f) for f in ("comm.py", "flight.py"))


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


class FlightRecorder:
    """One rank's last ``capacity`` collectives, over every group it communicates in."""

    def __init__(self, rank: int = 0, world_size: int = 1, capacity: int = 256):
        self.rank, self.world_size = rank, world_size
        self.entries: collections.deque[dict] = collections.deque(maxlen=capacity)
        self._seq: dict[str, int] = {}
        # what the doctor compares across ranks besides the collectives (train() and the
        # communicator note them): the run's config, the weights' fingerprints, whether the
        # start was replicated from rank 0, each step's gradient norm and parameter precision
        self.facts: dict = {}
        self._lock = threading.RLock()   # (SIGTERM's handler may dump while this thread holds it)
        self.file: FlightFile | None = None   # on disk as it flies (fly_to), once a run has a folder

    def fly_to(self, directory: str | os.PathLike) -> Path:
        """From now on write every collective into ``flight_rank{r}.ring`` in ``directory`` as
        it is issued, and mark it there when it completes (``flight_file.py``): what a rank that
        dies without reaching Python again leaves. The collectives held already go in first."""
        with self._lock:
            if self.file is None:
                self.file = FlightFile(directory, self.rank, self.world_size, self.entries.maxlen)
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

    def dump(self, directory: str | os.PathLike, reason: str, error: str | None = None) -> Path:
        """Write ``flight_rank{r}.json`` in ``directory`` (whole or not at all)."""
        path = Path(directory) / f"flight_rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            body = {"v": FORMAT_VERSION, "rank": self.rank, "world_size": self.world_size,
                    "capacity": self.entries.maxlen,    # a full ring has dropped older ones
                    "reason": reason, "error": error, "time": time.time(),
                    "entries": list(self.entries), "facts": self.facts}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, path)
        return path


class dumping:
    """``with dumping(recorder, directory):`` — the recorder is written on the way out: reason
    ``end``, ``exception`` (with the error; the exception goes on) or ``sigterm`` (torchrun
    stopping this rank because another failed: written, then the default handler runs).

    A SIGTERM that arrives while the way-out dump is being written waits for it (torchrun sends
    one to every rank as soon as the first exits, and ranks that time out together exit
    together): the handler stays ours until the file is whole, then the signal is sent again."""

    def __init__(self, recorder: FlightRecorder, directory, *, torch_recorder: bool = False):
        self.recorder, self.directory, self._old = recorder, directory, None
        self.torch_recorder = torch_recorder
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

    def _write(self, reason: str, error: str | None = None) -> None:
        self.recorder.dump(self.directory, reason, error)
        if self.torch_recorder:
            write_torch_recorder(self.directory, self.recorder.rank)

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
                self._write("exception", f"{kind.__name__}: {error}")
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
