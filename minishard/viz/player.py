"""The step-through player: replay a trace one event at a time.

``Player(events)`` shows, at any event of a run, what every rank holds in memory (stacked bars by
ledger category), the collective in flight (chunks moving round a ring of ranks) and where the
event sits on a per-rank timeline. It reads only events (``minishard.core.trace`` schema v1), from a
finished run or live while the ranks train::

    p = Player(trace.load("runs/ddp"))         # or Player("runs/ddp"), or Player(R.last_events)
    p.widget                                   # Play, slider, step buttons, jump to phase, figures
    p.jump_to_phase("backward", step=1)        # drive it from code, then assert on the figures
    p.snapshot()[0]["grads"]                   # bytes of gradients on rank 0 right now

    p = Player()                               # live: empty, fed as events arrive
    R.run(train, strategy="ddp", on_event=p.feed); p.flush()

Every jump is a lookup: :class:`minishard.core.trace.Replay` folds the trace once into per-event arrays
(the cumulative ledger, each event's phase, the units' states, the collectives' time spans), and a
redraw touches only the plotly traces whose values changed.
"""
from __future__ import annotations

import html
import time

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go

from minishard.core import trace
from minishard.viewers.playback import event_title, opening_event
from .figures import MiB, UNIT_STATE_COLORS, category_order, lane_spans, ledger_bars, spans_figure
from .ring import ring_figure, ring_view
from .live_figure import LiveFigure

NO_PHASE = "—"


class Replay(trace.Replay):
    """The trace's fold (:class:`minishard.core.trace.Replay`), with each event's title in words."""

    def title(self, i: int) -> str:
        """``step 1 · backward · rank 0 all_reduce bucket0 · event 412/813`` (slider value/max)."""
        return event_title(self.events[i], self.phase(i), i, self.n)


