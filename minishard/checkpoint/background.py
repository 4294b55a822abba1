"""Saves that do not stop training: copy to host memory, return, write in a thread.

A synchronous save holds the step for the whole write (hash, write, fsync, exchange, commit). In
the background (``save(..., background=True)``, as DCP's ``async_save``) the step waits only for
the copy of this rank's pieces to host memory; a thread writes the copy, exchanges with the
other ranks' threads and commits, while training goes on changing the live tensors. The copy is
memory — as much host memory as the rank's share of the checkpoint — held until the thread has
written it (its bytes: ``host_copy_bytes``; the ledger has no category for it).

**Its own group.** The thread's collectives cannot share the training's process group. Ranks
must issue a group's collectives in one order, and a thread's exchange lands between the
training's collectives wherever each rank's thread happens to reach it — before the third
all-gather of a step on one rank, after it on another — so the two would pair up wrong (DCP's
thread has the same problem, which is why ``async_save`` takes a ``process_group``). The save's
collectives run in a group of their own over the same ranks, created once — collectively, on
the main thread, at the first background save — and kept for as long as the training's group.

**One at a time.** The next save (either kind) waits for the one in flight, and so does
:func:`wait_for_saves`, which a training run calls before it ends: two saves writing at once
would double the memory and race for the same directory. An error in the thread is kept and
raised by ``wait()``: the protocol makes it the same error on every rank.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch.distributed as dist

from minishard.core.c10d import group_timeout
from minishard.core.comm import Comm

_pending: list["PendingSave"] = []
# the training's process group -> the checkpoint's group over the same ranks; weak, so that the
# checkpoint's group goes with the training's (a group kept alive keeps gloo's threads alive)
_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class PendingSave:
    """A checkpoint being written in the background. ``wait()`` blocks until it is committed and
    returns what a synchronous ``save`` returns (plus ``stall_seconds``: how long ``save`` held
    the caller), or raises its error; ``done()`` says whether ``wait()`` would block."""

    def __init__(self, work: Callable[[], dict], tracer, host_bytes: int, stall_s: float):
        self._work, self._tracer = work, tracer
        self._result: dict | None = None
        self._error: BaseException | None = None
        self._times = (0.0, 0.0)
        self._step = tracer.step if tracer is not None else None
        self.host_bytes, self.stall_seconds = host_bytes, stall_s
        # an ordinary (not daemon) thread: an interpreter that ends waits for the write to end
        self._thread = threading.Thread(target=self._run, name="minishard-checkpoint")
        _pending.append(self)
        self._thread.start()

    def _run(self) -> None:
        t0 = self._tracer.now() if self._tracer is not None else 0.0
        try:
            self._result = self._work()
        except BaseException as e:          # handed to whoever waits, in their thread
            self._error = e
        self._work = None                   # the host copy goes with it
        self._times = (t0, self._tracer.now() if self._tracer is not None else 0.0)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> dict:
        self._thread.join()
        if self in _pending:
            _pending.remove(self)
            self._record()
            if self._result is not None:
                self._result["stall_seconds"] = self.stall_seconds
        if self._error is not None:
            raise self._error
        return self._result

    def _record(self) -> None:
        """The write as a transfer to disk in the trace, emitted here, by the thread that owns
        the tracer (the writing thread never touches it), at the times the write took."""
        if self._tracer is None:
            return
        t0, t1 = self._times
        self._tracer.emit("transfer", t=t0, direction="to_disk", bytes=self.host_bytes,
                          seconds=round(t1 - t0, 7), tag="checkpoint_write", step=self._step)


def wait_for_saves() -> list[dict]:
    """Wait for every background save of this process still in flight (at most one: each save
    waits for the last); returns their results, or raises the first one's error."""
    out = []
    while _pending:
        out.append(_pending[0].wait())
    return out


def checkpoint_comm(comm: Comm) -> Comm:
    """The ranks of ``comm`` in a process group of their own, for a background save's
    collectives (see the module docstring). Every rank of ``comm`` calls it (the first call
    creates the group); a world of one needs none."""
    if comm.world_size == 1:
        return comm
    training = comm.group if comm.group is not None else dist.group.WORLD
    saver = _groups.get(training)
    if saver is None:
        ranks = dist.get_process_group_ranks(training)
        group = dist.new_group(ranks, timeout=group_timeout(comm.group),
                               use_local_synchronization=len(ranks) < dist.get_world_size())
        saver = _groups[training] = Comm(None, group, name=f"checkpoint{ranks}", flight=comm.flight)
        if saver.rank != comm.rank:          # (rank r writes file r: the same r in both groups)
            raise RuntimeError(f"the checkpoint group numbers rank {comm.rank} as {saver.rank}")
    return saver
