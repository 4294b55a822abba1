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
import math
import os
import shutil
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from minishard import strategies
from minishard.instruments.faults import FAULTS

if TYPE_CHECKING:
    from minishard.training.config import TrainConfig

MiB = 2**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to train")
    g.add_argument("--strategy", default="ddp", metavar="NAME",
                   help=f"one of {strategies.described()} (default ddp)")
    g.add_argument("--model", default="tiny", help="a built-in config: nano, tiny (default), gpt2-small, ...")
    g.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    g.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per forward")
    g.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (chapter 02)")
    g.add_argument("--accumulation", default=None, metavar="MODE",
                   help="FSDP and ZeRO-2 with --accum > 1: sync (reduce-scatter every micro-batch, "
                        "their default), no_sync (hold full gradients, reduce once), gathered (FSDP: "
                        "keep parameters gathered between micro-batches)")
    g.add_argument("--optimizer", default="adamw", help="adamw, sgd or sgd_momentum")
    g.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    g.add_argument("--precision", default="fp32", help="fp32 or bf16_mixed (chapters 01, 05)")
    g.add_argument("--clip", type=float, default=None, metavar="NORM", help="clip the global gradient norm (chapter 04)")
    g.add_argument("--freeze", action="append", default=[], metavar="PREFIX",
                   help="freeze parameters whose name starts with PREFIX (repeatable; chapter 06)")
    g.add_argument("--seed", type=int, default=0, help="initial weights, the same on every rank")
    _sharding_arguments(p.add_argument_group("sharding (chapters 02-07; hsdp's shard groups: chapter 10)"))
    g = p.add_argument_group("memory (chapters 07, 08, 10)")
    g.add_argument("--offload", choices=("host", "disk"), default=None, help="keep FSDP's sharded state off the device")
    g.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="where --offload disk keeps its files (needed with it, refused without)")
    g.add_argument("--recompute", action="store_true", help="activation recomputation: keep each block's input only")
    g.add_argument("--loss-chunk-tokens", type=int, default=None, metavar="N", help="compute the loss N tokens at a time")
    g.add_argument("--device-budget", type=float, default=None, metavar="MIB",
                   help="a device of this many MiB: an allocation past it raises DeviceOutOfMemory")
    g = p.add_argument_group("failures on purpose (chapter 11; then: minishard doctor DIR)")
    g.add_argument("--fault", default=None, metavar="NAME",
                   help="plant one: " + "; ".join(f"{k}: {v}" for k, v in FAULTS.items()))
    g.add_argument("--fault-rank", type=int, default=1, metavar="R", help="the rank it is planted on (default 1)")
    g.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="a collective waits this long for its peers, then raises (default 60): a "
                        "hang ends, each rank writing its flight dump beside --trace")
    g = p.add_argument_group("checkpoints (chapter 09) and outputs")
    g.add_argument("--save", metavar="DIR", help="save a sharded checkpoint after the last step")
    g.add_argument("--save-every", type=int, default=None, metavar="K",
                   help="with --save: also after every K-th step, each replacing the one before")
    g.add_argument("--save-background", action="store_true",
                   help="with --save: copy to host memory and write while training goes on")
    g.add_argument("--resume", metavar="DIR", help="start from a checkpoint (any world size, any strategy)")
    g.add_argument("--export", metavar="DIR", help="after training, write complete per-layer weight files here")
    g.add_argument("--trace", metavar="DIR", help="write rank*.jsonl (the player's trace) and trace.json (Perfetto)")
    g.add_argument("--torch-flight", action="store_true",
                   help="with --trace: also write PyTorch's own flight recorder there (the doctor reads it)")
    g.add_argument("--fingerprint-every", type=int, default=10, metavar="K",
                   help="with --trace: fingerprint the replicas and note the optimizer's settings after "
                        "every K-th step and the last (default 10; the doctor names a rank whose "
                        "replica drifted)")
    g.add_argument("--world-size", type=int, default=None, help="without torchrun: start this many ranks here")
    g.add_argument("--quiet", action="store_true", help="no per-step lines")
    g.add_argument("--json", action="store_true", help="print the results as JSON (for scripts), not tables")


