"""Collectives: the only module that calls torch.distributed's communication.

Every call records what it moved, as a ``collective`` event:

* ``payload`` — the bytes of the buffer the collective is about (the tensor reduced, or the
  full gathered / scattered buffer);
* ``wire`` — the bytes *this rank sends* with the algorithm that really runs. For a buffer of S
  bytes on N ranks, the ring algorithms send

      all_reduce       2 (N-1)/N * S     (a reduce-scatter, then an all-gather)
      reduce_scatter     (N-1)/N * S
      all_gather         (N-1)/N * S
      broadcast        binomial tree: the root sends ceil(log2 N) * S, inner nodes less
      reduce           the tree the other way: every rank but the root sends S once
  These were checked against the operating system's count of bytes each rank process wrote
  (``/proc/self/io`` ``wchar``; see ``tests/test_comm.py``).

gloo has no ring reduce-scatter: its ``reduce_scatter_tensor`` runs a full all-reduce and sends
2(N-1)/N * S, twice the ring volume. On gloo, minishard's :meth:`Comm.reduce_scatter` sends each
chunk straight to the rank it belongs to and receives the N-1 chunks meant for it (N-1
``isend``/``irecv`` pairs, :class:`PairwiseReduceScatter`; (N-1)/N * S on the wire), then sums
them locally in rank order — the ring volume, and the same sum on every rank. One chunk arrives
straight into the output, so the receive buffer holds N-2 chunks: none on two ranks (an
``all_to_all`` into a buffer as large as the input was as fast, but that fresh buffer cost every
ZeRO-2 step its page faults: docs/architecture.md). NCCL gets its native reduce-scatter.

gloo's all-gather is slower than an ``all_to_all`` of the same size (``benchmarks/
bench_collectives.py``). On gloo, :meth:`Comm.all_gather` therefore sends this rank's chunk
straight to every other rank and receives theirs into place (N-1 ``isend``/``irecv`` pairs,
:class:`PairwiseGather`): the same (N-1)/N * S on the wire, no buffer beyond the output.
"""
from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from . import quantized
from .c10d import group_timeout
from .flight import FlightRecorder
from .words import dtype_name
from .trace import Tracer


def ring_wire_bytes(op: str, nbytes: int, world_size: int, rank: int = 0, src: int = 0) -> int:
    """Bytes one rank sends for a collective on a buffer of ``nbytes`` (the formulas above)."""
    N = world_size
    if N == 1:
        return 0
    if op == "all_reduce":
        return 2 * (N - 1) * nbytes // N
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (N - 1) * nbytes // N
    if op == "broadcast":
        # binomial tree rooted at src: a rank at relative position r sends in every round k
        # where it already has the data (r < 2^k) and the partner r + 2^k exists
        r = (rank - src) % N
        rounds = math.ceil(math.log2(N))
        return nbytes * sum(1 for k in range(rounds) if r < 2 ** k and r + 2 ** k < N)
    if op == "reduce":              # the same tree the other way: all but the root send once
        return 0 if rank == src else nbytes
    raise ValueError(f"unknown collective {op!r}")


