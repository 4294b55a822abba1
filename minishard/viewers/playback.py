"""What the step-through player shows at an event, as plain data: no plotly, no widgets.

Two players draw a replay (:class:`minishard.core.trace.Replay`): the live one in a notebook
(``minishard.viz.Player``, plotly) and the offline one, one HTML file with no kernel
(``python -m minishard view``, :mod:`minishard.viewers.offline_player`). Both show the same words, rounds
and spans because both take them from here:

* :func:`describe` and :func:`event_title` — an event in a few words, and the title line
  (``step 1 · backward · rank 0 all_reduce bucket0 · event 412/813``);
* :func:`opening_event` — the event both open at: the first step's peak on the first rank;
* :func:`ring_schedule` and :func:`ring_caption` — the rounds of a ring collective (who sends
  which chunk to whom) and the caption of each round; :func:`chunk_xy` and :func:`label_side`
  — where a chunk and its label are drawn, clear of every rank's label;
* :func:`lane_spans` — the timeline's stretches: phases on a rank's compute lane, collectives
  and offload transfers on its comm lane;
* the colours of every category, phase, collective and FSDP unit state.

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

The trace records only when a collective started and ended on each rank, not its rounds, so a
player *derives* the round from how far the current time is between ``t`` and ``t_end``
(:func:`round_at`). That is a teaching picture of what the algorithm does, not a measurement of
when each round happened. (The engine side of the package: a cluster node with the engine alone
writes the offline player.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from minishard.core.ledger import CATEGORIES
from minishard.core.trace import PhaseSpan
from minishard.core.words import fmt_bytes  # noqa: F401  (the viewers' own import of it)

MiB = 2 ** 20           # memory is in binary units everywhere in the course: the bars' axis too

# One colour per ledger category and per phase / collective, the same in every figure.
COLORS = {
    "params": "#4C78A8", "grads": "#F58518", "main_grads": "#FFBF79", "master": "#54A24B",
    "exp_avg": "#88D27A", "exp_avg_sq": "#B6E3A8", "momentum": "#EECA3B",
    "activations": "#E45756", "unsharded": "#72B7B2", "comm_buffers": "#B279A2",
    "forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B",
    "all_reduce": "#E45756", "reduce_scatter": "#B279A2", "all_gather": "#72B7B2",
    "broadcast": "#9D755D", "transfer h2d": "#FF9DA6", "transfer d2h": "#D67195",
}
# An FSDP unit's states (blank: sharded), in the player's panel and the course's figures.
UNIT_STATE_COLORS = {"unsharding": "#B7DDE0", "unsharded": "#72B7B2", "reduce_scattering": "#B279A2",
                     "sharded_post_forward": "#EECA3B"}
SHARDED_COLOR = "#f4f4f4"


def color(name: str) -> str:
    return COLORS.get(name, "#BAB0AC")


def category_order(categories: Iterable[str]) -> list[str]:
    """The course's order (parameters at the bottom of the stack, then gradients, optimizer
    state, activations, temporaries); categories it doesn't know go last, in the order given."""
    cats = list(dict.fromkeys(categories))
    return [c for c in CATEGORIES if c in cats] + [c for c in cats if c not in CATEGORIES]


# --------------------------------------------------------------------------- words

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


def step_words(ev: dict) -> str:
    return f'step {ev["step"]}' if ev.get("step") is not None else ""


def event_title(ev: dict, phase: str, i: int, n: int) -> str:
    """``step 1 · backward · rank 0 all_reduce bucket0 · event 412/813``: the step, the phase
    the event's rank is in, the event, and its place among the ``n`` events (slider value/max)."""
    parts = [step_words(ev), phase, describe(ev), f"event {i}/{n - 1}"]
    return " · ".join(p for p in parts if p)


def opening_event(events: Sequence[dict]) -> int:
    """The event a player opens at: the first step's peak, where the first rank's ledger total
    (alloc minus free) is highest among the events of the trace's first step (the earliest such
    event). A trace without steps opens at that rank's highest; an empty one at 0. Event 0 is
    a nearly empty chart: the peak shows every category the step holds."""
    if not events:
        return 0
    rank = min(ev["rank"] for ev in events)
    steps = [ev["step"] for ev in events if ev.get("step") is not None]
    first = min(steps) if steps else None
    total, best, at = 0, None, 0
    for i, ev in enumerate(events):
        if ev["rank"] == rank and ev["kind"] in ("alloc", "free"):
            total += ev["bytes"] if ev["kind"] == "alloc" else -ev["bytes"]
        if (first is None or ev.get("step") == first) and (best is None or total > best):
            best, at = total, i
    return at


# --------------------------------------------------------------------------- the ring

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


