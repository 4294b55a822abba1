"""DeepSpeed's ZeRO under watch: its collectives, its partitions and buckets in the ledger, and
stage 3's fetched submodules as units.

Every collective DeepSpeed issues goes through one object, ``deepspeed.comm``'s backend (``cdb``,
a ``TorchBackend`` over torch.distributed): its methods are wrapped on that instance while the
watch is on, so each call is recorded once, with its payload, its group and the DeepSpeed line
that issued it (the flight recorder's ``where``; ``caller`` stays the user's line).

What the engine holds is read from its ZeRO optimizer's own containers (``held``: one list per
stage, each entry a category, a tensor and a tag) at every phase change and just before every
collective, and entered by storage, once, freed when the storage dies — so the ledger follows
DeepSpeed's buckets as they are made and dropped:

* stage 0 (no ZeRO): the parameters; the gradients as autograd accumulates them; the flat
  buffer DeepSpeed all-reduces them in, a communication buffer;
* stages 1 and 2: the flat buffer every parameter of a group is a view of (``params``, padded
  for alignment), the fp32 partition each rank steps (``master`` — in fp32 training a second
  copy of the rank's part of the weights), its gradient, the reduce
  bucket (``reduce_bucket_size`` elements, a communication buffer, allocated whole);
* stage 3: the rank's partition of every parameter (``params``), the fp32 partition (a copy,
  as in stages 1 and 2), the gradient partitions (``grads``), the reduce bucket; each
  submodule's gathered parameters (``unsharded``, tagged with the module's name — and
  ``persistent`` for those under ``stage3_param_persistence_threshold``, gathered once and kept).

A tensor a collective is given that none of these holds is a communication buffer (DeepSpeed's
transient flat buckets). The optimizer's moments, the phases and the activations are the
watch's own (``session.py``).
"""
from __future__ import annotations

import os

import torch

from minishard.core.flight import call_sites
from .basics import WatchError, _bytes, _dtype

# DeepSpeed's internals this module reaches, and why no public API serves (checked on
# CHECKED_ON; tests/test_deepspeed.py resolves each against the installed DeepSpeed, and on live
# engines of every stage for "Class#attribute")
CHECKED_ON = ("0.19.8",)
_Z = "deepspeed.runtime.zero"
PRIVATE = {
    "deepspeed.comm.comm#cdb": "the one backend object every DeepSpeed collective goes through; "
        "its methods are wrapped on the instance (deepspeed.comm's module functions are "
        "reached through it, and its all-gather is a function it captured at start)",
    "deepspeed.comm.torch.TorchBackend.all_reduce": "the methods wrapped: their arguments "
        "name the tensors and the group",
    "deepspeed.comm.torch.TorchBackend.all_gather_into_tensor": "the same, all-gather",
    "deepspeed.comm.torch.TorchBackend.reduce_scatter_tensor": "the same, reduce-scatter",
    f"{_Z}.stage_1_and_2.DeepSpeedZeroOptimizer#bit16_groups_flat": "the flat buffer each "
        "parameter group's parameters are views of (no accessor)",
    f"{_Z}.stage_1_and_2.DeepSpeedZeroOptimizer#single_partition_of_fp32_groups": "the fp32 "
        "partition each rank steps",
    f"{_Z}.stage_1_and_2.DeepSpeedZeroOptimizer#ipg_buckets": "the reduce bucket(s), "
        "reduce_bucket_size elements each",
    f"{_Z}.stage_1_and_2.DeepSpeedZeroOptimizer#averaged_gradients": "the gradient partitions "
        "stage 2 keeps",
    f"{_Z}.stage3.DeepSpeedZeroOptimizer_Stage3#fp16_partitioned_groups_flat": "the rank's "
        "partition of every parameter, flat",
    f"{_Z}.stage3.DeepSpeedZeroOptimizer_Stage3#fp32_partitioned_groups_flat": "the fp32 "
        "partition the optimizer steps",
    f"{_Z}.stage3.DeepSpeedZeroOptimizer_Stage3#grad_partitions_flat_buffer": "the reduced "
        "gradient partitions",
    f"{_Z}.stage3.DeepSpeedZeroOptimizer_Stage3#ipg_buckets": "stage 3's reduce bucket, "
        "reduce_bucket_size elements",
    f"{_Z}.stage3.DeepSpeedZeroOptimizer_Stage3#parameter_offload": "the object that owns the "
        "parameter coordinator",
    f"{_Z}.partitioned_param_coordinator.PartitionedParameterCoordinator.fetch_sub_module":
        "a submodule's parameters gathered before it runs: the unit's unshard, patched on the "
        "instance (no event marks it)",
    f"{_Z}.partitioned_param_coordinator.PartitionedParameterCoordinator.release_sub_module":
        "the same, released after it ran: the unit's reshard",
    f"{_Z}.partitioned_param_coordinator.PartitionedParameterCoordinator."
    "_PartitionedParameterCoordinator__all_gather_params_": "the gathers a fetch starts, for "
        "the submodule and its prefetches (name-mangled)",
    f"{_Z}.partitioned_param_coordinator.iter_params": "the parameters a fetch gathers for its "
        "module (its own and the ones it reads of others'), as the coordinator counts them",
    "deepspeed.utils.z3_leaf_module": "whether a fetch gathers a module's children's parameters too",
}

