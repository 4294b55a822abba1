"""Saving: every rank writes the part it holds, all ranks in parallel, and the result is atomic.

A sharded run has no rank that holds the whole training state, so the state is saved the way
it is held (:func:`.regions.describe`). Each rank checks the target and writes its file into a
sibling temporary directory on its own — no communication before the bytes are on disk — and
fsyncs it; then the ranks exchange their descriptions and checksums once, rank 0 writes the
metadata, fsyncs it and the directory, and renames the directory into place (an existing
checkpoint is renamed aside first and deleted last); a last agreement tells every rank how that
went. A save killed at any point leaves the previous checkpoint loadable; if any rank failed,
every rank raises the same error and the half-written directory is removed.

In the background (``save(..., background=True)``) the protocol is the same, cut in two: what a
rank holds is described, the target checked and the pieces copied to host memory before ``save``
returns; the file, the exchange and the commit follow in a thread (:mod:`.background`). A crash
while it writes is a crash inside a save: the previous checkpoint stays.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from minishard.core.comm import Comm
from .agreement import agree, raise_if_any
from .background import PendingSave, wait_for_saves
from .format import (BLOCK_BYTES, CHECKSUM, HASHES, METADATA, CheckpointError, build_metadata,
                     dtype_name, fsync_dir, plan_file, tensor_bytes, write_safetensors)
from .regions import ShardedState, describe


def save(model: nn.Module, optimizer, path: str | os.PathLike, *, comm: Comm | None = None,
         step: int, block_bytes: int = BLOCK_BYTES, background: bool = False) -> dict | PendingSave:
    """Every rank writes its pieces to ``path/rank{r}.safetensors``, rank 0 the metadata; the
    directory appears at ``path`` atomically (see the module docstring). A collective over
    ``comm`` (default: the default process group): every rank calls it, and every rank raises
    the same error if any rank fails. Returns this rank's numbers: bytes written, seconds, and
    (on rank 0) the metadata.

    ``background=True`` (what DCP's ``async_save`` does): the pieces this rank writes are copied
    to host memory, and the save returns a :class:`PendingSave` while a thread of its own writes
    them, exchanges and commits; training may change every tensor meanwhile. Its ``wait()``
    returns the same numbers, or raises the same error on every rank. A save — either kind —
    first waits for the one in flight over ``comm`` (and raises its error, if it failed); so does
    :func:`wait_for_saves`, which a run calls before it ends. A background save needs
    ``comm``: the communicator keeps the save in flight and the group it writes with."""
    t0 = time.perf_counter()
    comm_given, comm = comm, Comm() if comm is None else comm
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 8 or block_bytes % 8:
        raise ValueError(f"block_bytes must be a positive multiple of 8 (whole elements of every "
                         f"dtype in one checksum block), got {block_bytes!r}")
    if not isinstance(background, bool):
        raise TypeError(f"background must be True or False, got {background!r}")
    if background and comm_given is None:
        raise ValueError("save(..., background=True) needs comm=: the run's communicator keeps "
                         "the save in flight (the next save waits for it) and the process group "
                         "it writes with; pass the Comm the model was wrapped with")
    wait_for_saves(comm)                      # one save at a time, in the order they were asked
    path = Path(path)
    tmp = path.parent / f".{path.name}.saving"
    tracer = comm.tracer
    if not background:
        with _phase(tracer, "checkpoint_write"):
            own = _own_part(model, optimizer, comm, path, tmp, host_copy=False)
            out = _write_and_commit(comm, own, path, tmp, step, block_bytes, t0)
        return {**out, "stall_seconds": out["seconds"]}
    saver = comm.companion("checkpoint")      # (a collective: before any rank can fail alone)
    with _phase(tracer, "checkpoint_copy"):
        own = _own_part(model, optimizer, comm, path, tmp, host_copy=True)
    return PendingSave(lambda: _write_and_commit(saver, own, path, tmp, step, block_bytes, t0),
                       comm, own.host_bytes, time.perf_counter() - t0)


@dataclass
class _OwnPart:
    """What one rank writes, decided before any byte is: its description for the exchange, its
    file's entries and the tensors they come from (the live views, or their host copies), or the
    error that stopped it."""
    error: str | None = None
    info: dict | None = None
    entries: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    first: str = "no pieces"                  # the file's first piece, to name it in an error
    size: int = 0
    host_bytes: int = 0


def _own_part(model: nn.Module, optimizer, comm: Comm, path: Path, tmp: Path, *,
              host_copy: bool) -> _OwnPart:
    """On its own, every rank: what it holds, where each piece sits in its file, the target
    checked (before any byte is written); with ``host_copy``, a copy of each piece it writes in
    host memory, so that training can change the live tensors while the copies are written."""
    own = _OwnPart()
    try:
        state = describe(model, optimizer, comm)
        own.entries, pieces, records, own.size = plan_file(state)
        own.info = {"rank": comm.rank, "bytes": own.size, "records": records, "strategy": state.strategy,
                    "model": state.model_config, "optimizer": _optimizer_info(state),
                    "tensors": {n: (list(s), dtype_name(d)) for n, (s, d) in state.tensors.items()},
                    "replicas": _replica_checksums(state)}
        _check_target(path, tmp, _checkpoint_bytes(state))
        own.first = f"pieces of {pieces[0].name} ..." if pieces else "no pieces"
        own.tensors = [g.view for g in pieces]
        if host_copy:
            own.tensors = _to_host(pieces)
            own.host_bytes = sum(t.numel() * t.element_size() for t in own.tensors)
    except CheckpointError as e:
        own.error = str(e)
    return own


def _to_host(pieces: list) -> list[torch.Tensor]:
    """A copy of every piece in host memory, sharing nothing with the live tensors. Refused as a
    CheckpointError (every rank then raises it) if the host cannot hold it."""
    try:
        with torch.no_grad():
            return [g.view.detach().to("cpu", copy=True) for g in pieces]
    except (RuntimeError, MemoryError) as e:
        nbytes = sum(g.numel * g.view.element_size() for g in pieces)
        raise CheckpointError(f"cannot copy this rank's {nbytes / 2**20:.1f} MiB of pieces to host "
                              f"memory for a background save: {type(e).__name__}: {e}; save without "
                              f"background=True") from None


def _write_and_commit(comm: Comm, own: _OwnPart, path: Path, tmp: Path, step: int,
                      block_bytes: int, t0: float) -> dict:
    """The rest of the protocol: this rank's file written with a checksum per block, one
    exchange, rank 0's metadata and renames, a last agreement. In the background ``comm`` is the
    save's own group (``Comm.companion("checkpoint")``)."""
    error, sums, write_s = own.error, [], 0.0
    if error is None:
        try:
            t1 = time.perf_counter()
            sums = _write_own_file(tmp / f"rank{comm.rank}.safetensors", own, block_bytes)
            write_s = time.perf_counter() - t1
            own.tensors = []                  # a host copy is not needed past its file
        except CheckpointError as e:
            error = str(e)

    # one exchange: every rank's description and checksums, or its error
    results = comm.all_gather_object((error, own.info, sums))
    _clean_up_if_any(comm, tmp, [e for e, _, _ in results])

    # rank 0: the metadata last (its presence marks a complete checkpoint), then the renames;
    # every rank learns how that went
    meta, error = None, None
    if comm.rank == 0:
        try:
            meta = build_metadata(_one_step(results), step=step, block_bytes=block_bytes)
            _commit(meta, tmp, path)
        except (OSError, CheckpointError) as e:
            error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    _clean_up_if_any(comm, tmp, [error], agreed=False)
    return {"path": str(path), "step": step, "rank": comm.rank, "bytes_written": own.size,
            "seconds": time.perf_counter() - t0, "write_seconds": write_s, "metadata": meta,
            "host_copy_bytes": own.host_bytes}


def _checkpoint_bytes(state: ShardedState) -> int:
    """The tensor data of the whole checkpoint (every element saved once), from the global
    shapes alone: what the disk must hold, known to every rank without asking the others."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in state.tensors.values())


def _replica_checksums(state: ShardedState) -> dict[str, str]:
    """A checksum of every whole parameter this rank holds as a replica, to check that the ranks
    hold the same one (each writes only its chunk of it)."""
    return {g.name: HASHES[CHECKSUM](tensor_bytes(g.view)) for g in state.regions
            if g.replica and g.name.startswith("param/") and g.view.device.type != "meta"}


def _same_replicas(infos: list[dict]) -> None:
    """Every rank holds the same value of every replicated parameter — else rank r's chunk of
    each would be saved from N different models."""
    first = infos[0]["replicas"]
    for info in infos[1:]:
        for name, h in info["replicas"].items():
            if first.get(name, h) != h:
                raise CheckpointError(
                    f"{name.split('/', 1)[1]} differs between rank 0 and rank {info['rank']}, but "
                    f"the model holds it whole on every rank (a replica): the ranks trained "
                    f"different models. Wrap the model (DDP, ZeroOptimizer, fully_shard) so that "
                    f"the ranks stay equal, or save from one rank with comm=Comm(alone=True)")


def _one_step(results: list) -> list[dict]:
    """The ranks' descriptions, after checking that they hold the same replicas and took the
    same number of optimizer steps (the format keeps one)."""
    infos = []
    for _, info, sums in results:
        for rec, h in zip(info["records"], sums):
            rec["checksums"] = h
        infos.append(info)
    _same_replicas(infos)
    steps = {i["optimizer"]["step"] for i in infos if i["optimizer"]} - {None}
    if len(steps) > 1:
        raise CheckpointError(f"ranks disagree on the optimizer step: {sorted(steps)}")
    if infos[0]["optimizer"]:
        infos[0]["optimizer"]["step"] = steps.pop() if steps else None
    return infos


def _optimizer_info(state: ShardedState) -> dict | None:
    """What metadata.json keeps of the optimizer: its class, the one global step, the groups'
    hyperparameters as the user's optimizer holds them (a scheduler sets them there; a wrapper's
    inner optimizer sees them only at its next step)."""
    inner = state.optimizer
    if inner is None:
        return None
    steps = {float(st["step"]) for st in inner.state.values() if "step" in st}
    if len(steps) > 1:
        raise CheckpointError(f"parameters have taken different numbers of optimizer steps "
                              f"{sorted(steps)}: this format keeps one global step")

    def plain(v):
        return float(v) if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v

    groups = [{k: plain(v) for k, v in g.items() if k not in ("params", "param_names")}
              for g in state.param_groups]
    return {"class": type(inner).__name__, "step": steps.pop() if steps else None,
            "param_groups": groups}


def _write_own_file(file: Path, own: _OwnPart, block_bytes: int) -> list:
    """This rank's file, with a checksum per block of each piece; a failure names the file."""
    try:
        written, sums = write_safetensors(file, own.entries, iter(own.tensors), block_bytes)
        if written != own.size:
            raise OSError(f"wrote {written} bytes, expected {own.size}")
        return sums
    except OSError as e:
        raise CheckpointError(f"cannot write {file} ({own.first}): {type(e).__name__}: {e}") from None


