"""4: step-time overhead of each instrument on minishard.core.model.GPT (tiny by default) under torch
DDP and FSDP2, 2 gloo ranks, 1 thread each. Median of N measured steps after warm-up; a fresh
model per configuration (the instruments patch instances).

    .venv/bin/python scripts/spike/exp_overhead.py [ddp|fsdp] [tiny|nano] [steps]
    TORCH_FR_BUFFER_SIZE=2000 .venv/bin/python scripts/spike/exp_overhead.py ddp tiny 5 base
      (flight recorder: read at process-group creation, so a run of its own)
"""
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from common import build, data, out_dir, spawn, train_step


def saved_bytes_counter():
    """Activation bytes as autograd saves them (minishard's ledger's rule), deduplicated by
    storage; the cheapest memory instrument there is."""
    live = {}

    def pack(t):
        st = t.untyped_storage()
        live[st.data_ptr()] = st.nbytes()
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live


def ddp_hook(model, log):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        rec = {"i": bucket.index(), "b": bucket.buffer().numel() * bucket.buffer().element_size(),
               "t": time.perf_counter()}
        log.append(rec)
        fut = default_hooks.allreduce_hook(None, bucket)

        def done(f):
            rec["t_end"] = time.perf_counter()
            return f.value()
        return fut.then(done)
    model.register_comm_hook(None, hook)


class _WatchCtx:
    """exp_watch_proto.Watch, with w.step() after each step (called by run())."""
    def __init__(self, w):
        self.w = w

    def __enter__(self):
        self.w.__enter__()
        return self

    def __exit__(self, *exc):
        self.w.__exit__(*exc)
        self.events = len(self.w.tr.events)


class _PerStep(contextlib.nullcontext):
    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def step(self):
        return self.factory()


def configs(kind):
    from exp_dispatch import CommSpy
    from exp_fsdp_units import instrument
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor.debug import CommDebugMode

    def base(model, opt):
        return contextlib.nullcontext()

    def spy(model, opt):
        return CommSpy()

    def hooks(model, opt):
        if kind == "ddp":
            ddp_hook(model, [])
        else:
            instrument(model)
        return contextlib.nullcontext()

    def watch_proto(model, opt):
        hooks(model, opt)
        stack = contextlib.ExitStack()
        stack.enter_context(CommSpy())
        stack.enter_context(saved_bytes_counter()[0])
        return stack

    def saved(model, opt):
        return saved_bytes_counter()[0]

    def watch(model, opt):
        from exp_watch_proto import Watch
        from minishard.core.trace import Tracer
        return _WatchCtx(Watch(model, opt, Tracer(dist.get_rank(), dist.get_world_size())))

    def prof_cpu(model, opt):
        return profile(activities=[ProfilerActivity.CPU])

    def prof_mem(model, opt):
        return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)

    def memtracker(model, opt):
        if kind == "ddp":
            mt = MemTracker()
            mt.track_external(model, opt)
            return mt
        return FSDPMemTracker(model, opt)

    def commdebug(model, opt):
        return CommDebugMode()

    return dict(base=base, spy=spy, hooks=hooks, watch_proto=watch_proto, saved=saved,
                watch=watch, prof_cpu=prof_cpu,
                prof_mem=prof_mem, memtracker=memtracker, commdebug=commdebug)


def run(rank, world, kind, size, steps, only):
    from torch.distributed.tensor.debug import CommDebugMode
    globals()["CommDebugMode"] = CommDebugMode
    results, times_by, cpu_by = {}, {}, {}
    todo = [(n, m) for n, m in configs(kind).items() if not only or n in only]
    # the machine is shared (load 8-10 on 2 cores): wall time is noise-bound, so the primary
    # number is the rank process's CPU time per step (all its threads: gloo workers too), median
    # over the list run forward, then backward; wall-clock median second
    for name, make in todo + todo[::-1]:
        model, opt = build(kind, size)
        for s in range(2):
            train_step(model, opt, *data(size, s, rank, world))
        ctx = make(model, opt)
        times, cpu = [], []
        if name == "commdebug":     # over several FSDP2 steps its ModTracker raises IndexError:
            ctx = _PerStep(CommDebugMode)          # enter a fresh mode for each step
        with ctx:
            for s in range(steps):
                if name == "memtracker" and s:   # both trackers refuse a 2nd iteration
                    ctx.reset_mod_stats()          # without this (NotImplementedError)
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                with ctx.step() if name == "commdebug" else contextlib.nullcontext():
                    train_step(model, opt, *data(size, s + 2, rank, world))
                if name == "watch":
                    ctx.w.step()
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
        extra = ""
        if name == "watch":
            extra = f" {ctx.events / steps:.0f} events/step"
        if name.startswith("prof"):
            p = os.path.join(out_dir(f"overhead_{kind}"), f"{name}_rank{rank}.json")
            t = time.perf_counter()
            ctx.export_chrome_trace(p)
            extra = (f" export {time.perf_counter() - t:.2f}s, "
                     f"{os.path.getsize(p) / steps / 1e6:.2f} MB/step")
        times_by.setdefault(name, []).extend(times)
        cpu_by.setdefault(name, []).extend(cpu)
        results[name] = (statistics.median(cpu_by[name]), statistics.median(times_by[name]), extra)
        del model, opt
    if rank == 0:
        b, bm = results.get("base", (None, None))[:2]
        print(f"== {kind} {size}, 2 ranks, 2x{steps} steps, torch {torch.__version__}, "
              f"FR={os.environ.get('TORCH_FR_BUFFER_SIZE', '0')}; CPU-time / wall median per step")
        for name, (m, med, extra) in results.items():
            rel = f" ({m / b:.2f}x / {med / bm:.2f}x)" if b else ""
            print(f"  {name:<12} {m * 1e3:8.1f} / {med * 1e3:8.1f} ms{rel}{extra}")
        print(json.dumps({k: [round(v[0] * 1e3, 1), round(v[1] * 1e3, 1)]
                          for k, v in results.items()}))


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "ddp"
    size = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
    spawn(run, 2, (kind, size, steps, only))
