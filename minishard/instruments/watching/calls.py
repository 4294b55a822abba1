"""``torch.distributed``'s Python collectives under watch: ZeRO's broadcasts, a user's own.

Each function is wrapped only inside the ``with``; a hook above that records the same call
(DDP's bucket hook calls ``dist.all_reduce`` itself) sets the watch's re-entrancy guard, and the
wrapper stays quiet — else every bucket would be counted twice. So does a call from minishard's
own code: its ``Comm`` records its collectives itself.
"""
from __future__ import annotations

import inspect
import sys

import torch.distributed as dist

from .basics import WatchError, _bytes, _dtype

# the function, the op it is, the argument holding the payload (minishard's convention: the
# whole gathered / scattered buffer)
WRAPPED = {"all_reduce": ("all_reduce", "tensor"), "broadcast": ("broadcast", "tensor"),
           "all_gather_into_tensor": ("all_gather", "output_tensor"),
           "reduce_scatter_tensor": ("reduce_scatter", "input")}


def attach(w) -> None:
    for fname, (op, payload_arg) in WRAPPED.items():
        orig = getattr(dist, fname)
        if getattr(orig, "__minishard_watch__", False):
            raise WatchError("minishard.watch: another watch is already on in this process; "
                             "one at a time")
        sig = inspect.signature(orig)

        # A call from minishard's own modules (its Comm, the watch) is recorded where it is made;
        # counting it here too would count it twice. The caller's module is the only signal:
        # torch.distributed passes no caller, and the engine must not tell the watch it is on.
        # (the loop's values are bound under names no torch.distributed keyword has: a caller's
        # ``op=ReduceOp.AVG`` is the reduction, and must reach the function, not rename the record)
        def wrapped(*args, _fname=fname, _orig=orig, _op=op, _sig=sig, _arg=payload_arg, **kwargs):
            fname, orig, op, sig, arg = _fname, _orig, _op, _sig, _arg
            if w._quiet() or sys._getframe(1).f_globals.get("__name__", "").startswith("minishard."):
                return orig(*args, **kwargs)
            a = sig.bind(*args, **kwargs).arguments
            t, group, src = a[arg], a.get("group"), a.get("src")
            if op == "broadcast" and src is None and group is not None:
                src = dist.get_global_rank(group, a.get("group_src") or 0)
            t0, step = w.tracer.now(), w.tracer.step
            nbytes, dtype = _bytes(t), _dtype(t)       # numbers: the record must not hold t
            entry = w._issued(op, t, nbytes, group, f"dist.{fname}", t0)
            with w._recording():
                work = orig(*args, **kwargs)
            w._when_done(work if a.get("async_op") else None, lambda t1: w._collective(
                op, nbytes, dtype, group, t0, t1, f"dist.{fname}", step, src, entry=entry))
            return work
        wrapped.__minishard_watch__ = True
        wrapped.__wrapped__ = orig
        setattr(dist, fname, wrapped)
        w._undo.append(lambda fname=fname, orig=orig: setattr(dist, fname, orig))