# cdb's method -> (the op in the trace, its parameters after self, in order — read from
# deepspeed/comm/torch.py, whose decorators hide them from inspect; tests/test_private_torch.py
# compares them with the installed source — and the ones holding the payload: minishard's
# convention, the reduced buffer, the whole gathered / scattered buffer)
COLLECTIVES = {
    "all_reduce": ("all_reduce", ("tensor", "op", "group", "async_op"), "tensor"),
    "all_reduce_coalesced": ("all_reduce", ("tensors", "op", "group", "async_op"), "tensors"),
    "broadcast": ("broadcast", ("tensor", "src", "group", "async_op"), "tensor"),
    "all_gather_into_tensor": ("all_gather", ("output_tensor", "input_tensor", "group", "async_op"),
                               "output_tensor"),
    "all_gather": ("all_gather", ("tensor_list", "tensor", "group", "async_op"), "tensor_list"),
    "all_gather_coalesced": ("all_gather", ("output_tensors", "input_tensors", "group", "async_op"),
                             "output_tensors"),
    "reduce_scatter_tensor": ("reduce_scatter", ("output_tensor", "input_tensor", "op", "group",
                                                 "async_op"), "input_tensor"),
    "reduce_scatter": ("reduce_scatter", ("output", "input_list", "op", "group", "async_op"),
                       "input_list"),
    "all_to_all_single": ("all_to_all", ("output", "input", "output_split_sizes",
                                         "input_split_sizes", "group", "async_op"), "input"),
    # stages 1-2 reduce a bucket to each part's owner with these when
    # use_multi_rank_bucket_allreduce is off (a tree to dst: what a rank sends, broadcast's mirror)
    "reduce": ("reduce", ("tensor", "dst", "op", "group", "async_op"), "tensor"),
}


def _tensors(x) -> list:
    return [t for t in (x if isinstance(x, (list, tuple)) else [x]) if torch.is_tensor(t)]


def is_engine(model) -> bool:
    """DeepSpeed's data-parallel engine itself (checked without importing DeepSpeed: a job that
    never imported it cannot hold one) — not one of its subclasses, whose step differs (the
    pipeline engine's ``train_batch``, the hybrid engine's generation)."""
    cls = type(model)
    return cls.__name__ == "DeepSpeedEngine" and cls.__module__.startswith("deepspeed")


