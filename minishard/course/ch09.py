"""Chapter 09 (checkpoints): rank tasks that load a checkpoint under another layout and compare
what each rank then holds with the file, element by element."""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from minishard.checkpoint import describe, load, read_full
from minishard.core.comm import Comm


def compare(model: nn.Module, optimizer, path: str | os.PathLike, *, comm: Comm) -> dict:
    """What this rank holds against the checkpoint's values, bit for bit: the elements (and
    bytes) compared, and the tensors that differ (none: the load was exact). It reads the whole
    checkpoint, so it is a check for tests and the course, not a way to load."""
    full = {n: t.reshape(-1) for n, t in read_full(path).items()}
    compared, nbytes, differ = 0, 0, set()
    for g in describe(model, optimizer, comm).regions:
        if not g.load or (optimizer is None and not g.name.startswith("param/")):
            continue
        want = full[g.name][g.start:g.start + g.numel]
        if not torch.equal(g.view, want.to(g.view.dtype) if g.cast else want):
            differ.add(g.name)
        if not g.cast:
            compared += g.numel
            nbytes += g.numel * g.view.element_size()
    return {"rank": comm.rank, "elements": compared, "bytes": nbytes, "differ": sorted(differ)}


def resume_and_compare(rank, path: str, strategy: str, *, model: str = "tiny", seed: int = 1,
                       **build_options) -> dict:
    """Rank task: build ``model`` with *other* initial weights (``seed``) under ``strategy`` on
    this world size, load the checkpoint, and compare what the rank then holds with it."""
    from minishard.training.config import TrainConfig
    from minishard.core.model import GPT, config
    from minishard.strategies.registry import build
    comm = Comm(rank.tracer)
    built = build(GPT(config(model), seed=seed), TrainConfig(strategy, model=model, **build_options), comm)
    net, opt = built.model, built.optimizer
    info = load(net, opt, path, comm=comm)
    return {**compare(net, opt, path, comm=comm), "strategy": strategy,
            "bytes_read": info["bytes_read"], "seconds": info["seconds"], "step": info["step"]}
