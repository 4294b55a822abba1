"""The collective in flight, drawn on a ring: who sends which chunk to whom, round by round.

A ring collective on N ranks splits the buffer of S bytes into N chunks of S/N. In every round
each rank sends one chunk to its right neighbour (rank r -> r+1 mod N) and receives one from its
left, so all N links are busy at once and no rank ever sends more than S/N per round:

    reduce_scatter   N-1 rounds; in round k rank r sends (its partial sum of) chunk r-k. After
                     the last round rank r holds the fully reduced chunk r+1.
    all_gather       N-1 rounds; in round k rank r forwards chunk r-k, which it already has.
    all_reduce       a reduce-scatter, then an all-gather of the reduced chunks: 2(N-1) rounds,
                     2(N-1)/N * S bytes sent per rank.
    broadcast        not a ring: a binomial tree from the root. In round k every rank that has
                     the data (relative rank r < 2^k) sends the whole buffer to r + 2^k.

The trace records only when a collective started and ended on each rank, not its rounds, so the
player *derives* the round from how far the current time is between ``t`` and ``t_end``. That is a
teaching picture of what the algorithm does, not a measurement of when each round happened.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go

from .figures import fmt_bytes

RING_OPS = ("reduce_scatter", "all_gather", "all_reduce")


@dataclass(frozen=True)
class Round:
    """One round of a collective: ``sends`` holds ``(src, dst, chunk)`` for every message."""
    label: str
    sends: tuple[tuple[int, int, str], ...]
    along_ring: bool = True          # neighbours on the ring (True) or tree edges (False)


def ring_schedule(op: str, world_size: int, src: int = 0) -> list[Round]:
    """The rounds the algorithm runs for ``op`` on ``world_size`` ranks (empty for one rank)."""
    N = world_size
    if N <= 1:
        return []
    if op == "broadcast":
        n_rounds = math.ceil(math.log2(N))
        return [Round(f"broadcast (tree from rank {src}) round {k + 1}/{n_rounds}",
                      tuple(((r + src) % N, (r + 2 ** k + src) % N, "all")
                            for r in range(2 ** k) if r + 2 ** k < N),
                      along_ring=False)
                for k in range(n_rounds)]
    if op not in RING_OPS:
        return []                    # an op we have no picture for: the ring stays idle

    def reduce_scatter(k):           # chunk r-k: a partial sum that grows one rank per round
        return Round(f"reduce-scatter round {k + 1}/{N - 1}",
                     tuple((r, (r + 1) % N, f"Σc{(r - k) % N}") for r in range(N)))

    def all_gather(k, owned):        # rank r starts owning chunk r + owned, forwards one per round
        return Round(f"all-gather round {k + 1}/{N - 1}",
                     tuple((r, (r + 1) % N, f"c{(r + owned - k) % N}") for r in range(N)))

    if op == "reduce_scatter":
        return [reduce_scatter(k) for k in range(N - 1)]
    if op == "all_gather":
        return [all_gather(k, owned=0) for k in range(N - 1)]
    # all_reduce: after the reduce-scatter rank r owns the reduced chunk r+1
    return [reduce_scatter(k) for k in range(N - 1)] + [all_gather(k, owned=1) for k in range(N - 1)]


def round_at(collective: dict, t: float, n_rounds: int) -> tuple[int, float]:
    """``(round, fraction of that round done)`` at time ``t``, spreading the rounds evenly over
    the collective's ``[t, t_end]``."""
    span = collective["t_end"] - collective["t"]
    progress = 1.0 if span <= 0 else min(max((t - collective["t"]) / span, 0.0), 1.0)
    k = min(int(progress * n_rounds), n_rounds - 1)
    return k, min(progress * n_rounds - k, 1.0)


# --------------------------------------------------------------------------- geometry

def _angle(rank: float, N: int) -> float:
    return math.pi / 2 - 2 * math.pi * rank / N     # rank 0 at the top, clockwise


def node_xy(N: int) -> tuple[list[float], list[float]]:
    return ([math.cos(_angle(r, N)) for r in range(N)], [math.sin(_angle(r, N)) for r in range(N)])


def _path(src: int, dst: int, N: int, along_ring: bool, upto: float = 1.0, points: int = 16):
    """Points from ``src`` towards ``dst``: along the circle for ring neighbours (so the two
    directions between the same pair of ranks never overlap), a straight chord for tree edges."""
    out = []
    for j in range(points + 1):
        f = upto * j / points
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
    round: int | None = None         # the round shown, 0-based; None when nothing is in flight


def ring_view(world_size: int, collective: dict | None = None, round: int | None = None,
              t: float | None = None) -> RingView:
    """The ring at one moment. ``round`` (0-based index into :func:`ring_schedule`) wins over
    ``t``; with neither, the first round is shown. Chunk markers sit ``fraction`` of the way
    along their link, so stepping through time moves them."""
    if collective is None:
        return RingView(world_size, f"{world_size} ranks · no collective in flight", [], [], [], [], [])
    N = collective.get("group") or world_size
    rounds = ring_schedule(collective["op"], N, collective.get("src", 0))
    what = f'{collective["op"]} {collective.get("tag", "")}'.strip()
    head = (f'{what} · payload {fmt_bytes(collective["payload"])} · '
            f'wire {fmt_bytes(collective["wire"])} sent by rank {collective["rank"]}')
    if not rounds:
        why = "one rank: nothing to send" if N <= 1 else f'no picture of the {collective["op"]} algorithm'
        return RingView(N, f"{head}<br>({why})", [], [], [], [], [])
    if round is not None:
        k, frac = min(max(int(round), 0), len(rounds) - 1), 0.5
    elif t is not None:
        k, frac = round_at(collective, t, len(rounds))
    else:
        k, frac = 0, 0.5
    rnd = rounds[k]
    chunk = collective["payload"] if not rnd.along_ring else collective["payload"] // N
    sx, sy, cx, cy, text = [], [], [], [], []
    for src, dst, name in rnd.sends:
        path = _path(src, dst, N, rnd.along_ring)
        sx += [p[0] for p in path] + [None]
        sy += [p[1] for p in path] + [None]
        x, y = _path(src, dst, N, rnd.along_ring, upto=frac, points=1)[-1]
        cx.append(x), cy.append(y), text.append(name)
    title = f"{head}<br>{rnd.label} · each sender sends {fmt_bytes(chunk)}"
    return RingView(N, title, sx, sy, cx, cy, text, k)


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
                   textposition="middle center", marker=dict(size=46, color="#4C78A8"),
                   textfont=dict(color="white", size=11), hoverinfo="skip"),
        go.Scatter(name="chunks", x=view.chunks_x, y=view.chunks_y, text=view.chunks_text,
                   mode="markers+text", textposition="top center",
                   marker=dict(size=16, color="#F58518", symbol="square"), hoverinfo="text"),
    ])
    axis = dict(visible=False, range=[-1.45, 1.45], fixedrange=True)
    fig.update_layout(title=dict(text=view.title, font=dict(size=12)), showlegend=False,
                      xaxis=axis, yaxis=dict(axis, scaleanchor="x"), width=430, height=400,
                      margin=dict(l=10, r=10, t=70, b=10), plot_bgcolor="white")
    return fig
