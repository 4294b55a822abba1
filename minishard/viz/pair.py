"""Two traces side by side — minishard's run and PyTorch's, watched — moved together by step
and phase.

``PlayerPair(mine, theirs)`` shows two :class:`Player`\\ s under one slider whose stops are the
*moments* both traces have: each top-level phase's begin and end on rank 0, step by step
(``step 1 · backward · begin``). Moving it jumps each player to that moment in its own trace —
the events between moments differ (that is the point: the table of differences says how), the
moments are what the two runs share::

    pair = PlayerPair(mine_events, theirs_events, titles=("minishard FSDP", "torch FSDP2"))
    pair.widget
    pair.show("backward", step=1)         # both players at backward's begin in step 1
    pair.left.snapshot(), pair.right.snapshot()
"""
from __future__ import annotations

import ipywidgets as W

from .player import Player

PHASES = ("forward", "backward", "optimizer")


def moments(events: list[dict], rank: int = 0) -> list[tuple[int, str, str]]:
    """``(step, phase, edge)`` of every top-level phase edge on ``rank``, in the order it happened."""
    return [(e.get("step"), e["name"], e["edge"]) for e in sorted(events, key=lambda e: e["seq"])
            if e["kind"] == "phase" and e["rank"] == rank and "unit" not in e and e["name"] in PHASES]


def shared_moments(a: list[dict], b: list[dict], rank: int = 0) -> list[tuple[int, str, str]]:
    """The moments both traces have, in ``a``'s order."""
    theirs = set(moments(b, rank))
    return [m for m in moments(a, rank) if m in theirs]


def label(moment: tuple[int, str, str]) -> str:
    step, phase, edge = moment
    return f"step {step} · {phase} · {edge}"


class PlayerPair:
    """Two players, one slider over the moments both traces share (see the module's doc)."""

    def __init__(self, left, right, *, titles: tuple[str, str] = ("minishard", "PyTorch"), rank: int = 0):
        self.left, self.right = Player(left, title=titles[0]), Player(right, title=titles[1])
        self.rank = rank
        self.moments = shared_moments(self.left.replay.events, self.right.replay.events, rank)
        if not self.moments:
            raise ValueError("these two traces share no phase (forward / backward / optimizer) "
                             f"on rank {rank}: nothing to line them up by")
        self._slider = W.SelectionSlider(options=[label(m) for m in self.moments],
                                         description="both at", layout=W.Layout(width="520px"))
        self._slider.observe(lambda change: self._show(self.moments[change["owner"].index]),
                             names="value")
        self.widget = W.VBox([self._slider, W.HBox([self.left.widget, self.right.widget],
                                                   layout=W.Layout(flex_flow="row wrap"))])
        self._show(self.moments[0])

    def show(self, phase: str, step: int, edge: str = "begin") -> tuple[int, int]:
        """Both players at ``phase``'s ``edge`` in ``step``; the two event indices."""
        moment = (step, phase, edge)
        if moment not in self.moments:
            raise KeyError(f"{label(moment)} is not a moment both traces have; they share "
                           f"{', '.join(label(m) for m in self.moments[:6])}…")
        self._slider.value = label(moment)        # observers move the players
        return self._show(moment)

    def _show(self, moment) -> tuple[int, int]:
        step, phase, edge = moment
        return (self.left.jump_to_phase(phase, step=step, rank=self.rank, edge=edge),
                self.right.jump_to_phase(phase, step=step, rank=self.rank, edge=edge))
