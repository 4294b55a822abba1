"""1e: the c10d Flight Recorder on gloo (TORCH_FR_BUFFER_SIZE; TORCH_NCCL_TRACE_BUFFER_SIZE is
the old name). Runs 2 steps of DDP / ZeRO / FSDP2 and dumps torch._C._distributed_c10d.
_dump_fr_trace_json() on rank 0.

    TORCH_FR_BUFFER_SIZE=2000 .venv/bin/python scripts/spike/exp_flight.py [ddp|zero|fsdp]
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch._C._distributed_c10d as c10d

from common import build, data, spawn, train_step


def run(rank, world, kind):
    model, opt = build(kind, "nano")
    for s in range(2):
        train_step(model, opt, *data("nano", s, rank, world))
    if rank != 0:
        return
    raw = c10d._dump_fr_trace_json(includeCollectives=True)
    d = json.loads(raw)
    entries = d.get("entries", [])
    print(f"== {kind}: FR version {d.get('version')}, {len(entries)} entries, keys {sorted(d)}")
    for e in entries[:6] + entries[-3:]:
        print("  ", {k: e.get(k) for k in ("record_id", "profiling_name", "process_group",
                                          "input_sizes", "output_sizes", "input_dtypes", "state",
                                          "time_created_ns", "time_discovered_started_ns",
                                          "time_discovered_completed_ns", "duration_ms",
                                          "collective_seq_id", "is_p2p", "retired", "thread_name")})
    if entries:
        print("   all keys:", sorted(entries[0]))


if __name__ == "__main__":
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    spawn(run, 2, (sys.argv[1] if len(sys.argv) > 1 else "fsdp",))
