"""What the ranks of a run left in its folder, read and checked: each rank's flight dump
(``flight_rank{r}.json``), the ring of a rank that died before writing one
(``flight_rank{r}.ring``), PyTorch's own flight-recorder dumps, and the traces (``rank{r}.jsonl``)
— which stand in for the dumps of a run that left neither dump nor ring.

The doctor (``doctor.py``) diagnoses what this module reads; a file it cannot read is named with
its line (:class:`~minishard.core.trace.TraceFormatError`: the command line's exit status 2).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import one_run, torch_flight
from .causes import Finding
from minishard.core import flight_file
from minishard.core.flight import FORMAT_VERSION
from minishard.core.run_id import read_header
from minishard.core.trace import TraceFormatError, not_utf8, read_events

DUMP = re.compile(r"flight_rank(\d+)\.json")
RING = re.compile(r"flight_rank(\d+)\.ring")
TRACE = re.compile(r"rank(\d+)\.jsonl")
ENTRY_NEEDS = ("seq", "op", "group", "group_size", "shapes", "dtypes", "bytes", "state")
DUMP_NEEDS = ("rank", "world_size", "reason", "entries")


@dataclass
class Report:
    directory: str
    dumps: dict[int, dict]                   # rank -> its dump, as read
    traces: dict[int, Path]                  # rank -> its rank{r}.jsonl
    world_size: int | None
    findings: list[Finding] = field(default_factory=list)
    only_traces: bool = False                # no dump, no ring: the dumps were read from traces
    unchecked: list[str] = field(default_factory=list)   # files that carry no run id (one_run.py)
    run: str | None = None                   # the run's id, as its files say it

    def as_dict(self) -> dict:
        return {"directory": self.directory, "run": self.run, "unchecked": self.unchecked,
                "world_size": self.world_size,
                "dumps": {str(r): {"reason": d["reason"], "error": d.get("error"),
                                   "entries": len(d["entries"])} for r, d in sorted(self.dumps.items())},
                "traces": sorted(str(p) for p in self.traces.values()),
                "findings": [asdict(f) for f in self.findings]}


def read_dump(path: Path) -> dict:
    """One rank's dump, checked: a file this minishard cannot read is named with its line."""
    raw = path.read_bytes()
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line, where = not_utf8(e, raw)
        raise TraceFormatError(f"{path}:{line}: not UTF-8 text ({where}): a damaged dump, or not a "
                               f"flight-recorder dump") from None
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}:{e.lineno}: not JSON ({e.msg} at column {e.colno}): a dump "
                               f"cut short, or not a flight-recorder dump") from None
    if not isinstance(body, dict):
        raise TraceFormatError(f"{path}: not a flight-recorder dump (a JSON object with entries)")
    if body.get("v") != FORMAT_VERSION:
        newer = isinstance(body.get("v"), int) and body["v"] > FORMAT_VERSION
        raise TraceFormatError(f"{path}: flight dump format version {body.get('v')!r}, but this "
                               f"minishard reads version {FORMAT_VERSION}"
                               + ("; a newer minishard wrote it: upgrade to read it" if newer else ""))
    missing = [k for k in DUMP_NEEDS if k not in body]
    if missing or not isinstance(body["entries"], list):
        raise TraceFormatError(f"{path}: a flight dump without {', '.join(missing) or 'a list of entries'}")
    named = int(DUMP.fullmatch(path.name).group(1))
    if body["rank"] != named:
        raise TraceFormatError(f"{path}: the dump says rank {body['rank']}, its name rank {named}")
    for i, e in enumerate(body["entries"]):
        lacks = [k for k in ENTRY_NEEDS if not isinstance(e, dict) or k not in e]
        if lacks:
            raise TraceFormatError(f"{path}: entry {i} has no {', '.join(lacks)}")
    return body


