"""A run's id: twelve hex digits that rank 0 draws when the run starts and every rank writes into
every file it leaves — its flight dump, its ring, its trace — so that the doctor can tell the
files of one run from those of another left in the same folder (a rank's dump from Tuesday beside
the others' from today is otherwise read as one run that never happened).

Rank 0 draws it; the others get it from rank 0 through the process group: :func:`agree` for
minishard's engine (one 8-byte broadcast as ``train`` starts, made on the default group and
recorded by no flight recorder: it is not the run's), and inside the all-reduce that
``minishard.watch`` makes anyway as it starts (PyTorch's and DeepSpeed's jobs), as a float64 —
48 bits, which a float64 holds exactly.

A trace says it in its first line, a header that is not an event (no ``kind``): :func:`header`,
read back by :func:`read_header`.
"""
from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

BITS = 48
DIGITS = BITS // 4
SHAPE = re.compile(rf"[0-9a-f]{{{DIGITS}}}")


def new() -> str:
    return as_text(secrets.randbits(BITS))


def as_number(run: str) -> int:
    return int(run, 16)


def as_text(number: int) -> str:
    if not 0 <= number < 2 ** BITS:
        raise ValueError(f"a run id is a number below 2**{BITS}, got {number}")
    return f"{number:0{DIGITS}x}"


def agree(device=None, group=None) -> str:
    """Rank 0's new id, on every rank of ``group`` (the default group); a new one where there is
    no process group, or a group of one."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return new()
    mine = as_number(new()) if dist.get_rank(group) == 0 else 0
    number = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.broadcast(number, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return as_text(int(number.item()))


def header(run: str, rank: int, world_size: int | None) -> dict:
    """A trace's first line (``v``: the trace schema's version, ``trace.SCHEMA_VERSION``)."""
    return {"v": 1, "run": run, "rank": rank} | ({"world_size": world_size} if world_size is not None else {})


def is_header(line) -> bool:
    return isinstance(line, dict) and "kind" not in line and "run" in line


def read_header(path: str | Path) -> dict | None:
    """A trace's header (its run's id, rank and world size), or None: a trace written before
    run ids, or one whose first line is not a header."""
    with open(path, "rb") as f:
        first = f.readline()
    try:
        line = json.loads(first.decode("utf-8"))
    except ValueError:                           # (UnicodeDecodeError and JSONDecodeError both)
        return None
    return line if is_header(line) else None
