"""ZeRO-3 as PyTorch's FSDP does it: units that gather their parameters just in time.

``fully_shard(block)`` for every transformer block, then ``fully_shard(model)`` for the root,
makes each one a *unit*. From then on a rank stores 1/N of every parameter (its shard; that is
what ``model.parameters()`` returns, so any ``torch.optim`` optimizer works unchanged), and each
unit lives through this cycle every step::

    forward reaches the unit   unshard: all-gather the full parameters      SHARDED -> UNSHARDED
    compute
    forward leaves the unit    reshard: free the non-local part             UNSHARDED -> SHARDED
    backward reaches the unit  unshard again (the activations need them)    SHARDED -> UNSHARDED
    compute the gradients
    all gradients are in       reduce-scatter: keep the summed slice only   -> REDUCE_SCATTERING
                               reshard                                      -> SHARDED

Hooks drive it (registered in one place, :func:`_register_hooks`, each a single call to a named
method); ``fully_shard(..., manual=True)`` registers none, so a notebook can call ``unshard``,
``reshard`` and ``reduce_scatter_grads`` by hand. ``reshard_after_forward=False`` keeps the full
parameters from forward to backward (one all-gather per step, like ZeRO-2's traffic, for more
memory). The root unit is never resharded after forward: backward needs it at once.

How a unit's parameters are laid out (per parameter as FSDP2, or flat as FSDP1) is
``fsdp_param.py``'s business; this file is only the lifecycle.
"""
from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .comm import Comm, Work
from .fsdp_param import FlatLayout, PerParamLayout, collect_slots
from .ledger import LiveLedger
from .offload import Tier, TransferLog


class UnitState(enum.Enum):
    """What a unit holds in memory in each state (the player shows these)."""
    SHARDED = "sharded"                   # only this rank's shard of every parameter
    UNSHARDING = "unsharding"             # all-gather in flight into a freshly allocated buffer
    UNSHARDED = "unsharded"               # full parameters (and the shard) for compute
    REDUCE_SCATTERING = "reduce_scattering"   # full gradients being summed into the shard


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As PyTorch's: ``param_dtype`` for the gathered parameters and compute, ``reduce_dtype`` for
    the gradient reduce-scatter. The sharded parameters keep their own dtype (fp32): they are the
    master weights the optimizer updates."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