def read_dir(directory: str | Path) -> Report:
    """The dumps and the traces of one run; neither: an error naming the directory. Files of
    different runs, or that disagree on the world size, are refused (``one_run.py``)."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such trace directory (TrainConfig(flight_dir=DIR) or "
                                f"demo --trace DIR writes one)")
    files = sorted(d.iterdir())
    dumps = {int(m.group(1)): read_dump(p) for p in files if (m := DUMP.fullmatch(p.name))}
    traces = {int(m.group(1)): p for p in files if (m := TRACE.fullmatch(p.name))}
    rings = {int(m.group(1)): p for p in files if (m := RING.fullmatch(p.name))}
    theirs = {r: p for p in files if (r := torch_flight.rank_of(p)) is not None}
    if not dumps and not traces and not theirs and not rings:
        raise FileNotFoundError(f"{d}: no flight_rank*.json dumps or .ring records, no rank*.jsonl "
                                f"traces and no PyTorch flight-recorder dumps in this directory: "
                                f"nothing to diagnose")
    said = [one_run.Said(f"flight_rank{r}.json", b.get("run"), b["world_size"]) for r, b in dumps.items()]
    # a rank's ring stands in for the dump it did not live to write; beside a dump, its header
    # still says which run it flew in
    try:
        for r, p in rings.items():
            body = flight_file.header(p) if r in dumps else flight_file.read(p)
            said.append(one_run.Said(p.name, body["run"], body["world_size"]))
            if r not in dumps:
                dumps[r] = body
    except ValueError as e:
        raise TraceFormatError(str(e)) from None
    for p in traces.values():
        head = read_header(p) or {}
        said.append(one_run.Said(p.name, head.get("run"), head.get("world_size")))
    # PyTorch's own dumps stand in for the ranks that left none of minishard's
    world_of_theirs = max([r + 1 for r in theirs] + [b["world_size"] for b in dumps.values()], default=0)
    for r, p in theirs.items():
        if r not in dumps:
            dumps[r] = torch_flight.read(p, r, world_of_theirs)
            said.append(one_run.Said(p.name, None, None))
    unchecked = one_run.check(d, said)
    only_traces = not dumps and bool(traces)
    if only_traces:
        dumps = {r: from_trace(p, r) for r, p in traces.items()}
        # the traces' headers say the world size; without them, the world's collectives say it,
        # and a rank that completed none of them says no less
        world = next((s.world_size for s in said if s.world_size is not None), None) or max(
            [e["group_size"] for b in dumps.values() for e in b["entries"] if e["group"] == "world"]
            + [max(dumps) + 1])
        for body in dumps.values():
            body["world_size"] = world
    world = next(iter(dumps.values()))["world_size"] if dumps else None
    for r in dumps:
        if r >= world:
            raise TraceFormatError(f"{d / f'flight_rank{r}.json'}: rank {r} in a world of {world}")
    return Report(str(d), dumps, traces, world, only_traces=only_traces, unchecked=unchecked,
                  run=next((s.run for s in said if s.run is not None), None))


def from_trace(path: Path, rank: int) -> dict:
    """A dump read from a rank's trace, for a run recorded before rings were written (or whose
    rings were deleted). A trace holds a collective only once it *completed*, flat, with no call
    line: the order in which the ranks completed their collectives can be compared, a collective
    issued and never completed — a hang, a death — leaves no sign. (Its world size is the
    run's: :func:`read_dir` sets it from every rank's trace.)"""
    events, _ = read_events(path, damaged="stop")
    done = sorted((ev for ev in events if ev["kind"] == "collective"), key=lambda ev: ev["t"])
    seqs: dict[str, int] = {}
    entries = []
    for ev in done:
        group = "world" if "members" not in ev else "group[" + ", ".join(map(str, ev["members"])) + "]"
        seqs[group] = seqs.get(group, -1) + 1
        kind = getattr(torch, ev.get("dtype") or "", None)
        size = kind.itemsize if isinstance(kind, torch.dtype) else 0
        entries.append({"seq": seqs[group], "op": ev["op"], "group": group, "group_size": ev["group"],
                        "shapes": [[ev["payload"] // size]] if size else [], "dtypes": [ev.get("dtype", "?")],
                        "bytes": ev["payload"], "state": "completed", "tag": ev.get("tag", ""),
                        "t_issued": ev["t"], "t_completed": ev.get("t_end", ev["t"]),
                        "step": ev.get("step"), "src": ev.get("src")})
    return {"rank": rank, "world_size": None, "reason": "trace", "entries": entries}
