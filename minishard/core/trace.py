"""Events: what every rank did, one JSON object per line.

Every byte a strategy allocates (``alloc``/``free``), every collective it runs (``collective``),
every lifecycle phase (``phase``) and every unit state change (``unit``) becomes one event in a
per-rank :class:`Tracer`. The notebooks replay these events; the same files come out of
``torchrun -m minishard demo --trace DIR``. The engine only *writes* events; ``minishard.viz``
only *reads* them.

Schema version 1 (one object per line, per rank)::

    {"v": 1, "rank": r, "seq": k, "t": seconds, "kind": ..., ...}

    kind        extra fields
    phase       name (step/forward/backward/optimizer/...), edge ("begin"|"end"), step, unit?
    collective  op, payload, wire, dtype, group, t_end, tag
    alloc/free  category, bytes, tag, device ("device"|"host"|"disk")
    unit        name, state
    transfer    direction ("h2d"|"d2h"|...), bytes, seconds, tag

A trace of a run with an id begins with a header line that is not an event (``run_id.header``:
``{"v": 1, "run": "5f0c9a3be211", "rank": r, "world_size": n}``), which :func:`read_events` skips.

``t`` is seconds since the tracer's origin. Ranks started together share one origin (the
launcher passes it), so their timelines line up.

Reading a trace is one fold, done here once for every reader (the player, the course's tables):
:class:`LedgerTimeline` (live bytes per rank and category after each event), :class:`PhaseFold`
(phase begin/end pairs as spans, and the phase each rank is in), :func:`unit_spans` (each FSDP
unit's states over time) and :class:`Replay`, which keeps all of them per event so that any
event of a long trace is one lookup away.
"""
from __future__ import annotations

import bisect
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from . import run_id
from .lines import json_problem, not_utf8, numbered_lines  # noqa: F401 (trace readers import them here)

SCHEMA_VERSION = 1
KINDS = ("phase", "collective", "alloc", "free", "unit", "transfer")


class TraceFormatError(ValueError):
    """A trace file that this version of minishard cannot read."""


