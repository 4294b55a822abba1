"""One FSDP unit and its lifecycle, in the order a training step walks it.

    unshard / wait_for_unshard   all-gather the full parameters     SHARDED -> UNSHARDING -> UNSHARDED
    pre_forward                  forward reaches the unit: unshard, prefetch the next units
    post_forward / reshard       free the full parameters           UNSHARDED -> SHARDED
      reshard_after_forward=k    keep 1/k of them for backward      UNSHARDED -> SHARDED_POST_FORWARD
    pre_backward                 backward reaches the unit: unshard again (inside the k ranks), prefetch
    post_backward                its gradients are in: reduce_scatter_grads, reshard
    reduce_scatter_grads         sum the full gradients, keep the shard  -> REDUCE_SCATTERING
    finish_backward              the root's context, at the end of backward: wait, reshard, IDLE

Hooks call these (``hooks.py``), and nothing here calls a hook; with ``manual=True`` a notebook
calls ``unshard``, ``reshard`` and ``reduce_scatter_grads`` itself. What only the root holds
and does — the units, the forward order, prefetch bounds, the end of backward — is the root's
context (``state.py``). How the parameters are laid out is the layout's business: this file
asks its questions through ``layout.Layout`` and never looks inside one.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from minishard.core.autograd_private import set_version_counter
from minishard.core.comm import Comm, Work
from minishard.core.ledger import LiveLedger
from minishard.strategies.local_grad import local
from minishard.strategies.offload import Tier, TransferLog
from . import limits
from .layout import Layout
from .replicated import ReplicatedParams
from .slots import ParamSlot
from .state import AllGatherState, MemoryState, ReduceScatterState, RootContext, TrainingState

if TYPE_CHECKING:
    from .api import MixedPrecisionPolicy

_IN_BACKWARD = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


class FSDPUnit(ReplicatedParams):
    """One unit: its parameters' layout, its two states — ``memory_state`` (a
    :class:`MemoryState`, traced) and ``training_state`` — and the lifecycle steps as methods;
    ``context``, the root's context once the first forward has run (``state.py``).

    ``replicated``: parameters of the module the unit keeps whole on every rank (norms, say):
    never gathered nor freed, computing in their own dtype, their gradients all-reduced in it
    next to the reduce-scatter (``replicated.py``: :class:`ReplicatedParams`)."""

    def __init__(self, module: nn.Module, name: str, layout: Layout, comm: Comm, ledger: LiveLedger | None,
                 reshard_after_forward: bool | int | None, mp_policy: MixedPrecisionPolicy,
                 tier: Tier | None = None, replicate: Comm | None = None,
                 replicated: list[ParamSlot] = (), originals: set[int] = frozenset()):
        self.module, self.name, self.layout = module, name, layout
        self.comm, self.ledger = comm, ledger
        self.replica_group = replicate             # hybrid sharding: the ranks with the same shard
        # True / False / None (the root decides), or k: keep 1/k of the full parameters after
        # forward and gather them in backward over ``post_forward_comm``, k consecutive ranks
        self.reshard_after_forward = reshard_after_forward
        self.post_forward_comm: Comm | None = None
        self._post_forward_chunks: torch.Tensor | None = None
        self.mp_policy = mp_policy
        self.memory_state = MemoryState.SHARDED
        self.training_state = TrainingState.IDLE
        self._untold: dict = {}                    # facts for the trace's next unit event
        self.context = RootContext()               # its own until a root takes it in
        self.requires_gradient_sync = True
        self.reshard_after_backward = True         # False: stay gathered for the next micro-batch
        self.quantize: tuple = (None, None)        # ZeRO++: qwZ's and qgZ's quantized.Scheme
        self.replicated_slots = list(replicated)
        self.replicated = [s.module._parameters[s.name] for s in self.replicated_slots]
        self._originals = set(originals)           # ids of the parameters the shards replaced
        self._all_gather: AllGatherState | None = None          # work in flight, by name
        self._reduce_scatter: ReduceScatterState | None = None
        self._all_reduces: list[AllReduceState] | None = None
        # prefetch: explicit lists of units to unshard early, or (None) the root's depth rule
        self.forward_prefetch: list[FSDPUnit] | None = None
        self.backward_prefetch: list[FSDPUnit] | None = None
        self.exposed_s = 0.0                       # seconds compute waited for this unit's comm
        # offload: the shards and their gradients live in a tier off the device (offload.py)
        self.tier, self.transfers = tier, TransferLog()
        layout.account(ledger, name)            # it enters the full parameters it allocates
        self._place_shards()

    def _place_shards(self) -> None:
        """The shards (in the tier, with offload) and their gradients, allocated now and entered
        in the ledger: they exist for the whole run, and reduce-scatters accumulate into them."""
        where = self.tier.name if self.tier is not None else None
        for t in self.layout.shard_tensors():
            if self.tier is not None:
                t.data = self.tier.copy_of(t.data)
            if t.requires_grad:     # this rank's shard of the gradient: no norm of its own
                t.grad = local(self.tier.zeros_like(t) if self.tier is not None else torch.zeros_like(t))
        for p in self.replicated:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        if self.ledger is None:
            return
        # with a lower-precision compute dtype the fp32 shards are the master weights (a unit
        # whose every parameter is replicated has no shards: ``replicated.NoShards``). Asked of
        # each shard: a unit may hold several dtypes, and its first parameter's (the rule once
        # used) would count a bf16-first unit's fp32 shards as compute weights
        for i, t in enumerate(self.layout.shard_tensors()):
            master = self.mp_policy.param_dtype not in (None, t.dtype)
            self.ledger.track("master" if master else "params", t, f"{self.name}:shard{i}", where)
            if t.grad is not None:
                self.ledger.track("grads", t.grad, f"{self.name}:shard_grad{i}", where)
        for i, p in enumerate(self.replicated):     # at their own dtype's bytes: they compute in
            self.ledger.track("params", p, f"{self.name}:replicated{i}")    # it, no master beside
            if p.grad is not None:
                self.ledger.track("grads", p.grad, f"{self.name}:replicated_grad{i}")

    def offloaded(self) -> dict[torch.Tensor, Tier]:
        """The shards this unit keeps in an offload tier, each with its tier (empty without
        offload): the optimizer creates their moments beside them."""
        return {t: self.tier for t in self.layout.shard_tensors()} if self.tier is not None else {}

    @property
    def reduce_dtype(self) -> torch.dtype:
        """What this unit's gradients are reduced in — FSDP2's rule: the policy's
        ``reduce_dtype``, else the compute dtype (``param_dtype``), else as they are stored."""
        return self.mp_policy.reduce_dtype or self.mp_policy.param_dtype or self.layout.reduce_dtype

    def recorders(self) -> tuple[list, list]:
        """What records this unit's collectives and bytes (for ``minishard.watch``)."""
        return [self.comm, self.replica_group], [self.ledger]

    def shard_numel(self) -> tuple[int, int]:
        """Elements this rank's shards hold (padding included): (trainable, frozen)."""
        shards = self.layout.shard_tensors()
        return (sum(t.numel() for t in shards if t.requires_grad),
                sum(t.numel() for t in shards if not t.requires_grad))

    def transfer_bytes(self) -> tuple[int, int]:
        """With offload, the bytes one micro-batch moves (tier to device, device to tier): every
        gather brings this rank's shard over — in forward, and again in backward if forward freed
        it (not if it kept a copy to gather over k ranks: ``reshard_after_forward=k``) — and
        every reduce-scatter sends this rank's shard of the reduced gradient to the tier."""
        shards = self.layout.shard_tensors()
        again = bool(self.reshard_after_forward) and self.post_forward_comm is None
        h2d = sum(t.numel() * t.element_size() for t in shards) * (1 + again)
        return h2d, self.shard_numel()[0] * self.reduce_dtype.itemsize

    def release_tier(self) -> None:
        """Remove what the disk tier wrote for this unit (its folder of memory-mapped files)."""
        if self.tier is not None:
            self.tier.cleanup()

    @property
    def is_root(self) -> bool:
        return self.context.root is self

    @property
    def in_backward(self) -> bool:
        return self.training_state in _IN_BACKWARD

    def claims(self) -> dict[int, str]:
        """The ids of every tensor this unit took over — the parameters its shards replaced, its
        shards, its replicated parameters — to its name: no later unit may take them."""
        held = [*self.layout.shard_tensors(), *self.replicated]
        return {**dict.fromkeys(self._originals, self.name), **{id(t): self.name for t in held}}

    def _set_state(self, state: MemoryState) -> None:
        self.memory_state = state
        if self.comm.tracer is not None:
            self.comm.tracer.emit("unit", name=self.name, state=state.value, **self._untold)
        self._untold = {}

    def tell_trace(self, **facts) -> None:
        """Facts the trace's next event of this unit carries (the root's rule, say)."""
        self._untold.update(facts)

    # ------------------------------------------------------------------ unshard / reshard
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather of the unit's full parameters (``wait_for_unshard`` finishes it)
        into the buffer the layout gives (the flat layout: the full buffer itself; the
        per-parameter layout: a packed buffer, copied out when it lands)."""
        if self.memory_state not in (MemoryState.SHARDED, MemoryState.SHARDED_POST_FORWARD):
            return
        post_forward = self.memory_state is MemoryState.SHARDED_POST_FORWARD
        self._set_state(MemoryState.UNSHARDING)
        out = self.layout.begin_unshard()
        # gathering into the buffer whose views autograd saved must not count as modifying them
        # (they get back the very values saved). gloo may write until wait(): the version is
        # put back only after it.
        version = out._version
        with torch.no_grad():
            if post_forward:                # inside the k ranks, from the part kept after forward
                g = self.post_forward_comm
                inp = out.view(g.world_size, -1)[g.rank]
                inp.copy_(self._post_forward_chunks)
                self._drop_post_forward()
                work = g.all_gather(out, inp, async_op=True, tag=self.name, quantize=self.quantize[0])
            else:
                # our shards go straight to our chunk of the output: the gather sends them from
                # there and copies nothing more (as NCCL's in-place all-gather)
                inp = self._fetch_shards(into=out.view(self.comm.world_size, -1)[self.comm.rank])
                work = self.comm.all_gather(out, inp, async_op=True, tag=self.name,
                                            quantize=self.quantize[0])
        self._all_gather = AllGatherState(work, out, version)
        if not async_op:
            self.wait_for_unshard()

    def _fetch_shards(self, dtype: torch.dtype | None = None,
                      into: torch.Tensor | None = None) -> torch.Tensor:
        """What this rank sends into the all-gather, on the device (in ``into`` if given); with
        offload the shard comes over from the tier — a transfer."""
        t0 = time.perf_counter()
        inp = self.layout.all_gather_input(self.layout.device, dtype, into)
        if self.tier is not None:
            self.transfers.add("h2d", sum(t.numel() * t.element_size()
                                          for t in self.layout.shard_tensors()),
                               time.perf_counter() - t0, self.comm.tracer, self.name)
        return inp

    def wait_for_unshard(self) -> None:
        gather = self._all_gather
        if gather is None:
            return
        if gather.work is not None:
            self._wait(gather.work, "wait_unshard")
        set_version_counter((gather.buffer,), (gather.version,))
        self._all_gather = None
        self.layout.finish_unshard(gather.buffer)    # the module computes with them now
        self._set_state(MemoryState.UNSHARDED)

    def _wait(self, work: Work, what: str) -> None:
        """Block until a collective is done; the time spent here is *exposed* communication
        (compute had nothing to do), the rest was hidden behind compute."""
        if work.is_completed():             # nothing to wait for: nothing exposed
            work.wait()
            return
        t0 = time.perf_counter()
        tracer = self.comm.tracer
        with (tracer.phase(what, unit=self.name) if tracer is not None else contextlib.nullcontext()):
            work.wait()
        self.exposed_s += time.perf_counter() - t0

    def reshard(self) -> None:
        """Free the full parameters: the module holds nothing but shards again."""
        if self.memory_state is MemoryState.SHARDED_POST_FORWARD:
            self._drop_post_forward()
            self._set_state(MemoryState.SHARDED)
        elif self.memory_state is not MemoryState.SHARDED:
            self._free_full(then=MemoryState.SHARDED)

    def reshard_post_forward(self) -> None:
        """``reshard_after_forward=k`` after forward: keep this rank's part of the all-gather
        that backward will run inside its group of k ranks — 1/k of the full parameters, a
        fresh copy as FSDP2 makes it (the shard stays: the optimizer steps it) — and free the
        rest. Backward then gathers over k ranks, on a node's fast links, not over all N."""
        self.wait_for_unshard()
        g = self.post_forward_comm
        per = self.comm.world_size // g.world_size          # chunks each of the k keeps
        self._post_forward_chunks = self.layout.pack_chunks(range(g.rank * per, (g.rank + 1) * per))
        if self.ledger is not None:
            self.ledger.track("unsharded", self._post_forward_chunks, f"{self.name}:post_forward")
        self._free_full(then=MemoryState.SHARDED_POST_FORWARD)

    def _free_full(self, then: MemoryState) -> None:
        self.wait_for_unshard()
        self.layout.reshard()
        self._set_state(then)

    def _drop_post_forward(self) -> None:
        self._post_forward_chunks = None
        if self.ledger is not None:
            self.ledger.free(f"{self.name}:post_forward")

    # ------------------------------------------------------------------ forward
    def pre_forward(self) -> None:
        """Forward reaches the unit: its full parameters, and the next units' on their way."""
        self.context.lazy_init(self)        # the first unit to run forward is the root
        if self.in_backward:                # recomputation (activation checkpointing)
            self.unshard()
            self.wait_for_unshard()
            return
        self.training_state = TrainingState.FORWARD
        self.context.record_forward(self)
        self.unshard()
        self.wait_for_unshard()
        self.prefetch(self._prefetch_targets(forward=True))

    def post_forward(self) -> None:
        """Forward leaves the unit: its full parameters freed, or kept (whole, or 1/k)."""
        if self.in_backward:                # recomputation: backward needs the parameters now
            return
        if not torch.is_grad_enabled():     # no backward will come
            self.reshard()
        elif self.post_forward_comm is not None:
            self.reshard_post_forward()
        elif self.reshard_after_forward:
            self.reshard()
        self.training_state = TrainingState.IDLE
        self.context.end_forward(self)

    # ------------------------------------------------------------------ backward
    def pre_backward(self) -> None:
        """Backward reached the unit's outputs: its full parameters must be back."""
        if self.in_backward:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()
        self.wait_for_unshard()
        self.prefetch(self._prefetch_targets(forward=False))

    def on_grad_ready(self, index: int) -> None:
        """A full gradient of this unit was accumulated: enter it in the ledger."""
        if self.ledger is not None:
            tag = f"{self.name}:grad_full{index}"
            leaf = self.layout.grad_leaves()[index]
            if not self.ledger.is_live(tag) and leaf.grad is not None:
                self.ledger.alloc("grads", leaf.grad.numel() * leaf.grad.element_size(), tag)

    def post_backward(self) -> None:
        """The unit's backward is over: reduce-scatter its gradients, free its parameters."""
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        if self.requires_gradient_sync and (self.layout.grad_leaves() or self._replicated_grads()):
            self.reduce_scatter_grads(async_op=True)
        if not self.is_root and self.reshard_after_backward:
            self.reshard()

    def finish_backward(self) -> None:
        """Backward is over (the root's context asks every unit): the gradients reduced and in
        place, the parameters resharded, the unit idle until the next forward."""
        self.wait_for_reduce_scatter()
        if self.reshard_after_backward:
            self.reshard()
        elif self.memory_state is MemoryState.REDUCE_SCATTERING:     # the full parameters stay
            self._set_state(MemoryState.UNSHARDED)
        self.training_state = TrainingState.IDLE

    # ------------------------------------------------------------------ gradient reduction
    def reduce_scatter_grads(self, async_op: bool = False) -> None:
        """Sum the full gradients over ranks; this rank keeps its shard in the shards' ``.grad``
        (replicated parameters: the whole sum, by all-reduce). Waits first for the previous
        unit's reduce-scatter, so at most one is in flight."""
        for u in self.context.units or [self]:
            u.wait_for_reduce_scatter()
        self._set_state(MemoryState.REDUCE_SCATTERING)
        dtype = self.reduce_dtype
        inp = self.layout.reduce_scatter_input(dtype)
        replicas = self.replica_group.world_size if self.replica_group is not None else 1
        inp.div_(self.comm.world_size * replicas)   # sum / N: the gradient of the global mean loss
        self._release_full_grads()                  # packed into ``inp``: not needed
        out = self.layout.reduce_scatter_output(dtype)
        if self.ledger is not None:
            self.ledger.alloc("comm_buffers", inp.numel() * inp.element_size(), f"{self.name}:rs")
            self.ledger.alloc("grads", out.numel() * out.element_size(), f"{self.name}:rs_out")
        work = self.comm.reduce_scatter(out, inp, async_op=True, tag=self.name, quantize=self.quantize[1])
        self._reduce_scatter = ReduceScatterState(work, out, inp)
        if self.replicated:
            self._all_reduce_replicated(self.comm.world_size * replicas)
        if not async_op:
            self.wait_for_reduce_scatter()

    def wait_for_reduce_scatter(self) -> None:
        if self._reduce_scatter is not None:
            self._finish_reduce_scatter()
        if self._all_reduces is not None:
            self._finish_all_reduce()

    def _finish_reduce_scatter(self) -> None:
        work, out = self._reduce_scatter.work, self._reduce_scatter.output
        if work is not None:
            self._wait(work, "wait_reduce_scatter")
        if self.replica_group is not None:      # hybrid: sum the shard with its replicas' (slow link)
            self.replica_group.all_reduce(out, tag=self.name)
        t0 = time.perf_counter()
        if self.tier is not None:           # zero_grad(set_to_none=True) dropped them: the
            for t in self.layout.shard_tensors():   # gradients live in the tier, not the device
                if t.requires_grad and t.grad is None:
                    t.grad = local(self.tier.zeros_like(t))
        self.layout.accumulate_reduced(out)
        if self.tier is not None:           # the reduced shard goes to the tier
            self.transfers.add("d2h", out.numel() * out.element_size(), time.perf_counter() - t0,
                               self.comm.tracer, self.name)
        if self.ledger is not None:
            self.ledger.free(f"{self.name}:rs")
            self.ledger.free(f"{self.name}:rs_out")
        self._reduce_scatter = None

    def _release_full_grads(self) -> None:
        self.layout.drop_unsharded_grads()
        if self.ledger is not None:
            for i in range(len(self.layout.grad_leaves())):
                if self.ledger.is_live(f"{self.name}:grad_full{i}"):
                    self.ledger.free(f"{self.name}:grad_full{i}")

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, targets: list["FSDPUnit"]) -> None:
        """Start the all-gathers of units that will run soon, without waiting: they travel while
        this unit computes. Each prefetched unit holds its full parameters from now on — the
        memory price of hiding communication."""
        for u in targets:
            u.unshard(async_op=True)

    def _prefetch_targets(self, forward: bool) -> list["FSDPUnit"]:
        """The next ``depth`` units in the order forward runs them (reversed in backward), unless
        this unit was given an explicit list. With DeepSpeed's bounds set on the root
        (``set_stage3_limits``, ``limits.py``): as many units as its prefetch bucket holds, and
        any prefetch cut at its cap on live parameters."""
        ctx = self.context
        explicit = self.forward_prefetch if forward else self.backward_prefetch
        if explicit is not None:
            return limits.under_cap(ctx, explicit)
        order = ctx.forward_order()
        if not forward:
            order = order[::-1]
        if self.is_root:                  # the root runs first in forward and in backward
            ahead = order
        elif self in order:
            ahead = order[order.index(self) + 1:]
        else:                             # (did not run in the recorded forward)
            return []
        return limits.window(ctx, ahead, ctx.prefetch_depth[0 if forward else 1])

    # ------------------------------------------------------------------ what a checkpoint saves
    def checkpoint_regions(self, h) -> None:
        """What this rank holds of the unit, for ``minishard.checkpoint``: per parameter, the
        elements its layout keeps (rows of dim 0, or a chunk of the unit's flat buffer) and the
        state of the same elements in ``h.optimizer`` — whichever torch optimizer steps the
        shards; parameters the unit keeps whole are replicas. Under hybrid sharding each
        replica group holds a full copy: only the first group saves."""
        if self.memory_state is not MemoryState.SHARDED:
            raise RuntimeError(f"FSDP unit {self.name} is {self.memory_state.value}: a checkpoint is taken "
                               f"between steps, when every unit holds only its shard")
        lay = self.layout
        h.layout(h.layout_name(3, flat=lay.kind != "per_param", shard_size=lay.N))
        saves = h.rank // lay.N == 0                # the first replica group writes
        h.claim(*lay.shard_tensors())
        for i, s in enumerate(lay.slots):
            name = h.fqn(s.module, s.name)
            local, start, n, first = lay.shard_of(i)
            h.tensor(f"param/{name}", s.shape, local.dtype)
            h.add(f"param/{name}", start, local.detach().reshape(-1)[first:first + n], save=saves)
            for kind, t in h.optimizer_state(h.optimizer, local, name).items():
                h.tensor(f"{kind}/{name}", s.shape, t.dtype)
                h.add(f"{kind}/{name}", start, t[first:first + n], save=saves)
        for s, p in zip(self.replicated_slots, self.replicated):
            h.add_replicated_param(h.fqn(s.module, s.name), p, h.optimizer)

    # ------------------------------------------------------------------ reading the parameters
    @torch.no_grad()
    def full_values(self, dtype: torch.dtype | None = None) -> list[tuple[ParamSlot, torch.Tensor]]:
        """``(slot, full value)`` for every parameter of the unit, copies (a collective: every
        rank calls it). ``dtype=None``: the unit's own unshard, in the compute dtype, resharded
        after if it was sharded. A dtype: the shards all-gathered in it into fresh tensors — e.g.
        ``torch.float32`` gives the fp32 master weights exactly — and the unit left as it is."""
        if dtype is None:
            was_sharded = self.memory_state == MemoryState.SHARDED
            self.unshard()
            self.wait_for_unshard()
            values = [v.clone() for v in self.layout.full_values()]
            if was_sharded:
                self.reshard()
        else:
            out = self.layout.all_gather_output(dtype)
            self.comm.all_gather(out, self._fetch_shards(dtype), tag=self.name)
            values = self.layout.unpack(out)
        whole = [p.detach().to(dtype or p.dtype, copy=True) for p in self.replicated]
        return [*zip(self.layout.slots, values), *zip(self.replicated_slots, whole)]
