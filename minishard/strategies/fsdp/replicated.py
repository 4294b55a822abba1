"""Parameters a unit keeps whole on every rank (``fully_shard(..., replicate_params=...)``), in
their own dtype.

Mixed-precision recipes keep the norms whole and in fp32 while the matmuls compute in bf16 or
fp16. Inside a unit whose ``param_dtype`` is bf16, a replicated fp32 norm is DDP's parameter in
the middle of FSDP's: never gathered nor freed, its gradient all-reduced — and in its own dtype
(see ``ReplicatedParams._all_reduce_replicated``). Three things make that work:

* **Where the dtypes meet.** The module holding the replicated parameters computes in their
  dtype: its floating inputs are cast to it (FSDP2's ``cast_forward_inputs`` for a submodule with
  its own policy) and its floating outputs back to the unit's ``param_dtype`` (FSDP2's
  ``output_dtype``), so that the bf16 matmul after the norm gets bf16 again
  (``hooks.register_dtype_boundaries``). Left to torch, the dtypes would meet by chance: on the
  CPU ``layer_norm`` and ``rms_norm`` take a bf16 input with fp32 weights and return bf16
  (``rms_norm`` warning that it cannot use its fused kernel), but a norm written by hand,
  ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight``, promotes to fp32 and the
  next bf16 ``linear`` refuses it ("expected m1 and m2 to have the same dtype"). The boundary
  is a whole module, so such a module must hold nothing else: a bias kept whole next to a
  sharded weight would compute in two dtypes in one call, and is refused
  (:func:`dtype_boundaries`).
* **A unit with nothing to shard** (every parameter replicated, e.g. ``fully_shard(net.ln_f,
  replicate_params=("weight", "bias"))``): :class:`NothingToShard` — no all-gather, no
  reduce-scatter, only the all-reduce of its gradients, over an empty layout (:class:`NoShards`);
  ``fully_shard`` makes it an ``api.ReplicatedOnlyUnit``.
* **The ledger** counts the replicated parameters and their gradients at their own bytes
  (``numel * itemsize`` of their dtype; ``FSDPUnit._place_shards``): under bf16 compute an fp32
  norm still holds 4 bytes an element, and it is a parameter, not a master copy — the optimizer
  steps it directly.

The methods live here as mixins of ``FSDPUnit`` (:class:`ReplicatedParams`, every unit's; and
:class:`NothingToShard`), so that ``unit.py`` stays the lifecycle of the shards.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .layout import Accounted
from .slots import ParamSlot
from .state import AllReduceState, MemoryState


def dtype_boundaries(whole: list[ParamSlot], param_dtype: torch.dtype | None, unit: str,
                     knob: str) -> dict[nn.Module, torch.dtype]:
    """The modules that compute in their replicated parameters' own dtype, not in the unit's
    ``param_dtype``: each module holding a replicated parameter of another dtype, with that
    dtype. Refuses a module that would compute in two dtypes at once — one holding, next to
    such a parameter, parameters that are sharded (they compute in ``param_dtype``) or of
    another dtype — because its inputs can be cast to one dtype only."""
    if param_dtype is None:             # no compute dtype: every parameter computes as stored
        return {}
    kept = {id(s.module._parameters[s.name]): s.dtype for s in whole}
    out: dict[nn.Module, torch.dtype] = {}
    for s in whole:
        if s.dtype == param_dtype or s.module in out:
            continue
        others = [n for n, p in s.module.named_parameters() if kept.get(id(p)) != s.dtype]
        if others:
            where = ".".join(filter(None, (unit, s.fqn[:-len(s.name) - 1])))
            raise ValueError(
                f"{knob} with param_dtype {param_dtype}: {where} would compute in two dtypes — "
                f"{s.name} kept whole in {s.dtype}, {others[:3]} not (sharded parameters compute "
                f"in {param_dtype}). A parameter kept whole computes in its own dtype, its "
                f"module's inputs cast to it: keep all of {where}'s parameters whole, or cast "
                f"{s.fqn} to {param_dtype} yourself")
        out[s.module] = s.dtype
    return out


class NoShards(Accounted):
    """The layout of a unit whose every parameter is replicated: nothing sharded, gathered or
    reduce-scattered. Answers with nothing the questions such a unit still asks of a layout
    (``layout.Layout``); the gather's and the reduce-scatter's (``begin_unshard``,
    ``reduce_scatter_input``, ...) are never asked — ``NothingToShard`` overrides both steps."""
    mixed = False

    def __init__(self, kind: str, rank: int, world_size: int, device: torch.device,
                 dtype: torch.dtype):
        self.kind, self.rank, self.N, self.device = kind, rank, world_size, device
        self.slots: list[ParamSlot] = []
        self.sharded: list[nn.Parameter] = []
        self.unsharded: list[nn.Parameter] = []
        self.sizes, self.rows, self.inner = [], [], []
        self.per_rank = self.gather_per_rank = 0
        self.param_dtype = None
        self.reduce_dtype = self.gather_dtype = dtype

    def shard_tensors(self) -> list[torch.Tensor]:
        return []

    unsharded_tensors = grad_leaves = full_values = shard_tensors

    def trainable(self) -> list[int]:
        return []

    def unpack(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        return []

    def alloc_unsharded(self) -> None:
        pass

    free_unsharded = to_unsharded = to_sharded = drop_unsharded_grads = reshard = alloc_unsharded


class ReplicatedParams:
    """``FSDPUnit``'s methods for the parameters it keeps whole (``self.replicated``)."""

    def _replicated_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.replicated if p.grad is not None]

    def _all_reduce_replicated(self, divisor: int) -> None:
        """The replicated parameters' gradients, packed and all-reduced — one all-reduce per
        dtype, in that dtype, whatever the policy's ``reduce_dtype``. That is the sharded
        gradients' dtype: they come out of a bf16 compute and are worth summing wider. A
        replicated parameter computes its gradient in its own dtype and reduces in it, as under
        DDP; rounding a handful of fp32 norm gradients to bf16 on the wire would save nothing
        worth the error. Divided before the sum, as DDP does, so that a gradient accumulated
        onto an already reduced one (micro-batches without no_sync) stays the mean."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in self._replicated_grads():
            by_dtype.setdefault(g.dtype, []).append(g)
        self._all_reduces = [] if by_dtype else None
        for k, grads in enumerate(by_dtype.values()):
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(divisor)
            if self.ledger is not None:
                nbytes = flat.numel() * flat.element_size()
                self.ledger.alloc("comm_buffers", nbytes, f"{self.name}:ar{k}")
            work = self.comm.all_reduce(flat, async_op=True, tag=self.name)
            self._all_reduces.append(AllReduceState(work, flat, grads))

    def _finish_all_reduce(self) -> None:
        """Each ``.grad`` gets the sum over ranks (hybrid: and over the replica groups)."""
        for k, pending in enumerate(self._all_reduces):
            if pending.work is not None:
                self._wait(pending.work, "wait_reduce_scatter")
            if self.replica_group is not None:
                self.replica_group.all_reduce(pending.flat, tag=self.name)
            offset = 0
            for g in pending.grads:
                g.copy_(pending.flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            if self.ledger is not None:
                self.ledger.free(f"{self.name}:ar{k}")
        self._all_reduces = None


class NothingToShard:
    """A unit whose every parameter is kept whole (a norm of its own, say), mixed in before
    ``FSDPUnit``: the lifecycle of any unit — the same hooks, states, prefetch of the others,
    ``finish_backward``, checkpoint — but unsharding gathers nothing (the parameters are whole
    already) and the gradient reduction is the all-reduce alone. It rests in SHARDED (all it
    holds is what it keeps) and passes through REDUCE_SCATTERING when it issues its all-reduce,
    as a unit with shards does when it issues its reduce-scatter."""

    def unshard(self, async_op: bool = False) -> None:
        """Nothing to gather: the module computes with the parameters it always holds."""

    def reduce_scatter_grads(self, async_op: bool = False) -> None:
        """The replicated gradients' all-reduce (nothing to scatter); like any unit's reduction
        it waits first for the previous unit's, so at most one is in flight."""
        for u in self.context.units or [self]:
            u.wait_for_reduce_scatter()
        self._set_state(MemoryState.REDUCE_SCATTERING)
        replicas = self.replica_group.world_size if self.replica_group is not None else 1
        self._all_reduce_replicated(self.comm.world_size * replicas)
        if not async_op:
            self.wait_for_reduce_scatter()

    @torch.no_grad()
    def full_values(self, dtype: torch.dtype | None = None) -> list[tuple[ParamSlot, torch.Tensor]]:
        """Copies of the parameters, in their own dtype or ``dtype`` (no collective)."""
        return [(s, p.detach().to(dtype or p.dtype, copy=True))
                for s, p in zip(self.replicated_slots, self.replicated)]
