"""Chapter 09 (checkpoints): rank tasks that load a checkpoint under another layout and compare
what each rank then holds with the file, element by element; and §8's: the stall of a
synchronous, a background and DCP's asynchronous save side by side, a rank killed while its
background save writes, and the memory a full-state save takes on rank 0 beside a sharded one;
§9's: DeepSpeed's ZeRO-3 checkpoint and DCP's of the same model, side by side."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

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


# ====================================================================== §8: saving without stopping

SAVES = ("synchronous", "background", "DCP async_save")


def _burst(held: tuple) -> None:
    """A fixed piece of compute (~20 ms of one core here) standing in for the next training steps."""
    x, out = held
    for _ in range(12):
        torch.mm(x, x, out=out)


def _save_calls(ms, tf, comm: Comm, dcp_group, here: Path) -> dict:
    """Each save as the training step calls it (what the step waits for): minishard's over its
    FSDP model, DCP's ``async_save`` over the same model under PyTorch's FSDP2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from minishard import checkpoint

    def dcp_state():
        msd, osd = get_state_dict(tf.model, tf.optimizer)
        return {"model": msd, "optim": osd}

    return {"synchronous": lambda: checkpoint.save(ms.model, ms.optimizer, here / "synchronous",
                                                   comm=comm, step=1),
            "background": lambda: checkpoint.save(ms.model, ms.optimizer, here / "background",
                                                  comm=comm, step=1, background=True),
            "DCP async_save": lambda: dcp.async_save(dcp_state(), checkpoint_id=str(here / "dcp_async"),
                                                     process_group=dcp_group)}


def time_saves(calls: dict, order, burst) -> dict[str, dict[str, float]]:
    """Each save of ``calls`` (name -> the call the training step makes) in ``order``, with
    ``burst()`` — a fixed piece of compute standing in for training — run beside its write until
    it is on disk. Per save: the **stall** (the call until it returns: the step is blocked), the
    **slowed** time (how much longer the bursts beside the write took than alone), **visible** =
    the two, and **written** (the call until the checkpoint is on disk). The benchmark
    (``benchmarks/bench_checkpoint.py --what stall``) times its contenders with this too."""
    import torch.distributed as dist
    alone = []
    for _ in range(3):                          # every rank computing, nothing being written
        t = time.perf_counter()
        burst()
        alone.append(time.perf_counter() - t)
    one, out = sorted(alone)[1], {}
    for name in order:
        dist.barrier()
        t0 = time.perf_counter()
        handle = calls[name]()
        t1 = time.perf_counter()
        bursts = 0
        while callable(getattr(handle, "done", None)) and not handle.done():
            burst()                             # training goes on beside the write
            bursts += 1
        t2 = time.perf_counter()
        for finish in ("wait", "result"):       # PendingSave.wait, Future.result
            if callable(getattr(handle, finish, None)):
                getattr(handle, finish)()
        slowed = max(0.0, (t2 - t1) - bursts * one)
        out[name] = {"stall": t1 - t0, "slowed": slowed, "visible": t1 - t0 + slowed,
                     "written": time.perf_counter() - t0}
    return out


def save_stalls(rank, root: str, rounds: int = 3, *, model: str = "tiny") -> dict:
    """Rank task: the tiny GPT under minishard's FSDP and under PyTorch's FSDP2, each with its
    AdamW state; one round unrecorded (the first background save makes its group, the first
    ``async_save`` imports its executor), then ``rounds`` rounds of the three saves. DCP's thread
    gets a gloo group of its own, as minishard's background save has (``Comm.companion``).
    Returns this rank's rounds and what its saves hold; the last round's directories stay in
    ``root/round{rounds - 1}``."""
    import shutil

    import torch.distributed as dist

    from minishard.core.model import GPT, config
    from minishard.strategies.registry import build
    from minishard.training.config import TrainConfig
    comm = Comm(rank.tracer)
    ms = build(GPT(config(model), seed=0), TrainConfig("fsdp", model=model), comm)
    tf = build(GPT(config(model), seed=0), TrainConfig("torch_fsdp", model=model), comm)
    dcp_group = dist.new_group(backend="gloo")
    burst = (torch.randn(384, 384, generator=torch.Generator().manual_seed(0)), torch.empty(384, 384))
    rows = []
    for k in range(-1, rounds):
        here = Path(root) / f"round{k}"
        order = SAVES[k % 3:] + SAVES[:k % 3]           # the order rotates round by round
        rows.append(time_saves(_save_calls(ms, tf, comm, dcp_group, here), order, lambda: _burst(burst)))
        dist.barrier()
        if comm.rank == 0 and k < rounds - 1:
            shutil.rmtree(here)
    held = sum(g.numel * g.view.element_size() for g in describe(ms.model, ms.optimizer, comm).regions)
    return {"rank": comm.rank, "rounds": rows[1:], "held_bytes": held,
            "last": str(Path(root) / f"round{rounds - 1}")}


