"""The step-through player without a kernel: a trace's replay as one HTML file.

``python -m minishard view TRACE_DIR`` writes it for any trace (a torchrun run's ``rank*.jsonl``);
the chapters embed the same player in their executed notebooks (``minishard.viz.replay_html``),
so the static site and the committed notebooks step through every event with no kernel and no
network. It shows what the live ``minishard.viz.Player`` shows: the ledger of every rank as
stacked bars by category, the collective in flight on the ring (its chunks and rounds), the
timeline with a cursor, every FSDP unit's state, and the title line naming the event.

There is one replay logic: :class:`minishard.core.trace.Replay` folds the trace here, in Python, and
:mod:`minishard.viewers.playback` words it, exactly as for the live player. :func:`encode` writes the fold
compactly — every string once in a table, the ledger as per-event deltas (``alloc``/``free``),
the units' state changes, the collective in flight at every event with its round — and the
page's script (``offline_player.js``, package data, no dependencies) only sums deltas from its
nearest keyframe and draws. Every event is kept: no subsampling.

This module is engine-side on purpose (no plotly, no widgets): a cluster node that has only the
engine can write the player for the trace it just recorded.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import html
import json
from pathlib import Path
from typing import Iterable, Sequence

from minishard.core import trace
from .playback import (COLORS, SHARDED_COLOR, UNIT_STATE_COLORS, category_order, color, describe,
                       fmt_bytes, idle_ring_title, lane_spans, opening_event, ring_caption,
                       round_at, step_words)

FORMAT = 1                            # the encoding's version (the script refuses others)
TICKS = 10_000_000                    # times are integers of 0.1 µs: the trace's 7 decimals
LIBRARY = Path(__file__).with_name("offline_player.js")
LIB_MARK = "data-minishard-replay-lib"  # the site swaps the inline script for one shared file


class _Strings:
    """Every string once: the encoded data refers to them by index."""

    def __init__(self):
        self.table: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, s: str) -> int:
        if s not in self._index:
            self._index[s] = len(self.table)
            self.table.append(s)
        return self._index[s]


def _ticks(t: float) -> int:
    return round(t * TICKS)


def _deltas(values: Iterable[int]) -> list[int]:
    out, prev = [], 0
    for v in values:
        out.append(v - prev)
        prev = v
    return out


def encode(source, *, title: str = "", start: int | None = None, problems: Sequence[str] = (),
           read_plan=None) -> dict:
    """The replay of ``source`` (events, a trace directory, or a folded
    :class:`~minishard.core.trace.Replay`) as plain JSON-able data for the offline player.

    ``start``: the event shown first (None: the first step's peak,
    :func:`~minishard.viewers.playback.opening_event`, where the live ``Player`` opens too). ``problems``: lines saying what could not be read (shown
    above the player). ``read_plan``: a :class:`minishard.checkpoint.ReshardPlan`, drawn beside
    the replay (chapter 09)."""
    rp = source if isinstance(source, trace.Replay) else trace.Replay(trace.load(source))
    if rp.n == 0:
        raise ValueError("the trace has no events: nothing to replay")
    S = _Strings()
    start = opening_event(rp.events) if start is None else start
    data = {"format": FORMAT, "title": title, "n": rp.n, "start": min(max(start, 0), rp.n - 1),
            "ranks": rp.ranks, "problems": list(problems), "ymax": rp.ymax}
    data.update(_events(rp, S))
    data.update(_ledger(rp))
    data.update(_units(rp))
    data.update(_ring(rp, S))
    data.update(_timeline(rp, S))
    data.update(_jumps(rp))
    data["colors"], data["color_default"] = COLORS, color("")
    data["unit_colors"] = {**UNIT_STATE_COLORS, "sharded": SHARDED_COLOR}
    data["plan"] = _plan(read_plan) if read_plan is not None else None
    data["S"] = S.table
    return data


def _events(rp: trace.Replay, S: _Strings) -> dict:
    """Per event: its time and the three parts of its title (step, phase, the event in words)."""
    t0 = _ticks(rp.t[0])
    return {"t0": rp.t[0], "ticks": TICKS,
            "t": _deltas(_ticks(t) - t0 for t in rp.t),
            "step": [S(step_words(ev)) for ev in rp.events],
            "phase": [S(rp.phase(i)) for i in range(rp.n)],
            "what": [S(describe(ev)) for ev in rp.events]}


def _ledger(rp: trace.Replay) -> dict:
    """The ledger as deltas: ``[event - previous event, rank, category, ±bytes]`` per alloc/free,
    categories in the course's stacking order."""
    cats = category_order(rp.categories)
    ri = {r: a for a, r in enumerate(rp.ranks)}
    ci = {c: b for b, c in enumerate(cats)}
    flat, prev = [], 0
    for i, ev in enumerate(rp.events):
        if ev["kind"] in ("alloc", "free"):
            sign = 1 if ev["kind"] == "alloc" else -1
            flat += [i - prev, ri[ev["rank"]], ci[ev["category"]], sign * ev["bytes"]]
            prev = i
    return {"cats": cats, "ledger": flat}


