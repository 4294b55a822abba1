"""Rank tasks for tests/test_doctor.py: a few collectives through minishard's ``Comm`` — healthy,
or with one fault planted — each rank leaving its flight dump and its trace in a directory.

Each scenario runs in a process group of its own (``dist.new_group``): a collective a fault
leaves stuck in one group stalls no other scenario. A rank that waits for a collective that will
never complete polls it for ``WAIT_S`` seconds, then writes its dump with reason ``timeout`` and
returns, still waiting — the pool is closed (its processes terminated) by the test."""
import time

import torch
import torch.distributed as dist

from minishard.core import run_id
from minishard.core.comm import Comm
from minishard.core.flight import FlightRecorder, dumping

SIZES = (4, 8)       # two all-reduces' numels: small, so that gloo answers in milliseconds
WAIT_S = 2.0         # how long a rank waits for a collective before it calls it a hang
SKIPPER = 1          # the rank that skips a collective (the "rank 1 of 4")
RAISER = 3           # the rank that raises
ODD_PRECISION = 2    # the rank that reduces in another precision
LOSSES = 3           # all-reduces every rank issues alike before the one that differs
SMALL_RING = 2       # rank 0's ring in that scenario: it has dropped its oldest collectives


def _comm(ctx, flight: FlightRecorder | None = None) -> Comm:
    """The scenario's communicator; its run's id agreed in its group, as ``train`` agrees one."""
    group = dist.new_group(list(range(ctx.world_size)))
    comm = Comm(ctx.tracer, group=group, flight=flight)
    comm.flight.run = ctx.tracer.run = run_id.agree(group=group)
    return comm


def _waited(work, seconds: float = WAIT_S) -> bool:
    end = time.monotonic() + seconds
    while not work.is_completed():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    work.wait()
    return True


def _leave(ctx, comm: Comm, directory: str, reason: str) -> str:
    ctx.tracer.write_jsonl(f"{directory}/rank{ctx.rank}.jsonl")
    comm.flight.dump(directory, reason)
    return reason


def healthy(ctx, directory: str) -> str:
    comm = _comm(ctx)
    x = torch.ones(SIZES[0])
    comm.all_reduce(x, tag="grads")
    gathered = torch.empty(SIZES[0] * ctx.world_size)
    comm.all_gather(gathered, x, tag="unit0")
    comm.reduce_scatter(x, gathered, tag="unit0")
    comm.broadcast(torch.zeros(SIZES[1]), tag="weights")
    return _leave(ctx, comm, directory, "end")


def precision_desync(ctx, directory: str) -> str:
    """One rank reduces its gradients in bfloat16, the others in float16: the same shape and
    bytes, so gloo sums the bits of two formats together and nothing fails — silently. Rank 0
    keeps a ring of ``SMALL_RING``: it no longer holds the first collectives the others hold."""
    small = FlightRecorder(dist.get_rank(), dist.get_world_size(), capacity=SMALL_RING)
    comm = _comm(ctx, small if ctx.rank == 0 else None)
    for _ in range(LOSSES):
        comm.all_reduce(torch.ones(SIZES[0]), tag="loss")
    dtype = torch.bfloat16 if ctx.rank == ODD_PRECISION else torch.float16
    comm.all_reduce(torch.ones(SIZES[1], dtype=dtype), tag="grads")
    return _leave(ctx, comm, directory, "end")


def skipped_collective(ctx, directory: str) -> str:
    """The LoRA hang: one rank has no gradient to reduce, skips the optimizer's all-reduce and
    finishes; the others wait in it."""
    comm = _comm(ctx)
    comm.all_reduce(torch.ones(SIZES[0]), tag="loss")
    comm.broadcast(torch.ones(SIZES[1]), tag="weights")
    if ctx.rank == SKIPPER:                 # "nothing trainable here": the planted fault
        return _leave(ctx, comm, directory, "end")
    work = comm.all_reduce(torch.ones(SIZES[1]), async_op=True, tag="grads")
    return _leave(ctx, comm, directory, "end" if _waited(work) else "timeout")


def raised(ctx, directory: str) -> str:
    """One rank raises between two collectives; the others time out waiting in the second.
    Every rank's dump is written by ``dumping`` on the way out, as ``train`` writes it."""
    comm = _comm(ctx)
    try:
        with dumping(comm.flight, directory):
            comm.all_reduce(torch.ones(SIZES[0]), tag="loss")
            if ctx.rank == RAISER:
                raise RuntimeError("planted: the data loader ran dry on this rank")
            work = comm.all_reduce(torch.ones(SIZES[1]), async_op=True, tag="grads")
            if not _waited(work):
                raise TimeoutError(f"all_reduce did not complete in {WAIT_S} s")
    except (RuntimeError, TimeoutError) as e:
        return type(e).__name__
    return "end"


class WriteThrough(FlightRecorder):
    """A recorder written to disk as each collective is issued, before it reaches the wire:
    gloo aborts the whole process (``std::terminate`` in its own thread; no Python handler runs)
    when the ranks' sizes disagree, so a dump written at the end never would be."""

    def __init__(self, directory: str):
        super().__init__(dist.get_rank(), dist.get_world_size())
        self.directory = directory

    def issued(self, *args, **kwargs) -> dict:
        entry = super().issued(*args, **kwargs)
        self.dump(self.directory, "running")
        return entry


def swapped_order(ctx, directory: str) -> str:
    """Rank 1 issues the two all-reduces in the other order than the rest: at the first one its
    tensor is the other size. (gloo aborts a process that receives more bytes than it posted.)"""
    comm = _comm(ctx, WriteThrough(directory))
    sizes = SIZES[::-1] if ctx.rank == SKIPPER else SIZES
    works = []
    for n in sizes:
        works.append(comm.all_reduce(torch.ones(n), async_op=True, tag=f"bucket{n}"))
    done = all(_waited(w, WAIT_S / 2) for w in works)
    comm.flight.dump(directory, "end" if done else "timeout")
    return "end" if done else "timeout"
