"""The public API, named as PyTorch's FSDP2 names it: ``fully_shard`` and what acts on its units."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..comm import Comm
from ..ledger import LiveLedger
from ..offload import Tier
from . import hooks
from .layout import FlatLayout, ParamSlot, PerParamLayout, collect_slots
from .limits import persistent_names
from .state import MixedPrecisionPolicy
from .unit import FSDPUnit


def fully_shard(module: nn.Module, *, comm: Comm | None = None, ledger: LiveLedger | None = None,
                reshard_after_forward: bool | None = None,
                mp_policy: MixedPrecisionPolicy | None = None, layout: str = "per_param",
                manual: bool = False, name: str | None = None, offload: Tier | None = None,
                replicate: Comm | None = None, replicate_params: tuple[str, ...] = (),
                param_persistence_threshold: int | None = None) -> nn.Module:
    """Make ``module`` an FSDP unit owning its parameters that no child unit owns yet. Apply it
    bottom-up — blocks first, the root last. Returns the module itself (no class swapping).

    ``comm``: the ranks to shard over (default: ``Comm()`` over the default process group).
    ``reshard_after_forward``: None (default) reshards every unit but the root after forward;
    True/False force it (True on the root gives textbook ZeRO-3: every parameter gathered twice).
    ``manual=True`` registers no hooks: call ``unshard``/``reshard``/``reduce_scatter_grads``
    yourself. ``offload``: an ``offload.Tier`` that keeps the shards, their gradients and (see
    ``ShardedOptimizer``) the optimizer state. ``replicate``: hybrid sharding (HSDP) — ``comm``
    is the shard group (a node), ``replicate`` joins the ranks holding the same shard on other
    nodes (see ``Comm.split``). ``replicate_params``: names of parameters or submodules of
    ``module`` (``("ln1", "ln2")``) kept whole on every rank: never sharded, their gradients
    all-reduced — for small tensors where a gather costs more than it saves.
    ``param_persistence_threshold``: DeepSpeed's ``stage3_param_persistence_threshold``, in
    elements — every parameter of at most that many elements joins ``replicate_params``."""
    name = name or type(module).__name__
    if hasattr(module, "_fsdp_unit"):
        raise ValueError(f"{name} is already an FSDP unit: fully_shard a module once")
    if layout not in ("per_param", "flat"):
        raise ValueError(f"unknown layout {layout!r}; expected 'per_param' or 'flat'")
    children = _units_inside(module)
    comm = Comm() if comm is None else comm
    taken = {}
    for u in children:
        taken.update(u.claims())
    mp_policy = mp_policy or MixedPrecisionPolicy()
    slots = collect_slots(module, taken)
    whole, sharded = _split_replicated(slots, replicate_params,
                                       persistent_names(slots, param_persistence_threshold, name),
                                       name, mp_policy, offload)
    if not sharded:
        raise ValueError(f"{name} has no parameters left to shard")
    devices = {s.module._parameters[s.name].device for s in slots}
    if len(devices) > 1:
        raise ValueError(f"{name}: parameters on mixed devices {sorted(map(str, devices))}")
    # every rank starts from rank 0's model: inside the shard group, then (hybrid) across the
    # replica groups, whose first members all sit in the first shard group
    comm.replicate_from_rank0(s.module._parameters[s.name] for s in slots)
    if replicate is not None:
        replicate.replicate_from_rank0(s.module._parameters[s.name] for s in slots)
    originals = {id(s.module._parameters[s.name]) for s in sharded}
    if layout == "per_param":
        lay = PerParamLayout(sharded, comm.rank, comm.world_size, mp_policy.param_dtype)
    else:
        lay = FlatLayout(sharded, comm.rank, comm.world_size, mp_policy.param_dtype, module)
    unit = FSDPUnit(module, name, lay, comm, ledger, reshard_after_forward, mp_policy, offload,
                    replicate, whole, originals)
    module._fsdp_unit = unit
    if not manual:
        hooks.register_hooks(unit)
    return module


def _units_inside(module: nn.Module) -> list[FSDPUnit]:
    """The units already made below ``module``; refuses if they already ran (the root is fixed
    at the first forward)."""
    inside = units(module)
    for u in inside:
        if u.root is not None:
            raise ValueError(f"unit {u.name} has already run forward as part of root "
                             f"{u.root.name}; shard every module before the first forward")
    return inside


def _split_replicated(slots: list[ParamSlot], asked: tuple[str, ...] | str, persistent: tuple[str, ...],
                      unit: str, mp_policy: MixedPrecisionPolicy, offload: Tier | None):
    """(the slots kept whole, the slots to shard): those ``replicate_params`` names (``asked``)
    and those under the persistence threshold (``persistent``)."""
    asked = (asked,) if isinstance(asked, str) else tuple(asked)
    names = (*asked, *persistent)
    if not names:
        return [], slots
    knob = " and ".join(k for k, by in (("replicate_params", asked),
                                        ("param_persistence_threshold", persistent)) if by)
    match = lambda s, n: s.fqn == n or s.fqn.startswith(n + ".")            # noqa: E731
    missing = [n for n in names if not any(match(s, n) for s in slots)]
    if missing:
        raise ValueError(f"replicate_params: {unit} has no parameter or submodule {missing} "
                         f"(its parameters: {[s.fqn for s in slots][:6]}...)")
    whole = [s for s in slots if any(match(s, n) for n in names)]
    if offload is not None:
        raise ValueError(f"{knob} with offload: the tier holds the sharded state, a parameter kept "
                         f"whole would stay on the device; shard it instead")
    if mp_policy.param_dtype not in (None, *{s.dtype for s in whole}):
        raise ValueError(f"{knob} with param_dtype {mp_policy.param_dtype}: parameters kept whole "
                         f"compute in their own dtype; cast them yourself")
    for s in whole:
        s.module._parameters[s.name]._fsdp_replicated = True
    return whole, [s for s in slots if s not in whole]


def units(model: nn.Module) -> list[FSDPUnit]:
    """Every unit of ``model``, in module order (the root first)."""
    return [m._fsdp_unit for m in model.modules() if hasattr(m, "_fsdp_unit")]


# ---------------------------------------------------------------------------- prefetch

def _depth(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} prefetch depth must be a non-negative integer, got {value!r}")
    return value


def set_prefetch(model: nn.Module, forward: int = 1, backward: int = 1) -> None:
    """Prefetch depth for every unit of ``model`` (its root must be ``model``): while a unit
    computes, the next ``forward`` units (the previous ``backward`` units in backward) — in the
    order the first forward ran them — are already being gathered. Depth k keeps up to k+1
    units' full parameters in memory."""
    root = model._fsdp_unit
    root.prefetch_depth = (_depth(forward, "forward"), _depth(backward, "backward"))