class Player:
    """Step through a trace: memory per rank, the collective in flight, the timeline.

    ``events_or_path``: a list of events, a trace directory or ``.jsonl`` file (read with
    :func:`minishard.core.trace.load`, which raises ``TraceFormatError`` for another schema version),
    or None for a live player that :meth:`feed` fills. A trace opens at the first step's peak
    (:func:`~minishard.viewers.playback.opening_event`), as the offline player does; a live player
    follows the newest event.

    ``ring_round``: None (default) derives the ring's round from the time of the current event
    within the collective's ``[t, t_end]``; set it to an int (0-based index into
    :func:`~minishard.viz.ring.ring_schedule`) to hold one round while you explain it, e.g.
    ``p.ring_round = 3`` shows all-gather round 1/3 of an all-reduce on 4 ranks.
    """

    redraw_interval = 0.1        # seconds: live feeds redraw at most this often (flush() forces)

    def __init__(self, events_or_path=None, *, title: str = ""):
        events = [] if events_or_path is None else trace.load(events_or_path)
        self.replay = Replay(events)
        self.title = title
        self._index, self._ring_round, self._last_draw = -1, None, float("-inf")
        # what the figures show now, so that a redraw sends only what changed
        self._shown_bars: dict[str, tuple] = {}   # category -> bar heights (MiB)
        self._shown_ring: tuple | None = None
        self._ring_nodes = 0
        self._build_views()
        self._build_controls()
        if self.replay.n:            # the first step's peak: event 0 is a nearly empty chart
            self.jump(opening_event(self.replay.events))

    # ---- building the widget
    def _build_views(self) -> None:
        rp = self.replay
        self._bar_cats = category_order(rp.categories)
        self.memory_figure = LiveFigure(ledger_bars(
            {r: dict.fromkeys(self._bar_cats, 0) for r in rp.ranks}, rp.ymax))
        self._bar_ranks = rp.ranks
        self.ring_figure = LiveFigure(ring_figure(max(len(rp.ranks), 1)))
        self._ring_nodes = max(len(rp.ranks), 1)
        self.timeline_figure = LiveFigure(spans_figure(lane_spans(rp.phases.spans, rp.traffic()),
                                                       rp.ranks))

    def _build_controls(self) -> None:
        last = max(self.replay.n - 1, 0)
        self._play = W.Play(value=0, min=0, max=last, interval=150, description="play")
        self._slider = W.IntSlider(value=0, min=0, max=last, description="event",
                                   layout=W.Layout(width="480px"))
        W.jslink((self._play, "value"), (self._slider, "value"))   # the browser moves the slider
        self._slider.observe(self._on_slider, names="value")
        back, forward = W.Button(description="◀ step"), W.Button(description="step ▶")
        back.on_click(lambda _: self.step(-1))
        forward.on_click(lambda _: self.step(1))
        self._phase_menu = W.Dropdown(options=self._phase_options(), value=NO_PHASE,
                                      description="jump to phase")
        self._phase_menu.observe(self._on_phase_menu, names="value")
        head = [W.HTML(f"<b>{html.escape(self.title)}</b>")] if self.title else []
        # FSDP traces: every unit's state on every rank, next to the memory bars
        self.units_panel = W.HTML(layout=W.Layout(
            display="" if self.replay.unit_names else "none"))
        self.widget = W.VBox(head + [
            W.HBox([self._play, self._slider, back, forward, self._phase_menu]),
            W.HBox([self.memory_figure, self.ring_figure]),
            self.units_panel,
            self.timeline_figure])

    def _phase_options(self) -> list[str]:
        names = [e["name"] for e in self.replay.events if e["kind"] == "phase"]
        return [NO_PHASE] + [n for n in dict.fromkeys(names) if n != "step"]

    def _on_slider(self, change) -> None:
        if change["new"] != self._index:          # moved in the browser (or by Play)
            self._index = change["new"]
            self._render()

    def _on_phase_menu(self, change) -> None:
        if change["new"] != NO_PHASE:
            self.jump_to_phase(change["new"])
            self._phase_menu.value = NO_PHASE     # so picking the same phase again fires again

    # ---- moving through the trace
    @property
    def index(self) -> int:
        """The event shown (0-based; -1 while a live player is still empty)."""
        return self._index

    def jump(self, i: int) -> None:
        """Show the state after event ``i`` (negative counts from the end, like a list)."""
        n = self.replay.n
        if not -n <= i < n:
            raise IndexError(f"event {i} is outside this trace of {n} events")
        self._index = i % n
        self._slider.value = self._index          # _on_slider sees no change: we render once
        self._render()

    def step(self, n: int = 1) -> None:
        """Forward ``n`` events (backward if negative), stopping at either end."""
        if self.replay.n:
            self.jump(min(max(self._index + n, 0), self.replay.n - 1))

    def jump_to_phase(self, name: str, step: int | None = None, rank: int = 0,
                      edge: str = "begin") -> int:
        """Jump to the ``edge`` ("begin"/"end") of phase ``name`` on ``rank`` in ``step``.

        With ``step=None``, the next such event after the current one (wrapping round to the
        start), so that choosing forward, backward, optimizer, forward... walks through the run.
        Returns the index jumped to; raises ``KeyError`` if the trace has no such phase.
        """
        hits = [i for i, e in enumerate(self.replay.events)
                if e["kind"] == "phase" and e["name"] == name and e["edge"] == edge
                and e["rank"] == rank and (step is None or e.get("step") == step)]
        if not hits:
            raise KeyError(f"no {name!r} {edge} on rank {rank}"
                           + ("" if step is None else f" in step {step}"))
        target = hits[0] if step is not None else next((i for i in hits if i > self._index), hits[0])
        self.jump(target)
        return target

    def snapshot(self) -> dict[int, dict[str, int]]:
        """``{rank: {category: bytes}}`` live after the current event."""
        return self.replay.snapshot(self._index) if self._index >= 0 else {}

    def current_collective(self) -> dict | None:
        """The collective event whose ``[t, t_end]`` contains the current event's time."""
        return self.replay.collective_at(self.replay.t[self._index]) if self._index >= 0 else None

    @property
    def ring_round(self) -> int | None:
        return self._ring_round

    @ring_round.setter
    def ring_round(self, value: int | None) -> None:
        self._ring_round = None if value is None else int(value)
        if self._index >= 0:
            self._render()

    # ---- live mode
    def feed(self, ev: dict) -> None:
        """Append one event as it happens (``Ranks.run(..., on_event=p.feed)``). Redraws at most
        every ``redraw_interval`` seconds; call :meth:`flush` after the run to show the last."""
        self.replay.append(ev)
        if time.monotonic() - self._last_draw >= self.redraw_interval:
            self.flush()

    def flush(self) -> None:
        """Bring every view up to date with the events fed so far. The player follows the
        newest event unless you have moved it back to look at something earlier."""
        rp = self.replay
        if rp.n == 0:
            return
        follow = self._index == self._slider.max or self._index < 0
        self._play.max = self._slider.max = rp.n - 1
        if (self._bar_cats, self._bar_ranks) != (category_order(rp.categories), rp.ranks):
            self._rebuild_bars()
        self.memory_figure.layout.yaxis.range = [0, 1.05 * rp.ymax / MiB]
        if len(self._phase_menu.options) != len(options := self._phase_options()):
            self._phase_menu.options = options
        self._rebuild_timeline()
        self.jump(rp.n - 1 if follow else self._index)
        self._last_draw = time.monotonic()

    def _rebuild_bars(self) -> None:
        """New categories or ranks (live): new bar traces, in the course's order."""
        rp = self.replay
        self._bar_cats, self._bar_ranks = category_order(rp.categories), rp.ranks
        fresh = ledger_bars({r: dict.fromkeys(self._bar_cats, 0) for r in rp.ranks})
        self.memory_figure.data = ()
        self.memory_figure.add_traces(fresh.data)
        self._shown_bars = {}

    def _rebuild_timeline(self) -> None:
        """New spans (live): redraw the lanes, phases still open drawn up to the newest event."""
        rp, fig = self.replay, self.timeline_figure
        spans = lane_spans(rp.phases.spans, rp.traffic(), rp.phases.open_spans(max(rp.t)))
        fresh = spans_figure(spans, rp.ranks)
        fig.data = ()
        fig.add_traces(fresh.data)
        fig.layout.yaxis.categoryarray = fresh.layout.yaxis.categoryarray
        fig.layout.height = fresh.layout.height

    # ---- drawing
    def _render(self) -> None:
        """Show event ``self._index``. Only values that changed are sent to the figures."""
        i, rp = self._index, self.replay
        row, cats = rp.bytes_at(i), rp.categories
        with self.memory_figure.batch_update():
            for tr, c in zip(self.memory_figure.data, self._bar_cats):
                y = tuple((row[:, cats.index(c)] / MiB).tolist())
                if self._shown_bars.get(c) != y:
                    tr.y = self._shown_bars[c] = y
            self.memory_figure.layout.title.text = rp.title(i)
        self._render_ring(i)
        if rp.unit_names:
            self._render_units(i)
        x = rp.t[i] * 1e3                          # the timeline's cursor, in ms
        self.timeline_figure.layout.shapes[0].update(x0=x, x1=x, visible=True)

    def _render_units(self, i: int) -> None:
        states = self.replay.unit_states(i)
        names = list(self.replay.unit_names)
        head = "".join(f"<th style='padding:2px 6px'>{html.escape(n)}</th>" for n in names)
        rows = "".join(
            f"<tr><th style='padding:2px 6px'>rank {r}</th>" + "".join(
                f"<td style='padding:2px 6px;background:{UNIT_STATE_COLORS.get(st[n], '#f4f4f4')}'>"
                f"{st[n]}</td>" for n in names) + "</tr>"
            for r, st in states.items())
        after = self.replay.after_forward(i)
        policy = "<tr><th style='padding:2px 6px'>after forward</th>" + "".join(
            f"<td style='padding:2px 6px;font-size:smaller'>{html.escape(after.get(n, '—'))}</td>"
            for n in names) + "</tr>"
        value = f"<table><tr><th>unit states</th>{head}</tr>{policy}{rows}</table>"
        self.units_panel.layout.display = ""
        if self.units_panel.value != value:
            self.units_panel.value = value

    def unit_states(self) -> dict[int, dict[str, str]]:
        """Every FSDP unit's state on every rank at the current event."""
        return self.replay.unit_states(self._index)

    def _render_ring(self, i: int) -> None:
        view = ring_view(max(len(self.replay.ranks), 1), self.current_collective(),
                         self._ring_round, self.replay.t[i])
        key = (view.title, tuple(view.chunks_x), view.world_size)
        if self._shown_ring == key:
            return                                # e.g. stepping through allocs between collectives
        fig = self.ring_figure
        with fig.batch_update():
            if self._ring_nodes != view.world_size:   # ranks joined (live): new node positions
                nodes = ring_figure(view.world_size).data[2]
                fig.data[2].update(x=nodes.x, y=nodes.y, text=nodes.text)
                self._ring_nodes = view.world_size
            fig.data[1].update(x=view.sends_x, y=view.sends_y)
            fig.data[3].update(x=view.chunks_x, y=view.chunks_y, text=view.chunks_text,
                               textposition=view.chunks_side or "top center")
            fig.layout.title.text = view.title
        self._shown_ring = key