def _units(rp: trace.Replay) -> dict:
    """Every unit state change: ``[event - previous, rank, unit, state]``; a unit not seen yet
    is sharded (state 0)."""
    units = list(rp.unit_names)
    states = ["sharded"] + sorted({s for *_, s in rp.unit_events} - {"sharded"})
    ri = {r: a for a, r in enumerate(rp.ranks)}
    flat, prev = [], 0
    for i, rank, name, state in rp.unit_events:
        flat += [i - prev, ri[rank], units.index(name), states.index(state)]
        prev = i
    return {"units": units, "unit_states": states, "unit_changes": flat}


def _ring(rp: trace.Replay, S: _Strings) -> dict:
    """The collective in flight at every event (the one :meth:`Replay.collective_at` picks), the
    round it is in and how far through it, with each collective's round titles and sends."""
    world = max(len(rp.ranks), 1)
    colls, titles, schedules, sched_index = [], [], [], {}
    where = {id(rp.events[j]): c for c, j in enumerate(rp.collectives)}
    for j in rp.collectives:
        ev = rp.events[j]
        cap = ring_caption(ev, world)
        key = (ev["op"], cap.world_size, ev.get("src", 0))
        if key not in sched_index:
            sched_index[key] = len(schedules)
            schedules.append({"ring": cap.rounds[0].along_ring if cap.rounds else True,
                              "sends": [[[s, d, S(name)] for s, d, name in rnd.sends]
                                        for rnd in cap.rounds]})
        colls += [cap.world_size, sched_index[key], len(titles)]
        titles += [S(cap.title(k)) for k in range(len(cap.rounds))] or [S(cap.title(None))]
    coll, rnd, frac = [], [], []
    for i in range(rp.n):
        ev = rp.collective_at(rp.t[i])
        c = -1 if ev is None else where[id(ev)]
        k, f = (0, 0.0)
        if c >= 0 and schedules[colls[3 * c + 1]]["sends"]:
            k, f = round_at(ev, rp.t[i], len(schedules[colls[3 * c + 1]]["sends"]))
        coll.append(c), rnd.append(k), frac.append(round(f * 1000))
    return {"ring_idle": S(idle_ring_title(world)), "world": world, "colls": colls,
            "coll_titles": titles, "schedules": schedules,
            "coll": coll, "round": rnd, "frac": frac}


def _timeline(rp: trace.Replay, S: _Strings) -> dict:
    """The timeline's spans, ``[lane, name, t0, t1, hover text]`` (lane: rank·2, +1 on comm)."""
    ri = {r: a for a, r in enumerate(rp.ranks)}
    t0 = _ticks(rp.t[0])
    names: list[str] = []
    flat = []
    for s in lane_spans(rp.phases.spans, rp.traffic()):
        if s.name not in names:
            names.append(s.name)
        flat += [2 * ri[s.rank] + (s.lane == "comm"), names.index(s.name),
                 _ticks(s.t0) - t0, _ticks(s.t1) - t0, S(s.about)]
    lanes = [f"rank {r} · {lane}" for r in rp.ranks for lane in ("compute", "comm")]
    windows: dict[int, list[int]] = {}          # each step's stretch over all ranks, to zoom to
    for p in rp.phases.spans:
        if p.name == "step" and p.unit is None and p.step is not None:
            w = windows.setdefault(S(step_words({"step": p.step})), [_ticks(p.t0) - t0, _ticks(p.t1) - t0])
            w[0], w[1] = min(w[0], _ticks(p.t0) - t0), max(w[1], _ticks(p.t1) - t0)
    return {"lanes": lanes, "span_names": names, "spans": flat, "step_windows": windows}