class FSDPUnit:
    """One unit: its parameters' layout, its state, and the lifecycle steps as methods."""

    def __init__(self, module: nn.Module, name: str, layout, comm: Comm, ledger: LiveLedger | None,
                 reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy,
                 tier: Tier | None = None, replicate: Comm | None = None):
        self.module, self.name, self.layout = module, name, layout
        self.comm, self.ledger = comm, ledger
        self.replicate = replicate                 # hybrid sharding: the same shard elsewhere
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.state = UnitState.SHARDED
        self.root: FSDPUnit | None = None          # set lazily, at the first forward
        self.units: list[FSDPUnit] = []            # the root's list of every unit below it
        self.requires_gradient_sync = True
        self.in_backward = False
        self._gather: tuple[Work | None, torch.Tensor, int] | None = None
        self._pending_rs: tuple[Work | None, torch.Tensor, torch.Tensor] | None = None
        self._post_backward_done = False
        self._final_callback_queued = False
        # prefetch: explicit lists of units to unshard early, or (None) the root's depth rule
        self.forward_prefetch: list[FSDPUnit] | None = None
        self.backward_prefetch: list[FSDPUnit] | None = None
        self.prefetch_depth = (0, 0)               # (forward, backward); read on the root
        self.exposed_s = 0.0                       # seconds compute waited for this unit's comm
        # offload: the shards and their gradients live in a tier off the device (offload.py)
        self.tier, self.transfers = tier, TransferLog()
        where = tier.name if tier is not None else None
        for t in layout.shard_tensors():
            if tier is not None:
                t.data = tier.copy_of(t.data)
            # the sharded gradients exist for the whole run: allocate them now (the ledger sees
            # them, and reduce-scatters accumulate into them in place)
            if t.requires_grad:
                t.grad = tier.zeros_like(t) if tier is not None else torch.zeros_like(t)
        if ledger is not None:
            # with a lower-precision compute dtype the fp32 shards are the master weights
            lower = mp_policy.param_dtype not in (None, layout.slots[0].dtype)
            for i, t in enumerate(layout.shard_tensors()):
                ledger.track("master" if lower else "params", t, f"{name}:shard{i}", where)
                if t.grad is not None:
                    ledger.track("grads", t.grad, f"{name}:shard_grad{i}", where)

    @property
    def is_root(self) -> bool:
        return self.root is self

    def _set_state(self, state: UnitState) -> None:
        self.state = state
        if self.comm.tracer is not None:
            self.comm.tracer.emit("unit", name=self.name, state=state.value)

    # ------------------------------------------------------------------ unshard / reshard
    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather of the unit's full parameters (``wait_for_unshard`` finishes it).

        The flat layout gathers straight into its full buffer, allocated here. The per-parameter
        layout gathers into a packed buffer and allocates the parameters only at the copy-out,
        so a unit still in flight (prefetched) holds one copy of its parameters, not two."""
        if self.state != UnitState.SHARDED:
            return
        self._set_state(UnitState.UNSHARDING)
        if self.layout.gathers_in_place:
            self._alloc_unsharded()
        t0 = time.perf_counter()
        inp = self.layout.all_gather_input(self.layout.device)
        if self.tier is not None:           # the shard came over from the tier: a transfer
            self.transfers.add("h2d", sum(t.numel() * t.element_size()
                                          for t in self.layout.shard_tensors()),
                               time.perf_counter() - t0, self.comm.tracer, self.name)
        out = self.layout.all_gather_output()
        if not self.layout.gathers_in_place and self.ledger is not None:
            self.ledger.alloc("comm_buffers", out.numel() * out.element_size(), f"{self.name}:ag")
        # gathering into the buffer whose views autograd saved must not count as modifying them
        # (they get back the very values saved). gloo may write until wait(): the version is
        # put back only after it.
        version = out._version
        with torch.no_grad():
            work = self.comm.all_gather(out, inp, async_op=True, tag=self.name)
        self._gather = (work, out, version)
        if not async_op:
            self.wait_for_unshard()

    def _alloc_unsharded(self) -> None:
        self.layout.alloc_unsharded()
        if self.ledger is not None:
            for i, t in enumerate(self.layout.unsharded_tensors()):
                self.ledger.track("unsharded", t, f"{self.name}:full{i}")

    def wait_for_unshard(self) -> None:
        if self._gather is None:
            return
        work, out, version = self._gather
        if work is not None:
            self._wait(work, "wait_unshard")
        torch._C._autograd._unsafe_set_version_counter((out,), (version,))
        if not self.layout.gathers_in_place:
            self._alloc_unsharded()
            self.layout.copy_out(out)
            if self.ledger is not None:
                self.ledger.free(f"{self.name}:ag")
        self._gather = None
        self.layout.to_unsharded()          # the module now computes with the full parameters
        self._set_state(UnitState.UNSHARDED)

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
        if self.state == UnitState.SHARDED:
            return
        self.wait_for_unshard()
        self.layout.to_sharded()
        self.layout.free_unsharded()
        if self.ledger is not None:
            for i in range(len(self.layout.unsharded_tensors())):
                self.ledger.free(f"{self.name}:full{i}")
        self._set_state(UnitState.SHARDED)

    # ------------------------------------------------------------------ forward
    def pre_forward(self, args: tuple) -> tuple:
        if self.root is None:
            self.lazy_init_as_root()
        if self.is_root and not self.in_backward:
            self.root_pre_forward()
        if not self.in_backward:            # (a recomputation's graph is never walked back)
            # the gradient w.r.t. the unit's inputs is computed last in its backward: a node
            # there tells us the unit's backward is over. It is made before the flat layout's
            # views, so that autograd runs it after them (later nodes run first).
            args = _RegisterPostBackward.apply(self, *args)
        self.unshard()
        self.wait_for_unshard()
        if not self.in_backward:
            self.prefetch(self._prefetch_targets(forward=True))
        return args

    def post_forward(self, output):
        if self.in_backward:                # recomputation (activation checkpointing): keep
            return output
        if not torch.is_grad_enabled():     # no backward will come
            self.reshard()
        elif self.reshard_after_forward:
            self.reshard()
        self._register_pre_backward(output)
        return output

    # ------------------------------------------------------------------ backward
    def pre_backward(self) -> None:
        """Backward reached the unit's outputs: its full parameters must be back."""
        if self.in_backward:
            return
        self.in_backward = True
        self.root.queue_final_callback()
        self.unshard()
        self.wait_for_unshard()
        self.prefetch(self._prefetch_targets(forward=False))

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, targets: list["FSDPUnit"]) -> None:
        """Start the all-gathers of units that will run soon, without waiting: they travel while
        this unit computes. Each prefetched unit holds its full parameters from now on — the
        memory price of hiding communication."""
        for u in targets:
            u.unshard(async_op=True)

    def _prefetch_targets(self, forward: bool) -> list["FSDPUnit"]:
        explicit = self.forward_prefetch if forward else self.backward_prefetch
        if explicit is not None:
            return explicit
        root = self.root
        depth = root.prefetch_depth[0 if forward else 1]
        if depth == 0:
            return []
        order = [u for u in root.units if u is not root]       # forward order of the blocks
        if not forward:
            order = order[::-1]
        if self is root:                  # the root runs first in forward and in backward
            return order[:depth]
        i = order.index(self)
        return order[i + 1:i + 1 + depth]

    def on_grad_ready(self, index: int) -> None:
        """A full gradient of this unit was accumulated: enter it in the ledger."""
        if self.ledger is not None:
            tag = f"{self.name}:grad_full{index}"
            leaf = self.layout.grad_leaves()[index]
            if not self.ledger.is_live(tag) and leaf.grad is not None:
                self.ledger.alloc("grads", leaf.grad.numel() * leaf.grad.element_size(), tag)

    def post_backward(self) -> None:
        """The unit's backward is over: reduce-scatter its gradients, free its parameters."""
        if self._post_backward_done:
            return
        self._post_backward_done = True
        if self.requires_gradient_sync and self.layout.grad_leaves():
            self.reduce_scatter_grads(async_op=True)
        if not self.is_root:
            self.reshard()

    def reduce_scatter_grads(self, async_op: bool = False) -> None:
        """Sum the full gradients over ranks; this rank keeps its slice in the shards' ``.grad``.
        Waits first for the previous unit's reduce-scatter, so at most one is in flight."""
        for u in (self.root.units if self.root else [self]):
            u.wait_for_reduce_scatter()
        self._set_state(UnitState.REDUCE_SCATTERING)
        dtype = self.mp_policy.reduce_dtype or self.layout.reduce_dtype
        inp = self.layout.reduce_scatter_input(dtype)
        replicas = self.replicate.world_size if self.replicate is not None else 1
        inp.div_(self.comm.world_size * replicas)   # sum / N: the gradient of the global mean loss
        out = self.layout.reduce_scatter_output(dtype)
        self._release_full_grads()
        if self.ledger is not None:
            self.ledger.alloc("comm_buffers", inp.numel() * inp.element_size(), f"{self.name}:rs")
        work = self.comm.reduce_scatter(out, inp, async_op=True, tag=self.name)
        self._pending_rs = (work, out, inp)
        if not async_op:
            self.wait_for_reduce_scatter()

    def wait_for_reduce_scatter(self) -> None:
        if self._pending_rs is None:
            return
        work, out, _ = self._pending_rs
        if work is not None:
            self._wait(work, "wait_reduce_scatter")
        if self.replicate is not None:      # hybrid: sum the slice with its replicas' (slow link)
            self.replicate.all_reduce(out, tag=self.name)
        t0 = time.perf_counter()
        self.layout.accumulate_reduced(out)
        if self.tier is not None:           # the reduced slice goes to the tier
            self.transfers.add("d2h", out.numel() * out.element_size(), time.perf_counter() - t0,
                               self.comm.tracer, self.name)
        if self.ledger is not None:
            self.ledger.free(f"{self.name}:rs")
        self._pending_rs = None

    def _release_full_grads(self) -> None:
        self.layout.drop_unsharded_grads()
        if self.ledger is not None:
            for i in range(len(self.layout.grad_leaves())):
                if self.ledger.is_live(f"{self.name}:grad_full{i}"):
                    self.ledger.free(f"{self.name}:grad_full{i}")

    # ------------------------------------------------------------------ the root's duties
    def lazy_init_as_root(self) -> None:
        """The first unit to run forward is the root: it finds the units below it. Unless told
        otherwise, the root keeps its parameters from forward to backward (backward starts with
        it at once), every other unit reshards after its forward."""
        self.units = [m._fsdp_unit for m in self.module.modules() if hasattr(m, "_fsdp_unit")]
        for u in self.units:
            if u.root is not None and u.root is not u:
                raise RuntimeError(f"unit {u.name} already belongs to root {u.root.name}")
            u.root = self
            if u.reshard_after_forward is None:
                u.reshard_after_forward = u is not self

    def root_pre_forward(self) -> None:
        self._final_callback_queued = False

    def queue_final_callback(self) -> None:
        if not self._final_callback_queued:
            self._final_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.root_post_backward)

    def root_post_backward(self) -> None:
        """End of backward: units whose gradients did not all arrive (unused parameters) are
        reduced now, every reduce-scatter is waited for, every unit — the root too — reshards."""
        for u in self.units:
            if u.in_backward:       # e.g. the root, whose inputs (token ids) carry no gradient
                u.post_backward()
        for u in self.units:
            u.wait_for_reduce_scatter()
            u.reshard()
            u.in_backward = u._post_backward_done = False
        self._final_callback_queued = False

    # ------------------------------------------------------------------ hooks
    def _register_pre_backward(self, output) -> None:
        for t in tree_flatten(output)[0]:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(self._pre_backward_hook)

    def _pre_backward_hook(self, grad):
        self.pre_backward()
        return grad


