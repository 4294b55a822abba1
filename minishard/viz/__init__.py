"""Views of a trace: the step-through :class:`Player` widget and the plain figures it is made of,
and the course's calculator widgets. :func:`replay_html` is the same player without a kernel
(one HTML output that plays on the static site; ``python -m minishard view`` writes it for any
trace); it lives in the engine (``minishard.viewers.offline_player``) so that a node without plotly has it.

The engine never imports this package; it only reads events (``minishard.core.trace``).
"""
from minishard.viewers.offline_player import replay_html          # the player with no kernel: one HTML output
from .calculator import LedgerCalculator          # the ledger calculator widget, chapter 01
from .figures import ledger_bars, timeline_figure
from .planner import PlannerWidget                # the planner widget, chapter 10
from .pair import PlayerPair                   # two traces side by side, chapters 02 and 06
from .player import Player, Replay, static_player_figure
from .reshard import reshard_figure               # the reshard map, chapter 09
from .ring import ring_figure, ring_schedule

__all__ = ["LedgerCalculator", "Player", "PlayerPair", "PlannerWidget", "Replay", "ledger_bars", "replay_html",
           "reshard_figure", "ring_figure", "ring_schedule", "static_player_figure", "timeline_figure"]
