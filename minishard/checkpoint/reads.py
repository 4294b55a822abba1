"""Reading a checkpoint: which bytes deliver the elements a rank needs, and reading them verified.

A loader reads only the checksum blocks that :func:`overlap` what it needs (:func:`plan_reads`),
checks each file's size and each block's checksum (XXH3-64; SHA-256 in a version 1 checkpoint),
and only then hands the values on (:func:`read_verified`). The same reads serve
:func:`.loading.load` (this rank's regions), :func:`.resharding.plan` (from metadata alone),
:func:`read_full` and the export.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .format import (CODES, DTYPES, HASHES, METADATA, CheckpointError, element_size, read_metadata, resolve,
                     tensor_bytes)


@dataclass(frozen=True)
class Read:
    """One contiguous read: whole checksum blocks of one saved piece."""
    file: str
    key: str
    tensor: str
    start: int                  # first element read, in the tensor's index space
    numel: int
    offset: int                 # byte offset in the file
    nbytes: int
    piece_lo: int               # first element read, within the piece
    block: int                  # elements per checksum block
    checksums: tuple | None     # expected checksum of each block read (None: an imagined save)


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The elements ``(start, stop)`` two ranges of one tensor's index space share, or None.

    Loading on M ranks what N wrote is this one step, asked of every pair: what of a saved piece
    a new rank's region needs. The read plan asks it of each piece (:func:`plan_reads`), the load
    of each verified read (:func:`.loading.load`)."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def plan_reads(meta: dict, needs: Iterable[tuple[str, int, int]]) -> list[Read]:
    """The reads that deliver the elements ``needs`` = [(tensor, start, numel)]: for each saved
    piece overlapping them, the whole checksum blocks that cover the overlap (so that what is
    read can be verified), merged into contiguous reads."""
    wanted: dict[str, list[tuple[int, int]]] = {}
    for name, start, n in needs:
        if name not in meta["tensors"]:
            raise CheckpointError(f"the checkpoint has no tensor {name}")
        if n:
            wanted.setdefault(name, []).append((start, start + n))
    reads = []
    for name in [n for n in meta["tensors"] if n in wanted]:      # metadata (model) order
        t = meta["tensors"][name]
        size = element_size(t["dtype"])
        block = meta["block_bytes"] // size
        for p in t["pieces"]:
            ps, pe = p["start"], p["start"] + p["numel"]
            hits = [o for w in wanted[name] if (o := overlap(w, (ps, pe))) is not None]
            spans = [((a - ps) // block, (b - ps - 1) // block) for a, b in hits]
            for first, last in _runs(sorted(spans) if len(spans) > 1 else spans):
                lo, hi = first * block, min((last + 1) * block, p["numel"])
                sums = tuple(p["checksums"][first:last + 1]) if p.get("checksums") else None
                reads.append(Read(p["file"], p["key"], name, ps + lo, hi - lo,
                                  p["offset"] + lo * size, (hi - lo) * size, lo, block, sums))
    return reads


def _runs(spans: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """Sorted block ranges (first, last), merged where they overlap or touch:
    [(0, 1), (1, 2), (5, 5), (6, 6)] -> (0, 2), (5, 6)"""
    run = None
    for first, last in spans:
        if run is not None and first <= run[1] + 1:
            run = (run[0], max(run[1], last))
            continue
        if run is not None:
            yield run
        run = (first, last)
    if run is not None:
        yield run


def read_verified(root: Path, meta: dict, reads: list[Read], meter=None
                  ) -> Iterator[tuple[Read, torch.Tensor]]:
    """Execute reads file by file, verifying sizes and checksums; yields (read, values).
    ``meter`` (the export's) is told of every buffer read."""
    # looked up at call time: the tests record reads at safetensors' boundary
    from safetensors import SafetensorError, safe_open
    by_file: dict[str, list[Read]] = {}
    for rd in reads:
        by_file.setdefault(rd.file, []).append(rd)
    for fname, rs in by_file.items():
        file = root / fname
        what = f"{rs[0].tensor}" + (f" and {len(rs) - 1} more pieces" if len(rs) > 1 else "")
        _check_size(root, meta, fname, what)
        try:
            with safe_open(str(file), framework="pt") as f:
                for rd in rs:
                    sl = f.get_slice(rd.key)
                    if sl.get_dtype() != CODES[DTYPES[meta["tensors"][rd.tensor]["dtype"]]]:
                        raise CheckpointError(f"{file}: {rd.key} is {sl.get_dtype()}, {METADATA} "
                                              f"says {meta['tensors'][rd.tensor]['dtype']}")
                    values = sl[rd.piece_lo:rd.piece_lo + rd.numel]
                    if meter is not None:
                        meter.alloc(values)
                    _verify(file, root, meta, rd, values)
                    yield rd, values
        except SafetensorError as e:
            raise CheckpointError(f"{file} is not a readable safetensors file ({e}); it holds {what}") from None


def _check_size(root: Path, meta: dict, fname: str, what: str) -> None:
    """The file exists and has the size the metadata recorded (a truncated file fails here)."""
    file, info = root / fname, meta["files"].get(fname)
    if info is None:
        raise CheckpointError(f"{root / METADATA} lists pieces in {fname} but not the file")
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"missing shard file {file}: it holds {what}") from None
    if size != info["bytes"]:
        raise CheckpointError(f"{file} is {size:,} bytes, {METADATA} says {info['bytes']:,}: "
                              f"the file is truncated or was replaced (it holds {what})")


def _verify(file: Path, root: Path, meta: dict, rd: Read, values: torch.Tensor) -> None:
    """Every checksum block read has the checksum the metadata recorded."""
    if rd.checksums is None:
        raise CheckpointError(f"{root / METADATA} has no checksums for {rd.tensor}")
    data, size, h = tensor_bytes(values), values.element_size(), HASHES[meta["checksum"]]
    for k, want in enumerate(rd.checksums):
        got = h(data[k * rd.block * size:(k + 1) * rd.block * size])
        if got != want:
            a = rd.start + k * rd.block
            raise CheckpointError(
                f"{file}: checksum mismatch in {rd.tensor}, elements "
                f"[{a}, {min(a + rd.block, rd.start + rd.numel)}): the file is corrupted")


def read_full(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors from a checkpoint, verified (one process, no ranks): for tests and tools."""
    root = resolve(Path(path))
    meta = read_metadata(root)
    names = list(meta["tensors"]) if names is None else list(names)
    out = {n: torch.empty(math.prod(meta["tensors"][n]["shape"]), dtype=DTYPES[meta["tensors"][n]["dtype"]])
           for n in names}
    for rd, v in read_verified(root, meta, plan_reads(meta, [(n, 0, out[n].numel()) for n in names])):
        out[rd.tensor][rd.start:rd.start + rd.numel] = v
    return {n: t.view(meta["tensors"][n]["shape"]) for n, t in out.items()}
