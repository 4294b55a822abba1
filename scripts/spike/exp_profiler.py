"""1a + 2 + 3(profiler): what torch.profiler records for DDP / ZeRO / FSDP2 on gloo.

    .venv/bin/python scripts/spike/exp_profiler.py [ddp|zero|fsdp|fsdp_mp] [nano|tiny]

Rank 0 writes $TMP/watch_spike/prof_<kind>/rank0.json (Chrome trace) and prints: every
record_param_comms event with its args, the c10d/gloo op names, the FSDP:: labels with counts,
and the CPU memory events (profile_memory=True) summed.
"""
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from common import build, data, out_dir, spawn, train_step


def run(rank, world, kind, size, steps):
    model, opt = build(kind, size)
    x, y = data(size, 0, rank, world)
    train_step(model, opt, x, y)                     # warm-up (lazy init, ZeRO partitions)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        for s in range(steps):
            with record_function(f"step{s}"):
                train_step(model, opt, *data(size, s + 1, rank, world))
    d = out_dir(f"prof_{kind}")
    path = os.path.join(d, f"rank{rank}.json")
    prof.export_chrome_trace(path)
    if rank != 0:
        return
    tr = json.load(open(path))
    evs = tr["traceEvents"]
    comms = [e for e in evs if e.get("name") == "record_param_comms"]
    print(f"== {kind} {size} torch {torch.__version__}: {len(evs)} trace events, "
          f"{len(comms)} record_param_comms")
    seen = collections.Counter()
    for e in comms:
        a = e.get("args", {})
        key = (a.get("Collective name"), a.get("In msg nelems"), a.get("Out msg nelems"),
               a.get("dtype"), a.get("Group size"))
        seen[key] += 1
    for k, n in seen.most_common():
        print("  comms", n, "x", dict(zip(("coll", "in_nelems", "out_nelems", "dtype", "group"), k)))
    if comms:
        print("  one full args:", json.dumps(comms[0].get("args"))[:900])
        print("  one full event keys:", {k: v for k, v in comms[0].items() if k != "args"})
    names = collections.Counter(e.get("name") for e in evs if e.get("ph") == "X")
    c10d = {n: c for n, c in names.items() if n and ("c10d" in n or "gloo" in n.lower()
                                                     or "nccl" in n.lower() or "all_" in n
                                                     or "reduce_scatter" in n or "broadcast" in n)}
    print("  c10d/gloo op names:", dict(sorted(c10d.items())))
    fsdp = collections.Counter()
    for n, c in names.items():
        if n and n.startswith("FSDP::"):
            fsdp[n.split(" (")[0].split(" for ")[0]] += c
    print("  FSDP:: labels (per kind):", dict(sorted(fsdp.items())))
    ex = sorted({n for n in names if n and n.startswith("FSDP::")})[:12]
    print("  FSDP:: examples:", ex)
    mem = [e for e in evs if e.get("name") == "[memory]"]
    allocs = [e for e in mem if e["args"].get("Bytes", 0) > 0]
    print(f"  [memory] events: {len(mem)} ({len(allocs)} allocs); example args:",
          mem[0]["args"] if mem else None)
    # collective threads: which tid do record_param_comms events land on?
    print("  comms tids:", collections.Counter(e.get("tid") for e in comms))
    # ops on a non-main thread (DDP reducer's autograd thread?)
    by_tid = collections.Counter(e.get("tid") for e in evs if e.get("ph") == "X")
    print("  events per tid:", dict(by_tid))


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    size = sys.argv[2] if len(sys.argv) > 2 else "nano"
    spawn(run, 2, (kind, size, 2))
