"""``python -m minishard ...`` and ``torchrun -m minishard ...``: the command line.

    torchrun --standalone --nproc-per-node 4 -m minishard demo --strategy zero3 --steps 3 --trace DIR
    python -m minishard demo --world-size 4 --strategy ddp --steps 3       # ranks started here
    python -m minishard ledger --config configs/llama3-8b.json --world-size 8 --strategy zero3
    python -m minishard plan --config configs/qwen2-7b.json --gpus-per-node 8 --nodes 2
    python -m minishard perfetto DIR out.json
    python -m minishard view DIR                 # DIR/player.html: step through it offline

``demo`` trains (every knob a chapter teaches is a flag) and prints, per rank, the ledger by
category, the peak against the formula, the bytes sent per step and the time compute waited on
communication; ``ledger`` and ``plan`` answer for real model configs without training anything;
``view`` writes a trace's step-through player as one HTML file (no kernel, no network).
Bad input stops with one line naming the problem, before any rank starts.
"""
from __future__ import annotations

import argparse
import sys

from . import demo, plan, view

__all__ = ["main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minishard", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,ledger,plan,perfetto,view}")
    demo.add_arguments(sub.add_parser(
        "demo", help="train on N ranks: per-step progress, the ledger per rank, bytes, a trace",
        description="Train the course's GPT under a strategy, on the ranks torchrun started (or "
                    "--world-size ranks started here), and report what every rank measured."))
    plan.add_ledger_arguments(sub.add_parser(
        "ledger", help="the analytic ledger of a model: bytes per rank by category",
        description="Bytes per rank by ledger category for a model (a built-in name or a "
                    "Hugging Face config.json), a world size, a strategy and a precision."))
    plan.add_plan_arguments(sub.add_parser(
        "plan", help="the planner: memory and step time of every strategy on a cluster",
        description="Per-GPU memory by category, step time and whether it fits, for each "
                    "strategy, with the planner's warnings (chapter 10)."))
    pp = sub.add_parser("perfetto", help="convert a trace directory to Chrome/Perfetto JSON",
                        description="Write the trace of a demo run (DIR/rank*.jsonl) as one "
                                    "Chrome/Perfetto JSON file (open it in ui.perfetto.dev).")
    pp.add_argument("trace_dir", help="a directory with rank*.jsonl (demo --trace DIR)")
    pp.add_argument("out", help="the .json file to write")
    view.add_arguments(sub.add_parser(
        "view", help="a trace as one HTML file that steps through it (no kernel, no network)",
        description="Write the step-through player of a trace (DIR/rank*.jsonl, e.g. from "
                    "torchrun ... demo --trace DIR) as one self-contained HTML file: every rank's "
                    "ledger, the collective on the ring, the FSDP units, the timeline."))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            return demo.run(args)
        if args.cmd == "ledger":
            return plan.ledger(args)
        if args.cmd == "plan":
            return plan.plan(args)
        if args.cmd == "view":
            return view.run(args)
        from ..trace import load, write_chrome
        write_chrome(load(args.trace_dir), args.out)
        print(f"wrote {args.out}")
        return 0
    except (ValueError, FileNotFoundError) as e:
        demo.say_once(f"minishard {args.cmd}: error: {e}", file=sys.stderr)
        return 2