def _jumps(rp: trace.Replay) -> dict:
    """Where "jump to phase" and "jump to collective" go: the events of the first rank (the
    live player's default, rank 0), in trace order."""
    first = rp.ranks[0]
    phases: dict[str, list[int]] = {}
    traffic: dict[str, list[int]] = {}
    for i, ev in enumerate(rp.events):
        if ev["kind"] == "phase" and ev["name"] != "step":
            hits = phases.setdefault(ev["name"], [])
            if ev["edge"] == "begin" and ev["rank"] == first:
                hits.append(i)
        elif ev["kind"] in ("collective", "transfer") and ev["rank"] == first:
            name = ev["op"] if ev["kind"] == "collective" else f'transfer {ev.get("direction", "")}'
            traffic.setdefault(name, []).append(i)
    return {"jump_phase": phases, "jump_traffic": traffic}


def _plan(plan) -> dict:
    """A resharding read plan (chapter 09): bytes each new rank reads from each saved file."""
    read, needed = sum(plan.bytes_read()), sum(plan.needed_bytes)
    return {"title": (f"read plan, {plan.saved_world_size} → {plan.world_size} ranks: "
                      f"{fmt_bytes(read)} read for {fmt_bytes(needed)} needed"),
            "matrix": plan.bytes_matrix(), "read": plan.bytes_read(), "needed": list(plan.needed_bytes)}


# --------------------------------------------------------------------------- HTML

def library() -> str:
    """The player's script (package data): no dependencies, no network."""
    return LIBRARY.read_text(encoding="utf-8")


def payload(data: dict) -> str:
    """The data as the page carries it: JSON, gzip'ed, in base64 (a sixth of the JSON's size;
    the script inflates it with the browser's own ``DecompressionStream``)."""
    raw = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return base64.b64encode(gzip.compress(raw, compresslevel=9, mtime=0)).decode("ascii")


def unpack(text: str) -> dict:
    """:func:`payload` read back (tests; scripts that inspect a written player)."""
    return json.loads(gzip.decompress(base64.b64decode(text)))


def fragment(data: dict) -> str:
    """The player as an HTML fragment: a note for readers without scripts, the script, and the
    call that mounts the player in place of the note."""
    packed = payload(data)
    key = hashlib.sha1(packed.encode()).hexdigest()[:12]
    note = ("The offline step-through player is drawn here by its script. If you see this line, "
            "scripts did not run: open the course's static site (<code>make site</code>), or "
            "run the cell (a notebook's stored output runs no script until it is trusted).")
    return (f'<div class="minishard-replay-note" id="msr-{key}" '
            f'style="font:13px sans-serif;color:#57606a">{note}</div>\n'
            f'<script {LIB_MARK}="{FORMAT}">\n{library()}\n</script>\n'
            f'<script>MinishardReplay.mount("msr-{key}", "{packed}");</script>\n')


def page(data: dict) -> str:
    """A whole HTML document: the player alone (what ``minishard view`` writes)."""
    name = html.escape(data.get("title") or "minishard replay")
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{name}</title>\n'
            '<style>body{margin:16px 24px;font-family:-apple-system,"Segoe UI",Roboto,"Noto Sans",'
            'sans-serif;color:#1f2328}</style>\n</head>\n<body>\n'
            f"{fragment(data)}</body></html>\n")


def write(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(data), encoding="utf-8")
    return path


class ReplayHTML:
    """The offline player as a notebook output (``text/html``); ``str()`` is the fragment."""

    def __init__(self, data: dict):
        self.data = data

    def _repr_html_(self) -> str:
        return fragment(self.data)

    def __str__(self) -> str:
        return fragment(self.data)


def replay_html(source, *, title: str = "", start: int | None = None, read_plan=None) -> ReplayHTML:
    """The offline player of ``source`` (events, a trace directory, a ``Replay``, or a live
    ``Player``'s replay) to ``display`` in a notebook: it plays with no kernel, on the static
    site too. ``start``: the event shown first (None: the first step's peak); ``read_plan``: a
    ``ReshardPlan`` drawn beside."""
    return ReplayHTML(encode(source, title=title, start=start, read_plan=read_plan))

