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
    mark        name  (free-form annotation, e.g. "ready")

``t`` is seconds since the tracer's origin. Ranks started together share one origin (the
launcher passes it), so their timelines line up.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

SCHEMA_VERSION = 1
KINDS = ("phase", "collective", "alloc", "free", "unit", "transfer", "mark")


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
        self._seq = 0

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
        try:
            yield
        finally:
            self.emit("phase", name=name, edge="end", **fields)

    def mark(self, name: str, **fields) -> None:
        self.emit("mark", name=name, **fields)

    def write_jsonl(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for ev in self.events:
                f.write(json.dumps(ev) + "\n")
        return path


# --------------------------------------------------------------------------- reading traces

def _check(ev: dict, where: str) -> dict:
    v = ev.get("v")
    if v != SCHEMA_VERSION:
        raise TraceFormatError(
            f"{where}: trace schema version {v!r}, but this minishard reads version "
            f"{SCHEMA_VERSION}; re-record the trace with this version")
    for key in ("rank", "seq", "t", "kind"):
        if key not in ev:
            raise TraceFormatError(f"{where}: event has no {key!r} field: {ev}")
    return ev


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    events = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceFormatError(f"{path}:{n}: not JSON ({e})") from None
                events.append(_check(ev, f"{path}:{n}"))
    return events


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
        else:
            events = read_jsonl(p)
    else:
        events = [_check(ev, "event") for ev in source]
    return merge(events)


def merge(events: Iterable[dict]) -> list[dict]:
    return sorted(events, key=lambda e: (e["t"], e["rank"], e["seq"]))


def write_dir(events: Iterable[dict], directory: str | Path) -> list[Path]:
    """Write merged events back as one ``rank{r}.jsonl`` per rank."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    by_rank: dict[int, list[dict]] = {}
    for ev in events:
        by_rank.setdefault(ev["rank"], []).append(ev)
    paths = []
    for r, evs in sorted(by_rank.items()):
        p = directory / f"rank{r}.jsonl"
        with open(p, "w") as f:
            for ev in sorted(evs, key=lambda e: e["seq"]):
                f.write(json.dumps(ev) + "\n")
        paths.append(p)
    return paths


# --------------------------------------------------------------------------- Chrome / Perfetto

def to_chrome(events: Iterable[dict]) -> dict:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing).

    One process per rank; thread 0 is compute (phases), thread 1 communication (collectives),
    and a counter track per ledger category shows memory over time.
    """
    out: list[dict] = []
    live: dict[tuple[int, str], int] = {}
    ranks = set()
    for ev in merge(events):
        r, us = ev["rank"], ev["t"] * 1e6
        ranks.add(r)
        k = ev["kind"]
        if k == "phase":
            name = ev["name"] if "unit" not in ev else f'{ev["name"]} {ev["unit"]}'
            out.append({"name": name, "ph": "B" if ev["edge"] == "begin" else "E",
                        "pid": r, "tid": 0, "ts": us})
        elif k == "collective":
            out.append({"name": ev["op"], "ph": "X", "pid": r, "tid": 1, "ts": us,
                        "dur": max(0.0, (ev["t_end"] - ev["t"]) * 1e6),
                        "args": {kk: ev.get(kk) for kk in ("payload", "wire", "dtype", "tag")}})
        elif k in ("alloc", "free"):
            key = (r, ev["category"])
            live[key] = live.get(key, 0) + (ev["bytes"] if k == "alloc" else -ev["bytes"])
            out.append({"name": "memory", "ph": "C", "pid": r, "ts": us,
                        "args": {c: v for (rr, c), v in live.items() if rr == r}})
        elif k == "unit":
            out.append({"name": f'{ev["name"]}: {ev["state"]}', "ph": "i", "s": "t",
                        "pid": r, "tid": 0, "ts": us})
        elif k == "transfer":
            out.append({"name": f'transfer {ev.get("direction", "")}', "ph": "X", "pid": r,
                        "tid": 2, "ts": us, "dur": ev.get("seconds", 0) * 1e6,
                        "args": {"bytes": ev["bytes"]}})
    for r in sorted(ranks):
        out.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0,
                    "args": {"name": "compute"}})
        out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1,
                    "args": {"name": "communication"}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome(events: Iterable[dict], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_chrome(events)))
    return path


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
        import numpy as np
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
