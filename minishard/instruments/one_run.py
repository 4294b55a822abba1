"""Whether the files in a folder are one run's: the doctor diagnoses nothing else.

Every file a run leaves says which run it is and how many ranks it had (``core/run_id.py``): a
flight dump its ``run`` and ``world_size``, a ring its header, a trace its header line. Files of
two runs in one folder — rank 1's dump and trace from yesterday's run beside rank 0's from today's
— read as one would describe a run that never happened ("rank 1 died", "rank 0 never issued seq
2"), so they are refused, each file named under the run it says (:func:`check`), and so are files
that disagree on the world size.

A file written before run ids (no id in it: an older minishard, or a trace written back from
merged events without one) cannot say which run it is. It is read as before, and the doctor says
which files were not checked (what :func:`check` returns) rather than refuse every older folder.
PyTorch's own dumps carry no minishard id either: they are named so when they stand in for a rank.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from minishard.core.trace import TraceFormatError


@dataclass(frozen=True)
class Said:
    """What one file says of the run it belongs to (None: it does not say)."""
    name: str
    run: str | None
    world_size: int | None


def check(directory: Path, said: list[Said]) -> list[str]:
    """The names of the files that carry no run id; a :class:`TraceFormatError` naming the
    files when they say different runs or different world sizes."""
    for s in said:
        if s.run is not None and not isinstance(s.run, str):
            raise TraceFormatError(f"{directory / s.name}: run id {s.run!r} is not a run id (text)")
    runs = _by(said, "run")
    if len(runs) > 1:
        raise TraceFormatError(
            f"{directory}: files of {len(runs)} different runs in one folder — "
            + "; ".join(f"run {run}: {', '.join(names)}" for run, names in runs.items())
            + " — the doctor reads one run at a time: put each run's files in a folder of its own")
    worlds = _by(said, "world_size")
    if len(worlds) > 1:
        raise TraceFormatError(
            f"{directory}: the files disagree on the world size, as files of different runs do — "
            + "; ".join(f"{world} ranks in {', '.join(names)}" for world, names in worlds.items())
            + " — the doctor reads one run at a time: put each run's files in a folder of its own")
    return sorted({s.name for s in said if s.run is None}, key=_rank_order)


def _by(said: list[Said], what: str) -> dict:
    out: dict = defaultdict(list)
    for s in sorted(said, key=lambda s: _rank_order(s.name)):
        if getattr(s, what) is not None:
            out[getattr(s, what)].append(s.name)
    return dict(sorted(out.items(), key=lambda kv: _rank_order(kv[1][0])))


def _rank_order(name: str) -> tuple:
    """flight_rank0.json, flight_rank0.ring, rank0.jsonl, flight_rank1.json, ...: by rank first."""
    digits = "".join(c if c.isdigit() else " " for c in name).split()
    return (int(digits[0]) if digits else -1, name)
