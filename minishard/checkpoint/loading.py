"""Loading, under any world size and strategy, in two phases: read and verify, then copy.

A rank needs every element its regions hold (:func:`.regions.describe`), wherever the saving
ranks put it: it reads only the checksum blocks that overlap them (:func:`.reads.overlap`, asked
by :func:`.reads.plan_reads`) and verifies them. Only when every rank has read everything it
needs does any rank copy a value into its model — so a load that fails on any rank changes
nothing on any rank.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn as nn

from minishard.core.comm import Comm
from .agreement import agree
from .format import METADATA, CheckpointError, dtype_name, read_metadata, resolve
from .reads import overlap, plan_reads, read_verified
from .regions import Region, ShardedState, describe


def load(model: nn.Module, optimizer, path: str | os.PathLike, *, comm: Comm | None = None) -> dict:
    """Load a checkpoint saved by any number of ranks under any strategy into this rank's part
    of ``model`` and ``optimizer`` (None: weights only). A collective. Each rank reads only the
    blocks that overlap what it holds, verifies them, and — once every rank has succeeded —
    copies them in; on any failure nothing is changed on any rank. Returns the saved step, the
    bytes this rank read, the seconds, and the reads. ``comm``: the ranks loading together
    (default: the default process group)."""
    t0 = time.perf_counter()
    comm = Comm() if comm is None else comm
    error, staged, reads, targets = None, [], [], []
    try:                                              # 1. read and verify all, change nothing yet
        root = resolve(Path(path))
        meta = read_metadata(root)
        state = describe(model, optimizer, comm)
        _check_compatible(meta, state, root, optimizer is not None)
        targets = [g for g in state.regions if g.load and (optimizer is not None or g.name.startswith("param/"))]
        reads = plan_reads(meta, [(g.name, g.start, g.numel) for g in targets])
        staged = list(read_verified(root, meta, reads))
    except (CheckpointError, OSError) as e:
        error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    agree(comm, error)                                # 2. every rank succeeded: commit
    _copy_in(targets, staged)
    opt = meta.get("optimizer")
    if optimizer is not None and opt:
        _restore_optimizer(state.optimizer, opt)
        outer = getattr(optimizer, "param_groups", None)   # e.g. ZeroOptimizer's, which a
        if outer is not None and outer is not state.optimizer.param_groups:   # scheduler drives
            _restore_hyperparameters(outer, opt)
    return {"step": meta["step"], "rank": comm.rank, "bytes_read": sum(r.nbytes for r in reads),
            "seconds": time.perf_counter() - t0, "reads": reads, "saved_world_size": meta["world_size"],
            "saved_strategy": meta["strategy"]}


@torch.no_grad()
def _copy_in(targets: list[Region], staged: list) -> None:
    """Copy the verified values into the live views: of each read, what :func:`.reads.overlap`
    says each region needs."""
    by_tensor: dict[str, list] = {}
    for rd, v in staged:
        by_tensor.setdefault(rd.tensor, []).append((rd, v))
    for g in targets:
        for rd, v in by_tensor.get(g.name, []):
            both = overlap((g.start, g.start + g.numel), (rd.start, rd.start + rd.numel))
            if both is not None:
                a, b = both
                g.view[a - g.start:b - g.start].copy_(v[a - rd.start:b - rd.start])


def _check_compatible(meta: dict, state: ShardedState, root: Path, with_optimizer: bool) -> None:
    """Names, shapes, dtypes and optimizer state kinds must match; world size and strategy need
    not (that is what resharding is for)."""
    file = root / METADATA
    saved = meta["tensors"]
    ours = {n for n in state.tensors if n.startswith("param/")}
    theirs = {n for n in saved if n.startswith("param/")}
    for missing, where in ((ours - theirs, "the checkpoint lacks"), (theirs - ours, "the model lacks")):
        if missing:
            names = sorted(n.split("/", 1)[1] for n in missing)
            raise CheckpointError(f"{file}: parameter names do not match — {where} "
                                  f"{names[:4]}{' ...' if len(names) > 4 else ''}")
    if with_optimizer:
        opt = meta.get("optimizer") or {}
        ours_s = {n for n in state.tensors if not n.startswith("param/")}
        theirs_s = {n for n in saved if not n.startswith("param/")}
        cls = type(state.optimizer).__name__
        if opt.get("class") not in (None, cls) or ours_s != theirs_s:
            diff = sorted(ours_s ^ theirs_s)
            raise CheckpointError(f"{file}: optimizer state saved by {opt.get('class')} does not fit "
                                  f"this {cls} (e.g. {diff[:2]}); pass optimizer=None to load the "
                                  f"weights only")
    for name, (shape, dtype) in state.tensors.items():
        if name not in saved:
            continue
        if list(shape) != saved[name]["shape"]:
            raise CheckpointError(f"{file}: {name.split('/', 1)[1]} has shape {list(shape)} in the "
                                  f"model, {saved[name]['shape']} in the checkpoint ({name})")
        if dtype_name(dtype) != saved[name]["dtype"]:
            raise CheckpointError(f"{file}: dtype mismatch for {name}: saved as {saved[name]['dtype']}, "
                                  f"the model holds {dtype_name(dtype)}")


def _restore_optimizer(inner: torch.optim.Optimizer, saved: dict) -> None:
    """The global step count and the hyperparameters (a schedule may have changed the lr)."""
    if saved["step"] is not None:
        for st in inner.state.values():
            if "step" in st:
                st["step"].fill_(saved["step"])
    _restore_hyperparameters(inner.param_groups, saved)


def _restore_hyperparameters(groups: list[dict], saved: dict) -> None:
    if len(saved["param_groups"]) == len(groups):
        for group, values in zip(groups, saved["param_groups"]):
            for k, v in values.items():
                if k in group:
                    group[k] = tuple(v) if isinstance(v, list) else v
