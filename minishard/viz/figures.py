"""Plain plotly figures of a trace: the memory ledger per rank, and the timeline.

These are pure functions of events (no widgets, no kernel): the :class:`~minishard.viz.Player`
builds its live views from them, and a static HTML page can show them as they are.
"""
from __future__ import annotations

import plotly.graph_objects as go

# the words, colours and spans both players show live in the engine (minishard.viewers.playback), so
# that the offline player (python -m minishard view, no plotly) shows the same
from minishard.viewers.playback import (COLORS, MiB, UNIT_STATE_COLORS, Span, category_order, color, describe,  # noqa: F401
                        fmt_bytes, lane_spans)
from minishard.core.trace import phase_spans


# --------------------------------------------------------------------------- memory

def ledger_bars(snapshot_by_rank: dict[int, dict[str, int]], ymax: float | None = None,
                title: str = "") -> go.Figure:
    """Stacked bars, one per rank, one colour per ledger category, in MiB (2**20 bytes).

    ``snapshot_by_rank`` is ``{rank: {category: bytes}}`` (what ``LedgerTimeline.at`` and
    ``Player.snapshot`` return). Pass ``ymax`` (bytes: the largest total over the whole trace) to
    keep the axis fixed while stepping, so that the bars visibly grow and shrink.
    """
    ranks = sorted(snapshot_by_rank)
    cats = category_order(c for r in ranks for c in snapshot_by_rank[r])
    x = [f"rank {r}" for r in ranks]
    fig = go.Figure([go.Bar(name=c, x=x, y=[snapshot_by_rank[r].get(c, 0) / MiB for r in ranks],
                            marker_color=color(c),
                            hovertemplate=f"%{{x}} {c}: %{{y:.3f}} MiB<extra></extra>")
                     for c in cats])
    fig.update_layout(barmode="stack", title=dict(text=title, font=dict(size=13)),
                      yaxis=dict(title="MiB", range=[0, 1.05 * ymax / MiB] if ymax else None),
                      legend=dict(traceorder="reversed"), width=560, height=400,
                      margin=dict(l=50, r=10, t=60, b=30))
    return fig


# --------------------------------------------------------------------------- timeline

def spans_figure(spans: list[Span], ranks: list[int], t_now: float | None = None) -> go.Figure:
    """The timeline from spans: two lanes per rank (compute, comm), time in ms, and a dotted
    cursor at ``t_now`` (always ``layout.shapes[0]``, hidden when ``t_now`` is None)."""
    lanes = [f"rank {r} · {lane}" for r in ranks for lane in ("compute", "comm")]
    by_name: dict[str, list[Span]] = {}
    for s in sorted(spans, key=lambda s: s.lane != "compute"):      # phases first in the legend
        by_name.setdefault(s.name, []).append(s)
    fig = go.Figure([go.Bar(name=name, orientation="h", y=[f"rank {s.rank} · {s.lane}" for s in ss],
                            base=[s.t0 * 1e3 for s in ss], x=[max(s.t1 - s.t0, 0) * 1e3 for s in ss],
                            hovertext=[s.about for s in ss], hoverinfo="text+x", width=0.7,
                            marker=dict(color=color(name), opacity=0.8))
                     for name, ss in by_name.items()])
    fig.update_layout(
        barmode="overlay", height=90 + 36 * len(lanes), width=1000,
        xaxis=dict(title="time (ms)"), margin=dict(l=120, r=10, t=30, b=40),
        yaxis=dict(categoryorder="array", categoryarray=lanes, autorange="reversed"),
        shapes=[dict(type="line", xref="x", yref="paper", y0=0, y1=1, visible=t_now is not None,
                     x0=(t_now or 0) * 1e3, x1=(t_now or 0) * 1e3,
                     line=dict(color="black", dash="dot", width=1.5))])
    return fig


def timeline_figure(events: list[dict], t_now: float | None = None) -> go.Figure:
    """Per-rank lanes: compute phases (forward/backward/optimizer, from phase begin/end pairs)
    above communication (each collective from ``t`` to ``t_end``); a cursor at ``t_now``."""
    traffic = [e for e in events if e["kind"] in ("collective", "transfer")]
    return spans_figure(lane_spans(phase_spans(events), traffic), sorted({e["rank"] for e in events}),
                        t_now)
