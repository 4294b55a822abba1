"""A throw-away prototype of the mapping (not the feature): torch FSDP2 / DDP / ZeRO on 2 gloo
ranks -> minishard.core.trace.Tracer events (phase, collective, alloc/free, unit) -> rank*.jsonl,
then `python -m minishard view DIR` reads it. Shows the schema fits and which instrument feeds
which field; the memory part is deliberately rough (see docs/watch-spike.md).

    .venv/bin/python scripts/spike/exp_watch_proto.py [fsdp|ddp|zero] [DIR]
    .venv/bin/python -m minishard view DIR

Instruments (no profiler, no TorchDispatchMode):
  phases      root module forward pre/post hooks, opt.register_step_pre/post_hook, w.step()
  collectives FSDP2: set_custom_all_gather / set_custom_reduce_scatter (unit-named);
              DDP: register_comm_hook (bucket-named); everything else (ZeRO's broadcasts):
              wrappers on torch.distributed.broadcast / all_reduce / all_gather_into_tensor
  units       per-instance wrappers on FSDPParamGroup._to_unsharded / _to_sharded /
              _to_sharded_post_forward + the all-gather issue (unsharding)
  memory      params & optimizer state: storages' nbytes; unsharded: the unit's unsharded
              bytes on each state change; comm_buffers: Comm.allocate() + weakref.finalize;
              activations: saved_tensors_hooks (freed at backward end, roughly)
"""
import os
import sys
import time
import weakref

sys.path.insert(0, os.path.dirname(__file__))
import torch
import torch.distributed as dist

from common import build, data, spawn

from minishard.core.comm import ring_wire_bytes
from minishard.core.trace import Tracer


def _nbytes(t):
    return t.numel() * t.element_size()