def bytes_written() -> int | None:
    """This process's bytes written so far, as the kernel counts them (``/proc/self/io``
    ``wchar``: every write and send). gloo sends through sockets, so the delta around a
    collective is what this rank put on the wire, plus a few bytes of protocol headers."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Work:
    """An in-flight collective. ``wait()`` blocks until it is done and records the event.

    ``stamp``: a trace wants the time the collective *completed*, not when someone waited for
    it, so a helper thread waits for it and notes the time. The helper is an ordinary (not
    daemon) Python thread that ``wait()`` joins: no thread outside Python ever runs Python code
    for us (a completion callback runs in gloo's own thread), and none is left running Python
    when the interpreter shuts down — a thread that reaches for the interpreter while it is
    being torn down aborts the process ("terminate called without an active exception")."""

    def __init__(self, comm: "Comm", handle, event: dict, finish=None, *, stamp: bool = False):
        self._comm, self._handle, self._event, self._finish = comm, handle, event, finish
        self.done = False
        self._stamper, self._error = None, None
        if stamp and handle is not None:
            self._stamper = threading.Thread(target=self._stamp, name="minishard-stamp")
            self._stamper.start()

    def _stamp(self) -> None:
        try:
            self._handle.wait()
        except BaseException as e:           # handed to whoever waits, in their thread
            self._error = e
        self._event["t_done"] = self._comm.tracer.now()

    def then(self, after) -> "Work":
        """Run ``after`` once the collective is done, before it is recorded (qwZ dequantizes)."""
        first = self._finish
        self._finish = after if first is None else (lambda: (first(), after()))
        return self

    def is_completed(self) -> bool:
        """Finished on the wire (wait() would not block)."""
        return self.done or self._handle is None or self._handle.is_completed()

    def wait(self) -> None:
        if self.done:
            return
        if self._stamper is not None:
            self._stamper.join()
            if self._error is not None:
                raise self._error
        elif self._handle is not None:
            self._handle.wait()
        if self._finish is not None:
            self._finish()
        self.done = True
        self._comm._record(self._event)


class _PointToPoint:
    """N-1 ``isend``/``irecv`` pairs (``self._works``), waited for once: a gloo point-to-point
    work may be waited for once only (a second wait blocks for a completion that never comes);
    its Work waits once, in one thread (see Work.wait)."""

    def __init__(self):
        self._works, self._done = [], False

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def _wait_all(self) -> bool:
        """Wait for every exchange; False if that was done already."""
        if self._done:
            return False
        for w in self._works:
            w.wait()
        self._done = True
        return True


class PairwiseGather(_PointToPoint):
    """An all-gather as N-1 point-to-point exchanges (gloo; see the module docstring): rank r
    sends its chunk to r+k and receives r-k's into place, k = 1 .. N-1. Every collective gets
    its own tag, so that two gathers in flight at once (prefetch) never pair up wrongly: ranks
    issue collectives in the same order, so the k-th gather has the same tag everywhere."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, comm: "Comm", tag: int):
        super().__init__()
        N, r = comm.world_size, comm.rank
        chunks = output.view(N, -1)
        for k in range(1, N):
            self._works.append(dist.isend(input, group=comm.group, group_dst=(r + k) % N, tag=tag))
            self._works.append(dist.irecv(chunks[(r - k) % N], group=comm.group,
                                          group_src=(r - k) % N, tag=tag))
        if chunks[r].data_ptr() != input.data_ptr():
            chunks[r].copy_(input.view_as(chunks[r]))

    def wait(self) -> None:
        self._wait_all()


class PairwiseReduceScatter(_PointToPoint):
    """A reduce-scatter as N-1 point-to-point exchanges (gloo; see the module docstring): rank r
    sends chunk r+k of its input to rank r+k and receives rank r-k's chunk r, k = 1 .. N-1. The
    first contribution in rank order (rank 0's; rank 1's on rank 0) arrives straight into
    ``output``, the others into ``scratch`` (:meth:`receive_rows` of them) — on two ranks, no
    receive buffer at all — and ``wait`` adds the rest in rank order, so every rank sums its
    chunk the same way. In place (``output`` is chunk r of ``input``, as ZeRO-1 calls it) our
    own chunk must survive, so every contribution arrives in ``scratch`` and the sum is copied
    into ``output`` at the end."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, scratch: torch.Tensor | None,
                 comm: "Comm", tag: int):
        super().__init__()
        N, r = comm.world_size, comm.rank
        self._chunks, self._r, self._output = input.view(N, -1), r, output.view(-1)
        self._first = 1 if r == 0 else 0
        straight_in = not self.in_place(output, input, comm)
        rows = iter(scratch if scratch is not None else ())
        self._where = {}                        # the rank a contribution comes from -> its place
        for q in range(N):
            if q != r:
                self._where[q] = self._output if straight_in and q == self._first else next(rows)
        for k in range(1, N):
            dst, src = (r + k) % N, (r - k) % N
            self._works.append(dist.isend(self._chunks[dst], group=comm.group, group_dst=dst, tag=tag))
            self._works.append(dist.irecv(self._where[src], group=comm.group, group_src=src, tag=tag))

    @staticmethod
    def in_place(output: torch.Tensor, input: torch.Tensor, comm: "Comm") -> bool:
        return output.data_ptr() == input.view(comm.world_size, -1)[comm.rank].data_ptr()

    @classmethod
    def receive_rows(cls, output: torch.Tensor, input: torch.Tensor, comm: "Comm") -> int:
        """How many chunks wait in the receive buffer: N-2, or N-1 in place."""
        return comm.world_size - (1 if cls.in_place(output, input, comm) else 2)

    def wait(self) -> None:
        if not self._wait_all():
            return
        acc = self._where[self._first]          # the first contribution in rank order
        for q in range(len(self._chunks)):      # (x1 + x0 on rank 0: two terms commute exactly)
            if q != self._first:
                acc.add_(self._chunks[q] if q == self._r else self._where[q])
        if acc.data_ptr() != self._output.data_ptr():
            self._output.copy_(acc)


class Comm:
    """Instrumented collectives for one rank (and one process group).

    ``tracer`` receives the events; ``ledger`` (optional) receives the temporary buffers a
    collective needs (gloo's reduce-scatter receive buffer) as ``comm_buffers``.
    """

    def __init__(self, tracer: Tracer | None = None, group=None, ledger=None, *, alone: bool = False,
                 flight: FlightRecorder | None = None, name: str = "world"):
        """``alone``: a world of one even inside a process group (one rank training by itself,
        e.g. the no-communication reference a benchmark measures on every rank at once).
        ``flight``: the rank's flight recorder (one is made if None; ``split`` shares it, each
        group numbering its own collectives under ``name``)."""
        self.tracer, self.group, self.ledger = tracer, group, ledger
        self.initialized = not alone and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.initialized else 0
        self.world_size = dist.get_world_size(group) if self.initialized else 1
        self.backend = dist.get_backend(group) if self.initialized else "none"
        self.name = name
        # a group smaller than the world names its members in each collective's event (HSDP, k)
        self.members = (dist.get_process_group_ranks(group) if self.initialized and group is not None
                        and self.world_size < dist.get_world_size() else None)
        self._consecutive: dict[int, Comm] = {}
        self._companions: dict[str, Comm] = {}
        self.in_flight: list = []     # a thread's work over these ranks (a background save), unwaited
        self.flight = flight if flight is not None else FlightRecorder(   # (timed on the tracer's clock)
            dist.get_rank() if self.initialized else 0, dist.get_world_size() if self.initialized else 1,
            clock=tracer.now if tracer is not None else None)
        self.totals = {"payload": 0, "wire": 0, "calls": 0}
        self.by_op: dict[str, dict[str, int]] = {}
        self._p2p_collectives = 0              # tags for the point-to-point collectives

    # ---- bookkeeping
    def _next_tag(self) -> int:
        """Each point-to-point collective's own tag: ranks issue collectives in the same order,
        so the k-th one has the same tag everywhere and two in flight never pair up wrongly."""
        self._p2p_collectives += 1
        return self._p2p_collectives % (1 << 24)

    def _begin(self, op: str, tensor: torch.Tensor, nbytes: int, tag: str, **extra) -> dict:
        tr = self.tracer
        t0 = tr.now() if tr is not None else 0.0
        step, phase = (tr.step, tr.current_phase) if tr is not None else (None, None)
        flight = self.flight.issued(op, self.name, self.world_size, (tensor,), nbytes, tag,
                                    step, phase, t0, issuer=type(self), **extra)
        return {"op": op, "payload": nbytes,
                "wire": ring_wire_bytes(op, nbytes, self.world_size, self.rank, extra.get("src", 0)),
                "dtype": dtype_name(tensor.dtype), "group": self.world_size,
                "tag": tag, "t": t0, "_flight": flight,
                **({"members": self.members} if self.members is not None else {}), **extra}

    def _record(self, ev: dict) -> None:
        self.totals["payload"] += ev["payload"]
        self.totals["wire"] += ev["wire"]
        self.totals["calls"] += 1
        o = self.by_op.setdefault(ev["op"], {"payload": 0, "wire": 0, "calls": 0})
        o["payload"] += ev["payload"]
        o["wire"] += ev["wire"]
        o["calls"] += 1
        flight = ev.pop("_flight")
        if self.tracer is not None:
            t = ev.pop("t")
            t_end = ev.pop("t_done", None) or self.tracer.now()
            self.flight.completed(flight, t_end)
            self.tracer.emit("collective", t=t, t_end=round(t_end, 7), **ev)
        else:
            self.flight.completed(flight, 0.0)

    def reset_counters(self) -> None:
        self.totals = {"payload": 0, "wire": 0, "calls": 0}
        self.by_op = {}

    def _run(self, ev: dict, launch, async_op: bool, finish=None) -> Work | None:
        handle = launch() if self.world_size > 1 else None
        stamp = async_op and self.tracer is not None and self.tracer.enabled
        work = Work(self, handle, ev, finish, stamp=stamp)
        if async_op:
            return work
        work.wait()
        return None

    # ---- the collectives
    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False, tag: str = "") -> Work | None:
        """Sum ``tensor`` across ranks, in place."""
        ev = self._begin("all_reduce", tensor, tensor.numel() * tensor.element_size(), tag)
        return self._run(ev, lambda: dist.all_reduce(tensor, group=self.group, async_op=True), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   tag: str = "", quantize: quantized.Scheme | None = None) -> Work | None:
        """``output`` (N * input.numel()) receives every rank's ``input``, in rank order.
        ``quantize``: in int8 or int4 with a scale per block (ZeRO++'s qwZ, ``quantized.py``;
        the trace shows the bytes that travel)."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                             f"{self.world_size} x {input.numel()}")
        if quantize and self.world_size > 1:
            return quantized.all_gather(self, output, input, quantize, async_op, tag)
        ev = self._begin("all_gather", output, output.numel() * output.element_size(), tag)
        if self.world_size == 1:
            output.copy_(input.view_as(output))
        if self.backend == "gloo":
            p2p_tag = self._next_tag()
            return self._run(ev, lambda: PairwiseGather(output, input, self, p2p_tag), async_op)
        return self._run(ev, lambda: dist.all_gather_single(
            output, input, group=self.group, async_op=True), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                       tag: str = "", quantize: quantized.Scheme | None = None) -> Work | None:
        """``output`` receives chunk ``rank`` of the sum over ranks of ``input`` (N chunks).
        ``quantize``: each contribution in int8 or int4 through an all-to-all (ZeRO++'s qgZ)."""
        N = self.world_size
        if input.numel() != output.numel() * N:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"{N} x {output.numel()}")
        if quantize and N > 1:
            return quantized.reduce_scatter(self, output, input, quantize, async_op, tag)
        ev = self._begin("reduce_scatter", input, input.numel() * input.element_size(), tag)
        if N == 1:
            output.copy_(input.view_as(output))
            return self._run(ev, None, async_op)
        if self.backend == "nccl":
            return self._run(ev, lambda: dist.reduce_scatter_single(
                output, input, group=self.group, async_op=True), async_op)
        # gloo: the N-1 chunks meant for this rank arrive point to point, one of them straight
        # into output, the others (N > 2, or in place) into a receive buffer; summed in rank order
        input = input.contiguous()
        rows = PairwiseReduceScatter.receive_rows(output, input, self)
        scratch, buf_tag = None, None
        if rows:
            scratch = torch.empty(rows, output.numel(), dtype=input.dtype, device=input.device)
            buf_tag = f"rs_recv:{tag}:{id(scratch)}"
            if self.ledger is not None:
                self.ledger.alloc("comm_buffers", scratch.numel() * scratch.element_size(), buf_tag)

        def finish():
            if self.ledger is not None and buf_tag is not None:
                self.ledger.free(buf_tag)

        p2p_tag = self._next_tag()
        return self._run(ev, lambda: PairwiseReduceScatter(output, input, scratch, self, p2p_tag),
                         async_op, finish)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                   tag: str = "") -> Work | None:
        """Chunk q of ``input`` (N equal chunks) goes to rank q; ``output``'s chunk q comes from it."""
        ev = self._begin("all_to_all", input, input.numel() * input.element_size(), tag)
        return self._run(ev, lambda: dist.all_to_all_single(output, input, group=self.group,
                                                            async_op=True), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False,
                  tag: str = "") -> Work | None:
        """``src`` is a rank of this communicator's group (not a global rank)."""
        ev = self._begin("broadcast", tensor, tensor.numel() * tensor.element_size(), tag, src=src)
        return self._run(ev, lambda: dist.broadcast(tensor, group=self.group, group_src=src,
                                                    async_op=True), async_op)

    @torch.no_grad()
    def broadcast_from_rank0(self, tensors, ledger=None) -> None:
        """Make every rank's ``tensors`` equal rank 0's — how DDP, ZeRO and FSDP start from one
        model: packed into one flat buffer, so that it is one broadcast rather than one per tensor
        (entered in ``ledger`` as a communication buffer while it lives). Traced with the tag
        ``replicate``, as traces always were."""
        tensors = list(tensors)
        if self.world_size == 1 or not tensors:
            return
        self.flight.facts.setdefault("start_replicated", []).append(
            {"group": self.name, "tensors": len(tensors)})
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        if ledger is not None:
            ledger.alloc("comm_buffers", flat.numel() * flat.element_size(), "replicate")
        self.broadcast(flat, 0, tag="replicate")
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        if ledger is not None:
            ledger.free("replicate")


    def gather_object(self, obj, dst: int = 0) -> list | None:
        """Small Python objects (tables, summaries) to rank ``dst``; not traced as training traffic."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, group=self.group, group_dst=dst)
        return out

    def _sibling(self, group, name: str, *, alone: bool = False) -> "Comm":
        """A communicator for a subgroup of this one's ranks: the same tracer, ledger and flight
        recorder, and the same class — a subclass (chapter 11's faults wrap the collectives this
        way) reaches its subgroups too."""
        return type(self)(self.tracer, group, self.ledger, alone=alone, flight=self.flight, name=name)

    def split(self, shard_size: int) -> tuple["Comm", "Comm"]:
        """Two communicators for hybrid sharding on a grid of ranks: *shard* groups of
        ``shard_size`` consecutive ranks (a node: fast links) and *replica* groups joining the
        ranks that hold the same shard across nodes (``replicate[...]`` in traces). Every rank
        must call this (it creates process groups, a collective)."""
        N = self.world_size
        if shard_size < 1 or N % shard_size:
            raise ValueError(f"shard size {shard_size} does not divide the world size {N}")
        mine_shard = mine_rep = None
        timeout = group_timeout(self.group)            # (a new group would wait 30 minutes)
        for start in range(0, N, shard_size):            # every rank creates every group
            g = dist.new_group(list(range(start, start + shard_size)), timeout=timeout)
            if start <= self.rank < start + shard_size:
                mine_shard = g
        for offset in range(shard_size):
            g = dist.new_group(list(range(offset, N, shard_size)), timeout=timeout)
            if self.rank % shard_size == offset:
                mine_rep = g
        # each group named by its members: the same name on each of them, another elsewhere
        shard = list(range(self.rank - self.rank % shard_size, self.rank - self.rank % shard_size + shard_size))
        rep = list(range(self.rank % shard_size, N, shard_size))
        return self._sibling(mine_shard, f"shard{shard}"), self._sibling(mine_rep, f"replicate{rep}")

    def companion(self, name: str) -> "Comm":
        """These ranks in a group of their own, for a thread's collectives (a background save's:
        in one group they would pair up wrong with this one's). Made at the first call under
        ``name`` — every rank calls it at the same point — and kept; a world of one needs none."""
        if self.world_size == 1:
            return self
        if name not in self._companions:
            ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
            group = dist.new_group(ranks, timeout=group_timeout(self.group),
                                   use_local_synchronization=len(ranks) < dist.get_world_size())
            other = Comm(None, group, name=f"{name}{ranks}", flight=self.flight)
            if other.rank != self.rank:
                raise RuntimeError(f"the {name} group renumbers rank {self.rank} as {other.rank}")
            self._companions[name] = other
        return self._companions[name]

    def consecutive(self, size: int) -> "Comm":
        """This rank's group of ``size`` consecutive members of this group — a node, where ranks
        are numbered node by node: what ``fully_shard(reshard_after_forward=size)`` gathers over
        in backward (FSDP2's post-forward mesh). Made once per size. Every rank of the world
        calls it at the same time (process groups are made by all), each with its own group
        where this is one of several (hybrid sharding's shard groups): the ranks first learn
        each other's groups, then every rank makes every group."""
        if size in self._consecutive:
            return self._consecutive[size]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or self.world_size % size:
            raise ValueError(f"a group of {size!r} consecutive ranks does not divide this group of "
                             f"{self.world_size}")
        mine = tuple(self.members or range(self.world_size))
        every = [mine]
        if self.initialized:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        timeout = group_timeout(self.group)            # (a new group would wait 30 minutes)
        made = None
        for group in sorted(set(every)):                 # the same order on every rank
            for start in range(0, len(group), size):
                members = list(group[start:start + size])
                g = dist.new_group(members, timeout=timeout) if self.initialized else None
                if (dist.get_rank() if self.initialized else 0) in members:
                    made = self._sibling(g, f"post_forward{members}", alone=not self.initialized)
        self._consecutive[size] = made
        return made

    def all_gather_object(self, obj) -> list:
        """Small Python objects from every rank, on every rank (a checkpoint's piece tables, and
        the ranks' agreement that all succeeded); not traced as training traffic."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def anyone(self, flag: bool) -> bool:
        """Is ``flag`` true on any rank? One 4-byte all-reduce (e.g. "did any rank fail?");
        not traced as training traffic."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
