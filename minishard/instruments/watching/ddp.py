"""torch DDP under watch: each bucket's all-reduce, through a comm hook around DDP's own.

A DDP model takes one comm hook, for good; the hook's state says which watch records now (None:
it is DDP's default ``allreduce_hook`` and nothing more). Step 0 runs other buckets than the
next steps: DDP first puts every parameter in one bucket, then rebuilds them in ready order (the
first capped at 1 MiB) and broadcasts the plan from C++ (not seen here). The gradients are counted
where autograd accumulates them (approximate: a ``.grad`` that is a view of a bucket,
``gradient_as_bucket_view=True``, is already counted there).
"""
from __future__ import annotations

from .basics import WatchError, _bytes, _dtype

# DDP's internals this module reaches, and why no public API serves (checked on CHECKED_ON;
# tests/test_private_torch.py resolves each, on a live DDP model for "Class#attribute")
CHECKED_ON = ("2.13.0",)
PRIVATE = {
    "torch.nn.parallel.DistributedDataParallel#_comm_hooks": "whether a comm hook is set: DDP "
        "takes one, and registering a second raises from C++ after the first was kept",
}


class _Relay:
    """The state of the one comm hook a DDP model takes: the watch on now (or None), and DDP's
    own process group (its all-reduce must stay in it: the hook's ``None`` means the world)."""
    watch = None

    def __init__(self, group):
        self.group = group


def _watched_allreduce_hook(relay: _Relay, bucket):
    """DDP's default all-reduce of a bucket (``allreduce_hook``), recorded while a watch is on."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    if relay.watch is None:
        return default_hooks.allreduce_hook(relay.group, bucket)
    return _bucket(relay.watch, bucket, default_hooks.allreduce_hook, relay.group)


def attach(w, model) -> None:
    relay = getattr(model, "_minishard_watch_hook", None)
    if relay is None:
        if model._comm_hooks:
            raise WatchError("minishard.watch: this DistributedDataParallel already has a comm "
                             "hook (DDP takes one); watch it without the hook")
        relay = _Relay(model.process_group)
        model.register_comm_hook(relay, _watched_allreduce_hook)
        model._minishard_watch_hook = relay
    relay.watch = w
    w._undo.append(lambda: setattr(relay, "watch", None))
    for name, p in model.named_parameters():
        if p.requires_grad:
            h = p.register_post_accumulate_grad_hook(
                lambda p, name=name: w._track("grads", p.grad.untyped_storage(),
                                              f"grad:{name} (approx: at accumulation)"))
            w._undo.append(h.remove)


def _bucket(w, bucket, allreduce_hook, group):
    """One DDP bucket: DDP's own all-reduce in DDP's group, timed to its future's completion."""
    buf = bucket.buffer()
    tag = f"bucket{bucket.index()}"
    w._track("comm_buffers", buf.untyped_storage(), tag)
    t0, step, payload, dtype = w.tracer.now(), w.tracer.step, _bytes(buf), _dtype(buf)
    entry = w._issued("all_reduce", buf, payload, group, tag, t0)
    with w._recording():
        fut = allreduce_hook(group, bucket)

    def done(f):
        value = f.value()        # a failed all-reduce raises here: issued, never completed
        w._collective("all_reduce", payload, dtype, group, t0, w.tracer.now(), tag, step, entry=entry)
        return value
    return fut.then(done)
