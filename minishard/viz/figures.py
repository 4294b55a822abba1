"""Plain plotly figures of a trace: the memory ledger per rank, and the timeline.

These are pure functions of events (no widgets, no kernel): the :class:`~minishard.viz.Player`
builds its live views from them, and a static HTML page can show them as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import plotly.graph_objects as go

from ..ledger import CATEGORIES
from ..trace import PhaseSpan, phase_spans

MB = 1_000_000          # the bars are in decimal megabytes, like the "MB" on their axis

# One colour per ledger category and per phase / collective, the same in every figure.
COLORS = {
    "params": "#4C78A8", "grads": "#F58518", "main_grads": "#FFBF79", "master": "#54A24B",
    "exp_avg": "#88D27A", "exp_avg_sq": "#B6E3A8", "momentum": "#EECA3B",
    "activations": "#E45756", "unsharded": "#72B7B2", "comm_buffers": "#B279A2",
    "forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B",
    "all_reduce": "#E45756", "reduce_scatter": "#B279A2", "all_gather": "#72B7B2",
    "broadcast": "#9D755D",
}
# An FSDP unit's states (blank: sharded), in the player's panel and the course's figures.
UNIT_STATE_COLORS = {"unsharding": "#B7DDE0", "unsharded": "#72B7B2", "reduce_scattering": "#B279A2"}


def color(name: str) -> str:
    return COLORS.get(name, "#BAB0AC")


def fmt_bytes(n: float) -> str:
    """Decimal units, three significant digits: ``870656 -> '871 KB'``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def category_order(categories: Iterable[str]) -> list[str]:
    """The course's order (parameters at the bottom of the stack, then gradients, optimizer
    state, activations, temporaries); categories it doesn't know go last, in the order given."""
    cats = list(dict.fromkeys(categories))
    return [c for c in CATEGORIES if c in cats] + [c for c in cats if c not in CATEGORIES]


def describe(ev: dict) -> str:
    """One event in a few words, e.g. ``rank 0 all_reduce bucket0``."""
    k, who = ev["kind"], f'rank {ev["rank"]}'
    if k == "phase":
        unit = f' {ev["unit"]}' if ev.get("unit") else ""
        return f'{who} {ev["name"]}{unit} {ev["edge"]}'
    if k == "collective":
        return f'{who} {ev["op"]} {ev.get("tag", "")}'.rstrip()
    if k in ("alloc", "free"):
        tag = f' ({ev["tag"]})' if ev.get("tag") else ""
        return f'{who} {k} {ev["category"]} {fmt_bytes(ev["bytes"])}{tag}'
    if k == "unit":
        return f'{who} {ev["name"]} → {ev["state"]}'
    if k == "transfer":
        return f'{who} transfer {ev.get("direction", "")} {fmt_bytes(ev["bytes"])}'
    return f'{who} {k} {ev.get("name", "")}'.rstrip()


# --------------------------------------------------------------------------- memory

def ledger_bars(snapshot_by_rank: dict[int, dict[str, int]], ymax: float | None = None,
                title: str = "") -> go.Figure:
    """Stacked bars, one per rank, one colour per ledger category, in MB.

    ``snapshot_by_rank`` is ``{rank: {category: bytes}}`` (what ``LedgerTimeline.at`` and
    ``Player.snapshot`` return). Pass ``ymax`` (bytes: the largest total over the whole trace) to
    keep the axis fixed while stepping, so that the bars visibly grow and shrink.
    """
    ranks = sorted(snapshot_by_rank)
    cats = category_order(c for r in ranks for c in snapshot_by_rank[r])
    x = [f"rank {r}" for r in ranks]
    fig = go.Figure([go.Bar(name=c, x=x, y=[snapshot_by_rank[r].get(c, 0) / MB for r in ranks],
                            marker_color=color(c)) for c in cats])
    fig.update_layout(barmode="stack", title=dict(text=title, font=dict(size=13)),
                      yaxis=dict(title="MB", range=[0, 1.05 * ymax / MB] if ymax else None),
                      legend=dict(traceorder="reversed"), width=560, height=400,
                      margin=dict(l=50, r=10, t=60, b=30))
    return fig


# --------------------------------------------------------------------------- timeline

@dataclass(frozen=True)
class Span:
    """A stretch of time on one rank's lane: a compute phase or a collective in flight."""
    rank: int
    lane: str            # "compute" or "comm"
    name: str            # the phase ("forward") or the collective ("all_reduce")
    t0: float
    t1: float
    about: str           # hover text


def lane_spans(phases: Iterable[PhaseSpan], traffic: Iterable[dict],
               ongoing: Iterable[PhaseSpan] = ()) -> list[Span]:
    """What the timeline draws, from the trace's fold (:class:`~minishard.trace.PhaseFold`): the
    top-level phases on the compute lane (``step`` nests around them and is not drawn), a unit's
    waits for its collectives over compute (the exposed communication; a unit's other phases
    nest inside the top-level ones), the collectives and transfers (``traffic``) on the comm
    lane, and the top-level phases still ``ongoing`` in a live run."""
    out = []
    for p in phases:
        if p.unit is None and p.name != "step":
            out.append(Span(p.rank, "compute", p.name, p.t0, p.t1, f"rank {p.rank} step {p.step} {p.name}"))
        elif p.name.startswith("wait"):           # compute stood still
            out.append(Span(p.rank, "compute", "waiting on comm", p.t0, p.t1,
                            f"rank {p.rank} {p.name} {p.unit}"))
    for ev in traffic:
        r = ev["rank"]
        if ev["kind"] == "collective":
            about = f'rank {r} {ev["op"]} {ev.get("tag", "")} · {fmt_bytes(ev["payload"])}'
            out.append(Span(r, "comm", ev["op"], ev["t"], ev["t_end"], about))
        elif ev["kind"] == "transfer":            # offload: host <-> device copies
            about = f'rank {r} {ev.get("direction", "")} {ev.get("tag", "")} · {fmt_bytes(ev["bytes"])}'
            out.append(Span(r, "comm", f'transfer {ev.get("direction", "")}', ev["t"],
                            ev["t"] + ev.get("seconds", 0.0), about))
    out += [Span(p.rank, "compute", p.name, p.t0, p.t1, f"rank {p.rank} step {p.step} {p.name} …")
            for p in ongoing if p.unit is None and p.name != "step"]
    return out


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
