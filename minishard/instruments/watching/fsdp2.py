"""FSDP2 under watch: each unit's collectives and memory states, by the unit's module name.

FSDP2 takes a custom all-gather and reduce-scatter per module (``set_custom_all_gather`` /
``set_custom_reduce_scatter``, public); subclasses of its defaults record each call and each
buffer FSDP2 asks them to allocate, and still pass FSDP2's own ``isinstance`` checks. The
states come from the parameter group's memory-state changes (``_to_unsharded``,
``_to_sharded``, ``_to_sharded_post_forward``: internal, patched on the instance — the same ones
``FSDPMemTracker`` patches; tests/test_watch.py pins them).

FSDP2 **reshards before it reduce-scatters** (it keeps the unsharded gradients, not the
parameters), so its units have no ``reduce_scattering`` state: the reduce-scatter follows
``sharded``. The root's module name is ``""``; it is called ``root``, as in minishard's FSDP.
"""
from __future__ import annotations

from .basics import WatchError, _bytes, _dtype

# FSDP2's internals this module reaches, and why no public API serves (checked on CHECKED_ON;
# tests/test_private_torch.py resolves each, on a live FSDP2 model for "Class#attribute")
CHECKED_ON = ("2.13.0",)
_FS = "torch.distributed.fsdp._fully_shard"
PRIVATE = {
    f"{_FS}._fsdp_collectives.DefaultAllGather": "FSDP2's own all-gather, subclassed so the "
        "custom one set with the public set_custom_all_gather passes FSDP2's isinstance checks",
    f"{_FS}._fsdp_collectives.DefaultReduceScatter": "the same, for set_custom_reduce_scatter",
    f"{_FS}._fully_shard.FSDPModule._get_fsdp_state": "a module's FSDP state: its parameter "
        "groups (no public accessor)",
    f"{_FS}._fsdp_state.FSDPState#_fsdp_param_groups": "the groups, whose states change below",
    f"{_FS}._fsdp_param_group.FSDPParamGroup#_all_gather_comm": "the all-gather in use, put "
        "back when the watch ends (no public getter)",
    f"{_FS}._fsdp_param_group.FSDPParamGroup#_reduce_scatter_comm": "the same, reduce-scatter",
    f"{_FS}._fsdp_param_group.FSDPParamGroup#_sharded_state": "whether a reshard changed "
        "anything (the root is asked twice)",
    f"{_FS}._fsdp_param_group.FSDPParamGroup._to_unsharded": "the unit's memory-state changes, "
        "patched on the instance as FSDPMemTracker patches them: no public event marks them",
    f"{_FS}._fsdp_param_group.FSDPParamGroup._to_sharded": "the change back to sharded, patched "
        "the same way",
    f"{_FS}._fsdp_param_group.FSDPParamGroup._to_sharded_post_forward": "the change to the "
        "post-forward shard (reshard_after_forward=int), patched the same way",
}


def _comms():
    """FSDP2's default all-gather and reduce-scatter, subclassed. Built on first use: importing
    FSDP2's internals costs half a second that a DDP job need not pay."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllGather,
                                                                       DefaultReduceScatter)

    class WatchedAllGather(DefaultAllGather):
        """FSDP2's own all-gather, recorded under the unit it gathers (also a prefetch)."""

        def __init__(self, w, unit):
            self.w, self.unit = w, unit

        def allocate(self, size, *, dtype, device):
            out, w = super().allocate(size, dtype=dtype, device=device), self.w
            w._track("comm_buffers", out.untyped_storage(), f"all_gather_out:{self.unit}")
            return out

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            w = self.w
            w._emit("unit", name=self.unit, state="unsharding")
            t0, step = w.tracer.now(), w.tracer.step
            # the record keeps numbers, not the tensor: a closure holding it would keep FSDP2's
            # buffer alive until the work's future goes, and the ledger would show that
            nbytes, dtype = _bytes(output_tensor), _dtype(output_tensor)
            entry = w._issued("all_gather", output_tensor, nbytes, group, self.unit, t0)
            with w._recording():
                work = super().__call__(output_tensor, input_tensor, group, async_op)
            w._when_done(work if async_op else None, lambda t1: w._collective(
                "all_gather", nbytes, dtype, group, t0, t1, self.unit, step, entry=entry))
            return work

    class WatchedReduceScatter(DefaultReduceScatter):
        """FSDP2's own reduce-scatter; its output holds the unit's sharded gradients."""

        def __init__(self, w, unit):
            self.w, self.unit, self.allocated = w, unit, []

        def allocate(self, size, *, dtype, device):
            out = super().allocate(size, dtype=dtype, device=device)
            self.allocated.append(out)         # which buffer it is, the call below tells
            return out

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            w = self.w
            _enter_buffers(w, self.unit, self.allocated, input_tensor, output_tensor)
            t0, step = w.tracer.now(), w.tracer.step
            nbytes, dtype = _bytes(input_tensor), _dtype(input_tensor)
            entry = w._issued("reduce_scatter", input_tensor, nbytes, group, self.unit, t0)
            with w._recording():
                work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            w._when_done(work if async_op else None, lambda t1: w._collective(
                "reduce_scatter", nbytes, dtype, group, t0, t1, self.unit, step, entry=entry))
            return work

    return WatchedAllGather, WatchedReduceScatter