class Tracer:
    """Per-rank event recorder: the one piece of mutable state the engine shares.

    It is passed explicitly to the ledger and to the comm layer (no globals). ``sink`` is called
    with each event as it happens (a queue for live notebooks, a file for torchrun); the events
    are also kept in ``self.events`` unless ``keep=False``.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, *, origin: float | None = None,
                 sink: Callable[[dict], None] | None = None, keep: bool = True,
                 enabled: bool = True):
        self.rank, self.world_size = rank, world_size
        self.origin = time.time() if origin is None else origin
        # perf_counter is monotonic and fine-grained; anchor it to the wall-clock origin so that
        # ranks in different processes agree on t.
        self._perf0 = time.perf_counter() - (time.time() - self.origin)
        self.sink, self.keep, self.enabled = sink, keep, enabled
        self.events: list[dict] = []
        self.step: int | None = None
        self._phases: list[str] = []            # open phases, innermost last (the flight recorder's)
        self._seq = 0
        self.run: str | None = None              # the run's id, once the ranks agreed it

    def header(self) -> dict | None:
        """The trace's first line (None before the run has an id): see the module's docstring."""
        return None if self.run is None else run_id.header(self.run, self.rank, self.world_size)

    @property
    def current_phase(self) -> str | None:
        return self._phases[-1] if self._phases else None

    def now(self) -> float:
        return time.perf_counter() - self._perf0

    def emit(self, kind: str, t: float | None = None, **fields) -> dict | None:
        if not self.enabled:
            return None
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {KINDS}")
        ev = {"v": SCHEMA_VERSION, "rank": self.rank, "seq": self._seq,
              "t": round(self.now() if t is None else t, 7), "kind": kind}
        if self.step is not None and "step" not in fields:
            fields["step"] = self.step
        ev.update(fields)
        self._seq += 1
        if self.keep:
            self.events.append(ev)
        if self.sink is not None:
            self.sink(ev)
        return ev

    @contextlib.contextmanager
    def phase(self, name: str, **fields) -> Iterator[None]:
        """``with tracer.phase("forward"):`` emits a begin and an end event around the block."""
        self.emit("phase", name=name, edge="begin", **fields)
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()
            self.emit("phase", name=name, edge="end", **fields)

    def write_jsonl(self, path: str | Path) -> Path:
        """The events so far, whole or not at all: SIGTERM or a kill may come while it writes."""
        path, tmp = Path(path), Path(f"{path}.tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        head = [json.dumps(self.header()) + "\n"] if self.run is not None else []
        tmp.write_text("".join(head + [json.dumps(ev) + "\n" for ev in list(self.events)]))  # (threads append)
        tmp.replace(path)
        return path


# --------------------------------------------------------------------------- reading traces

def not_an_event(ev) -> str | None:
    """Why a decoded line is not an event this minishard reads, or None."""
    if not isinstance(ev, dict):
        return f"a JSON {type(ev).__name__}, not a trace event (a JSON object per line)"
    if (v := ev.get("v")) != SCHEMA_VERSION:
        newer = isinstance(v, int) and v > SCHEMA_VERSION
        return (f"trace schema version {v!r}, but this minishard reads version {SCHEMA_VERSION}; "
                + ("a newer minishard wrote it: upgrade to read it" if newer else "re-record it with this one"))
    missing = [k for k in ("rank", "seq", "t", "kind") if k not in ev]
    return f"event has no {missing[0]!r} field: {ev}" if missing else None


def read_events(path: str | Path, *, damaged: str = "raise",
                also: Callable[[dict], str | None] | None = None) -> tuple[list[dict], list[tuple[int, str]]]:
    """One trace file's events, and its bad lines as ``(line number, why)``. Every reader of a
    trace reads it here; they differ in what a bad line means (``damaged``): ``"raise"`` — a
    trace that must be whole: :class:`TraceFormatError` naming the line; ``"stop"`` — a rank that
    died cut it: the events before it; ``"skip"`` (the viewer): every good event. ``also``: a
    reader's own test of an event (what it needs of each kind), answering like the others."""
    if damaged not in ("raise", "stop", "skip"):
        raise ValueError(f"damaged={damaged!r}: expected 'raise', 'stop' or 'skip'")
    events: list[dict] = []
    bad: list[tuple[int, str]] = []
    for n, raw in numbered_lines(Path(path)):
        why, ev = _line_problem(raw, first=n == 1)
        if why is None and ev is not None and also is not None:
            why = also(ev)
        if why is None:
            events += [ev] if ev is not None else []       # (None: a blank line)
            continue
        if damaged == "raise":
            raise TraceFormatError(f"{path}:{n}: {why}")
        bad.append((n, why))
        if damaged == "stop":
            break
    return events, bad


def _line_problem(raw: bytes, first: bool = False) -> tuple[str | None, dict | None]:
    """(why the line is not an event, None), (None, the event), or (None, None) if blank or
    the ``first`` line is the run's header."""
    try:
        line = raw.decode("utf-8").strip()   # (a line cut inside a string reads as unterminated)
    except UnicodeDecodeError as e:
        return f"not UTF-8 text ({not_utf8(e, raw)[1]}): a damaged trace, or not a trace", None
    if not line:
        return None, None
    try:
        ev = json.loads(line)
    except json.JSONDecodeError as e:
        return f"not JSON ({json_problem(e)}): a line cut short, or not a trace", None
    if first and run_id.is_header(ev):
        return None, None
    why = not_an_event(ev)
    return (why, None) if why is not None else (None, ev)


def read_jsonl(path: str | Path) -> list[dict]:
    """A whole trace file's events (a bad line raises :class:`TraceFormatError`)."""
    return read_events(path)[0]


def load(source: str | Path | Iterable[dict]) -> list[dict]:
    """Events from a directory of ``rank*.jsonl`` files, one file, or an iterable of events,
    merged across ranks and sorted by time (ties: rank, then seq)."""
    if isinstance(source, (str, Path)):
        p = Path(source)
        if p.is_dir():
            files = sorted(p.glob("rank*.jsonl"))
            if not files:
                raise FileNotFoundError(f"{p}: no rank*.jsonl trace files in this directory")
            events = [ev for f in files for ev in read_jsonl(f)]
        elif p.exists():
            events = read_jsonl(p)
        else:
            raise FileNotFoundError(f"{p}: no such trace directory or file (demo --trace DIR writes one)")
    else:
        events = list(source)
        for ev in events:
            if (why := not_an_event(ev)) is not None:
                raise TraceFormatError(f"event: {why}")
    return merge(events)