def median_round(results: list[dict], name: str) -> dict[str, float]:
    """Save ``name``'s measures in its median round, as the slowest rank (the largest visible
    cost) measured them: one rank's one round, so that its stall + slowed is its visible (a
    median taken column by column would not add up)."""
    rows = [max((r["rounds"][k][name] for r in results), key=lambda m: m["visible"])
            for k in range(len(results[0]["rounds"]))]
    return sorted(rows, key=lambda m: m["visible"])[len(rows) // 2]


# ====================================================================== §8: killed while writing

def killed_mid_write(rank, path: str, die_rank: int = 1, *, model: str = "tiny") -> None:
    """Rank task, for a pool of its own (a rank dies): train 2 steps on FSDP, saving in the
    background after each; resume and train on, saving the same way — and inside the first of
    those background writes, rank ``die_rank`` writes the first 1,000 bytes of its file, fsyncs
    them and SIGKILLs itself while the other ranks train on: a node lost in the middle of a
    checkpoint nobody waited for."""
    import signal

    from minishard import checkpoint
    from minishard.training.config import TrainConfig
    from minishard.training.loop import train
    kw = dict(strategy="fsdp", model=model, micro_batch=2, track_activations=False, save_every=1,
              save_background=True)
    train(rank, TrainConfig(steps=2, save_to=path, **kw))
    real_write = checkpoint.saving.write_safetensors

    def dying_write(file, entries, tensors, *args):
        if rank.rank == die_rank:
            with open(file, "wb") as f:
                f.write(b"\0" * 1000)           # a partial file, on disk ...
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)    # ... and the process is gone
        return real_write(file, entries, tensors, *args)

    checkpoint.saving.write_safetensors = dying_write
    try:
        train(rank, TrainConfig(steps=3, resume_from=path, save_to=path, **kw))
    finally:
        checkpoint.saving.write_safetensors = real_write


# ====================================================================== §8: the full state on rank 0

def full_state_on_rank0(model: nn.Module, optimizer, comm: Comm) -> tuple[dict, dict]:
    """Every tensor of the training state assembled whole on rank 0 — what a "full state dict"
    save does before it writes: rank 0 allocates each tensor and receives every other rank's
    pieces of it straight into place (a replica's pieces once, as the sharded save writes them).
    Returns rank 0's tensors (``{}`` elsewhere) and the bytes this rank allocated for it,
    counted tensor by tensor as they are made: ``peak`` (the most held at once) and ``sent``."""
    import math

    import torch.distributed as dist

    from minishard.core.ledger import storage_nbytes
    state = describe(model, optimizer, comm)
    mine = {(g.name, g.start): g.view for g in state.regions if g.save}
    table = comm.all_gather_object(sorted((n, s, v.numel()) for (n, s), v in mine.items()))
    full, held, peak, sent = {}, 0, 0, 0
    for name, (shape, dtype) in sorted(state.tensors.items()):
        if comm.rank == 0:
            full[name] = torch.empty(math.prod(shape), dtype=dtype)
            held += storage_nbytes(full[name])
            peak = max(peak, held)
        for src, pieces in enumerate(table):
            for start, numel in ((s, n) for t, s, n in pieces if t == name):
                if src == comm.rank == 0:
                    full[name][start:start + numel].copy_(mine[(name, start)])
                elif comm.rank == 0:
                    dist.recv(full[name][start:start + numel], src=src, group=comm.group)
                elif src == comm.rank:
                    view = mine[(name, start)]
                    piece = view.contiguous()       # a copy only if the view is not contiguous
                    if piece.data_ptr() != view.data_ptr():
                        peak = max(peak, storage_nbytes(piece))
                    dist.send(piece, dst=0, group=comm.group)
                    sent += numel * view.element_size()
    return full, {"peak": peak, "sent": sent}


