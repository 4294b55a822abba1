"""3 (profiler side): profile_memory=True [memory] events and the profiler's own categoriser
(torch.profiler._memory_profiler via prof._memory_profile(): PARAMETER, GRADIENT, ACTIVATION,
OPTIMIZER_STATE, TEMPORARY, INPUT, AUTOGRAD_DETAIL) on CPU, for one step.

    .venv/bin/python scripts/spike/exp_profmem.py [ddp|zero|fsdp]
"""
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch
from torch.profiler import ProfilerActivity, profile

from common import data, spawn, train_step, warmed


def run(rank, world, kind):
    model, opt = warmed(rank, world, kind)
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        train_step(model, opt, *data("nano", 2, rank, world))
    t_prof = time.perf_counter() - t
    if rank != 0:
        return
    t = time.perf_counter()
    try:
        mp = prof._memory_profile()
        tl = mp.timeline                       # [(t_us, Action, (TensorKey, version), bytes)]
        t_cat = time.perf_counter() - t
        cats = collections.Counter()
        peak = collections.Counter()
        live = collections.Counter()
        for t_us, action, (key, version), nbytes in tl:
            cat = mp._categories.get(key, version)
            name = cat.name if cat is not None else "UNKNOWN"
            cats[(action.name, name)] += 1
            if action.name in ("CREATE", "INCREMENT_VERSION") and action.name == "CREATE":
                live[name] += nbytes
            elif action.name == "DESTROY":
                live[name] -= nbytes
            peak[name] = max(peak[name], live[name])
        print(f"== {kind}: profiled step {t_prof*1e3:.0f} ms; _memory_profile() took "
              f"{t_cat*1e3:.0f} ms; {len(tl)} timeline entries")
        for (a, c), n in sorted(cats.items()):
            print(f"  {a:<18} {c:<16} {n}")
        print("  per-category peak bytes in this step:", dict(peak))
    except Exception as e:                                          # noqa: BLE001
        print(f"== {kind}: _memory_profile failed: {e!r}"[:400])
    mem = [e for e in prof.events() if e.name == "[memory]"]
    print(f"  prof.events() [memory]: {len(mem)}")


if __name__ == "__main__":
    spawn(run, 2, (sys.argv[1] if len(sys.argv) > 1 else "fsdp",))
