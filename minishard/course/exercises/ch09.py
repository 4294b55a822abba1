"""Chapter 09 exercises: the resharding read plan (N saved ranks → M new ranks), and which
checkpoint survives a save killed midway.

A flat tensor of ``numel`` elements was saved by N ranks, each its own chunk: rank r holds
elements ``[r*c, min((r+1)*c, numel))`` with ``c = ceil(numel / N)``. It is loaded on M ranks,
chunked the same way with ``ceil(numel / M)``. Write, for every new rank, which element ranges
of which saved ranks' files it must read.

The check compares your plan with minishard's reader (``checkpoint.plan_reads``, the function
that decides what ``checkpoint.load`` reads) on a checkpoint description with one tensor, for
even and uneven splits: 64 → 32, 4 → 3, 3 → 4, 7 → 2, ...

``survivor``: a save (synchronous or in the background: the same protocol) was killed somewhere;
given the directories it left, which one does a load read? The check builds each case as real
directories — copies of a real checkpoint, without metadata.json where the save had not written
it — and asks minishard's loader.
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


# ---------------------------------------------------------------- §8: which checkpoint survives

# (story, the directories next to ck after the kill: name -> holds metadata.json): a save of
# step 3 over the step-2 checkpoint "ck" (or the first save ever), killed at one point of it
SURVIVOR_CASES = [
    ("killed while the ranks write their files", {"ck": True, ".ck.saving": False}),
    ("killed after rank 0 wrote the new metadata, before the renames", {"ck": True, ".ck.saving": True}),
    ("killed between the two renames", {".ck.old": True, ".ck.saving": True}),
    ("killed after the second rename, before the old one was deleted", {"ck": True, ".ck.old": True}),
    ("the first save ever, killed while writing", {".ck.saving": False}),
    ("the first save ever, killed before its rename", {".ck.saving": True}),
]


def survivor(entries: dict[str, bool]) -> str | None:
    """A save of the checkpoint ``ck`` was killed somewhere in its four phases. ``entries`` are
    the directories it left next to each other — ``"ck"``, ``".ck.saving"`` (the new one being
    written), ``".ck.old"`` (the previous one, renamed aside) — each mapped to whether it holds
    ``metadata.json``. Return the name of the directory that a load of ``ck`` reads, or None if
    there is no complete checkpoint to load."""
    raise NotImplementedError("survivor: your code here")


def _make(root, entries: dict[str, bool], saved) -> None:
    """The directories of one case, as real files: copies of a real checkpoint, without their
    metadata.json where the case says so (the save had not written it yet)."""
    import shutil
    for name, complete in entries.items():
        shutil.copytree(saved, root / name)
        if not complete:
            (root / name / "metadata.json").unlink()


def minishard_survivor(root) -> str | None:
    """What minishard's load does with ``root/ck``: reads the metadata (of ``ck`` or, after a
    save that died between its renames, of ``.ck.old``) and verifies every block, or refuses."""
    from minishard.checkpoint import CheckpointError, read_full
    from minishard.checkpoint.format import resolve
    try:
        read_full(root / "ck")                  # resolves ck, reads its metadata, verifies every block
    except CheckpointError:
        return None
    return resolve(root / "ck").name


@attempt
def check_survivor(fn=None, ranks=None) -> None:
    import tempfile
    from pathlib import Path

    import torch

    from minishard.checkpoint import save
    from minishard.core.comm import Comm
    from minishard.core.model import GPT
    fn = fn or survivor
    with tempfile.TemporaryDirectory(prefix="minishard-ch09-") as tmp:
        net = GPT("nano")
        save(net, torch.optim.AdamW(net.parameters()), Path(tmp) / "saved", comm=Comm(alone=True), step=2)
        for k, (story, entries) in enumerate(SURVIVOR_CASES):
            root = Path(tmp) / f"case{k}"
            _make(root, entries, Path(tmp) / "saved")
            want, got = minishard_survivor(root), call(fn, dict(entries))
            expect(got == want, f"{story} (left {entries}): a load reads {want!r}, you say {got!r}"
                   + (" — a load looks at ck (and at .ck.old, for a save that died between its renames), "
                      "never at .ck.saving: the rename is the commit" if got == ".ck.saving" else ""))
            print(f"{story:<66} -> {want}")
