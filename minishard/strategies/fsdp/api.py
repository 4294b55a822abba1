"""The public API, named as PyTorch's FSDP2 names it: ``fully_shard`` and what acts on its units."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from minishard.core import quantized
from minishard.strategies.clipping import clip_sharded_grad_norm_
from minishard.core.comm import Comm
from minishard.core.ledger import LiveLedger
from minishard.strategies.offload import OffloadPolicy, Tier, checked_policy, state_bytes
from . import hooks
from .layout import FlatLayout, PerParamLayout
from .slots import ParamSlot, collect_slots
from .limits import persistent_names
from .replicated import NoShards, NothingToShard, dtype_boundaries
from .unit import FSDPUnit


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As PyTorch's: ``param_dtype`` for the gathered parameters and compute, ``reduce_dtype`` for
    the gradient reduce-scatter (None: in ``param_dtype``, as FSDP2 does — so a policy that names
    only bf16 compute also reduces in bf16). The sharded parameters keep their own dtype (fp32):
    they are the master weights the optimizer updates."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def fully_shard(module: nn.Module, *, comm: Comm | None = None, ledger: LiveLedger | None = None,
                reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), layout: str = "per_param",
                manual: bool = False, name: str | None = None, offload_policy: OffloadPolicy = OffloadPolicy(),
                replicate: Comm | None = None, replicate_params: tuple[str, ...] = (),
                param_persistence_threshold: int | None = None, quantized_weights: bool | int = False,
                quantized_gradients: bool | int = False) -> nn.Module:
    """Make ``module`` an FSDP unit owning its parameters that no child unit owns yet. Apply it
    bottom-up — blocks first, the root last. Returns the module itself (no class swapping).

    ``comm``: the ranks to shard over (default: ``Comm()`` over the default process group).
    ``reshard_after_forward``: None (default) reshards every unit but the root after forward;
    True/False force it (True on the root gives textbook ZeRO-3: every parameter gathered twice);
    an int k dividing the shard group keeps 1/k of the full parameters after forward, so that
    backward gathers inside groups of k consecutive ranks (a node) — FSDP2's rule: 1 is False,
    the group's size is True.
    ``manual=True`` registers no hooks: call ``unshard``/``reshard``/``reduce_scatter_grads``
    yourself. ``offload_policy``: FSDP2's, as there — ``OffloadPolicy()`` (default) offloads nothing,
    ``CPUOffloadPolicy()`` keeps the shards, their gradients and the optimizer state in host
    memory, ``DiskOffloadPolicy(directory)`` in memory-mapped files (the unit's ``offload.Tier``).
    ``replicate``: hybrid sharding (HSDP) — ``comm`` is the shard group (a node), ``replicate``
    joins the ranks holding the same shard on other nodes (see ``Comm.split``).
    ``replicate_params``: names of parameters or submodules of ``module`` (``("ln1", "ln2")``)
    kept whole on every rank: never sharded, their gradients all-reduced — for small tensors
    where a gather costs more than it saves. They keep their dtype: fp32 norms in a bf16 unit
    compute in fp32 and all-reduce fp32 gradients; a unit may keep every parameter whole, and
    gathers nothing (``replicated.py``).
    ``param_persistence_threshold``: DeepSpeed's ``stage3_param_persistence_threshold``, in
    elements — every parameter of at most that many elements joins ``replicate_params``.
    ``quantized_weights`` / ``quantized_gradients``: ZeRO++'s qwZ and qgZ — the all-gathers, and
    the gradient reduction (as an all-to-all), in int8 (True or 8) or int4 (4) with one scale per
    block of ``quantized.BLOCK`` elements (``minishard/core/quantized.py``)."""
    name = name or type(module).__name__
    offload_policy = checked_policy(offload_policy, name)
    if hasattr(module, "_fsdp_unit"):
        raise ValueError(f"{name} is already an FSDP unit: fully_shard a module once")
    if layout not in ("per_param", "flat"):
        raise ValueError(f"unknown layout {layout!r}; expected 'per_param' or 'flat'")
    children = _units_inside(module)
    comm = Comm() if comm is None else comm
    reshard_after_forward, post_forward = _post_forward(reshard_after_forward, comm, name)
    taken = {t: owner for u in children for t, owner in u.claims().items()}
    mp_policy = mp_policy or MixedPrecisionPolicy()
    slots = collect_slots(module, taken)
    whole, sharded, boundaries = _split_replicated(
        slots, replicate_params, persistent_names(slots, param_persistence_threshold, name), name,
        mp_policy, offload_policy)
    _start_from_rank0(slots, comm, replicate, name)
    originals = {id(s.module._parameters[s.name]) for s in sharded}
    lay = _layout(layout, sharded, whole, comm, mp_policy, module)
    unit = (FSDPUnit if sharded else ReplicatedOnlyUnit)(module, name, lay, comm, ledger,
        reshard_after_forward, mp_policy, _tier(offload_policy, comm.rank, name, lay), replicate,
        whole, originals)
    unit.post_forward_comm = post_forward if sharded else None     # nothing gathered, none kept
    unit.quantize = _quantize(quantized_weights, quantized_gradients, lay, name)
    module._fsdp_unit = unit
    if not manual:
        hooks.register_hooks(unit)
    hooks.register_dtype_boundaries(boundaries, mp_policy.param_dtype)    # after its hooks
    return module


class ReplicatedOnlyUnit(NothingToShard, FSDPUnit):
    """A unit whose every parameter is kept whole: no all-gather, no reduce-scatter, only the
    all-reduce of its gradients (``replicated.NothingToShard``)."""


def _layout(kind: str, sharded: list[ParamSlot], whole: list[ParamSlot], comm: Comm,
            mp_policy: MixedPrecisionPolicy, module: nn.Module):
    if not sharded:
        p = whole[0].module._parameters[whole[0].name]
        return NoShards(kind, comm.rank, comm.world_size, p.device, p.dtype)
    if kind == "per_param":
        return PerParamLayout(sharded, comm.rank, comm.world_size, mp_policy.param_dtype)
    return FlatLayout(sharded, comm.rank, comm.world_size, mp_policy.param_dtype, module)


def _start_from_rank0(slots: list[ParamSlot], comm: Comm, replicate: Comm | None, name: str) -> None:
    """Every rank starts from rank 0's model: inside the shard group, then (hybrid) across the
    replica groups, whose first members all sit in the first shard group."""
    devices = {s.module._parameters[s.name].device for s in slots}
    if len(devices) > 1:
        raise ValueError(f"{name}: parameters on mixed devices {sorted(map(str, devices))}")
    params = [s.module._parameters[s.name] for s in slots]
    comm.broadcast_from_rank0(params)
    if replicate is not None:
        replicate.broadcast_from_rank0(params)


def _quantize(weights, gradients, lay, name: str) -> tuple:
    """ZeRO++: the all-gathers' quantization (qwZ) and the reduction's (qgZ), or None."""
    schemes = (quantized.scheme_of(weights, f"{name}: quantized_weights"),
               quantized.scheme_of(gradients, f"{name}: quantized_gradients"))
    if any(schemes) and getattr(lay, "mixed", False):
        raise ValueError(f"{name}: quantized collectives need one dtype to gather; its parameters "
                         f"hold several and no param_dtype is set (give mp_policy a param_dtype)")
    return schemes


def _post_forward(k, comm: Comm, name: str) -> tuple[bool | int | None, Comm | None]:
    """``reshard_after_forward`` as the unit keeps it, and for an int k the k consecutive ranks
    backward gathers over (a collective: every rank makes the groups). As FSDP2 reads an int:
    1 keeps the full parameters (False), the shard group's size reshards to the shard (True)."""
    if k is None or isinstance(k, bool):
        return k, None
    if not isinstance(k, int) or k < 1 or comm.world_size % k:
        raise ValueError(f"{name}: reshard_after_forward={k!r} must be True, False, None or a number "
                         f"of ranks dividing the shard group's {comm.world_size}")
    if k in (1, comm.world_size):
        return k > 1, None
    return k, comm.consecutive(k)


def _units_inside(module: nn.Module) -> list[FSDPUnit]:
    """The units already made below ``module``; refuses if they already ran (the root is fixed
    at the first forward)."""
    inside = units(module)
    for u in inside:
        if u.context.root is not None:
            raise ValueError(f"unit {u.name} has already run forward as part of root "
                             f"{u.context.root.name}; shard every module before the first forward")
    return inside


def _tier(policy: OffloadPolicy, rank: int, unit: str, layout) -> Tier | None:
    """The unit's own place in its offload tier, with room for its shards' state."""
    if policy.tier is None:
        return None
    shards = sum(t.numel() for t in layout.shard_tensors())
    return Tier(policy, rank, unit=unit, needed_bytes=state_bytes(shards))


def _split_replicated(slots: list[ParamSlot], asked: tuple[str, ...] | str, persistent: tuple[str, ...],
                      unit: str, mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy):
    """(the slots kept whole, the slots to shard, the modules computing in their replicated
    parameters' dtype): those ``replicate_params`` names (``asked``) and those under the
    persistence threshold (``persistent``)."""
    if not slots:
        raise ValueError(f"{unit} has no parameters of its own: the units inside it hold them all")
    asked = (asked,) if isinstance(asked, str) else tuple(asked)
    names = (*asked, *persistent)
    if not names:
        return [], slots, {}
    knob = " and ".join(k for k, by in (("replicate_params", asked),
                                        ("param_persistence_threshold", persistent)) if by)
    match = lambda s, n: s.fqn == n or s.fqn.startswith(n + ".")            # noqa: E731
    missing = [n for n in names if not any(match(s, n) for s in slots)]
    if missing:
        raise ValueError(f"replicate_params: {unit} has no parameter or submodule {missing} "
                         f"(its parameters: {[s.fqn for s in slots][:6]}...)")
    whole = [s for s in slots if any(match(s, n) for n in names)]
    if offload_policy.tier is not None:
        # the tier holds the shards, their gradients and moments, and the step runs there; a
        # parameter kept whole would stay on the device with its gradient and moments, outside
        # what the tier accounts for, and the step would straddle both
        raise ValueError(f"{knob} with offload_policy: the tier holds the sharded state, a parameter kept "
                         f"whole would stay on the device; shard it instead")
    boundaries = dtype_boundaries(whole, mp_policy.param_dtype, unit, knob)
    for s in whole:
        s.module._parameters[s.name]._fsdp_replicated = True
    return whole, [s for s in slots if s not in whole], boundaries


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
    model._fsdp_unit.context.prefetch_depth = (_depth(forward, "forward"), _depth(backward, "backward"))


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


@contextlib.contextmanager
def keep_gathered(model: nn.Module):
    """Gradient accumulation that keeps every unit's parameters gathered from one micro-batch's
    backward to the next one's forward (FSDP2's ``set_reshard_after_backward(False)``): the
    next forward gathers nothing, at the price of every unit's full parameters held in between.
    Gradients are still reduce-scattered every micro-batch."""
    us = units(model)
    for u in us:
        u.reshard_after_backward = False
    try:
        yield
    finally:
        for u in us:
            u.reshard_after_backward = True


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the norm of the *whole* gradient, which no rank holds (``clipping.py``): the
    units' gradient shards are this rank's shards, their replicated parameters' gradients are
    whole on every rank; the all-reduce runs over the shard group."""
    us = units(model)
    whole = {id(p) for u in us for p in u.replicated}
    params = [p for p in model.parameters() if p.grad is not None]
    return clip_sharded_grad_norm_([p.grad for p in params if id(p) not in whole], us[0].comm, max_norm,
                                   whole=[p.grad for p in params if id(p) in whole])


@torch.no_grad()
def full_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's full value by its original name, gathered unit by unit (a collective:
    every rank must call it). ``dtype=None``: as the units compute (the compute dtype under
    mixed precision; a replicated parameter in its own dtype); e.g. ``torch.float32``: the fp32
    master weights the optimizer updates."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for u in units(model):
        for s, value in u.full_values(dtype):
            prefix = names[id(s.module)]
            out[f"{prefix}.{s.name}" if prefix else s.name] = value
    return out