def _sharding_arguments(g) -> None:
    g.add_argument("--bucket-cap-mb", type=float, default=25.0, metavar="MIB",
                   help="gradient bucket size in MiB (ddp, zero1, zero2; default 25)")
    g.add_argument("--wrap", default="block", help="FSDP units below the root: block, linear or model (chapter 06)")
    g.add_argument("--reshard-after-forward", nargs="?", const=True, default=True, type=int,
                   metavar="K", help="free a unit's gathered parameters after its forward (chapter 06); "
                   "K: keep 1/K of them, so that backward gathers inside groups of K ranks")
    g.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="keep a unit's gathered parameters from its forward to its backward")
    g.add_argument("--reshard-root", action="store_true", help="free the root too (the textbook ZeRO-3 schedule)")
    g.add_argument("--quantized-weights", nargs="?", const=True, default=False, type=int, metavar="BITS",
                   help="ZeRO++ qwZ: FSDP's all-gathers in int8 (or BITS: 8 or 4) with a scale per block")
    g.add_argument("--quantized-gradients", nargs="?", const=True, default=False, type=int, metavar="BITS",
                   help="ZeRO++ qgZ: FSDP's gradient reduction in int8 (or BITS: 8 or 4), through an all-to-all")
    g.add_argument("--prefetch", type=int, default=0, metavar="K", help="FSDP units gathered ahead (chapter 07; fsdp, fsdp_flat, hsdp, torch_fsdp: FSDP2 gathers 1 ahead in backward at 0)")
    g.add_argument("--shard-size", type=int, default=2, help="hsdp only: ranks per shard group, a node (default 2)")


def config_of(args) -> "TrainConfig":
    """The run's TrainConfig; every bad value is refused here, before any rank starts, named by
    its flag (``--prefetch -1``, not ``prefetch=-1``), and so is a flag the strategy never reads."""
    from minishard.training.config import ConfigError, TrainConfig
    if args.device_budget is not None and not (math.isfinite(args.device_budget) and args.device_budget > 0):
        raise ValueError(f"--device-budget {args.device_budget}: must be a positive, finite number of MiB")
    try:
        config = TrainConfig(
            strategy=args.strategy, steps=args.steps, model=args.model, micro_batch=args.micro_batch,
            accum=args.accum, accumulation=args.accumulation, seed=args.seed, optimizer=args.optimizer, lr=args.lr, precision=args.precision,
            clip=args.clip, freeze=tuple(args.freeze), bucket_cap_mb=args.bucket_cap_mb, wrap=args.wrap,
            reshard_after_forward=args.reshard_after_forward, reshard_root=args.reshard_root,
            quantized_weights=args.quantized_weights, quantized_gradients=args.quantized_gradients,
            prefetch=args.prefetch, shard_size=args.shard_size, recompute=args.recompute,
            loss_chunk_tokens=args.loss_chunk_tokens, offload=args.offload, offload_dir=_here(args.offload_dir),
            device_budget=None if args.device_budget is None else int(args.device_budget * MiB),
            track_activations=True, trace=True, flight_dir=_here(args.trace), torch_flight=args.torch_flight, fingerprint_every=args.fingerprint_every, resume_from=_here(args.resume),
            save_every=args.save_every, save_background=args.save_background,
            save_to=_here(args.save or (str(Path(args.export) / ".checkpoint") if args.export else None)))
        config.refuse_unused()
    except ConfigError as e:
        raise ValueError(e.worded(lambda name, value: _flag(args, name, value))) from None
    return config