# The ring's geometry, in ring radii (the ring is the unit circle, rank 0 at the top, clockwise),
# the same in both players' drawings (offline_player.js repeats these numbers; a test compares
# them): a rank is a disc of RING_NODE round its point, and a chunk on the move stays RING_CLEAR
# from the centres of the ranks at either end of its link, so that its square never covers a
# rank's label; its label goes to the side farthest from every rank.
RING_NODE = 0.19
RING_CLEAR = 0.34
# Where a chunk's label may sit, as plotly names it, and the way each one points (x right, y up)
LABEL_SIDES = {"top center": (0, 1), "top right": (1, 1), "middle right": (1, 0),
               "bottom right": (1, -1), "bottom center": (0, -1), "bottom left": (-1, -1),
               "middle left": (-1, 0), "top left": (-1, 1)}
LABEL_REACH = 0.2           # how far from its chunk a label's middle is, roughly, in ring radii


def ring_angle(rank: float, N: int) -> float:
    return math.pi / 2 - 2 * math.pi * rank / N


def ring_point(rank: float, N: int) -> tuple[float, float]:
    a = ring_angle(rank, N)
    return math.cos(a), math.sin(a)


def chunk_xy(src: int, dst: int, N: int, along_ring: bool, frac: float) -> tuple[float, float]:
    """Where a chunk is ``frac`` of the way through its round: on the arc from ``src`` to its
    neighbour (ring collectives) or on the chord to ``dst`` (tree edges), between the points
    :data:`RING_CLEAR` from either end's centre (the middle, where the link is shorter)."""
    if along_ring:
        reach = 2 * math.asin(min(RING_CLEAR / 2, 1.0)) / (2 * math.pi / N)   # of the arc
        lo = min(reach, 0.5)
        return ring_point(src + lo + frac * (1 - 2 * lo), N)
    (x0, y0), (x1, y1) = ring_point(src, N), ring_point(dst, N)
    lo = min(RING_CLEAR / max(math.hypot(x1 - x0, y1 - y0), 1e-12), 0.5)
    f = lo + frac * (1 - 2 * lo)
    return x0 + f * (x1 - x0), y0 + f * (y1 - y0)


def label_side(x: float, y: float, N: int) -> str:
    """The side of a chunk at ``(x, y)`` its label goes to: the one farthest from every rank
    (the first of :data:`LABEL_SIDES` among equals), so that no label sits on a rank's."""
    nodes = [ring_point(r, N) for r in range(N)]
    best, side = -1.0, "top center"
    for name, (dx, dy) in LABEL_SIDES.items():
        norm = LABEL_REACH / math.hypot(dx, dy)
        lx, ly = x + dx * norm, y + dy * norm
        room = min(math.hypot(lx - nx, ly - ny) for nx, ny in nodes)
        if room > best + 1e-6:
            best, side = room, name
    return side


def round_at(collective: dict, t: float, n_rounds: int) -> tuple[int, float]:
    """``(round, fraction of that round done)`` at time ``t``, spreading the rounds evenly over
    the collective's ``[t, t_end]``."""
    span = collective["t_end"] - collective["t"]
    progress = 1.0 if span <= 0 else min(max((t - collective["t"]) / span, 0.0), 1.0)
    k = min(int(progress * n_rounds), n_rounds - 1)
    return k, min(progress * n_rounds - k, 1.0)


@dataclass(frozen=True)
class RingCaption:
    """A collective on the ring, in words: its ranks, rounds and what each round's title says."""
    world_size: int
    head: str                        # op, tag, payload, wire bytes and who sent them
    rounds: list[Round]
    chunk: int                       # bytes each sender sends per round
    why: str = ""                    # why there is no picture (no rounds)

    def title(self, k: int | None) -> str:
        if not self.rounds or k is None:
            return f"{self.head}<br>({self.why})"
        return f"{self.head}<br>{self.rounds[k].label} · each sender sends {fmt_bytes(self.chunk)}"


def idle_ring_title(world_size: int) -> str:
    return f"{world_size} ranks · no collective in flight"


def ring_caption(collective: dict, world_size: int) -> RingCaption:
    """The rounds of ``collective`` and the words around them; its ``group`` (ranks taking part)
    wins over ``world_size``."""
    N = collective.get("group") or world_size
    rounds = ring_schedule(collective["op"], N, collective.get("src", 0))
    what = f'{collective["op"]} {collective.get("tag", "")}'.strip()
    among = f' among ranks {collective["members"]}' if collective.get("members") else ""
    head = (f'{what}{among} · payload {fmt_bytes(collective["payload"])} · '
            f'wire {fmt_bytes(collective["wire"])} sent by rank {collective["rank"]}')
    why = "one rank: nothing to send" if N <= 1 else f'no picture of the {collective["op"]} algorithm'
    along = rounds[0].along_ring if rounds else True
    chunk = collective["payload"] // N if along else collective["payload"]
    return RingCaption(N, head, rounds, chunk, "" if rounds else why)


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
    """What the timeline draws, from the trace's fold (:class:`~minishard.core.trace.PhaseFold`): the
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
