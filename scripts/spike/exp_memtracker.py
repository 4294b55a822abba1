"""3: MemTracker (DDP/ZeRO) and FSDPMemTracker (FSDP2) on CPU tensors, 2 gloo ranks.

    .venv/bin/python scripts/spike/exp_memtracker.py [ddp|zero|fsdp|fsdp_mp]

Subclasses the tracker to turn its private _update_snap(ADD/DEL/REF/SIZE, winfo) into a stream
of events (category, bytes), then prints on rank 0: the categories seen, event counts, the peak
snapshot, the per-module snapshot states for one module, the final current snapshot, and the step
time with and without the tracker.
"""
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType

from common import build, data, spawn, train_step


def streaming(base):
    class Streaming(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.stream = []

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            b = winfo.mem_consumed
            if u_type == _UpdateType.SIZE:
                b = winfo.mem_consumed - old_mem_consumed
            self.stream.append((time.perf_counter(), u_type.name, str(winfo.reftype.value),
                                None if old_reftype is None else str(old_reftype.value), b,
                                str(winfo.device)))
    return Streaming


def run(rank, world, kind):
    model, opt = build(kind, "nano")
    x, y = data("nano", 0, rank, world)
    train_step(model, opt, x, y)
    t = time.perf_counter()
    train_step(model, opt, *data("nano", 1, rank, world))
    plain = time.perf_counter() - t
    if kind.startswith("fsdp"):
        mt = streaming(FSDPMemTracker)(model, opt)
    else:
        mt = streaming(MemTracker)()
        mt.track_external(model, opt)
    t = time.perf_counter()
    with mt:
        for s in (2, 3):
            if s > 2:      # FSDPMemTracker: "does not support ... multiple iterative calls"
                mt.reset_mod_stats()
            train_step(model, opt, *data("nano", s, rank, world))
    tracked = (time.perf_counter() - t) / 2
    if rank != 0:
        return
    print(f"== {kind}: {len(mt.stream)} tracker updates in 2 steps; "
          f"step {plain*1e3:.1f} ms plain, {tracked*1e3:.1f} ms tracked")
    c = collections.Counter((u, cat) for _, u, cat, _, _, _ in mt.stream)
    for (u, cat), n in sorted(c.items()):
        print(f"  {u:<5} {cat:<16} {n}")
    refs = collections.Counter((old, cat) for _, u, cat, old, _, _ in mt.stream if u == "REF")
    print("  REF moves (old -> new):", dict(refs))
    print("  devices:", collections.Counter(d for *_, d in mt.stream))
    snap = mt.get_tracker_snapshot("peak")
    print("  peak:", {str(d): {k: v for k, v in s.items() if v} for d, s in snap.items()})
    cur = mt.get_tracker_snapshot("current")
    print("  current after:", {str(d): {k: v for k, v in s.items() if v} for d, s in cur.items()})
    mods = mt.memory_tracking
    for mod, stats in list(mods.items())[:40]:
        if stats.mod_fqn.endswith("blocks.1") or stats.mod_fqn.count(".") == 0:
            states = {str(k.value if hasattr(k, "value") else k): len(v) for k, v in stats.snapshots.items()}
            print(f"  module {stats.mod_fqn}: snapshot states {states}")
            for k, v in stats.snapshots.items():
                if v:
                    print("     e.g.", k.value if hasattr(k, "value") else k,
                          {str(d): {c: b for c, b in s.items() if b} for d, s in v[-1].items()})
                    break


if __name__ == "__main__":
    spawn(run, 2, (sys.argv[1] if len(sys.argv) > 1 else "fsdp",))
