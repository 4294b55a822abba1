"""``python -m minishard ...`` and ``torchrun -m minishard ...``.

    torchrun --standalone --nproc-per-node 4 -m minishard demo --strategy ddp --steps 3 --trace DIR
    python -m minishard demo --world-size 4 --strategy ddp --steps 3 --trace DIR   # no torchrun
    python -m minishard ledger --model llama3-8b --world-size 8 --strategy zero3
    python -m minishard perfetto DIR out.json

``demo`` trains the tiny GPT, prints one ledger row per rank (measured peak by category, next to
the analytic estimate) and the bytes each rank sent, and writes ``DIR/rank{r}.jsonl`` — the
trace the notebooks' player replays — plus ``DIR/trace.json`` for Perfetto.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

MB = 2**20


def _demo_args(p: argparse.ArgumentParser) -> None:
    from .strategies import names
    from .train import OPTIMIZERS
    p.add_argument("--strategy", default="ddp", choices=names())
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--trace", metavar="DIR", help="write rank*.jsonl and trace.json here")
    p.add_argument("--world-size", type=int, default=None,
                   help="without torchrun: start this many ranks from this process")


def format_table(results: list[dict]) -> str:
    """One row per rank: the measured peak ledger by category, the estimate, the traffic."""
    cats = []
    for r in results:
        for c in r.get("ledger", {}).get("peak_snapshot", {}):
            if c not in cats:
                cats.append(c)
    head = f"{'rank':>4} " + " ".join(f"{c:>11}" for c in cats) + \
        f" {'peak MB':>9} {'formula MB':>10} {'sent/step MB':>12}"
    lines = [head]
    for r in results:
        led = r.get("ledger")
        if led is None:
            lines.append(f"{r['rank']:>4}  (not instrumented)")
            continue
        snap = led["peak_snapshot"]
        est = sum(led["estimate"].values())
        lines.append(f"{r['rank']:>4} " + " ".join(f"{snap.get(c, 0) / MB:>11.2f}" for c in cats) +
                     f" {led['peak'] / MB:>9.2f} {est / MB:>10.2f} {r['wire'][-1] / MB:>12.2f}")
    return "\n".join(lines)


def demo(args) -> int:
    from .train import TrainConfig, train
    kwargs = dict(strategy=args.strategy, steps=args.steps, model=args.model,
                  micro_batch=args.micro_batch, accum=args.accum, optimizer=args.optimizer,
                  bucket_cap_mb=args.bucket_cap_mb)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:        # under torchrun
        from .comm import Comm
        from .launch import context_from_env
        ctx = context_from_env()
        out = train(ctx, TrainConfig(**kwargs))
        out.pop("params", None)
        results = Comm().gather_object(out)
        events = ctx.tracer.events
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            ctx.tracer.write_jsonl(Path(args.trace) / f"rank{ctx.rank}.jsonl")
        import torch.distributed as dist
        dist.barrier()
        if ctx.rank == 0:
            _report(results, args)
        dist.destroy_process_group()
        return 0
    from .launch import Ranks
    with Ranks(args.world_size or 1) as ranks:
        results = ranks.run(train, TrainConfig(**kwargs))
        events = ranks.last_events
    if args.trace:
        from .trace import write_dir
        write_dir(events, args.trace)
    _report(results, args)
    return 0


def _report(results: list[dict], args) -> None:
    r0 = results[0]
    print(f"minishard demo: strategy={args.strategy} world_size={r0['world_size']} "
          f"model={args.model} params={r0['n_params']:,} steps={args.steps}")
    print(format_table(results))
    print("losses (rank 0): " + " ".join(f"{x:.4f}" for x in r0["losses"]))
    if args.trace:
        from .trace import load, write_chrome
        events = load(args.trace)
        write_chrome(events, Path(args.trace) / "trace.json")
        print(f"trace: {args.trace}/rank*.jsonl ({len(events)} events); "
              f"Perfetto: {args.trace}/trace.json")


def ledger_cmd(args) -> int:
    from .ledger import estimate
    from .model import GPT, config
    net = GPT(config(args.model), device="meta")
    est = estimate(net, world_size=args.world_size, strategy=args.strategy,
                   precision=args.precision, optimizer=args.optimizer)
    print(f"{args.model}: {est.n_params:,} parameters, {args.strategy} on {args.world_size} ranks, "
          f"{args.precision}, {args.optimizer}: {est.bytes_per_param:.2f} bytes/param per rank")
    print(est.table(unit=1e9, unit_name="GB"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minishard", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    _demo_args(sub.add_parser("demo", help="train on N ranks, print the ledger, write a trace"))
    lp = sub.add_parser("ledger", help="the analytic ledger of a model config")
    lp.add_argument("--model", default="llama3-8b")
    lp.add_argument("--world-size", type=int, default=1)
    lp.add_argument("--strategy", default="ddp")
    lp.add_argument("--precision", default="bf16_mixed")
    lp.add_argument("--optimizer", default="adamw")
    pp = sub.add_parser("perfetto", help="convert a trace directory to Chrome/Perfetto JSON")
    pp.add_argument("trace_dir")
    pp.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "demo":
            return demo(args)
        if args.cmd == "ledger":
            return ledger_cmd(args)
        if args.cmd == "perfetto":
            from .trace import load, write_chrome
            write_chrome(load(args.trace_dir), args.out)
            print(f"wrote {args.out}")
            return 0
    except (ValueError, FileNotFoundError) as e:
        print(f"minishard: error: {e}", file=sys.stderr)
        return 2
    return 0