def merge(events: Iterable[dict]) -> list[dict]:
    return sorted(events, key=lambda e: (e["t"], e["rank"], e["seq"]))


def write_dir(events: Iterable[dict], directory: str | Path, run: str | None = None,
              world_size: int | None = None) -> list[Path]:
    """Write merged events back as one ``rank{r}.jsonl`` per rank (each headed by ``run``'s
    header, when given)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    by_rank: dict[int, list[dict]] = {}
    for ev in events:
        by_rank.setdefault(ev["rank"], []).append(ev)
    paths = []
    for r, evs in sorted(by_rank.items()):
        p = directory / f"rank{r}.jsonl"
        with open(p, "w") as f:
            if run is not None:
                f.write(json.dumps(run_id.header(run, r, world_size)) + "\n")
            for ev in sorted(evs, key=lambda e: e["seq"]):
                f.write(json.dumps(ev) + "\n")
        paths.append(p)
    return paths


@dataclass
class LedgerTimeline:
    """Cumulative live bytes per (rank, category) after every event: a snapshot at any event is
    one index lookup, so a player can jump anywhere in a long trace instantly."""
    events: list[dict]
    ranks: list[int]
    categories: list[str]
    # bytes[i][rank_index][category_index]: live bytes after event i
    bytes: "object" = field(repr=False, default=None)

    @classmethod
    def build(cls, events: list[dict]) -> "LedgerTimeline":
        ranks = sorted({e["rank"] for e in events})
        cats: list[str] = []
        for e in events:
            if e["kind"] in ("alloc", "free") and e["category"] not in cats:
                cats.append(e["category"])
        ri = {r: i for i, r in enumerate(ranks)}
        ci = {c: i for i, c in enumerate(cats)}
        delta = np.zeros((len(events), len(ranks), max(1, len(cats))), dtype=np.int64)
        for i, e in enumerate(events):
            if e["kind"] == "alloc":
                delta[i, ri[e["rank"]], ci[e["category"]]] = e["bytes"]
            elif e["kind"] == "free":
                delta[i, ri[e["rank"]], ci[e["category"]]] = -e["bytes"]
        return cls(events, ranks, cats, np.cumsum(delta, axis=0))

    def at(self, i: int) -> dict[int, dict[str, int]]:
        row = self.bytes[i]
        return {r: {c: int(row[a, b]) for b, c in enumerate(self.categories)}
                for a, r in enumerate(self.ranks)}


# --------------------------------------------------------------------------- folding a trace

def rank_events(events: Iterable[dict], rank: int, step: int | None = None) -> list[dict]:
    """One rank's events in the order it recorded them (``seq``), optionally of one step. (A
    collective's ``t`` is when it started, so time order would put it before what the rank did
    while it was in flight.)"""
    evs = [e for e in events if e["rank"] == rank and (step is None or e.get("step") == step)]
    return sorted(evs, key=lambda e: e["seq"])


@dataclass(frozen=True)
class PhaseSpan:
    """One phase on one rank, from its begin event to its end. ``unit`` names the FSDP unit of a
    unit's own phases (its waits for a collective); top-level phases have none."""
    rank: int
    name: str
    unit: str | None
    step: int | None
    t0: float
    t1: float


class PhaseFold:
    """Pairs each rank's phase begin/end events into :class:`PhaseSpan` s and knows which phase
    each rank is in. Feed it events in order with :meth:`add`."""

    def __init__(self):
        self.spans: list[PhaseSpan] = []         # in the order the phases ended
        self._open: dict[int, list[tuple[str, str | None, float, int | None]]] = {}

    def add(self, ev: dict) -> str:
        """Fold one event; return the phase its rank is in ("" outside any; ``step`` does not
        count, an ``end`` event is still inside the phase it ends, a unit's phase reads
        ``"wait_unshard blocks.0"``)."""
        stack = self._open.setdefault(ev["rank"], [])
        if ev["kind"] != "phase":
            return _innermost(stack)
        name, unit = ev["name"], ev.get("unit")
        if ev["edge"] == "begin":
            stack.append((name, unit, ev["t"], ev.get("step")))
            return _innermost(stack)
        label = _innermost(stack)
        for j in range(len(stack) - 1, -1, -1):
            if stack[j][:2] == (name, unit):
                _, _, t0, step = stack.pop(j)
                self.spans.append(PhaseSpan(ev["rank"], name, unit, step, t0, ev["t"]))
                break
        return label

    def open_spans(self, t_now: float) -> list[PhaseSpan]:
        """Phases begun and not ended yet (a live run), as if they ended at ``t_now``."""
        return [PhaseSpan(r, name, unit, step, t0, max(t0, t_now))
                for r, stack in self._open.items() for name, unit, t0, step in stack]