def static_player_figure(events, max_frames: int = 200) -> go.Figure:
    """The memory bars as a plain ``go.Figure`` with animation frames, a Play/Pause button and
    a slider: it plays in any browser with no kernel (an HTML export, a docs page).

    Long traces are subsampled to ``max_frames`` evenly spaced events (first and last included,
    and the first step's peak, where it opens, as the players do). Show it with
    ``fig.show(renderer="notebook")`` or save it with ``fig.write_html(path, include_plotlyjs=True, auto_play=False)`` (plotly starts playing on
    load unless told otherwise).
    """
    rp = Replay(trace.load(events))
    if rp.n == 0:
        raise ValueError("static_player_figure: the trace has no events")
    picks = set(np.linspace(0, rp.n - 1, min(rp.n, max_frames)).round().astype(int).tolist())
    opening = opening_event(rp.events)
    inner = picks - {0, rp.n - 1}
    if opening not in picks and len(picks) >= max_frames and inner:   # it takes a neighbour's place
        picks.discard(min(inner, key=lambda i: abs(i - opening)))
    picks = sorted(picks | {opening})
    cats = category_order(rp.categories)

    def bars(i):
        row = rp.bytes_at(i)
        return [go.Bar(y=(row[:, rp.categories.index(c)] / MiB).tolist()) for c in cats]

    fig = ledger_bars(rp.snapshot(opening), rp.ymax, rp.title(opening))
    fig.frames = [go.Frame(name=str(i), data=bars(i), traces=list(range(len(cats))),
                           layout=dict(title_text=rp.title(i))) for i in picks]
    still = {"mode": "immediate", "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}}
    fig.update_layout(
        height=480, margin=dict(b=110),
        updatemenus=[dict(type="buttons", direction="left", x=0, y=-0.12, xanchor="left", buttons=[
            dict(label="Play", method="animate",
                 args=[None, {"frame": {"duration": 120, "redraw": True}, "fromcurrent": True,
                              "transition": {"duration": 0}}]),
            dict(label="Pause", method="animate", args=[[None], still])])],
        sliders=[dict(active=picks.index(opening), x=0.12, y=-0.08, len=0.88,
                      currentvalue={"prefix": "event "},
                      steps=[dict(label=str(i), method="animate", args=[[str(i)], still])
                             for i in picks])])
    return fig