def _enter_buffers(w, unit: str, allocated: list, input_tensor, output_tensor) -> None:
    """FSDP2 allocates a reduce-scatter's buffers just before it calls it: the input holds the
    unit's full gradients (a communication buffer), the output its sharded ones (the gradients
    the optimizer steps). Each buffer is entered once the call tells which it is, by storage."""
    kinds = {input_tensor.untyped_storage().data_ptr(): ("comm_buffers", f"reduce_scatter_in:{unit}"),
             output_tensor.untyped_storage().data_ptr(): ("grads", f"grads:{unit} (the reduce-scatter output)")}
    for buffer in allocated:
        category, tag = kinds.get(buffer.untyped_storage().data_ptr(),
                                  ("comm_buffers", f"reduce_scatter_buffer:{unit}"))
        w._track(category, buffer.untyped_storage(), tag)
    allocated.clear()


def attach(w, model) -> None:
    """Give every FSDP2 module of ``model`` the watched collectives and unit states."""
    from torch.distributed.fsdp import FSDPModule
    WatchedAllGather, WatchedReduceScatter = _comms()
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        unit = name or "root"
        groups = m._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise WatchError(f"minishard.watch: FSDP2 module {unit!r} has {len(groups)} "
                             f"parameter groups (shard_placement_fn); one per module is supported")
        for pg in groups:
            ag, rs = pg._all_gather_comm, pg._reduce_scatter_comm
            w._undo.append(lambda m=m, ag=ag, rs=rs: (m.set_custom_all_gather(ag),
                                                     m.set_custom_reduce_scatter(rs)))
            m.set_custom_all_gather(WatchedAllGather(w, unit))
            m.set_custom_reduce_scatter(WatchedReduceScatter(w, unit))
            _states(w, pg, unit)


def _states(w, pg, unit: str) -> None:
    """One parameter group's memory-state changes, as minishard's unit states, and the gathered
    bytes the unit holds while unsharded."""
    held, hooked, gathered = [0], {}, []

    def unsharded_grads() -> None:
        """The unsharded gradients autograd accumulates into the gathered parameters (FSDP2
        copies them into the reduce-scatter input and lets them go: their storages die)."""
        for fp in pg.fsdp_params:
            p = getattr(fp, "_unsharded_param", None)
            if p is not None and p.requires_grad and id(p) not in hooked:
                hooked[id(p)] = p.register_post_accumulate_grad_hook(
                    lambda p: w._track("grads", p.grad.untyped_storage(), f"grads_unsharded:{unit}"))
    w._undo.append(lambda: [h.remove() for h in hooked.values()])
    for method, state in (("_to_unsharded", "unsharded"), ("_to_sharded", "sharded"),
                          ("_to_sharded_post_forward", "sharded")):
        orig = getattr(pg, method)

        def wrapped(orig=orig, state=state):
            before = pg._sharded_state
            orig()
            if pg._sharded_state == before:      # the root asked again: nothing changed
                return
            w._emit("unit", name=unit, state=state)
            if state == "unsharded":
                unsharded_grads()
                storages = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
                            for fp in pg.fsdp_params for o in fp.all_gather_outputs}
                # while gathered, a saved tensor in these storages is a parameter, not an
                # activation; once resharded their addresses go to other tensors
                gathered[:] = storages
                w._gathered |= set(storages)
                held[0] = sum(storages.values())
                w._emit("alloc", category="unsharded", bytes=held[0], tag=f"unsharded:{unit}",
                        device="device")
            elif held[0]:
                w._gathered -= set(gathered)
                w._emit("free", category="unsharded", bytes=held[0], tag=f"unsharded:{unit}",
                        device="device")
                held[0] = 0
        setattr(pg, method, wrapped)
        w._undo.append(lambda method=method: pg.__dict__.pop(method, None))
