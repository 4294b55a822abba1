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
collectives run in the training communicator's ``companion("checkpoint")``: a group of their own
over the same ranks, created once — collectively, on the main thread, at the first background
save — and kept with that communicator.

**One at a time.** The next save (either kind) over a communicator waits for the one in flight
(``Comm.in_flight``: the communicator keeps it, so this module keeps no state of its own), and
so does :func:`wait_for_saves`, which a training run calls before it ends: two saves writing at
once would double the memory and race for the same directory. A background save therefore
needs the run's communicator (``comm=``): a fresh default one would know of no save before it.
An error in the thread is kept and raised by ``wait()``: the protocol makes it the same error
on every rank.
"""
from __future__ import annotations

import threading
from typing import Callable

from minishard.core.comm import Comm


class PendingSave:
    """A checkpoint being written in the background. ``wait()`` blocks until it is committed and
    returns what a synchronous ``save`` returns (plus ``stall_seconds``: how long ``save`` held
    the caller), or raises its error; ``done()`` says whether ``wait()`` would block."""

    def __init__(self, work: Callable[[], dict], comm: Comm, host_bytes: int, stall_s: float):
        self._work, self._tracer, self._comm = work, comm.tracer, comm
        self._result: dict | None = None
        self._error: BaseException | None = None
        self._times = (0.0, 0.0)
        self._step = comm.tracer.step if comm.tracer is not None else None
        self.host_bytes, self.stall_seconds = host_bytes, stall_s
        # an ordinary (not daemon) thread: an interpreter that ends waits for the write to end
        self._thread = threading.Thread(target=self._run, name="minishard-checkpoint")
        comm.in_flight.append(self)
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
        if self in self._comm.in_flight:
            self._comm.in_flight.remove(self)
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


def wait_for_saves(comm: Comm) -> list[dict]:
    """Wait for every background save over ``comm`` still in flight (at most one: each save
    waits for the last); returns their results, or raises the first one's error."""
    out = []
    while comm.in_flight:
        out.append(comm.in_flight[0].wait())
    return out