def set_modules_to_forward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    """Explicit override, as FSDP2's: when ``module`` runs forward, gather ``modules`` early."""
    module._fsdp_unit.forward_prefetch = [m._fsdp_unit for m in modules]


def set_modules_to_backward_prefetch(module: nn.Module, modules: list[nn.Module]) -> None:
    module._fsdp_unit.backward_prefetch = [m._fsdp_unit for m in modules]


# ---------------------------------------------------------------------------- around the step

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
    adds the ranks up (hybrid: each replica group holds the same shards), the replicated
    parameters' gradients — whole on every rank — are added once, and every rank scales by the
    same factor — ``torch.nn.utils.clip_grad_norm_``'s rule, as ZeRO's."""
    us = units(model)
    whole = {id(p) for u in us for p in u.replicated}
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
    for p in params:
        if id(p) not in whole:
            sq += p.grad.double().pow(2).sum()
    us[0].comm.all_reduce(sq, tag="grad_norm")
    for p in params:
        if id(p) in whole:
            sq += p.grad.double().pow(2).sum()
    total = sq.sqrt().to(torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


@torch.no_grad()
def full_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's full value by its original name, gathered unit by unit (a collective:
    every rank must call it). ``dtype=None``: as the units compute (the compute dtype under
    mixed precision); e.g. ``torch.float32``: the fp32 master weights the optimizer updates."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for u in units(model):
        for s, value in u.full_values(dtype):
            prefix = names[id(s.module)]
            out[f"{prefix}.{s.name}" if prefix else s.name] = value
    return out