class _RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's inputs in forward; in backward, it runs when the gradients w.r.t.
    those inputs are done — after every gradient of the unit's parameters was accumulated."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None, *grads)


def _register_hooks(unit: FSDPUnit) -> None:
    """Every hook FSDP needs, in one visible place; each is one call to a named method."""
    unit.module.register_forward_pre_hook(lambda mod, args: unit.pre_forward(args))
    unit.module.register_forward_hook(lambda mod, args, out: unit.post_forward(out))
    for i, leaf in enumerate(unit.layout.grad_leaves()):
        leaf.register_post_accumulate_grad_hook(lambda p, i=i: unit.on_grad_ready(i))


def fully_shard(module: nn.Module, *, comm: Comm, ledger: LiveLedger | None = None,
                reshard_after_forward: bool | None = None,
                mp_policy: MixedPrecisionPolicy | None = None, layout: str = "per_param",
                manual: bool = False, name: str | None = None,
                offload: Tier | None = None, replicate: Comm | None = None) -> nn.Module:
    """Make ``module`` an FSDP unit owning its parameters that no child unit owns yet. Apply it
    bottom-up — blocks first, the root last. Returns the module itself (no class swapping).

    ``reshard_after_forward``: None (default) reshards every unit but the root after forward;
    True/False force it (True on the root gives textbook ZeRO-3: every parameter gathered twice).
    ``manual=True`` registers no hooks: call ``unshard``/``reshard``/``reduce_scatter_grads``
    yourself (see :func:`manual_step`). ``offload``: an ``offload.Tier`` that keeps the shards,
    their gradients (and, with ``optim_state.ensure_optimizer_state``, the optimizer state).
    ``replicate``: hybrid sharding (HSDP) — ``comm`` is the shard group (a node), ``replicate``
    joins the ranks holding the same shard on other nodes (see ``Comm.split``)."""
    name = name or type(module).__name__
    if hasattr(module, "_fsdp_unit"):
        raise ValueError(f"{name} is already an FSDP unit: fully_shard a module once")
    if layout not in ("per_param", "flat"):
        raise ValueError(f"unknown layout {layout!r}; expected 'per_param' or 'flat'")
    taken = {}
    for m in module.modules():
        if hasattr(m, "_fsdp_unit"):
            u = m._fsdp_unit
            if u.root is not None:
                raise ValueError(f"unit {u.name} has already run forward as part of root "
                                 f"{u.root.name}; shard every module before the first forward")
            taken.update({pid: u.name for pid in u.original_param_ids})
            taken.update({id(t): u.name for t in u.layout.shard_tensors()})
    slots = collect_slots(module, taken)
    if not slots:
        raise ValueError(f"{name} has no parameters left to shard")
    devices = {s.module._parameters[s.name].device for s in slots}
    if len(devices) > 1:
        raise ValueError(f"{name}: parameters on mixed devices {sorted(map(str, devices))}")
    original_ids = {id(s.module._parameters[s.name]) for s in slots}
    mp_policy = mp_policy or MixedPrecisionPolicy()
    comm.replicate_from_rank0(s.module._parameters[s.name] for s in slots)   # rank 0's model
    if layout == "per_param":
        lay = PerParamLayout(slots, comm.rank, comm.world_size, mp_policy.param_dtype)
    else:
        lay = FlatLayout(slots, comm.rank, comm.world_size, mp_policy.param_dtype, module)
    unit = FSDPUnit(module, name, lay, comm, ledger, reshard_after_forward, mp_policy, offload,
                    replicate)
    unit.original_param_ids = original_ids
    module._fsdp_unit = unit
    if not manual:
        _register_hooks(unit)
    return module


