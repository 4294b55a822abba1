"""ZeRO-3 as DeepSpeed bounds it: three limits beside FSDP's unit-by-unit prefetch.

DeepSpeed's ZeRO-3 does not count units: its config counts *parameters* — numbers of elements,
not bytes (multiply by the element size: 4 in fp32, 2 in bf16) — and minishard counts them the
same way, per unit (a unit's elements are those of its sharded parameters, whole)::

    DeepSpeed config key                  minishard                                  bounds
    stage3_prefetch_bucket_size           set_stage3_limits(prefetch_bucket_size=n)  gathered ahead
    stage3_max_live_parameters            set_stage3_limits(max_live_parameters=n)   gathered at once
    stage3_param_persistence_threshold    fully_shard(param_persistence_threshold=n) never sharded

* **Prefetch by a budget.** Instead of the next k units, the units ahead in the recorded order
  while their elements add up to at most ``prefetch_bucket_size`` (those already gathered or in
  flight count too): a window of elements, which equals depth k when k equal blocks fill it.
  (DeepSpeed refills its budget at every fetch with the parameters not yet in flight, and may
  pass it by one parameter; its lookahead is bounded by ``max_live_parameters`` only.)
* **A cap on live parameters.** Elements gathered at once — unsharded or in flight, the root
  included — never pass ``max_live_parameters`` because of a prefetch: the prefetch stops at the
  first unit that would cross it. The unit that must compute is always gathered, so the bound
  is the cap or the root plus the largest unit, whichever is larger.
* **Persistence.** Parameters of at most ``param_persistence_threshold`` elements (DeepSpeed's
  test is ``numel <= threshold`` too) are kept whole on every rank — ``replicate_params``: they
  leave the all-gathers, their gradients are all-reduced, they cost their full size on every
  rank. (DeepSpeed keeps their optimizer state sharded and all-gathers them once after each
  step; here they are replicated outright, as DDP would.)
"""
from __future__ import annotations

from .state import MemoryState, Stage3Limits


def elements(unit) -> int:
    """What gathering the unit costs, in elements: its sharded parameters, whole."""
    return sum(s.numel for s in unit.layout.slots)


def live_elements(context) -> int:
    """Elements gathered now under the root (``context``: the root's, ``state.py``): every unit
    not back to its shard (unsharding, unsharded, or reduce-scattering with its parameters
    still whole)."""
    return sum(elements(u) for u in context.units if u.memory_state is not MemoryState.SHARDED)


def window(context, ahead: list, depth: int) -> list:
    """The units to prefetch from ``ahead`` (the units after the one computing, in the order
    they will run): the next ``depth`` — or, with a bucket, as many as fit in it — then cut at
    the cap on live parameters."""
    limits = context.stage3_limits
    if limits.prefetch_bucket_size is None:
        chosen = ahead[:depth]
    else:
        chosen, total = [], 0
        for u in ahead:
            total += elements(u)
            if total > limits.prefetch_bucket_size:
                break
            chosen.append(u)
    return under_cap(context, chosen)


def under_cap(context, targets: list) -> list:
    """``targets`` up to the first unit whose gather would take the live elements over the
    cap (units already gathered or in flight cost nothing more)."""
    cap = context.stage3_limits.max_live_parameters
    if cap is None:
        return list(targets)
    live, kept = live_elements(context), []
    for u in targets:
        if u.memory_state is MemoryState.SHARDED:
            if live + elements(u) > cap:
                break
            live += elements(u)
        kept.append(u)
    return kept


def _count(value, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} is a number of parameters (elements, as DeepSpeed counts "
                         f"them, not bytes): a non-negative integer or None, got {value!r}")
    return value


def set_stage3_limits(model, prefetch_bucket_size: int | None = None,
                      max_live_parameters: int | None = None) -> None:
    """DeepSpeed's two prefetch bounds for every unit of ``model`` (its root), in elements:
    ``prefetch_bucket_size`` (``stage3_prefetch_bucket_size``) replaces the prefetch depth by
    the elements gathered ahead; ``max_live_parameters`` (``stage3_max_live_parameters``) caps
    the elements gathered at once — it also bounds ``set_prefetch``'s depth and explicit lists."""
    bucket = _count(prefetch_bucket_size, "prefetch_bucket_size")
    model._fsdp_unit.context.stage3_limits = Stage3Limits(bucket, _count(max_live_parameters, "max_live_parameters"))


def persistent_names(slots, threshold: int | None, unit: str) -> tuple[str, ...]:
    """The names of the parameters at most ``threshold`` elements big (``fully_shard`` keeps
    them whole, refusing what keeping parameters whole refuses). A unit whose every parameter
    is that small gathers nothing: its gradients are all-reduced, as DDP's."""
    if _count(threshold, "param_persistence_threshold") is None:
        return ()
    return tuple(s.fqn for s in slots if s.numel <= threshold)
