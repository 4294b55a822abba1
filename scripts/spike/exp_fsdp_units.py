"""2: FSDP2 unit lifecycle by module name, without the profiler.

    .venv/bin/python scripts/spike/exp_fsdp_units.py [fsdp|fsdp_mp] [raf]

raf = reshard_after_forward: 1 (default) | 0 | 2 (int: reshard to a smaller post-forward mesh;
on 2 ranks that is just "no reshard"... kept for completeness).

Three instruments, side by side, on one step (after 2 warm-up steps), rank 0:
  A. public: FSDPModule.set_custom_all_gather / set_custom_reduce_scatter with subclasses of
     the default comms: unit name, buffer sizes (allocate()), issue + completion time.
  B. internal: per-instance wrappers on FSDPParamGroup._to_unsharded / _to_sharded /
     _to_sharded_post_forward / unshard / post_backward: the memory-state changes.
  C. the "torch.distributed.fsdp.fully_shard" logger at DEBUG (pre/post forward/backward).
"""
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllGather,
                                                                   DefaultReduceScatter)

from common import build, data, spawn, train_step

T0 = time.perf_counter()
EVENTS = []


def now():
    return round((time.perf_counter() - T0) * 1e3, 2)


def emit(**ev):
    ev["t"] = now()
    EVENTS.append(ev)
    return ev


def _time_work(work, ev):
    if work is None:
        ev["t_end"] = now()
        return
    try:
        work.get_future().then(lambda f: ev.__setitem__("t_end", now()))
    except RuntimeError:            # gloo reduce_scatter: "Work::getFuture not implemented"
        def poll():
            while not work.is_completed():
                time.sleep(0.0002)
            ev["t_end"] = now()
            ev["polled"] = True
        threading.Thread(target=poll, daemon=True).start()


class WatchedAllGather(DefaultAllGather):
    def __init__(self, unit):
        self.unit = unit

    def allocate(self, size, *, dtype, device):
        t = super().allocate(size, dtype=dtype, device=device)
        emit(kind="alloc", category="comm_buffers/ag_out", unit=self.unit,
             bytes=t.numel() * t.element_size())
        return t

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ev = emit(kind="collective", op="all_gather", unit=self.unit, group=group.size(),
                  payload=output_tensor.numel() * output_tensor.element_size(),
                  dtype=str(output_tensor.dtype), async_op=async_op)
        work = super().__call__(output_tensor, input_tensor, group, async_op)
        _time_work(work, ev)
        return work


class WatchedReduceScatter(DefaultReduceScatter):
    def __init__(self, unit):
        self.unit = unit

    def allocate(self, size, *, dtype, device):
        t = super().allocate(size, dtype=dtype, device=device)
        emit(kind="alloc", category="comm_buffers/rs", unit=self.unit,
             bytes=t.numel() * t.element_size())
        return t

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        ev = emit(kind="collective", op="reduce_scatter", unit=self.unit, group=group.size(),
                  payload=input_tensor.numel() * input_tensor.element_size(),
                  dtype=str(input_tensor.dtype), async_op=async_op)
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        _time_work(work, ev)
        return work


def instrument(model):
    units = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        unit = name or "<root>"
        m.set_custom_all_gather(WatchedAllGather(unit))
        m.set_custom_reduce_scatter(WatchedReduceScatter(unit))
        for pg in m._get_fsdp_state()._fsdp_param_groups:
            for meth, state in (("_to_unsharded", "unsharded"), ("_to_sharded", "sharded"),
                                ("_to_sharded_post_forward", "sharded_post_forward")):
                orig = getattr(pg, meth)

                def wrapped(orig=orig, state=state, pg=pg, unit=unit):
                    before = pg._sharded_state
                    orig()
                    if pg._sharded_state != before:
                        emit(kind="unit", name=unit, state=state,
                             training=pg._training_state.name)
                setattr(pg, meth, wrapped)
            orig_unshard = pg.unshard

            def unshard(async_op=False, orig=orig_unshard, pg=pg, unit=unit):
                had = pg._all_gather_result is not None or pg.is_unsharded
                orig(async_op)
                if not had and pg._all_gather_result is not None:
                    emit(kind="unit", name=unit, state="unsharding",
                         training=pg._training_state.name)
            pg.unshard = unshard
        units.append(unit)
    return units


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.msgs = []

    def emit(self, record):
        self.msgs.append((now(), record.getMessage()))


def run(rank, world, kind, raf):
    model, opt = build(kind, "nano", reshard_after_forward=raf)
    units = instrument(model)
    for s in range(2):
        train_step(model, opt, *data("nano", s, rank, world))
    EVENTS.clear()
    h = Collect()
    lg = logging.getLogger("torch.distributed.fsdp.fully_shard")
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    train_step(model, opt, *data("nano", 2, rank, world))
    dist.barrier()
    time.sleep(0.1)
    lg.removeHandler(h)
    if rank == 0:
        print(f"== {kind} reshard_after_forward={raf}: units {units}; {len(EVENTS)} events")
        for ev in EVENTS:
            extra = {k: v for k, v in ev.items() if k not in ("kind", "t")}
            dur = f" dur={ev['t_end'] - ev['t']:.2f}ms" if "t_end" in ev else ""
            print(f"  {ev['t']:9.2f} {ev['kind']:<10} {extra}{dur}")
        print(f"  logger: {len(h.msgs)} DEBUG records, first {h.msgs[:3]}")


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    raf = {"1": True, "0": False}.get(sys.argv[2] if len(sys.argv) > 2 else "1", None)
    if raf is None:
        raf = int(sys.argv[2])
    spawn(run, 2, (kind, raf))