def fault_of(args, config) -> "Fault | None":
    """The failure ``--fault`` plants (chapter 11), checked against the run like every flag."""
    from minishard.instruments.faults import Fault
    from minishard.training.config import ConfigError
    try:
        if args.fault is None:
            if args.fault_rank != 1:
                raise ConfigError("{fault_rank} is the rank a fault is planted on: set {fault}, or "
                                  "drop it", fault_rank=args.fault_rank, fault=...)
            return None
        fault = Fault(args.fault, args.fault_rank)
        fault.check(config)
    except ConfigError as e:
        raise ValueError(e.worded(lambda name, value: _flag(args, name, value))) from None
    return fault


def _here(path: str | None) -> str | None:
    """A path as the user typed it, made absolute here: the ranks may run in another folder (warm
    ranks lent by ``cli.main(pools=)`` stay in the one they started in)."""
    return None if path is None else os.path.abspath(path)


def _flag(args, name: str, value) -> str:
    """A TrainConfig field as the command line spells it: the flag, and the value as typed."""
    dest = {"resume_from": "resume", "save_to": "save", "flight_dir": "trace"}.get(name, name)
    flag = "--" + dest.replace("_", "-")
    if value is ...:
        return flag
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    typed = getattr(args, dest, value)                 # (--device-budget is MiB, the field bytes)
    return f"{flag} {typed if typed is not None else value}"


