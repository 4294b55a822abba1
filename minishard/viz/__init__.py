"""Views of a trace: the step-through :class:`Player` widget and the plain figures it is made of.

The engine never imports this package; it only reads events (``minishard.trace``).
"""
from .figures import ledger_bars, timeline_figure
from .player import Player, Replay, static_player_figure
from .ring import ring_figure, ring_schedule

__all__ = ["Player", "Replay", "ledger_bars", "ring_figure", "ring_schedule", "timeline_figure",
           "static_player_figure"]
from .calculator import LedgerCalculator  # noqa: E402  (the ledger calculator widget, chapter 01)
from .reshard import reshard_figure  # noqa: E402  (the reshard map, chapter 09)
from .planner import PlannerWidget  # noqa: E402  (the planner widget, chapter 10)
