"""Chapter 09 exercise: the resharding read plan (N saved ranks → M new ranks).

A flat tensor of ``numel`` elements was saved by N ranks, each its own chunk: rank r holds
elements ``[r*c, min((r+1)*c, numel))`` with ``c = ceil(numel / N)``. It is loaded on M ranks,
chunked the same way with ``ceil(numel / M)``. Write, for every new rank, which element ranges
of which saved ranks' files it must read.

The check compares your plan with minishard's reader (``checkpoint.plan_reads``, the function
that decides what ``checkpoint.load`` reads) on a checkpoint description with one tensor, for
even and uneven splits: 64 → 32, 4 → 3, 3 → 4, 7 → 2, ...
"""
from __future__ import annotations

import math

from . import attempt, call, expect

CASES = [(1000, 4, 2), (1000, 4, 3), (1000, 3, 4), (1001, 7, 2), (10, 4, 4), (5, 2, 8),
         (4096, 64, 32), (4096, 32, 64), (999, 1, 5), (999, 5, 1)]


def read_plan(numel: int, saved_world_size: int, world_size: int) -> list[list[tuple[int, int, int]]]:
    """For each new rank (a list of length ``world_size``), the reads
    ``(saved_rank, start, stop)`` — element ranges in the tensor's index space, in order of
    ``start``, only non-empty ones — that deliver exactly its chunk."""
    raise NotImplementedError("read_plan: your code here")


def _metadata(numel: int, n: int) -> dict:
    """What ``checkpoint.save`` writes, for one fp32 tensor chunked over ``n`` ranks (checksum
    blocks of one element, so that reads are not rounded up to blocks)."""
    c = math.ceil(numel / n)
    pieces = [{"start": r * c, "numel": max(0, min((r + 1) * c, numel) - r * c),
               "file": f"rank{r}.safetensors", "key": "flat", "offset": 0, "sha256": None}
              for r in range(n)]
    return {"block_bytes": 4, "world_size": n,
            "tensors": {"flat": {"dtype": "float32", "shape": [numel],
                                 "pieces": [p for p in pieces if p["numel"] > 0]}}}


def minishard_plan(numel: int, n: int, m: int) -> list[list[tuple[int, int, int]]]:
    from minishard.checkpoint import plan_reads

    meta, c = _metadata(numel, n), math.ceil(numel / m)
    plan = []
    for r in range(m):
        lo, hi = r * c, min((r + 1) * c, numel)
        reads = plan_reads(meta, [("flat", lo, max(0, hi - lo))])
        plan.append(sorted((int(rd.file[4:].split(".")[0]), rd.start, rd.start + rd.numel)
                           for rd in reads))
    return plan


@attempt
def check_read_plan(fn=None, ranks=None) -> None:
    fn = fn or read_plan
    for numel, n, m in CASES:
        want = minishard_plan(numel, n, m)
        got = [sorted(tuple(map(int, x)) for x in reads) for reads in call(fn, numel, n, m)]
        expect(len(got) == m, f"{numel} elements, {n} → {m}: plan for {len(got)} ranks, not {m}")
        for r in range(m):
            expect(got[r] == want[r], f"{numel} elements, {n} → {m} ranks: new rank {r} reads "
                   f"{want[r]} (saved rank, start, stop), you say {got[r]}")
        files = [len(reads) for reads in want]
        print(f"{numel:>5} elements, {n:>2} → {m:<2}: agrees; files read per new rank "
              f"{files if m <= 8 else f'{min(files)}–{max(files)}'}")