class Watch:
    def __init__(self, model, opt, tracer):
        self.tr, self.model, self.opt = tracer, model, opt
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self._act = {}
        self._undo = []
        self._phase_open = None

    # ---- collectives
    def collective(self, op, nbytes, dtype, t, t_end, tag, group=None, **extra):
        g = group or self.world
        self.tr.emit("collective", t=t, t_end=round(t_end, 7), op=op, payload=nbytes,
                     wire=ring_wire_bytes(op, nbytes, g, self.rank, extra.get("src", 0)),
                     dtype=str(dtype).replace("torch.", ""), group=g, tag=tag)

    def timed(self, op, nbytes, dtype, tag, work, **extra):
        t0 = self.tr.now()
        if work is None:
            self.collective(op, nbytes, dtype, t0, self.tr.now(), tag, **extra)
            return
        try:
            work.get_future().then(
                lambda f: self.collective(op, nbytes, dtype, t0, self.tr.now(), tag, **extra))
        except RuntimeError:      # gloo reduce_scatter Work: no future; FSDP waits on it anyway
            work.wait()
            self.collective(op, nbytes, dtype, t0, self.tr.now(), tag, **extra)

    # ---- FSDP2
    def attach_fsdp(self):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllGather,
                                                                           DefaultReduceScatter)
        w = self

        def buffer(t, unit, what):
            tag, nb = f"{what}:{unit}:{id(t)}", _nbytes(t)
            w.tr.emit("alloc", category="comm_buffers", bytes=nb, tag=tag, device="host")
            # the callback must not hold t (a closure over t keeps it alive forever)
            weakref.finalize(t, lambda: w.tr.emit("free", category="comm_buffers",
                                                  bytes=nb, tag=tag, device="host"))

        class AG(DefaultAllGather):
            def __init__(self, unit):
                self.unit = unit

            def allocate(self, size, *, dtype, device):
                t = super().allocate(size, dtype=dtype, device=device)
                buffer(t, self.unit, "ag")
                return t

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                w.tr.emit("unit", name=self.unit, state="unsharding")
                t0 = w.tr.now()
                work = super().__call__(output_tensor, input_tensor, group, async_op)
                if work is None or async_op is False:
                    w.collective("all_gather", _nbytes(output_tensor), output_tensor.dtype, t0,
                                 w.tr.now(), f"ag:{self.unit}", group=group.size())
                else:
                    w.timed("all_gather", _nbytes(output_tensor), output_tensor.dtype,
                            f"ag:{self.unit}", work, group=group.size())
                return work

        class RS(DefaultReduceScatter):
            def __init__(self, unit):
                self.unit = unit

            def allocate(self, size, *, dtype, device):
                t = super().allocate(size, dtype=dtype, device=device)
                buffer(t, self.unit, "rs")
                return t

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                t0 = w.tr.now()
                work = super().__call__(output_tensor, input_tensor, group, op, async_op)
                w.collective("reduce_scatter", _nbytes(input_tensor), input_tensor.dtype, t0,
                             w.tr.now(), f"rs:{self.unit}", group=group.size())
                return work

        for name, m in self.model.named_modules():
            if not isinstance(m, FSDPModule):
                continue
            unit = name or "root"
            m.set_custom_all_gather(AG(unit))
            m.set_custom_reduce_scatter(RS(unit))
            for pg in m._get_fsdp_state()._fsdp_param_groups:
                full = sum(fp._orig_size.numel() for fp in pg.fsdp_params) * 4   # fp32 here
                for meth, state in (("_to_unsharded", "unsharded"), ("_to_sharded", "sharded"),
                                    ("_to_sharded_post_forward", "sharded")):
                    orig = getattr(pg, meth)

                    def wrapped(orig=orig, state=state, pg=pg, unit=unit, full=full):
                        before = pg._sharded_state
                        orig()
                        if pg._sharded_state == before:
                            return
                        w.tr.emit("unit", name=unit, state=state)
                        if state == "unsharded":
                            w.tr.emit("alloc", category="unsharded", bytes=full,
                                      tag=f"unsharded:{unit}", device="host")
                        else:
                            w.tr.emit("free", category="unsharded", bytes=full,
                                      tag=f"unsharded:{unit}", device="host")
                    setattr(pg, meth, wrapped)

    # ---- DDP
    def attach_ddp(self):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        w = self

        def hook(state, bucket):
            t0 = w.tr.now()
            buf = bucket.buffer()
            w._in_hook = True
            try:
                fut = default_hooks.allreduce_hook(None, bucket)
            finally:
                w._in_hook = False

            def done(f):
                w.collective("all_reduce", _nbytes(buf), buf.dtype, t0, w.tr.now(),
                             f"bucket{bucket.index()}")
                return f.value()
            return fut.then(done)
        self.model.register_comm_hook(None, hook)

    # ---- torch.distributed's Python entry points (ZeRO's broadcasts, a user's own)
    def attach_dist(self):
        # re-entrancy guard: DDP's default allreduce_hook calls dist.all_reduce itself, so
        # without it every bucket is recorded twice (found by this prototype)
        w = self
        for fname, op in (("broadcast", "broadcast"), ("all_reduce", "all_reduce")):
            orig = getattr(dist, fname)

            def wrapped(tensor, *a, orig=orig, op=op, **k):
                if getattr(w, "_in_hook", False):
                    return orig(tensor, *a, **k)
                async_op = k.get("async_op", False)
                t0 = w.tr.now()
                work = orig(tensor, *a, **k)
                extra = {"src": k["src"]} if "src" in k else {}
                if async_op:
                    w.timed(op, _nbytes(tensor), tensor.dtype, f"dist.{op}", work, **extra)
                else:
                    w.collective(op, _nbytes(tensor), tensor.dtype, t0, w.tr.now(),
                                 f"dist.{op}", **extra)
                return work
            setattr(dist, fname, wrapped)
            self._undo.append(lambda fname=fname, orig=orig: setattr(dist, fname, orig))

    # ---- phases + coarse memory
    def attach_phases(self):
        w, root = self, self.model
        pre = root.register_forward_pre_hook(lambda m, a: w._phase("forward"), prepend=True)
        post = root.register_forward_hook(lambda m, a, o: w._phase("backward"))
        self.opt.register_step_pre_hook(lambda o, a, k: w._phase("optimizer"))
        self.opt.register_step_post_hook(lambda o, a, k: w._after_optimizer())
        self._undo += [pre.remove, post.remove]

    def _phase(self, name):
        if self._phase_open:
            self.tr.emit("phase", name=self._phase_open, edge="end")
            if self._phase_open == "backward":
                self._free_activations()
        self.tr.emit("phase", name=name, edge="begin")
        self._phase_open = name

    def _after_optimizer(self):
        if not getattr(self, "_opt_tracked", False):
            self._opt_tracked = True
            seen = set()
            for st in self.opt.state.values():
                for k, v in st.items():
                    v = v.to_local() if hasattr(v, "to_local") else v   # FSDP2: DTensor state
                    if torch.is_tensor(v) and v.untyped_storage().data_ptr() not in seen:
                        seen.add(v.untyped_storage().data_ptr())
                        cat = k if k in ("exp_avg", "exp_avg_sq", "momentum") else "master"
                        self.tr.emit("alloc", category=cat, bytes=v.untyped_storage().nbytes(),
                                     tag=f"opt:{k}:{len(seen)}", device="host")

    def _free_activations(self):
        for ptr, nb in self._act.items():
            self.tr.emit("free", category="activations", bytes=nb, tag=f"act:{ptr}",
                         device="host")
        self._act.clear()

    def __enter__(self):
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel
        seen = set()
        for n, p in self.model.named_parameters():
            lt = p.to_local() if hasattr(p, "to_local") else p
            st = lt.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                self.tr.emit("alloc", category="params", bytes=st.nbytes(), tag=f"param:{n}",
                             device="host")
        if isinstance(self.model, FSDPModule):
            self.attach_fsdp()
        elif isinstance(self.model, DistributedDataParallel):
            self.attach_ddp()
        else:
            raise TypeError(f"{type(self.model).__name__}: supported are DistributedDataParallel "
                            "and FSDP2 fully_shard modules")
        self.attach_dist()
        self.attach_phases()
        w = self

        def pack(t):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in w._act and not isinstance(t, torch.nn.Parameter):
                w._act[ptr] = st.nbytes()
                w.tr.emit("alloc", category="activations", bytes=st.nbytes(), tag=f"act:{ptr}",
                          device="host")
            return t
        self._saved = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._saved.__enter__()
        self.tr.step = 0
        self.tr.emit("phase", name="step", edge="begin")
        return self

    def step(self):
        if self._phase_open:
            self.tr.emit("phase", name=self._phase_open, edge="end")
            self._phase_open = None
        self.tr.emit("phase", name="step", edge="end")
        self.tr.step += 1
        self.tr.emit("phase", name="step", edge="begin")

    def __exit__(self, *exc):
        self._saved.__exit__(*exc)
        for u in self._undo:
            u()
        self.tr.emit("phase", name="step", edge="end")


def run(rank, world, kind, out):
    model, opt = build(kind, "nano")
    origin = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(origin, 0)                    # one origin for every rank (minishard's rule)
    tr = Tracer(rank, world, origin=float(origin))
    with Watch(model, opt, tr) as w:
        for s in range(3):
            x, y = data("nano", s, rank, world)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step()
    dist.barrier()
    tr.write_jsonl(os.path.join(out, f"rank{rank}.jsonl"))
    if rank == 0:
        from collections import Counter
        print(f"== {kind}: {len(tr.events)} events:", dict(Counter(e["kind"] for e in tr.events)))
        print("  ops:", dict(Counter((e["op"], e["payload"]) for e in tr.events
                                     if e["kind"] == "collective" and e.get("step") == 1)))


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    out = sys.argv[2] if len(sys.argv) > 2 else f"/tmp/watch_spike/proto_{kind}"
    os.makedirs(out, exist_ok=True)
    spawn(run, 2, (kind, out))
