"""How many of minishard's files one training step runs through, and how many calls go from one
file to another — the measure of how far a learner has to follow one step.

    python scripts/step_crossings.py                 # ddp, zero2, fsdp on 2 ranks
    python scripts/step_crossings.py fsdp --calls    # and every call between two files

It runs ``train_step`` (one step, after one warm-up step so that lazy set-up is not counted) on
2 gloo ranks of the nano model, with the profiler hook of rank 0 counting Python calls whose
caller and callee are both in ``minishard/`` and in different files (calls inside one file, and
calls into torch, are not counted). Ledger and trace bookkeeping are counted like everything else:
they are files a reader crosses too."""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = str(ROOT / "minishard")


def one_step(rank, strategy: str) -> dict:
    import torch

    from minishard.core.comm import Comm
    from minishard.core.ledger import LiveLedger
    from minishard.core.model import GPT, batch, config as model_config
    from minishard.strategies import build
    from minishard.training.config import TrainConfig
    from minishard.training.loop import train_step

    cfg = model_config("nano")
    config = TrainConfig(strategy=strategy, model="nano", micro_batch=2, track_activations=False)
    torch.manual_seed(0)
    comm = Comm(tracer=rank.tracer)
    ledger = LiveLedger(rank.tracer)
    built = build(GPT(cfg), config, comm, ledger)
    data = [batch(cfg, 0, 2, rank.rank, rank.world_size)]
    train_step(built, data, clip=1.0, ledger=ledger)            # warm-up: lazy set-up
    calls: Counter = Counter()
    files: set = set()

    def hook(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if callee.startswith(PKG):
            files.add(callee)
            if caller.startswith(PKG) and caller != callee:
                calls[(_short(caller), _short(callee), frame.f_code.co_name)] += 1

    sys.setprofile(hook)
    try:
        train_step(built, data, clip=1.0, ledger=ledger)
    finally:
        sys.setprofile(None)
    return {"files": sorted(_short(f) for f in files), "calls": dict(calls)}


def _short(path: str) -> str:
    return str(Path(path).relative_to(ROOT / "minishard"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("strategies", nargs="*", default=["ddp", "zero2", "fsdp"])
    ap.add_argument("--calls", action="store_true", help="list every call between two files")
    args = ap.parse_args(argv)
    import os
    from minishard import Ranks
    # the ranks import the task by its module's name: this file, as ``step_crossings``
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    import step_crossings
    with Ranks(2) as ranks:
        for s in args.strategies:
            out = ranks.run(step_crossings.one_step, s)[0]
            sites = out["calls"]
            print(f"{s}: {len(out['files'])} files, {len(sites)} distinct calls between files "
                  f"({sum(sites.values())} made)")
            print("   " + ", ".join(out["files"]))
            if args.calls:
                for (a, b, name), n in sorted(sites.items()):
                    print(f"     {a} -> {b}:{name}  x{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
