"""The collective in flight, drawn on a ring: who sends which chunk to whom, round by round.

The rounds themselves (:func:`ring_schedule`: which rank sends which chunk in each round of a
reduce-scatter, all-gather, all-reduce or tree broadcast), the round a moment falls in
(:func:`round_at`) and the words of the title live in :mod:`minishard.viewers.playback`, which the
offline player (``python -m minishard view``) reads too; this module draws them with plotly.
The trace records only when a collective started and ended on each rank, not its rounds, so the
player *derives* the round from how far the current time is between ``t`` and ``t_end``: a
teaching picture of what the algorithm does, not a measurement of when each round happened.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go

from minishard.viewers.playback import (RING_NODE, RING_OPS, Round, chunk_xy, idle_ring_title, label_side,  # noqa: F401
                        ring_angle, ring_caption, ring_schedule, round_at)


# --------------------------------------------------------------------------- geometry

_angle = ring_angle                                  # rank 0 at the top, clockwise
# The plot is SCALE pixels per ring radius (its height sets it; x follows, scaleanchor), so that
# the discs and squares drawn in pixels are the size the geometry (minishard.viewers.playback) reckons with.
SCALE = 110
REACH = 1.45                        # the axes: ±REACH ring radii
PLOT_PX = round(2 * REACH * SCALE)
MARGIN = dict(l=10, r=10, t=70, b=10)
CHUNK_PX = 14                       # a chunk's square


def node_xy(N: int) -> tuple[list[float], list[float]]:
    return ([math.cos(_angle(r, N)) for r in range(N)], [math.sin(_angle(r, N)) for r in range(N)])


def _path(src: int, dst: int, N: int, along_ring: bool, points: int = 16):
    """Points from ``src`` to ``dst``: along the circle for ring neighbours (so the two
    directions between the same pair of ranks never overlap), a straight chord for tree edges."""
    out = []
    for j in range(points + 1):
        f = j / points
        if along_ring:
            a = _angle(src + f, N)
            out.append((math.cos(a), math.sin(a)))
        else:
            (x0, x1), (y0, y1) = [(math.cos(_angle(src, N)), math.cos(_angle(dst, N))),
                                  (math.sin(_angle(src, N)), math.sin(_angle(dst, N)))]
            out.append((x0 + f * (x1 - x0), y0 + f * (y1 - y0)))
    return out


@dataclass
class RingView:
    """Everything the ring picture shows at one moment (plain lists, ready for plotly)."""
    world_size: int
    title: str
    sends_x: list
    sends_y: list
    chunks_x: list
    chunks_y: list
    chunks_text: list
    chunks_side: list | None = None  # where each chunk's label sits (plotly's textposition)
    round: int | None = None         # the round shown, 0-based; None when nothing is in flight


def ring_view(world_size: int, collective: dict | None = None, round: int | None = None,
              t: float | None = None) -> RingView:
    """The ring at one moment. ``round`` (0-based index into :func:`ring_schedule`) wins over
    ``t``; with neither, the first round is shown. Chunk markers sit ``fraction`` of the way
    along their link (:func:`~minishard.viewers.playback.chunk_xy`: clear of the ranks at its ends), so
    stepping through time moves them; each label on the side away from every rank."""
    if collective is None:
        return RingView(world_size, idle_ring_title(world_size), [], [], [], [], [], [])
    cap = ring_caption(collective, world_size)
    N, rounds = cap.world_size, cap.rounds
    if not rounds:
        return RingView(N, cap.title(None), [], [], [], [], [], [])
    if round is not None:
        k, frac = min(max(int(round), 0), len(rounds) - 1), 0.5
    elif t is not None:
        k, frac = round_at(collective, t, len(rounds))
    else:
        k, frac = 0, 0.5
    rnd = rounds[k]
    sx, sy, cx, cy, text, side = [], [], [], [], [], []
    for src, dst, name in rnd.sends:
        path = _path(src, dst, N, rnd.along_ring)
        sx += [p[0] for p in path] + [None]
        sy += [p[1] for p in path] + [None]
        x, y = chunk_xy(src, dst, N, rnd.along_ring, frac)
        cx.append(x), cy.append(y), text.append(name), side.append(label_side(x, y, N))
    return RingView(N, cap.title(k), sx, sy, cx, cy, text, side, k)


def ring_figure(world_size: int, collective_event: dict | None = None, round: int | None = None,
                *, t: float | None = None) -> go.Figure:
    """Ranks on a circle and, for ``collective_event``, the chunks on the move in one round.

    Traces, in order (the player updates them in place): ``ring`` (the circle), ``sends`` (the
    links busy this round), ``ranks`` (the nodes), ``chunks`` (one marker per message).
    """
    view = ring_view(world_size, collective_event, round, t)
    N = view.world_size
    circle = [2 * math.pi * j / 64 for j in range(65)]
    nx, ny = node_xy(N)
    fig = go.Figure([
        go.Scatter(name="ring", x=[math.cos(a) for a in circle], y=[math.sin(a) for a in circle],
                   mode="lines", line=dict(color="#ddd", width=1), hoverinfo="skip"),
        go.Scatter(name="sends", x=view.sends_x, y=view.sends_y, mode="lines",
                   line=dict(color="#E45756", width=3), hoverinfo="skip"),
        go.Scatter(name="ranks", x=nx, y=ny, mode="markers+text", text=[f"rank {r}" for r in range(N)],
                   textposition="middle center", marker=dict(size=2 * RING_NODE * SCALE, color="#4C78A8"),
                   textfont=dict(color="white", size=11), hoverinfo="skip"),
        go.Scatter(name="chunks", x=view.chunks_x, y=view.chunks_y, text=view.chunks_text,
                   mode="markers+text", textposition=view.chunks_side or "top center",
                   marker=dict(size=CHUNK_PX, color="#F58518", symbol="square"),
                   textfont=dict(size=11), hoverinfo="text"),
    ])
    axis = dict(visible=False, range=[-REACH, REACH], fixedrange=True)
    fig.update_layout(title=dict(text=view.title, font=dict(size=12)), showlegend=False,
                      xaxis=axis, yaxis=dict(axis, scaleanchor="x"), width=430,
                      height=PLOT_PX + MARGIN["t"] + MARGIN["b"], margin=MARGIN, plot_bgcolor="white")
    return fig