def _depth(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} prefetch depth must be a non-negative integer, got {value!r}")
    return value


def set_prefetch(model: nn.Module, forward: int = 1, backward: int = 1) -> None:
    """Prefetch depth for every unit of ``model`` (its root must be ``model``): while a unit
    computes, the next ``forward`` units (the previous ``backward`` units in backward) are
    already being gathered. Depth k keeps up to k+1 units' full parameters in memory."""
    root = model._fsdp_unit
    root.prefetch_depth = (_depth(forward, "forward"), _depth(backward, "backward"))


def set_modules_to_forward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    """Explicit override, as FSDP2's: when ``module`` runs forward, gather ``modules`` early."""
    module._fsdp_unit.forward_prefetch = [m._fsdp_unit for m in modules]


def set_modules_to_backward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    module._fsdp_unit.backward_prefetch = [m._fsdp_unit for m in modules]


def units(model: nn.Module) -> list[FSDPUnit]:
    return [m._fsdp_unit for m in model.modules() if hasattr(m, "_fsdp_unit")]


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Gradient accumulation without communication: full gradients stay on every rank (memory!)
    and are reduce-scattered once, by the first backward outside this context."""
    us = units(model)
    for u in us:
        u.requires_gradient_sync = False
    try:
        yield
    finally:
        for u in us:
            u.requires_gradient_sync = True


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the norm of the *whole* gradient, which no rank holds: each rank sums the squares
    of its gradient shards (padding is zero), one all-reduce of that number over the shard group
    adds the ranks up (hybrid: each replica group holds the same shards), and every rank scales
    by the same factor — ``torch.nn.utils.clip_grad_norm_``'s rule, as ZeRO's."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    comm = units(model)[0].comm
    sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:
        sq += g.double().pow(2).sum()
    comm.all_reduce(sq, tag="grad_norm")
    total = sq.sqrt().to(torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value by its original name, gathered unit by unit (a collective:
    every rank must call it)."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for u in units(model):
        was_sharded = u.state == UnitState.SHARDED
        u.unshard()
        for s, value in zip(u.layout.slots, u.layout.full_values()):
            prefix = names[id(s.module)]
            out[f"{prefix}.{s.name}" if prefix else s.name] = value.clone()
        if was_sharded:
            u.reshard()
    return out
