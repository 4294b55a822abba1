"""1c: DDP register_comm_hook — bucket index, bytes, parameter names, start/end via the future.

    .venv/bin/python scripts/spike/exp_commhook.py [ddp|zero] [after]

"after": register the hook after a warm-up step (a watch attached to a running job) instead of
before the first forward. Prints each bucket of steps 0..2 on rank 0.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from common import build, data, spawn, train_step


def run(rank, world, kind, when):
    model, opt = build(kind, "nano")
    names = {p: n for n, p in model.module.named_parameters()}
    t0 = time.perf_counter()
    log = []

    def hook(state, bucket):
        rec = {"step": state["step"], "index": bucket.index(), "last": bucket.is_last(),
               "nbytes": bucket.buffer().numel() * bucket.buffer().element_size(),
               "dtype": str(bucket.buffer().dtype), "n_params": len(bucket.parameters()),
               "first": names.get(bucket.parameters()[0]), "t": time.perf_counter() - t0}
        log.append(rec)
        fut = default_hooks.allreduce_hook(dist.group.WORLD, bucket)

        def done(f):
            rec["t_end"] = time.perf_counter() - t0
            return f.value()
        return fut.then(done)

    state = {"step": 0}
    if when == "before":
        model.register_comm_hook(state, hook)
    for s in range(3):
        state["step"] = s
        if when == "after" and s == 1:
            try:
                model.register_comm_hook(state, hook)
            except Exception as e:                         # noqa: BLE001
                print("register after step 0:", repr(e)[:300])
        train_step(model, opt, *data("nano", s, rank, world))
    if rank == 0:
        for r in log:
            print(f"  step {r['step']} bucket {r['index']} last={r['last']} {r['nbytes']} B "
                  f"{r['dtype']} {r['n_params']} params first={r['first']} "
                  f"span_ms={(r.get('t_end', r['t']) - r['t']) * 1e3:.2f}")


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "ddp"
    when = sys.argv[2] if len(sys.argv) > 2 else "before"
    spawn(run, 2, (kind, when))
