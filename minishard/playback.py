"""What the step-through player shows at an event, as plain data: no plotly, no widgets.

Two players draw a replay (:class:`minishard.trace.Replay`): the live one in a notebook
(``minishard.viz.Player``, plotly) and the offline one, one HTML file with no kernel
(``python -m minishard view``, :mod:`minishard.offline_player`). Both show the same words, rounds
and spans because both take them from here:

* :func:`describe` and :func:`event_title` — an event in a few words, and the title line
  (``step 1 · backward · rank 0 all_reduce bucket0 · event 412/813``);
* :func:`ring_schedule` and :func:`ring_caption` — the rounds of a ring collective (who sends
  which chunk to whom) and the caption of each round;
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
from typing import Iterable

from .ledger import CATEGORIES
from .trace import PhaseSpan

MB = 1_000_000          # the bars are in decimal megabytes, like the "MB" on their axis

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
UNIT_STATE_COLORS = {"unsharding": "#B7DDE0", "unsharded": "#72B7B2", "reduce_scattering": "#B279A2"}
SHARDED_COLOR = "#f4f4f4"


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
    head = (f'{what} · payload {fmt_bytes(collective["payload"])} · '
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
