"""``minishard demo``: train under any strategy, with every knob a chapter teaches, and report.

Under torchrun the ranks are the processes torchrun started; without it ``--world-size N``
starts N ranks here. Rank 0 prints a line per step (loss, step time, peak memory) and, at the
end, one row per rank: the ledger by category at the peak, the peak against the formula (and
what the formula leaves out), the bytes sent per step and the time compute waited on
communication. Everything is checked before any rank starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from .. import strategies

if TYPE_CHECKING:
    from ..config import TrainConfig

MiB = 2**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(f"{s.name} ({s.course_name})" for s in strategies.STRATEGIES.values())
    g = p.add_argument_group("what to train")
    g.add_argument("--strategy", default="ddp", metavar="NAME",
                   help=f"ddp, zero1, zero2, zero3 (= fsdp), fsdp, fsdp-flat, hsdp, ... — all: {names}")
    g.add_argument("--model", default="tiny", help="a built-in config: nano, tiny (default), gpt2-small, ...")
    g.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    g.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per forward")
    g.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (chapter 02)")
    g.add_argument("--optimizer", default="adamw", help="adamw, sgd or sgd_momentum")
    g.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    g.add_argument("--precision", default="fp32", help="fp32 or bf16_mixed (chapters 01, 05)")
    g.add_argument("--clip", type=float, default=None, metavar="NORM", help="clip the global gradient norm (chapter 04)")
    g.add_argument("--freeze", action="append", default=[], metavar="PREFIX",
                   help="freeze parameters whose name starts with PREFIX (repeatable; chapter 06)")
    g.add_argument("--seed", type=int, default=0, help="initial weights, the same on every rank")
    g = p.add_argument_group("sharding (chapters 02-07)")
    g.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket size in MiB (DDP, ZeRO-1/2)")
    g.add_argument("--wrap", default="block", help="FSDP units below the root: block, linear or model (chapter 06)")
    g.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="free a unit's gathered parameters after its forward (chapter 06)")
    g.add_argument("--reshard-root", action="store_true", help="free the root too (the textbook ZeRO-3 schedule)")
    g.add_argument("--prefetch", type=int, default=0, metavar="K", help="FSDP units gathered ahead (chapter 07)")
    g.add_argument("--shard-size", type=int, default=2, help="hsdp: ranks per shard group, a node (chapter 10)")
    g = p.add_argument_group("memory (chapters 07, 08, 10)")
    g.add_argument("--offload", choices=("host", "disk"), default=None, help="keep FSDP's sharded state off the device")
    g.add_argument("--offload-dir", default=None, help="where --offload disk keeps its files")
    g.add_argument("--recompute", action="store_true", help="activation recomputation: keep each block's input only")
    g.add_argument("--loss-chunk-tokens", type=int, default=None, metavar="N", help="compute the loss N tokens at a time")
    g.add_argument("--device-budget", type=float, default=None, metavar="MIB",
                   help="a device of this many MiB: an allocation past it raises DeviceOutOfMemory")
    g = p.add_argument_group("checkpoints (chapter 09) and outputs")
    g.add_argument("--save", metavar="DIR", help="save a sharded checkpoint after the last step")
    g.add_argument("--resume", metavar="DIR", help="start from a checkpoint (any world size, any strategy)")
    g.add_argument("--export", metavar="DIR", help="after training, write complete per-layer weight files here")
    g.add_argument("--trace", metavar="DIR", help="write rank*.jsonl (the player's trace) and trace.json (Perfetto)")
    g.add_argument("--world-size", type=int, default=None, help="without torchrun: start this many ranks here")
    g.add_argument("--quiet", action="store_true", help="no per-step lines")
    g.add_argument("--json", action="store_true", help="print the results as JSON (for scripts), not tables")


def config_of(args) -> "TrainConfig":
    """The run's TrainConfig; every bad value is refused here, before any rank starts."""
    from ..config import TrainConfig
    return TrainConfig(
        strategy=args.strategy, steps=args.steps, model=args.model, micro_batch=args.micro_batch,
        accum=args.accum, seed=args.seed, optimizer=args.optimizer, lr=args.lr, precision=args.precision,
        clip=args.clip, freeze=tuple(args.freeze), bucket_cap_mb=args.bucket_cap_mb, wrap=args.wrap,
        reshard_after_forward=args.reshard_after_forward, reshard_root=args.reshard_root,
        prefetch=args.prefetch, shard_size=args.shard_size, recompute=args.recompute,
        loss_chunk_tokens=args.loss_chunk_tokens, offload=args.offload, offload_dir=args.offload_dir,
        device_budget=None if args.device_budget is None else int(args.device_budget * MiB),
        track_activations=True, trace=True, resume_from=args.resume,
        save_to=args.save or (str(Path(args.export) / ".checkpoint") if args.export else None))


