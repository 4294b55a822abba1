"""Saving: every rank writes the part it holds, all ranks in parallel, and the result is atomic.

A sharded run has no rank that holds the whole training state, so the state is saved the way
it is held (:func:`.regions.describe`). The ranks write into a sibling temporary directory;
files and directories are fsync'd; only then is it renamed into place (an existing checkpoint
is renamed aside first and deleted last). A save killed at any point leaves the previous
checkpoint loadable. Every step ends with the ranks agreeing: if any rank failed, every rank
raises the same error.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn as nn

from ..comm import Comm
from .format import (BLOCK_BYTES, METADATA, CheckpointError, build_metadata, dtype_name, file_layout,
                     fsync_dir, raise_if_any, write_safetensors)
from .regions import describe


def save(model: nn.Module, optimizer, path: str | os.PathLike, *, comm: Comm, step: int,
         block_bytes: int = BLOCK_BYTES) -> dict:
    """Every rank writes its pieces to ``path/rank{r}.safetensors``, rank 0 the metadata; the
    directory appears at ``path`` atomically (see the module docstring). A collective: every
    rank calls it, and every rank raises the same error if any rank fails. Returns this rank's
    numbers: bytes written, seconds, and (on rank 0) the metadata."""
    t0 = time.perf_counter()
    path = Path(path)
    tmp = path.parent / f".{path.name}.saving"
    file = tmp / f"rank{comm.rank}.safetensors"

    # 1. what this rank holds and where each piece will sit in its file; rank 0 checks the target
    entries, pieces, size, infos = _describe_everywhere(model, optimizer, comm)
    error = _on_rank0(comm, lambda: _prepare_target(path, tmp, sum(i["bytes"] for i in infos)))
    raise_if_any(comm.all_gather_object(error))     # (also: nobody writes before tmp exists)

    # 2. every rank writes its own file, in parallel; checksums per block go to the metadata
    t1 = time.perf_counter()
    error, hashes = _write_own_file(file, entries, pieces, size, block_bytes)
    write_s = time.perf_counter() - t1
    results = comm.all_gather_object((error, hashes))
    _clean_up_if_any(comm, tmp, [e for e, _ in results])
    for i, (_, hs) in zip(infos, results):
        for rec, h in zip(i["records"], hs):
            rec["sha256"] = h

    # 3. rank 0: the metadata last (its presence marks a complete checkpoint), then the renames
    meta = build_metadata(infos, step=step, block_bytes=block_bytes) if comm.rank == 0 else None
    error = _on_rank0(comm, lambda: _commit(meta, tmp, path))
    _clean_up_if_any(comm, tmp, comm.all_gather_object(error))
    return {"path": str(path), "step": step, "rank": comm.rank, "bytes_written": size,
            "seconds": time.perf_counter() - t0, "write_seconds": write_s, "metadata": meta}


def _describe_everywhere(model: nn.Module, optimizer, comm: Comm) -> tuple[list, list, int, list[dict]]:
    """This rank's file (entries, pieces, size) and every rank's description of its file, the
    ranks agreeing on one optimizer step."""
    error, info, entries, pieces, size = None, None, None, None, None
    try:
        state = describe(model, optimizer, comm)
        entries, pieces, records, size = file_layout(state)
        info = {"rank": comm.rank, "bytes": size, "records": records, "strategy": state.strategy,
                "model": state.model_config, "optimizer": _optimizer_info(state.optimizer),
                "tensors": {n: (list(s), dtype_name(d)) for n, (s, d) in state.tensors.items()}}
    except CheckpointError as e:
        error = str(e)
    infos = comm.all_gather_object((error, info))
    raise_if_any([e for e, _ in infos])
    infos = [i for _, i in infos]
    steps = {i["optimizer"]["step"] for i in infos if i["optimizer"]} - {None}
    if len(steps) > 1:
        raise CheckpointError(f"ranks disagree on the optimizer step: {sorted(steps)}")
    if infos[0]["optimizer"]:
        infos[0]["optimizer"]["step"] = steps.pop() if steps else None
    return entries, pieces, size, infos


def _optimizer_info(inner) -> dict | None:
    """What metadata.json keeps of the optimizer: its class, the one global step, the groups'
    hyperparameters."""
    if inner is None:
        return None
    steps = {float(st["step"]) for st in inner.state.values() if "step" in st}
    if len(steps) > 1:
        raise CheckpointError(f"parameters have taken different numbers of optimizer steps "
                              f"{sorted(steps)}: this format keeps one global step")

    def plain(v):
        return float(v) if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v

    groups = [{k: plain(v) for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return {"class": type(inner).__name__, "step": steps.pop() if steps else None,
            "param_groups": groups}


def _write_own_file(file: Path, entries: list, pieces: list, size: int,
                    block_bytes: int) -> tuple[str | None, list]:
    """This rank's file, with a SHA-256 per block of each piece; a failure becomes a message."""
    try:
        written, hashes = write_safetensors(file, entries, (g.view for g in pieces), block_bytes)
        if written != size:
            raise OSError(f"wrote {written} bytes, expected {size}")
        return None, hashes
    except OSError as e:
        what = f"pieces of {pieces[0].name} ..." if pieces else "no pieces"
        return f"cannot write {file} ({what}): {type(e).__name__}: {e}", []


def _clean_up_if_any(comm: Comm, tmp: Path, errors: list) -> None:
    """If any rank failed, rank 0 removes the half-written checkpoint and every rank raises."""
    if any(errors) and comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise_if_any(errors)


def _on_rank0(comm: Comm, fn) -> str | None:
    """Run ``fn`` on rank 0 only; its failure becomes a message every rank will raise."""
    if comm.rank != 0:
        return None
    try:
        return fn()
    except (OSError, CheckpointError) as e:
        return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _prepare_target(path: Path, tmp: Path, nbytes: int) -> None:
    """Checks before any byte is written: the parent exists or can be made, ``path`` is ours to
    replace, the disk has room; leftovers of an interrupted save are cleaned up."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint directory {path.parent}: {e}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"the checkpoint directory {path.parent} is not writable")
    old = path.parent / f".{path.name}.old"
    if not path.exists() and (old / METADATA).exists():
        os.rename(old, path)             # a save died between its two renames: put it back
    if path.exists() and not (path.is_dir() and (path / METADATA).exists()):
        raise CheckpointError(f"{path} exists and is not a minishard checkpoint; not replacing it")
    free = shutil.disk_usage(path.parent).free
    if nbytes > free:
        raise CheckpointError(f"the checkpoint directory {path.parent} has {free / 2**20:.1f} MiB "
                              f"free; the checkpoint needs {nbytes / 2**20:.1f} MiB")
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)          # an interrupted save's half-written files
    tmp.mkdir()


def _commit(meta: dict, tmp: Path, path: Path) -> None:
    """The metadata, fsync'd, then the new checkpoint renamed into place."""
    with open(tmp / METADATA, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    _swap_in(tmp, path)


def _swap_in(tmp: Path, path: Path) -> None:
    """Rename the complete new checkpoint into place. The old one is renamed aside first and
    deleted last, so at every instant a complete checkpoint exists under ``path`` or aside."""
    old = path.parent / f".{path.name}.old"
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