def check(args, config, world_size: int, fault=None) -> None:
    """What TrainConfig cannot know alone: the world size, the files and checkpoints on disk.
    Every refusal names the flag and what to do, before any rank starts."""
    from minishard import checkpoint
    from minishard.core.model import GPT
    from minishard.core.model import config as model_config
    if world_size < 1:
        raise ValueError(f"--world-size {world_size}: a run needs at least one rank; use --world-size 1 or more")
    strategy = strategies.get(config.strategy)
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout {args.timeout}: a collective's timeout must be a positive, "
                         f"finite number of seconds")
    if fault is not None and fault.rank >= world_size:
        raise ValueError(f"--fault-rank {fault.rank}: no such rank in a world of {world_size} "
                         f"(ranks 0 to {world_size - 1})")
    if strategy.single_process and world_size > 1:
        raise ValueError(f"--strategy {args.strategy} trains one process, not {world_size}; use "
                         f"--world-size 1, or a strategy that spreads the work (ddp, zero1, fsdp, ...)")
    world = f"the world size {world_size}" + (f" (--world-size {world_size})" if args.world_size else "")
    if strategy.hybrid and world_size % config.shard_size:
        raise ValueError(f"--shard-size {config.shard_size} does not divide {world}: --strategy "
                         f"{args.strategy} shards in groups of --shard-size ranks; use --shard-size "
                         f"one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    k = config.reshard_after_forward
    if not isinstance(k, bool) and strategy.stage == 3:
        group = config.shard_size if strategy.hybrid else world_size
        if group % k:
            raise ValueError(f"--reshard-after-forward {k} does not divide the {group} ranks a unit "
                             f"shards over; use one of {[d for d in range(1, group + 1) if group % d == 0]}")
    if config.freeze:
        names = [n for n, _ in GPT(config.model, device="meta").named_parameters()]
        for prefix in config.freeze:
            if not any(n.startswith(prefix) for n in names):
                tops = ", ".join(dict.fromkeys(n.split(".")[0] for n in names))
                raise ValueError(f"--freeze {prefix} matches no parameter of --model {config.model}; "
                                 f"parameter names start with {tops} (blocks.0., blocks.1., ...)")
    for flag, target in (("--save", args.save), ("--export", args.export), ("--trace", args.trace),
                         ("--offload-dir", args.offload_dir)):
        if target is not None and Path(target).exists() and not Path(target).is_dir():
            raise ValueError(f"{flag} {target} is a file, not a directory; name a new or existing directory")
        if target is not None and (why := not_writable(Path(target))):
            raise ValueError(f"{flag} {target} cannot be written: {why}; name a directory this user "
                             f"can create or write in")
    if args.save and Path(args.save).is_dir() and any(Path(args.save).iterdir()) \
            and not (Path(args.save) / checkpoint.METADATA).exists():
        raise ValueError(f"--save {args.save} is a directory that holds other files, not a checkpoint; "
                         f"name a new directory (a checkpoint there is replaced)")
    if args.resume:
        _check_resume(args, config, checkpoint, model_config)


def not_writable(path: Path) -> str | None:
    """Why nothing can be written in the directory ``path`` (made if it is not there), or None:
    found by making a directory where it would be (and removing it), which is how the ranks
    would fail — a file in the way, no permission, a read-only file system — after training."""
    import tempfile
    there = Path(os.path.abspath(path))
    while not there.exists():
        there = there.parent
    if not there.is_dir():
        return f"{there} is a file, not a directory"
    try:
        tempfile.TemporaryDirectory(dir=there, prefix=".minishard-").cleanup()
    except OSError as e:
        return f"{'it' if there == Path(os.path.abspath(path)) else there} refuses new files ({e.strerror or e})"
    return None


def _check_resume(args, config, checkpoint, model_config) -> None:
    """--resume DIR must be a whole checkpoint of this model and this optimizer: its metadata
    says so, and every shard file it lists must be there at its size (the bytes themselves are
    checked as the ranks read them)."""
    where = f"--resume {args.resume}"
    if not Path(args.resume).is_dir():
        raise FileNotFoundError(f"{where}: no such checkpoint directory")
    root = checkpoint.format.resolve(Path(args.resume))
    if not (root / checkpoint.METADATA).exists():
        raise ValueError(f"{where}: no {checkpoint.METADATA} in it, so not a checkpoint; name a "
                         f"directory that demo --save DIR wrote")
    try:
        meta = checkpoint.read_metadata(args.resume)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"{where}: {e}; the checkpoint is damaged, save it again") from None
    for fname, info in meta.get("files", {}).items():
        f = root / fname
        if not f.exists():
            raise ValueError(f"{where}: shard file {fname} is missing (rank {info.get('rank')} of "
                             f"{meta.get('world_size')} saved it); the checkpoint is incomplete, "
                             f"save it again or resume another")
        if f.stat().st_size != info.get("bytes"):
            raise ValueError(f"{where}: {fname} is {f.stat().st_size:,} bytes, the metadata says "
                             f"{info.get('bytes'):,}: cut short or overwritten; save it again")
    saved = meta.get("model")
    want = dataclasses.asdict(model_config(config.model))
    if saved != want:
        raise ValueError(f"{where} holds another model ({_describe(saved)}), not "
                         f"--model {config.model} ({_describe(want)})")
    kinds = {n.split("/", 1)[0] for n in meta.get("tensors", {})} - {"param"}
    wants = {"adamw": {"exp_avg", "exp_avg_sq"}, "sgd": set(), "sgd_momentum": {"momentum_buffer"}}
    if kinds != wants[config.optimizer]:
        theirs = [o for o, k in wants.items() if k == kinds]
        raise ValueError(f"{where} holds {(meta.get('optimizer') or {}).get('class', 'another')} state "
                         f"({', '.join(sorted(kinds)) or 'none'}), which --optimizer {config.optimizer} "
                         f"cannot continue; resume with "
                         + (f"--optimizer {theirs[0]}" if theirs else "the optimizer that saved it"))