def optimizer_of(engine):
    """The torch optimizer whose step is the optimizer phase: the one DeepSpeed's ZeRO optimizer
    wraps, or the engine's own at stage 0."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def stage(engine) -> int:
    return int(engine.zero_optimization_stage())


# ---------------------------------------------------------------------------- what it holds
def held(engine):
    """(category, tensor, tag) for everything DeepSpeed's ZeRO optimizer holds now, stage by
    stage (see the module's docstring); the parameters first, so that a container that is a
    view of another (stage 3's groups of its partitions buffer) is counted once, as what it is."""
    z, opt = stage(engine), engine.optimizer
    if z == 0:
        for name, p in engine.module.named_parameters():
            yield "params", p, f"param:{name}"
        return
    # (the tags are the terms of minishard.planner.deepspeed_estimator.deepspeed_holdings, which
    # gives each one's bytes: the watch's ledger and the formula are compared term by term)
    if z in (1, 2):
        for flat in opt.bit16_groups_flat:
            yield "params", flat, "flat parameters (padded to 2N)"
        for part in opt.single_partition_of_fp32_groups:
            yield "master", part, "fp32 partition"
            if part.grad is not None:
                yield "grads", part.grad, "fp32 partition's gradient (at the step)"
        for bucket in opt.ipg_buckets.values():
            for buf in bucket.buffer:
                yield "comm_buffers", buf, "reduce bucket"
        for grads in (getattr(opt, "averaged_gradients", None) or {}).values():
            for g in ([grads] if torch.is_tensor(grads) else grads or []):
                yield "grads", g, "gradient partition (whole parameters)"
        return
    if getattr(opt, "lp_param_buffer", None) is not None:
        yield "params", opt.lp_param_buffer, "partitions"
    for flat in opt.fp16_partitioned_groups_flat:
        yield "params", flat, "partitions"
    for part in opt.fp32_partitioned_groups_flat:
        yield "master", part, "fp32 partitions"
        if part.grad is not None:
            yield "grads", part.grad, "fp32 partitions' gradient (at the step)"
    if opt.grad_partitions_flat_buffer is not None:
        yield "grads", opt.grad_partitions_flat_buffer, "gradient partitions"
    for bucket in opt.ipg_buckets.values():
        if bucket.buffer is not None:
            yield "comm_buffers", bucket.buffer, "reduce bucket"


class Adapter:
    """One watch's hold on one engine: what is patched, and the names stage 3's units carry."""

    def __init__(self, w, engine):
        import deepspeed.comm.comm as ds_comm
        if ds_comm.cdb is None:
            raise WatchError("minishard.watch: DeepSpeed's communication backend is not set up; "
                             "call deepspeed.init_distributed() and deepspeed.initialize() first")
        self.w, self.engine, self.cdb = w, engine, ds_comm.cdb
        self.stage = stage(engine)
        self.tag: str | None = None              # stage 3: the units a gather is for
        # a parameter's owning module, by the parameter's identity (stage 3's units)
        self.owner = {id(p): name or "root" for name, m in engine.module.named_modules()
                      for p in m.parameters(recurse=False)}
        self.units: dict[str, str] = {}          # unit -> its state, as last emitted
        self.unit_params: dict[str, list] = {}   # stage 3: unit -> the parameters it owns
        # DeepSpeed's folder, then its plumbing: its communicator and its profiling decorator
        # (instrument_w_nvtx wraps the calls that issue collectives): the line that issued a
        # collective is the first one past them
        root = os.path.dirname(os.path.dirname(ds_comm.__file__))
        self.library = (root + os.sep, os.path.join(root, "comm") + os.sep,
                        os.path.join(root, "utils", "nvtx.py"))

    # ------------------------------------------------------------------ the ledger
    def sweep(self) -> None:
        for category, t, tag in held(self.engine):
            if t is not None and t.numel():
                self.w._track(category, t.untyped_storage(), tag)
        self.refresh()

    def _buffer(self, t) -> None:
        """A tensor a collective is given: nothing else holds it, so it is a buffer."""
        if torch.is_tensor(t) and t.numel():
            self.w._track("comm_buffers", t.untyped_storage(), "DeepSpeed's flat bucket")

    # ------------------------------------------------------------------ collectives
    def wrap_collectives(self) -> None:
        for method, (op, params, payload) in COLLECTIVES.items():
            orig = getattr(self.cdb, method, None)
            if orig is not None:
                setattr(self.cdb, method, self._recorded(method, op, params, payload, orig))
                self.w._undo.append(lambda method=method: self.cdb.__dict__.pop(method, None))

    def _recorded(self, method: str, op: str, params: tuple, payload: str, orig):
        w = self.w

        def wrapped(*args, **kwargs):
            if w._quiet():                       # (one of DeepSpeed's collectives calls another)
                return orig(*args, **kwargs)
            a = {**dict(zip(params, args)), **kwargs}
            self.sweep()
            tensors = _tensors(a[payload])
            if self.stage == 3 and op == "all_gather":          # a unit's parameters, gathered
                self._gathered(tensors, [t for p in params if p != payload for t in _tensors(a.get(p))])
            for t in (t for p in params for t in _tensors(a.get(p))):
                self._buffer(t)
            group, src = a.get("group"), a.get("src", a.get("dst"))
            nbytes, dtype = sum(_bytes(t) for t in tensors), _dtype(tensors[0])
            # the unit it gathers (stage 3's fetches), else the DeepSpeed function that issued it
            sites = call_sites(1, library=self.library)
            tag = self.tag or sites[0].rpartition(" in ")[2] or f"deepspeed.{method}"
            t0, step = w.tracer.now(), w.tracer.step
            entry = w._issued(op, tensors[0], nbytes, group, tag, t0, sites=sites)
            with w._recording():
                work = orig(*args, **kwargs)
            w._when_done(work if a.get("async_op") else None, lambda t1: w._collective(
                op, nbytes, dtype, group, t0, t1, tag, step, src, entry=entry))
            return work
        return wrapped

    def _gathered(self, outputs: list, inputs: list) -> None:
        """Stage 3's all-gather outputs are parameters: a fetch's (tagged with its unit), or — when
        DeepSpeed gathers outside a fetch (the parameters it keeps whole, again after each step) —
        the parameter whose partition is the input (its ``ds_tensor``: DeepSpeed points the
        parameter at the output only once the gather is done)."""
        if self.tag is not None:
            for t in outputs:
                self.w._track("unsharded", t.untyped_storage(), f"unsharded:{self.tag}")
            return
        owners = {p.ds_tensor.data_ptr(): (self.owner.get(id(p), "?"), getattr(p, "ds_persist", False))
                  for p in self.engine.module.parameters() if getattr(p, "ds_tensor", None) is not None}
        for t in inputs[:1]:
            unit, persistent = owners.get(t.data_ptr(), (None, False))
            for out in outputs if unit is not None else ():
                self.w._track("unsharded", out.untyped_storage(),
                              f"unsharded:{'persistent:' if persistent else ''}{unit}")

    # ------------------------------------------------------------------ stage 3's units
    def wrap_units(self) -> None:
        """Stage 3: a unit is a module that owns parameters itself (DeepSpeed fetches each before
        it runs). Its state is read from its parameters' own (``ds_status``: all available —
        unsharded, any in flight — unsharding, else sharded) whenever the coordinator fetches or
        releases, and at every sweep: DeepSpeed releases in several places (after a module, at
        the end of backward, on a trace change), and the parameters always say what happened."""
        if self.stage != 3:
            return
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        self._status = ZeroParamStatus
        for name, m in self.engine.module.named_modules():
            params = list(m.parameters(recurse=False))
            if params:
                self.unit_params[name] = params
        coordinator = self.engine.optimizer.parameter_offload.get_param_coordinator()
        fetch, release = coordinator.fetch_sub_module, coordinator.release_sub_module
        gather_name = "_PartitionedParameterCoordinator__all_gather_params_"
        gather = getattr(coordinator, gather_name)
        from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
        from deepspeed.utils import z3_leaf_module
        fetching: list[set[int]] = []           # what each fetch under way gathers for its module

        def fetch_sub_module(module, forward):
            # its own parameters and the ones it reads of other modules' (DeepSpeed's "external"
            # parameters: a model's root reading its position table), as DeepSpeed fetches them
            fetching.append({id(p) for p in iter_params(module, recurse=z3_leaf_module(module))})
            try:
                fetch(module, forward)
            finally:
                fetching.pop()
            self.refresh()

        def release_sub_module(module, forward=False):
            release(module, forward)
            self.refresh()

        def all_gather_params(params, forward, quantize=False):
            units = sorted({self.owner.get(id(p), "?") for p in params})
            for_this_fetch = bool(fetching) and any(id(p) in fetching[-1] for p in params)
            tag = units[0] + (f" +{len(units) - 1}" if len(units) > 1 else "")
            persistent = all(getattr(p, "ds_persist", False) for p in params)
            self.tag = ("persistent:" if persistent else "" if for_this_fetch else "prefetch:") + tag
            for u in units:
                self._state(u, "unsharding")
            try:
                gather(params, forward, quantize)
            finally:
                self.tag = None
            for p in params:                    # (a gather DeepSpeed made without a collective)
                self.w._track("unsharded", p.data.untyped_storage(), f"unsharded:{self.owner.get(id(p), '?')}")

        for name, f in (("fetch_sub_module", fetch_sub_module), ("release_sub_module", release_sub_module),
                        (gather_name, all_gather_params)):
            setattr(coordinator, name, f)
            self.w._undo.append(lambda name=name: coordinator.__dict__.pop(name, None))

    def refresh(self) -> None:
        """Every unit's state, from its parameters' (emitted where it changed)."""
        for unit, params in self.unit_params.items():
            status = {p.ds_status for p in params}
            self._state(unit, "unsharded" if status == {self._status.AVAILABLE} else
                        "unsharding" if self._status.INFLIGHT in status else "sharded")

    def _name(self, module) -> str | None:
        """A unit's name: the module that owns parameters itself (DeepSpeed fetches every
        module; one that owns none, as a model's root, gathers nothing of its own)."""
        for p in module.parameters(recurse=False):
            return self.owner.get(id(p))
        return None

    def _state(self, unit: str, state: str) -> None:
        if self.units.get(unit, "sharded") != state and unit != "?":
            self.units[unit] = state
            self.w._emit("unit", name=unit, state=state)

    # ------------------------------------------------------------------ gradients (stages 0-1)
    def hook_grads(self) -> None:
        """Stages 0 and 1 keep every full gradient in ``.grad`` until the step's reduction."""
        if self.stage > 1:
            return
        for name, p in self.engine.module.named_parameters():
            if p.requires_grad:
                h = p.register_post_accumulate_grad_hook(lambda p, name=name: p.grad is not None and
                    self.w._track("grads", p.grad.untyped_storage(), f"grad:{name}"))
                self.w._undo.append(h.remove)


def attach(w, engine) -> Adapter:
    """Record ``engine``'s collectives, holdings and (stage 3) units in the watch ``w``."""
    a = Adapter(w, engine)
    a.sweep()
    w._sweeps.append(a.sweep)                   # at every phase change too
    a.wrap_collectives()
    a.wrap_units()
    a.hook_grads()
    return a
