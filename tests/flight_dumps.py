"""Flight dumps made by hand for the doctor's tests (tests/test_doctor_branches.py,
tests/test_doctor_properties.py): minishard's own (``flight_rank{r}.json``) and PyTorch's c10d
Flight Recorder's (``torch_fr_rank{r}.json``, as ``_dump_fr_trace_json`` writes it on gloo), and
a small scheduler that plays a program of collectives on ranks the way gloo pairs them.

The scheduler is the reference the doctor is checked against: each rank issues its own
collectives in program order, one at a time (each waits until it completes); the k-th collective
of a group completes when every member of the group has issued its k-th. A planted fault changes
one rank's program — it stops before one collective, or issues another op or size at one — and
what the dumps then hold follows from the pairing rule alone, not from the doctor's logic."""
from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

WORLD_GROUP = "world"
WHERE = re.compile(r"seq (\d+) of group '([^']+)'")


def entry(seq, op="all_reduce", numel=8, group=WORLD_GROUP, size=4, state="completed", tag="grads",
          step=0, dtype="float32", where="train.py:10 in step", **extra) -> dict:
    """One collective as minishard's recorder enters it (``minishard/core/flight.py``)."""
    return {"seq": seq, "op": op, "group": group, "group_size": size, "shapes": [[numel]],
            "dtypes": [dtype], "bytes": 4 * numel, "tag": tag, "step": step, "phase": "backward",
            "state": state, "where": where, "caller": "", "t_issued": 0.0, "t_completed": None, **extra}


def dump(rank, entries, world=4, reason="end", error=None, time=0.0) -> dict:
    return {"v": 1, "rank": rank, "world_size": world, "capacity": 256, "reason": reason,
            "error": error, "time": time, "entries": entries, "facts": {}}


def write(directory: Path, dumps) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for body in dumps:
        (directory / f"flight_rank{body['rank']}.json").write_text(json.dumps(body))
    return directory


def named(name: str, members) -> str:
    """A group as minishard names one that is not the world: by its members, ``shard[0, 1]``."""
    return f"{name}[{', '.join(map(str, members))}]"


# --------------------------------------------------------------------------- PyTorch's format

def torch_entry(seq, pg=0, op="all_reduce", numel=8, dtype="Float", retired=True, record_id=0,
                p2p=False, **extra) -> dict:
    """One entry of c10d's recorder: ``process_group`` is (id, name), the name ``default_pg``
    for the world and ``undefined`` for every other group on gloo; gloo never marks a work
    ``completed``, it retires it when it ends."""
    return {"record_id": record_id, "pg_id": pg, "process_group": (str(pg), "default_pg" if pg == 0
                                                                    else "undefined"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"gloo:{op}",
            "input_sizes": [[numel]], "input_dtypes": [dtype], "output_sizes": [[numel]],
            "output_dtypes": [dtype], "state": "scheduled", "retired": retired, "is_p2p": p2p,
            "timeout_ms": 1800000, **extra}


def write_torch(directory: Path, entries_by_rank: dict[int, list[dict]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for r, entries in entries_by_rank.items():
        body = {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},
                "pg_status": {}, "entries": [dict(e, record_id=i) for i, e in enumerate(entries)]}
        (directory / f"torch_fr_rank{r}.json").write_text(json.dumps(body))
    return directory


# --------------------------------------------------------------------------- the scheduler

@dataclass(frozen=True)
class Collective:
    group: str
    members: tuple[int, ...]
    op: str
    numel: int


@dataclass
class Played:
    entries: dict[int, list[dict]]     # rank -> what its recorder holds, in issue order
    reasons: dict[int, str]            # rank -> why its dump was written
    seq_of: list[int]                  # the program's k-th collective: its seq in its group


def play(world: int, program: list[Collective], stop=None, change=None) -> Played:
    """Every rank runs the collectives of ``program`` it is a member of. ``stop=(rank, k)``: that
    rank stops before the k-th (exits as a rank with nothing left to do); ``change=(rank, k,
    Collective)``: that rank issues another collective in its place (gloo pairs them anyway)."""
    todo = {r: [(k, c) for k, c in enumerate(program) if r in c.members] for r in range(world)}
    if stop is not None:
        rank, k = stop
        todo[rank] = [(j, c) for j, c in todo[rank] if j < k]
    if change is not None:
        rank, k, other = change
        todo[rank] = [(j, other if j == k else c) for j, c in todo[rank]]
    counts = defaultdict(int)
    seq_of = []
    for c in program:
        seq_of.append(counts[c.group])
        counts[c.group] += 1
    members = {c.group: c.members for c in program}
    entries = {r: [] for r in range(world)}
    issued: dict[tuple, dict[int, dict]] = defaultdict(dict)     # (group, seq) -> rank -> entry
    held = {r: defaultdict(int) for r in range(world)}
    waits: dict[int, tuple | None] = {r: None for r in range(world)}
    moved = True
    while moved:
        moved = False
        for r in range(world):
            if waits[r] is None and todo[r]:
                _, c = todo[r].pop(0)
                seq = held[r][c.group]
                held[r][c.group] += 1
                e = entry(seq, op=c.op, numel=c.numel, group=c.group, size=len(c.members), state="issued",
                          tag=f"{c.op}{c.numel}", where=f"model.py:{seq} in {c.op}")
                entries[r].append(e)
                issued[(c.group, seq)][r] = e
                waits[r] = (c.group, seq)
                moved = True
        for (group, seq), got in issued.items():
            waiting = [r for r, e in got.items() if e["state"] == "issued"]
            if waiting and set(got) == set(members[group]):
                for r in waiting:
                    got[r]["state"], waits[r] = "completed", None
                moved = True
    reasons = {r: "timeout" if waits[r] else "end" for r in range(world)}
    return Played(entries, reasons, seq_of)


def write_played(directory: Path, world: int, played: Played) -> Path:
    return write(directory, [dump(r, played.entries[r], world=world, reason=played.reasons[r])
                             for r in range(world)])


def as_torch(played: Played, pg_of: dict[str, int]) -> dict[int, list[dict]]:
    """The same run as c10d's recorder holds it: seq ids from 1, groups by id."""
    return {r: [torch_entry(e["seq"] + 1, pg=pg_of[e["group"]], op=e["op"], numel=e["shapes"][0][0],
                            retired=e["state"] == "completed") for e in es]
            for r, es in played.entries.items()}


def never_issued_by(played: Played, rank: int, program: list[Collective]) -> set[tuple[str, int]]:
    """(group, seq) of each group of ``rank``'s where another member issued a seq it never did:
    the first such seq (the truth a hang finding must name)."""
    out = set()
    for group in {c.group for c in program if rank in c.members}:
        mine = sum(e["group"] == group for e in played.entries[rank])
        theirs = max((e["seq"] for r, es in played.entries.items() if r != rank for e in es
                      if e["group"] == group), default=-1)
        if theirs >= mine:
            out.add((group, mine))
    return out


def found(directory) -> list[tuple[str, list[int], str | None, int | None]]:
    """(kind, ranks, group, seq) of each of the doctor's findings, the group and seq as its
    title says them (None for a finding about no collective)."""
    from minishard.instruments import doctor
    out = []
    for f in doctor.diagnose(directory).findings:
        m = WHERE.search(f.title)
        out.append((f.kind, f.ranks, m and m.group(2), m and int(m.group(1))))
    return out