def _innermost(stack: list) -> str:
    for name, unit, _, _ in reversed(stack):
        if name != "step":
            return f"{name} {unit}" if unit else name
    return ""


def phase_spans(events: Iterable[dict]) -> list[PhaseSpan]:
    """Every phase of ``events`` that ended, in the order they ended."""
    fold = PhaseFold()
    for ev in events:
        fold.add(ev)
    return fold.spans


@dataclass(frozen=True)
class UnitSpan:
    """An FSDP unit in one state other than ``sharded`` on one rank, until its next state
    (``until``; None: still in it when the events end)."""
    rank: int
    unit: str
    state: str
    t0: float
    t1: float
    until: str | None


def unit_spans(events: list[dict], t_end: float | None = None) -> list[UnitSpan]:
    """Every unit's states other than ``sharded``, in the order they ended; the states still held
    when ``events`` end come last, drawn up to ``t_end`` (default: the last event's time)."""
    held: dict[tuple[int, str], tuple[str, float]] = {}
    out = []
    for e in events:
        if e["kind"] != "unit":
            continue
        key = (e["rank"], e["name"])
        if key in held:
            state, t0 = held.pop(key)
            out.append(UnitSpan(e["rank"], e["name"], state, t0, e["t"], e["state"]))
        if e["state"] != "sharded":
            held[key] = (e["state"], e["t"])
    if t_end is None:
        t_end = max((e["t"] for e in events), default=0.0)
    return out + [UnitSpan(r, n, state, t0, t_end, None) for (r, n), (state, t0) in held.items()]


