"""A trace as Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open:
``python -m minishard perfetto DIR out.json``. Each rank is a process with a compute track, a
communication track and a memory counter per ledger category — the view for long runs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from minishard.core.trace import merge


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