def check(args, config, world_size: int) -> None:
    """What TrainConfig cannot know alone: the world size, the checkpoint on disk."""
    from .. import checkpoint
    from ..model import config as model_config
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    strategy = strategies.get(config.strategy)
    if strategy.single_process and world_size > 1:
        raise ValueError(f"strategy {strategy.name!r} trains one process; use --world-size 1")
    if strategy.hybrid and world_size % config.shard_size:
        raise ValueError(f"hsdp: --shard-size {config.shard_size} does not divide the world size "
                         f"{world_size}; use one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    if args.resume:
        if not Path(args.resume).is_dir():
            raise FileNotFoundError(f"--resume {args.resume}: no such checkpoint directory")
        saved = checkpoint.read_metadata(args.resume).get("model")
        want = dataclasses.asdict(model_config(config.model))
        if saved != want:
            raise ValueError(f"--resume {args.resume} holds another model ({_describe(saved)}), not "
                             f"--model {config.model} ({_describe(want)})")


def run(args) -> int:
    config = config_of(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:       # under torchrun
        check(args, config, int(os.environ["WORLD_SIZE"]))
        results, events = _under_torchrun(config, args)
    else:
        check(args, config, args.world_size or 1)
        from ..launch import Ranks
        from ..train import train
        with Ranks(args.world_size or 1) as ranks:
            results = ranks.run(train, config, on_step=None if (args.quiet or args.json) else progress)
            events = ranks.last_events
        _finish(args, results, events)
    return 0


def _under_torchrun(config, args):
    import torch.distributed as dist

    from ..comm import Comm
    from ..launch import context_from_env
    from ..train import train
    ctx = context_from_env()
    out = train(ctx, config, on_step=None if (args.quiet or args.json) else progress)
    out.pop("params", None)
    comm = Comm()
    results = comm.gather_object(out)
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        ctx.tracer.write_jsonl(Path(args.trace) / f"rank{ctx.rank}.jsonl")
    comm.barrier()
    if ctx.rank == 0:
        _finish(args, results, None)
    comm.barrier()
    dist.destroy_process_group()
    return results, None


def _finish(args, results: list[dict], events) -> None:
    from .report import report, summary
    if args.trace and events is not None:
        from ..trace import write_dir
        write_dir(events, args.trace)
    if args.export:
        from .. import checkpoint
        ck = Path(args.export) / ".checkpoint"
        info = checkpoint.export(args.save or ck, args.export)
        if not args.save:
            shutil.rmtree(ck, ignore_errors=True)
        print(f"exported {len(info['files'])} weight files to {args.export}")
    if args.json:
        import json
        print(json.dumps(summary(results)))
    else:
        print(report(results, args))


def progress(info: dict) -> None:
    """A line per optimizer step, printed by rank 0 only (the other ranks' lines would interleave)."""
    if info["rank"] == 0:
        print(f"step {info['step'] + 1:>3}/{info['steps']}  loss {info['loss']:.4f}  "
              f"{info['seconds'] * 1e3:7.1f} ms  peak {info['peak'] / MiB:8.1f} MiB", flush=True)


def say_once(message: str, file=sys.stdout) -> None:
    """Under torchrun every rank runs the command line: rank 0 speaks for them."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=file)


def _describe(cfg: dict | None) -> str:
    if not cfg:
        return "no model config"
    return (f"d_model {cfg.get('d_model')}, {cfg.get('n_layer')} layers, vocab {cfg.get('vocab_size')}")