class Replay:
    """A trace folded once, so that any event is one lookup away: live bytes per rank and
    category (:meth:`snapshot`, the fold of every alloc/free up to the event), every unit's state
    (:meth:`unit_states`), the phase the event's rank is in (:meth:`phase`), the collective in
    flight at a time (:meth:`collective_at`); ``phases`` holds the phases as spans.

    A finished trace gets its ledger from :class:`LedgerTimeline` (one cumsum); :meth:`append`
    extends everything one event at a time for live runs (capacity doubles as it fills)."""

    def __init__(self, events: Iterable[dict] = ()):
        events = list(events)
        self.events: list[dict] = []
        self.t: list[float] = []                 # time of each event
        self._phase: list[str] = []              # phase its rank was in ("" outside any)
        self.collectives: list[int] = []         # indices of the collective events
        self.transfers: list[int] = []           # indices of the transfer events (offload)
        self.unit_events: list[tuple] = []       # (index, rank, unit, state) of unit events
        self.unit_names: dict[str, None] = {}    # units in the order they first appear
        self.after_forward_events: list[tuple] = []   # (index, {unit: words}): the root's rule
        self.phases = PhaseFold()
        self._coll_cache = (0, np.empty(0), np.empty(0))
        timeline = LedgerTimeline.build(events)
        # columns of the fold: ranks and categories in the order they first appeared
        self._slots, self.categories = timeline.ranks, timeline.categories
        self._bytes = timeline.bytes if events else np.zeros((16, 1, 1), dtype=np.int64)
        for ev in events:
            self._index(ev)
        self.ymax = int(self._bytes[:self.n].sum(axis=2).max()) if events else 0

    @property
    def n(self) -> int:
        return len(self.events)

    @property
    def ranks(self) -> list[int]:
        return sorted(self._slots)

    def append(self, ev: dict) -> None:
        """Add one event (live mode): check its schema, extend the ledger fold by one row."""
        ev = load([ev])[0]
        if ev["rank"] not in self._slots:
            self._slots.append(ev["rank"])
        if ev["kind"] in ("alloc", "free") and ev["category"] not in self.categories:
            self.categories.append(ev["category"])
        n, R, C = self.n, len(self._slots), len(self.categories)
        cap, r0, c0 = self._bytes.shape
        if n >= cap or R > r0 or C > c0:         # grow: double the events, pad new ranks/categories
            grown = np.zeros((max(cap, 2 * n, 16), max(R, r0), max(C, c0)), dtype=np.int64)
            grown[:cap, :r0, :c0] = self._bytes
            self._bytes = grown
        self._bytes[n] = self._bytes[n - 1] if n else 0
        if ev["kind"] in ("alloc", "free"):
            sign = 1 if ev["kind"] == "alloc" else -1
            self._bytes[n, self._slots.index(ev["rank"]),
                        self.categories.index(ev["category"])] += sign * ev["bytes"]
        self.ymax = max(self.ymax, int(self._bytes[n].sum(axis=1).max()))
        self._index(ev)

    def _index(self, ev: dict) -> None:
        self.events.append(ev)
        self.t.append(ev["t"])
        self._phase.append(self.phases.add(ev))
        kind = ev["kind"]
        if kind == "collective":
            self.collectives.append(self.n - 1)
        elif kind == "transfer":
            self.transfers.append(self.n - 1)
        elif kind == "unit":
            self.unit_events.append((self.n - 1, ev["rank"], ev["name"], ev["state"]))
            self.unit_names.setdefault(ev["name"])
            if "after_forward" in ev:                # the root's, at its first forward
                self.after_forward_events.append((self.n - 1, ev["after_forward"]))

    # ---- lookups
    def bytes_at(self, i: int) -> np.ndarray:
        """Live bytes after event ``i``: one row per rank (in rank order), one column per
        category (in ``self.categories`` order)."""
        row = self._bytes[i, :len(self._slots), :len(self.categories)]
        if self._slots != self.ranks:            # live ranks can join out of order
            row = row[np.argsort(self._slots)]
        return row

    def snapshot(self, i: int) -> dict[int, dict[str, int]]:
        """``{rank: {category: bytes}}`` live after event ``i``."""
        row = self.bytes_at(i)
        return {r: {c: int(row[a, b]) for b, c in enumerate(self.categories)}
                for a, r in enumerate(self.ranks)}

    def unit_states(self, i: int) -> dict[int, dict[str, str]]:
        """``{rank: {unit: state}}`` after event ``i``; a unit not seen yet is sharded."""
        states = {r: dict.fromkeys(self.unit_names, "sharded") for r in self.ranks}
        end = bisect.bisect_right(self.unit_events, (i, float("inf")))
        for _, rank, name, state in self.unit_events[:end]:
            states[rank][name] = state
        return states

    def after_forward(self, i: int) -> dict[str, str]:
        """``{unit: what it does after forward}`` as decided by event ``i`` (the root decides at
        its first forward, FSDP2's root rule included; before that, nothing)."""
        told = {}
        for at, words in self.after_forward_events:
            if at <= i:
                told.update(words)
        return told

    def phase(self, i: int) -> str:
        """The phase event ``i``'s rank was in (see :meth:`PhaseFold.add`)."""
        return self._phase[i]

    def collective_at(self, t: float) -> dict | None:
        """The collective in flight at time ``t`` on any rank. When several are (every rank
        has its own event for the same all-reduce), the one that started *last*: a ring cannot
        move until its last rank has joined."""
        n, starts, ends = self._coll_cache
        if n != len(self.collectives):           # live runs add collectives; rebuild lazily
            starts = np.array([self.events[i]["t"] for i in self.collectives])
            ends = np.array([self.events[i]["t_end"] for i in self.collectives])
            self._coll_cache = (len(self.collectives), starts, ends)
        inside = np.flatnonzero((starts <= t) & (t <= ends))
        if inside.size == 0:
            return None
        return self.events[self.collectives[inside[np.argmax(starts[inside])]]]

    def traffic(self) -> list[dict]:
        """The collective and transfer events, in trace order."""
        return [self.events[i] for i in sorted(self.collectives + self.transfers)]
