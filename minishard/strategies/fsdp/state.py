"""What a unit holds and what it is doing — two states, as PyTorch's FSDP2 keeps them apart —
and what only the root holds and does, one object every unit under it shares.

``MemoryState`` is what the unit's parameters occupy in memory right now (FSDP2: each
parameter's ``sharded_state``); every change is a ``unit`` event in the trace, which the player
and the course draw. ``TrainingState`` is where the unit is in the step (FSDP2: the parameter
group's ``_training_state``); it decides what a hook does — e.g. a forward during backward is a
recomputation, not a new step — and it is not traced.

``RootContext`` is FSDP2's ``FSDPStateContext``: each unit starts with a context of its own,
and the first unit to run forward — the root — finds the units below it and hands them its
context, so that from then on they all read one list of units, one recorded forward order, one
set of prefetch bounds. ``set_prefetch`` and ``set_stage3_limits``, called on the root's module
before the first forward, write into the root's context, which is the one kept.

    lazy_init           the first forward: the root takes the units below it, applies the rule
                        for ``reshard_after_forward=None``
    record_forward      the first forward's order of units (prefetch follows it)
    first_in_backward   backward reached its first unit: the end-of-backward callback is due
    post_backward       the end of backward: every unit reduced, waited for and resharded
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .unit import FSDPUnit


class MemoryState(enum.Enum):
    """What a unit's parameters occupy. A unit rests in SHARDED or UNSHARDED (or, between its
    forward and its backward, SHARDED_POST_FORWARD); UNSHARDING and REDUCE_SCATTERING are the
    moments a collective is filling memory, shown because that is where time and bytes go."""
    SHARDED = "sharded"
    """Only this rank's shard of every parameter (1/N, padded) and the shard's gradient."""
    SHARDED_POST_FORWARD = "sharded_post_forward"
    """``reshard_after_forward=k``: between forward and backward, the shard and this rank's 1/k of
    the full parameters — its part of the all-gather that backward runs inside its group of k
    ranks (a node), instead of over all N."""
    UNSHARDING = "unsharding"
    """The shard, and an all-gather in flight into a fresh buffer (the flat layout's full buffer;
    the per-parameter layout's packed buffer, copied out into the parameters when it lands)."""
    UNSHARDED = "unsharded"
    """The full parameters, which the module computes with, next to the shard."""
    REDUCE_SCATTERING = "reduce_scattering"
    """The full parameters still, and the unit's full gradients packed into a reduce-scatter in
    flight; the shard's ``.grad`` receives this rank's summed shard when it lands."""


@dataclass
class AllGatherState:
    """An all-gather in flight (FSDP2's name): its work, the buffer it fills, and the buffer's
    autograd version before it (put back when it lands: the gathered values are the saved ones)."""
    work: object
    buffer: torch.Tensor
    version: int


@dataclass
class ReduceScatterState:
    """A reduce-scatter in flight: its work, the shard it fills, and the packed full gradients it
    reads (alive until it lands)."""
    work: object
    output: torch.Tensor
    input: torch.Tensor


@dataclass
class AllReduceState:
    """One all-reduce of replicated parameters' gradients in flight: its work, the flat buffer it
    sums, and the ``.grad`` tensors the sum goes back into."""
    work: object
    flat: torch.Tensor
    grads: list


class TrainingState(enum.Enum):
    """Where the unit is in the training step (what its hooks are doing)."""
    IDLE = "idle"
    """Between steps, or between its forward and its backward: no hook of the unit is running."""
    FORWARD = "forward"
    """Its forward runs: from the forward pre-hook (unshard) to the forward hook (reshard)."""
    PRE_BACKWARD = "pre_backward"
    """Backward reached its outputs: it is unsharded for, and computing, its gradients. A
    forward now is a recomputation (activation checkpointing) and changes nothing."""
    POST_BACKWARD = "post_backward"
    """Its gradients are all in: reduce-scatter issued, parameters resharded (the root stays
    unsharded). The root's end-of-backward callback brings every unit back to IDLE."""


def after_forward_words(asked, kept) -> str:
    """What a unit does after forward, as the trace's unit-state table shows it: ``reshard``,
    ``keep`` or ``keep 1/k`` — and, where ``reshard_after_forward=None`` left it to the root's
    rule (FSDP2's clamp: the root keeps, every other unit reshards), says so."""
    what = "reshard" if kept is True else "keep" if kept is False else f"keep 1/{kept}"
    return what + (" (None: the root's rule)" if asked is None else "")


def root_rule(root, units: list) -> dict[str, str]:
    """FSDP2's rule for ``reshard_after_forward=None``, applied by the root at its first forward:
    the root keeps its parameters (backward starts with it at once), every other unit reshards.
    Returns what each unit does after forward, in words, for the trace."""
    told = {}
    for u in units:
        asked = u.reshard_after_forward
        if asked is None:
            u.reshard_after_forward = u is not root
        told[u.name] = after_forward_words(asked, u.reshard_after_forward)
    return told


# ---------------------------------------------------------------------------- the root's context

@dataclass
class Stage3Limits:
    """The root's DeepSpeed bounds (``limits.py``), in elements; None: unbounded (FSDP's depth
    rule alone)."""
    prefetch_bucket_size: int | None = None
    max_live_parameters: int | None = None


class RootContext:
    """The root's state: the units it owns, the order its first forward ran them, the prefetch
    depth and DeepSpeed's bounds, and whether the end-of-backward callback is queued."""

    def __init__(self) -> None:
        self.root: FSDPUnit | None = None          # the unit that ran forward first
        self.units: list[FSDPUnit] = []            # every unit under the root, the root first
        # (forward, backward) depth when no list is given: FSDP2's default, which gathers the
        # unit before in backward and nothing ahead in forward (set_prefetch changes it)
        self.prefetch_depth = (0, 1)
        self.stage3_limits = Stage3Limits()         # DeepSpeed's bounds (``limits.py``)
        self._recording: list[FSDPUnit] | None = None
        self._forward_order: list[FSDPUnit] | None = None
        self._post_backward_queued = False

    def lazy_init(self, root: "FSDPUnit") -> None:
        """The first unit to run forward is the root: it takes every unit below it into its
        context. Unless told otherwise, the root keeps its parameters from forward to backward
        (backward starts with it at once), every other unit reshards after its forward."""
        if self.root is not None:
            return
        self.root = root
        self.units = [m._fsdp_unit for m in root.module.modules() if hasattr(m, "_fsdp_unit")]
        for u in self.units:
            if u.context.root is not None and u.context is not self:
                raise RuntimeError(f"unit {u.name} already belongs to root {u.context.root.name}")
            u.context = self
        root.tell_trace(after_forward=root_rule(root, self.units))

    def record_forward(self, unit: "FSDPUnit") -> None:
        """The order in which the first forward runs the units (as FSDP2 records it): prefetch
        follows it, not the order the modules were declared in."""
        if unit is self.root:
            if self._forward_order is None:
                self._recording = []
        elif self._recording is not None and unit not in self._recording:
            self._recording.append(unit)

    def end_forward(self, unit: "FSDPUnit") -> None:
        """A unit's forward is over; the root's ends the recording."""
        if unit is self.root and self._recording is not None:
            self._forward_order, self._recording = self._recording, None

    def forward_order(self) -> list["FSDPUnit"]:
        """The units below the root in the order forward runs them: as recorded in the first
        forward; until that forward is over, the order of the modules."""
        if self._forward_order is not None:
            return self._forward_order
        return [u for u in self.units if u is not self.root]

    def first_in_backward(self) -> bool:
        """True once per backward, for the first unit it reaches: the hooks then queue
        :meth:`post_backward` on the autograd engine."""
        if self._post_backward_queued:
            return False
        self._post_backward_queued = True
        return True

    def post_backward(self) -> None:
        """End of backward: units whose post-backward did not run — the root, whose inputs
        (token ids) carry no gradient; units whose parameters got none — are reduced now; then
        every unit, the root too, waits for its reduction and reshards."""
        for u in self.units:
            if u.training_state is TrainingState.PRE_BACKWARD:
                u.post_backward()
        for u in self.units:
            u.finish_backward()
        self._post_backward_queued = False