def save_peaks(rank, root: str, *, model: str = "tiny") -> dict:
    """Rank task: one FSDP training step of ``model`` (so the moments exist), then three ways to
    save the same state — sharded (``checkpoint.save``), sharded in the background, and the full
    state gathered on rank 0 — each with the bytes of the tensors this rank allocates for it,
    measured as they are made. Rank 0 checks that the gathered state is the sharded
    checkpoint's, element for element."""
    from minishard import checkpoint
    from minishard.core.model import GPT, batch, config
    from minishard.strategies.registry import build
    from minishard.training.config import TrainConfig
    from minishard.training.step import train_step
    comm, cfg = Comm(rank.tracer), config(model)
    built = build(GPT(cfg, seed=0), TrainConfig("fsdp", model=model), comm)
    train_step(built, [batch(cfg, 0, 2, comm.rank, comm.world_size)])
    net, opt = built.model, built.optimizer
    held = sum(g.numel * g.view.element_size() for g in describe(net, opt, comm).regions)
    out = {"rank": comm.rank, "held": held}
    out["sharded"] = checkpoint.save(net, opt, Path(root) / "sharded", comm=comm, step=1)["host_copy_bytes"]
    pending = checkpoint.save(net, opt, Path(root) / "background", comm=comm, step=1, background=True)
    out["background"] = pending.wait()["host_copy_bytes"]
    full, measured = full_state_on_rank0(net, opt, comm)
    out["full"], out["sent"] = measured["peak"], measured["sent"]
    if comm.rank == 0:
        saved = checkpoint.read_full(Path(root) / "sharded")
        out["full_equals_checkpoint"] = (sorted(saved) == sorted(full) and
                                         all(torch.equal(full[n], saved[n].reshape(-1)) for n in full))
    return out


# ====================================================================== §9: DeepSpeed's checkpoints

@contextlib.contextmanager
def _quiet():
    """This rank's output silenced at the file descriptors: DeepSpeed's start-up lines (its
    accelerator guess, its communication op) and the deprecation warnings its collectives raise
    in torch would fill the notebook's cell. An error still reaches the caller (the pool reports
    it, traceback and all)."""
    import sys
    import warnings
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        os.close(null)


def deepspeed_and_dcp(rank, root: str, *, model: str = "tiny", steps: int = 2, global_batch: int = 12) -> dict:
    """Rank task: DeepSpeed's engine trains ``model`` at ZeRO-3 for ``steps`` steps, saves with
    ``engine.save_checkpoint(root/deepspeed)`` and trains one step more (the loss any resume must
    continue with); the same model under PyTorch's FSDP2 trains as many steps and saves its
    state with DCP (``root/dcp``). ZeRO-3's bounds at their smallest, so that the parameters are
    partitioned and gathered (DeepSpeed's defaults keep a small model whole). Returns this rank's
    losses: DeepSpeed's, and its next step's."""
    with _quiet():
        return _deepspeed_and_dcp(rank, Path(root), model, steps, global_batch)


def _deepspeed_and_dcp(rank, root: Path, model: str, steps: int, global_batch: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from minishard.core.model import GPT, batch, config
    from minishard.strategies.registry import build
    from minishard.training.config import TrainConfig
    from minishard.training.step import train_step
    comm, cfg = Comm(rank.tracer), config(model)
    mb = global_batch // comm.world_size
    batches = [[batch(cfg, s, mb, comm.rank, comm.world_size)] for s in range(steps + 1)]
    ds = build(GPT(cfg, seed=0), TrainConfig("deepspeed_zero3", model=model, micro_batch=mb, max_live_parameters=0,
                                             prefetch_bucket_size=0, param_persistence_threshold=0), comm)
    losses = [train_step(ds, b) for b in batches[:steps]]
    ds.engine.save_checkpoint(str(root / "deepspeed"))
    after = train_step(ds, batches[steps])
    ds.engine.destroy()
    tf = build(GPT(cfg, seed=0), TrainConfig("torch_fsdp", model=model, micro_batch=mb), comm)
    for b in batches[:steps]:
        train_step(tf, b)
    msd, osd = get_state_dict(tf.model, tf.optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / "dcp"))
    return {"rank": comm.rank, "losses": losses, "next_loss": after}