def _clean_up_if_any(comm: Comm, tmp: Path, errors: list, agreed: bool = True) -> None:
    """If any rank failed, rank 0 removes the half-written checkpoint and every rank raises the
    same error — after the removal, so that a rank's next save cannot make the directory anew
    only to have it removed under its write. ``agreed=False``: ``errors`` is this rank's own;
    the ranks agree first."""
    try:
        raise_if_any(errors) if agreed else agree(comm, errors[0])
    except CheckpointError:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()                        # every rank is here: the error is agreed
        raise


def _check_target(path: Path, tmp: Path, nbytes: int) -> None:
    """Checks before any byte is written — the parent exists or can be made, ``path`` is ours to
    replace, the disk has room — and the temporary directory made. Every rank checks for itself
    (they see the same directory), so that none waits for another before writing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint directory {path.parent}: {e}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"the checkpoint directory {path.parent} is not writable")
    if path.exists() and not (path.is_dir() and (path / METADATA).exists()):
        raise CheckpointError(f"{path} exists and is not a minishard checkpoint; not replacing it")
    free = shutil.disk_usage(path.parent).free
    if nbytes > free:
        raise CheckpointError(f"the checkpoint directory {path.parent} has {free / 2**20:.1f} MiB "
                              f"free; the checkpoint needs {nbytes / 2**20:.1f} MiB")
    try:
        tmp.mkdir(exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {tmp}: {e}") from None


def _commit(meta: dict, tmp: Path, path: Path) -> None:
    """The leftovers of an interrupted save removed, every rank's file checked to be there with
    the size it reported (the metadata must never name a file that is not), the metadata written
    and fsync'd, then the new checkpoint renamed into place."""
    for f in tmp.iterdir():
        if f.name not in meta["files"]:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    for name, info in meta["files"].items():
        size = (tmp / name).stat().st_size if (tmp / name).exists() else None
        if size != info["bytes"]:
            raise CheckpointError(f"rank {info['rank']} wrote {info['bytes']:,} bytes to {tmp / name}, "
                                  f"but {'the file is gone' if size is None else f'it holds {size:,}'}: "
                                  f"not committing this checkpoint")
    with open(tmp / METADATA, "w") as f:
        f.write(json.dumps(meta, separators=(",", ":")))     # one line: json's C encoder, 20x faster
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    _swap_in(tmp, path)


def _swap_in(tmp: Path, path: Path) -> None:
    """Rename the complete new checkpoint into place. The old one is renamed aside first and
    deleted last, so at every instant a complete checkpoint exists under ``path`` or aside
    (where :func:`.format.resolve` finds it)."""
    old = path.parent / f".{path.name}.old"
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)   # aside from a save that died after its renames
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _phase(tracer, name: str):
    """The save's stretch of the rank's critical path, as a phase of the trace."""
    return tracer.phase(name) if tracer is not None else contextlib.nullcontext()