def run(args, pools=None) -> int:
    """``pools``: warm ranks to run on (``cli.main``'s), unless a run asks for its own collective
    timeout (a pool's is fixed when it starts)."""
    config = config_of(args)
    fault = fault_of(args, config)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:       # under torchrun
        world_size = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world_size:
            raise ValueError(f"--world-size {args.world_size} under torchrun, which started "
                             f"{world_size} ranks: torchrun's --nproc-per-node (times --nnodes) sets "
                             f"the world size; drop --world-size")
        check(args, config, world_size, fault)
        try:
            results, events = _under_torchrun(config, args, fault)
        except Exception as e:      # as Ranks reports a rank's failure: its rank, its own traceback
            import traceback

            from minishard.core.launch import RankError
            raise RankError(int(os.environ["RANK"]), repr(e), traceback.format_exc()) from None
    else:
        world_size = 1 if args.world_size is None else args.world_size
        check(args, config, world_size, fault)
        from contextlib import nullcontext

        from minishard.core.launch import Ranks
        lent = pools is not None and args.timeout is None
        quiet = args.quiet or args.json
        with nullcontext(pools(world_size)) if lent else Ranks(world_size, **_timeout(args)) as ranks:
            # the progress lines are printed here, as the ranks report them: a rank's own
            # stdout is not this process's (warm ranks were started before this command)
            results = ranks.run(train_reporting, config, fault,
                                on_report=None if quiet else lambda rank, info: progress(info))
            events = ranks.last_events
        _finish(args, results, events)
    return 0


def train_reporting(rank, config, fault=None) -> dict:
    """``train`` on a rank of ``Ranks`` (``fault`` planted), each step's progress handed to the caller."""
    from minishard.training.loop import train
    return train(rank, config, on_step=rank.report, hooks=fault)


def _timeout(args) -> dict:
    return {} if args.timeout is None else {"collective_timeout": args.timeout}


def _under_torchrun(config, args, fault=None):
    import torch.distributed as dist

    from minishard.core.comm import Comm
    from minishard.core.launch import context_from_env
    from minishard.training.loop import train
    ctx = context_from_env(**_timeout(args))
    # the results travel in a group of their own: a rank done early (a fault) waits there,
    # not in the training group, where its next collective would pair with the others' last
    comm = Comm(group=dist.new_group(list(range(ctx.world_size))))
    try:
        out = train(ctx, config, on_step=None if (args.quiet or args.json) else progress, hooks=fault)
    finally:                 # a rank that failed leaves its trace too: the doctor reads it
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            ctx.tracer.write_jsonl(Path(args.trace) / f"rank{ctx.rank}.jsonl")
    out.pop("params", None)
    results = comm.gather_object(out)
    comm.barrier()
    if ctx.rank == 0:
        _finish(args, results, None)
    comm.barrier()
    dist.destroy_process_group()
    return results, None


def _finish(args, results: list[dict], events) -> None:
    from .report import report, summary
    if args.trace and events is not None:
        from minishard.core.trace import write_dir
        write_dir(events, args.trace, run=results[0].get("run"), world_size=len(results))
    exported = None
    if args.export:
        from minishard import checkpoint
        ck = Path(args.export) / ".checkpoint"
        exported = checkpoint.export(args.save or ck, args.export)
        if not args.save:
            shutil.rmtree(ck, ignore_errors=True)
    if args.json:
        import json
        print(json.dumps(summary(results, exported)))
    else:
        print(report(results, args, exported))


def progress(info: dict) -> None:
    """A line per optimizer step, printed by rank 0 only (the other ranks' lines would interleave):
    its own loss, step time and peak; the first step says so once. Steps count on from a resumed
    checkpoint's."""
    if info["rank"] != 0:
        return
    if info.get("first", info["step"] == 0):
        print("rank 0's steps (its own micro-batches' loss; the global batch's is in the summary):")
    resolution = info.get("loss_resolution", 0.0)
    rounded = f" (bf16: in steps of {resolution:g})" if resolution >= 5e-5 else ""
    print(f"step {info['step'] + 1:>3}/{info['steps']}  loss {info['loss']:.4f}{rounded}  "
          f"{info['seconds'] * 1e3:7.1f} ms  peak {info['peak'] / MiB:8.1f} MiB", flush=True)


def say_once(message: str, file=sys.stdout) -> None:
    """Under torchrun every rank runs the command line: rank 0 speaks for them."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=file, flush=True)


def _describe(cfg: dict | None) -> str:
    if not cfg:
        return "no model config"
    return (f"d_model {cfg.get('d_model')}, {cfg.get('n_layer')} layers, vocab {cfg.get('vocab_size')}")
