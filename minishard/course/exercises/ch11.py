"""Chapter 11 exercise: find the first desync in the ranks' flight recorders.

Every rank numbers its collectives in a group 0, 1, 2, … (``seq``), and the k-th collective
must be the same one on every rank: the same op, shapes and dtypes, moving the same unit or
bucket (``tag``) of the same step. Given each rank's flight-recorder entries of one group, find
the first ``seq`` where the ranks issued different collectives, and the ranks that are the odd
ones out.

Two things make it more than a loop over ``zip``: a ring buffer drops its oldest entries, and
ranks may have dropped different ones (compare only the seqs every rank still holds, aligned by
seq, not by position); and two units of one size, swapped, agree in op, shapes and dtypes — only
what they move differs, and nothing fails.

The check compares your answer with the doctor's (``minishard.instruments.doctor.desync``) on the dumps of a
real run with two units gathered in swapped order on rank 1 of 4, and on hand-made rings: a
healthy run, a skipped collective, another dtype of the same size, rings that dropped different
entries, a tie.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

from . import attempt, call, expect, pools


def first_desync(held: dict[int, list[dict]]) -> tuple[int, list[int]] | None:
    """``held``: rank → that rank's entries of one group, oldest first; each entry a dict with
    ``seq``, ``op``, ``shapes``, ``dtypes``, ``tag``, ``step`` (and more). Return ``(seq,
    ranks)`` for the first seq held by every rank at which the ranks issued different
    collectives — ``ranks``: those outside the largest set of ranks that agree, sorted; every
    rank if no set is larger than all others — or ``None`` if they agree wherever all hold."""
    raise NotImplementedError("first_desync: your code here")


# --------------------------------------------------------------------------- hand-made rings

def _entry(seq: int, tag: str, numel: int = 8, dtype: str = "float32", op: str = "all_reduce",
           *, step: int | None = 0) -> dict:
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return {"seq": seq, "op": op, "group": "world", "group_size": 4, "shapes": [[numel]],
            "dtypes": [dtype], "bytes": numel * size, "tag": tag, "step": step, "phase": "backward",
            "state": "completed", "where": "exercise", "caller": ""}


def _ring(tags: list[tuple], first: int = 0) -> list[dict]:
    """One rank's ring: the collectives ``(tag, numel, dtype, op)``, four a step, from ``first``
    on (the ones before it dropped)."""
    return [_entry(i, *t, step=i // 4) for i, t in enumerate(tags) if i >= first]


BUCKETS = [("loss", 1), ("bucket0", 64), ("bucket1", 32), ("bucket2", 16), ("loss", 1),
           ("bucket0", 64), ("bucket1", 32), ("bucket2", 16), ("loss", 1), ("bucket0", 64)]


def _cases() -> dict[str, tuple[dict[int, list[dict]], str]]:
    """name → (held, the hint for a wrong answer)."""
    same = {r: _ring(BUCKETS) for r in range(4)}
    skipped = same | {1: _ring(BUCKETS[:2] + BUCKETS[3:])}                  # rank 1 skips bucket1
    half = _ring(BUCKETS[:5] + [("bucket0", 128, "float16")] + BUCKETS[6:])
    odd_dtype = {0: half, 1: half, 2: _ring(BUCKETS[:5] + [("bucket0", 128, "bfloat16")] + BUCKETS[6:]),
                 3: half}
    pair = [("bucket1", 32), ("bucket2", 32)]
    swapped = {r: _ring(BUCKETS[:2] + pair + BUCKETS[4:]) for r in range(3)}
    swapped[3] = _ring(BUCKETS[:2] + pair[::-1] + BUCKETS[4:])
    other = [("other", 32)]
    dropped = same | {0: _ring(BUCKETS, first=4),                          # rank 0 kept seqs 4..9
                      3: _ring(BUCKETS[:2] + other + BUCKETS[3:6] + other + BUCKETS[7:])}
    gathered = _ring(BUCKETS[:7] + [("bucket2", 16, "float32", "all_gather")] + BUCKETS[8:])
    tie = same | {2: gathered, 3: gathered}
    return {
        "a healthy run": (same, "every rank issued the same collectives: the answer is None"),
        "rank 1 skipped a collective": (skipped, "after a skipped collective, the next one pairs "
                                                 "with it: compare the entries at each seq"),
        "another dtype of the same size on rank 2": (odd_dtype, "compare the dtypes too: bf16 and "
                                                                "fp16 have the same bytes"),
        "two buckets of one size swapped on rank 3": (swapped, "op, shapes and dtypes agree here: "
                                                               "compare what they move (the tag) too"),
        "rank 0's ring dropped seqs 0-3": (dropped, "align the ranks by seq, not by position, and "
                                                    "compare only the seqs every rank still holds"),
        "two ranks against two": (tie, "when no set of agreeing ranks is the largest, every rank "
                                       "is named"),
    }


def doctors_answer(held: dict[int, list[dict]]) -> tuple[int, list[int]] | None:
    """What ``minishard doctor`` says about these rings: (seq, ranks) of its desync, or None."""
    from minishard.instruments.doctor import desync
    by_seq = {r: {e["seq"]: e for e in entries} for r, entries in held.items()}
    found = desync("world", by_seq, sorted(held))
    return None if found is None else (int(re.search(r"at seq (\d+)", found.title).group(1)),
                                       sorted(found.ranks))


def _real_reorder(ranks) -> dict[int, list[dict]]:
    """The world group's entries of a 4-rank FSDP run whose rank 1 gathers blocks.1 first."""
    import json

    from minishard.course.ch11 import broken
    with tempfile.TemporaryDirectory() as d, pools(ranks) as get:
        get(4).run(broken, d, strategy="fsdp", fault="reorder")
        dumps = {r: json.loads((Path(d) / f"flight_rank{r}.json").read_text()) for r in range(4)}
    return {r: [e for e in body["entries"] if e["group"] == "world"] for r, body in dumps.items()}


@attempt
def check_first_desync(fn=None, ranks=None) -> None:
    fn = fn or first_desync
    cases = _cases() | {"FSDP on 4 real ranks, rank 1 gathers blocks.1 first": (
        None, "the units are the same size: compare what the all-gathers move (the tag)")}
    for name, (held, hint) in cases.items():
        held = held if held is not None else _real_reorder(ranks)    # (last: a stub fails first)
        want = doctors_answer(held)
        got = call(fn, {r: list(entries) for r, entries in held.items()})
        got = None if got is None else (int(got[0]), sorted(int(r) for r in got[1]))
        expect(got == want, f"{name}: the doctor says {want} (seq, ranks), you say {got} — {hint}")
        print(f"{name:<52} {'no desync' if want is None else f'seq {want[0]}, ranks {want[1]}'}: agrees")
