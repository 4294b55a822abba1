"""The checkpoint on disk: one safetensors file per rank, written by hand, and ``metadata.json``.

``path/rank{r}.safetensors`` holds rank r's pieces, one 1-D tensor each (plain little-endian
bytes behind a JSON header: no pickle, so loading runs no code from the file);
``path/metadata.json`` lists every tensor's shape and dtype and every piece's file, key, first
element, byte offset and checksum per 64 KiB block. Its presence marks a complete checkpoint.

The checksum is XXH3-64 (the ``xxhash`` package: an order of magnitude faster than SHA-256, so
a save is not held up by it; docs/architecture.md, "The measurements behind the code"). It
catches what goes wrong by accident — flipped bits, a block of zeros, a torn or truncated
write, a file from another save — missing such damage with a chance of about 2^-64 per block. It is not cryptographic:
whoever can edit the files can also make the checksums match, so it does not detect
deliberate tampering (sign the files for that). Version 1 checkpoints, which carry SHA-256 per
block, are still read and verified with SHA-256.

The header is written by hand, not by the safetensors library, so that every byte offset is
known before any data exists: the planner computes them for saves that never ran, and the
export streams data into a file whose header is already written.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
import xxhash

from minishard.core.words import dtype_name

if TYPE_CHECKING:
    from .regions import Region, ShardedState

# version 2: XXH3-64 checksums (version 1: SHA-256, ~11x the CPU per byte; still readable)
FORMAT, VERSION, READABLE_VERSIONS = "minishard-checkpoint", 2, (1, 2)
METADATA = "metadata.json"
# One checksum per 64 KiB block: a rank reads whole blocks, so that what it reads can be verified
# without reading whole pieces. Smaller blocks: less read beyond the need, a longer metadata file
# (a real 8B run would pick MiBs).
BLOCK_BYTES = 64 << 10
CHECKSUM = "xxh3_64"
HASHES = {"xxh3_64": xxhash.xxh3_64_hexdigest, "sha256": lambda b: hashlib.sha256(b).hexdigest()}
# the per-element optimizer states the format knows (the step count is global: metadata)
STATE_KINDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
DTYPES = {dtype_name(d): d for d in CODES}          # "float32" -> torch.float32


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read. The message names the file and the tensor."""


def element_size(name: str) -> int:
    """Bytes per element of a dtype as metadata.json names it (``"float32"`` -> 4)."""
    return DTYPES[name].itemsize


# ====================================================================== safetensors, by hand

