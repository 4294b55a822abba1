"""1b: a TorchDispatchMode over torch.ops.c10d.* — what it sees and whether it can time async ops.

    .venv/bin/python scripts/spike/exp_dispatch.py [ddp|zero|fsdp|fsdp_mp] [nano|tiny]

Every c10d op seen: name, tensor shapes/dtypes, the process group's size (from the ScriptObject
argument), issue time, and completion time from work.get_future().then(...) (runs on the gloo
worker thread when the work finishes). Rank 0 prints one step's list.
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from common import build, data, spawn, train_step

C10D = torch.ops.c10d


class CommSpy(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.records = []
        self.t0 = time.perf_counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        group = None
        for a in flat:          # the ProcessGroup is a ScriptObject; so is the ReduceOp: pick by type
            if isinstance(a, torch._C.ScriptObject) and "ProcessGroup" in str(a._type()):
                pg = dist.ProcessGroup.unbox(a)
                group = (pg.size(), pg.group_name)
        rec = {"op": func.__name__, "shapes": [tuple(t.shape) for t in tensors],
               "dtypes": sorted({str(t.dtype) for t in tensors}),
               "bytes": [t.numel() * t.element_size() for t in tensors], "group": group,
               "t": time.perf_counter() - self.t0, "thread": threading.current_thread().name,
               "t_end": None, "grad_mode": torch.is_grad_enabled()}
        self.records.append(rec)
        out = func(*args, **kwargs)
        outs, _ = tree_flatten(out)
        works = [o for o in outs if isinstance(o, torch._C.ScriptObject) or "Work" in type(o).__name__]
        rec["returns"] = [type(o).__name__ for o in outs]
        for w in works:
            try:
                w = dist.distributed_c10d.Work.unbox(w) if isinstance(w, torch._C.ScriptObject) else w
                fut = w.get_future()

                def done(f, rec=rec):
                    rec["t_end"] = time.perf_counter() - self.t0
                    rec["end_thread"] = threading.current_thread().name
                    return None
                fut.then(done)
            except Exception as e:                       # noqa: BLE001
                rec["work_err"] = repr(e)[:120]
        rec["t_ret"] = time.perf_counter() - self.t0
        return out


def run(rank, world, kind, size):
    model, opt = build(kind, size)
    train_step(model, opt, *data(size, 0, rank, world))
    train_step(model, opt, *data(size, 1, rank, world))     # DDP rebuilds buckets in step 1
    spy = CommSpy()
    with spy:
        train_step(model, opt, *data(size, 2, rank, world))
    dist.barrier()
    time.sleep(0.2)
    if rank == 0:
        print(f"== {kind} {size}: {len(spy.records)} c10d ops seen in one step")
        for r in spy.records[:60]:
            dur = None if r["t_end"] is None else round((r["t_end"] - r["t"]) * 1e3, 2)
            print(f"  {r['op']:<28} shapes={r['shapes']} {r['dtypes']} group={r['group']} "
                  f"thr={r['thread']} ret={r.get('returns')} issue_ms={(r['t_ret']-r['t'])*1e3:.2f} "
                  f"done_ms={dur} end_thr={r.get('end_thread')} {r.get('work_err','')}")


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    size = sys.argv[2] if len(sys.argv) > 2 else "nano"
    spawn(run, 2, (kind, size))
