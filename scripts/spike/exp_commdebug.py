"""1d: torch.distributed.tensor.debug.CommDebugMode on one step of DDP / ZeRO / FSDP2 (gloo).

    .venv/bin/python scripts/spike/exp_commdebug.py [ddp|zero|fsdp]

Prints get_comm_counts(), the per-module forward/backward counts, what one operations_list entry
holds (no sizes for plain-tensor c10d ops), the time of the step with and without the mode, and whether one mode survives two steps.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch
from torch.distributed.tensor.debug import CommDebugMode

from common import data, spawn, train_step, warmed


def run(rank, world, kind):
    model, opt = warmed(rank, world, kind)
    t = time.perf_counter()
    train_step(model, opt, *data("nano", 2, rank, world))
    plain = time.perf_counter() - t
    mode = CommDebugMode()
    t = time.perf_counter()
    with mode:
        train_step(model, opt, *data("nano", 3, rank, world))
    watched = time.perf_counter() - t
    try:                                   # one mode over two steps: does it survive?
        with CommDebugMode():
            for s in (4, 5):
                train_step(model, opt, *data("nano", s, rank, world))
        two = "ok"
    except Exception as e:                 # noqa: BLE001
        two = f"{type(e).__name__}: {e}"
    if rank == 0:
        print(f"== {kind}: one CommDebugMode over 2 steps: {two}")
        print(f"== {kind}: counts {dict((str(k), v) for k, v in mode.get_comm_counts().items())}")
        for m, d in list(mode.comm_module_counts.items())[:8]:
            print("  module", m, {k: {str(o): n for o, n in v.items()} for k, v in d.items()})
        ops = [o for m in mode.comm_module_operation_counts.values() for o in m["operations_list"]]
        comm = [o for o in ops if "c10d" in str(o["name"])]
        print(f"  operations_list: {len(ops)} entries, {len(comm)} c10d; one:", comm[:1])
        print(f"  step {plain*1e3:.1f} ms plain, {watched*1e3:.1f} ms under CommDebugMode")


if __name__ == "__main__":
    spawn(run, 2, (sys.argv[1] if len(sys.argv) > 1 else "fsdp",))
