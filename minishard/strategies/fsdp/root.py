"""What only the root holds and does: one object shared by every unit under it.

PyTorch's FSDP2 keeps these in ``FSDPStateContext``: each unit starts with a context of its own,
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

from typing import TYPE_CHECKING

from . import limits
from .state import TrainingState, root_rule

if TYPE_CHECKING:
    from .unit import FSDPUnit


class RootContext:
    """The root's state: the units it owns, the order its first forward ran them, the prefetch
    depth and DeepSpeed's bounds, and whether the end-of-backward callback is queued."""

    def __init__(self) -> None:
        self.root: FSDPUnit | None = None          # the unit that ran forward first
        self.units: list[FSDPUnit] = []            # every unit under the root, the root first
        self.prefetch_depth = (0, 0)               # (forward, backward), when no list is given
        self.stage3_limits = limits.Stage3Limits()  # DeepSpeed's bounds (``limits.py``)
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