def safetensors_header(entries: list[tuple[str, str, list[int], int]]) -> bytes:
    """The JSON header of a safetensors file whose tensors ``(key, dtype code, shape, nbytes)``
    follow in this order."""
    h: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for key, code, shape, nbytes in entries:
        h[key] = {"dtype": code, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(h, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)             # data starts 8-byte aligned, as the library's


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy (unless it is not contiguous). Called once
    per piece on every save and load: the shortest path through torch we measured."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:                   # numpy has no bfloat16
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def block_checksums(data: memoryview, block_bytes: int, algorithm: str = CHECKSUM) -> list[str]:
    """The checksum of every ``block_bytes`` block of ``data`` (the last one may be shorter)."""
    h = HASHES[algorithm]
    return [h(data[i:i + block_bytes]) for i in range(0, len(data), block_bytes)]


def write_safetensors(file: Path, entries: list, tensors: Iterable[torch.Tensor],
                      hash_bytes: int | None = None) -> tuple[int, list[list[str]]]:
    """Write a safetensors file: 8-byte little-endian header length, the header, then each
    tensor's bytes as ``tensors`` yields them (one at a time), straight from the tensor's memory
    (no copy in Python). With ``hash_bytes``, also the checksum of every block of that many bytes
    of each tensor. fsync'd; returns the file's size and the checksums per tensor."""
    header = safetensors_header(entries)
    hashes = []
    # ~1 MiB segments of whole blocks: each is hashed while in cache, then written, and the kernel
    # copies a segment for less CPU than one multi-MB write (docs/architecture.md, measured)
    segment = max(1, (1 << 20) // hash_bytes) * hash_bytes if hash_bytes else 1 << 20
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for t in tensors:
            data, sums = tensor_bytes(t), []
            for i in range(0, len(data), segment):
                seg = data[i:i + segment]
                if hash_bytes:
                    sums += block_checksums(seg, hash_bytes)
                f.write(seg)
            hashes.append(sums)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(header) + sum(e[3] for e in entries), (hashes if hash_bytes else [])


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ====================================================================== a rank's file, the metadata

def plan_file(state: ShardedState) -> tuple[list, list[Region], list[dict], int]:
    """Rank r's file: its safetensors entries, the regions they hold, one record per piece
    (tensor, key, first element, byte offset in the file), and the file's size."""
    pieces = [g for g in state.regions if g.save]
    keys = [g.name for g in pieces]
    if len(set(keys)) != len(keys):
        raise CheckpointError(f"rank {state.rank} holds two pieces of one tensor (a layout bug)")
    entries = [(g.name, CODES[state.tensors[g.name][1]], [g.numel],
                g.numel * g.view.element_size()) for g in pieces]
    data_start = 8 + len(safetensors_header(entries))
    records, off = [], data_start
    for g, e in zip(pieces, entries):
        records.append({"tensor": g.name, "file": f"rank{state.rank}.safetensors", "key": g.name,
                        "start": g.start, "numel": g.numel, "offset": off})
        off += e[3]
    return entries, pieces, records, off


def build_metadata(states_info: list[dict], *, step: int | None, block_bytes: int) -> dict:
    """metadata.json from every rank's description (the same code for real saves and for the
    planner's imagined ones)."""
    first = states_info[0]
    tensors = {name: {"shape": list(shape), "dtype": dtype, "pieces": []}
               for name, (shape, dtype) in first["tensors"].items()}
    files = {}
    for info in states_info:
        if info["tensors"] != first["tensors"]:
            raise CheckpointError(f"rank {info['rank']} describes other tensors than rank 0: the "
                                  f"ranks do not hold the same model")
        files[f"rank{info['rank']}.safetensors"] = {"rank": info["rank"], "bytes": info["bytes"]}
        for rec in info["records"]:
            tensors[rec["tensor"]]["pieces"].append({k: v for k, v in rec.items() if k != "tensor"})
    for name, t in tensors.items():              # every element saved exactly once: a self-check
        t["pieces"].sort(key=lambda p: p["start"])
        at = 0
        for p in t["pieces"]:
            if p["start"] != at:
                raise CheckpointError(f"{name}: the pieces leave elements {at}..{p['start']} unsaved "
                                      f"or saved twice (a layout bug)")
            at += p["numel"]
        if at != math.prod(t["shape"]):
            raise CheckpointError(f"{name}: pieces cover {at} of {math.prod(t['shape'])} elements")
    return {"format": FORMAT, "version": VERSION, "step": step, "strategy": first["strategy"],
            "world_size": len(states_info), "model": first["model"], "optimizer": first["optimizer"],
            "block_bytes": block_bytes, "checksum": CHECKSUM, "tensors": tensors, "files": files}


def resolve(path: Path) -> Path:
    """``path``, or — if a save died between its two renames — the previous checkpoint aside."""
    old = path.parent / f".{path.name}.old"
    if not (path / METADATA).exists() and (old / METADATA).exists():
        return old
    return path


def read_metadata(path: str | os.PathLike) -> dict:
    """The checkpoint's metadata.json, after checking that this code can read its format."""
    file = resolve(Path(path)) / METADATA
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file} does not exist: {path} is not a (complete) checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read as JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} metadata file")
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{file} has format version {meta.get('version')!r}; this minishard "
                              f"reads versions {', '.join(map(str, READABLE_VERSIONS))}")
    if meta["version"] == 1:                # SHA-256 under its own name: as version 2 names it
        meta["checksum"] = "sha256"
        for t in meta["tensors"].values():
            for p in t["pieces"]:
                p["checksums"] = p.pop("sha256", None)
    if meta.get("checksum") not in HASHES:
        raise CheckpointError(f"{file}: unknown checksum {meta.get('checksum')!r}; this minishard "
                              f"knows {sorted(HASHES)}")
    return meta
