"""The optimizer step on the shards: where it sits in FSDP's lifecycle, and where it runs."""
from __future__ import annotations

import torch
import torch.nn as nn

from minishard.strategies.offload import OffloadPolicy, OptimizerOffload, checked_policy
from minishard.strategies.optim_state import MadeAhead, ensure_optimizer_state
from .api import units
from .state import MemoryState


class ShardedOptimizer:
    """Any element-wise ``torch.optim`` optimizer over an FSDP model's parameters — which are the
    shards — stepped at its place in the lifecycle.

    Position: after backward (the root's end-of-backward callback has waited for every
    reduce-scatter and resharded every unit), before the next forward. Every unit is SHARDED:
    ``model.parameters()`` are this rank's shards (the fp32 master weights under mixed
    precision), each ``.grad`` is this rank's shard of the reduced gradient, and the optimizer
    state is born the shards' shape, 1/N of the model's. Parameters a unit keeps replicated are
    whole, with all-reduced gradients. The step communicates nothing: the next forward's
    all-gathers carry the updated shards to every rank.

    With offload (``fully_shard(offload_policy=...)``) a unit's shards, their gradients and the
    moments all live in its tier (the moments are created there now), so the step runs there —
    on the CPU for host memory, over memory-mapped files for the disk tier — and nothing
    crosses for it.

    Only the optimizer's side offloaded instead — ZeRO-Offload's choice —
    ``ShardedOptimizer(model, opt, offload_policy=CPUOffloadPolicy())`` on units with no
    offload: the moments and a master copy of the shards live in the tier and the step runs
    there; the gradient shards go out and the updated shards come back, once per step
    (``offload.OptimizerOffload``).

    Its state and ``zero_grad`` are torch.optim's (``tests/test_sharded_optimizer.py``): after the
    same steps on the same gradients the same entries (SGD without momentum none), the same values,
    the gradients None after ``zero_grad()`` and zeros after ``zero_grad(set_to_none=False)``. State
    made ahead in a tier is what a first step makes, or is handed to torch's first step
    (``optim_state.MadeAhead``: SGD's first buffer is a copy of the gradient, not a zero one).

    A checkpoint asks the units, not this wrapper, what the rank holds (``FSDPUnit.checkpoint_regions``):
    a plain torch optimizer over ``model.parameters()`` is checkpointed the same way."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 offload_policy: OffloadPolicy = OffloadPolicy()):
        self.optimizer = optimizer
        self.units = units(model)
        self.param_groups = optimizer.param_groups
        tiers = {t: tier for u in self.units for t, tier in u.offloaded().items()}
        self.offload = self._offload(checked_policy(offload_policy, "ShardedOptimizer"), bool(tiers))
        if self.offload is not None:
            tiers = dict.fromkeys(self.offload.params, self.offload.tier)
        made = ensure_optimizer_state(optimizer, lambda p: tiers[p].zeros_like(p) if p in tiers
                                      else torch.zeros_like(p)) if tiers else []
        self.made_ahead = MadeAhead(optimizer, made)

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        """Update the shards. Refuses while a unit is not sharded: its module would go on
        computing with full parameters the step did not update."""
        for u in self.units:
            if u.memory_state is not MemoryState.SHARDED:
                raise RuntimeError(f"optimizer step while FSDP unit {u.name} is {u.memory_state.value}: "
                                   f"step after backward, when every unit holds only its shard")
        with self.made_ahead.first_steps():
            if self.offload is None:
                return self.optimizer.step(closure)
            with self.offload.stepping():
                return self.optimizer.step(closure)

    def _offload(self, policy: OffloadPolicy, units_offload: bool) -> OptimizerOffload | None:
        if policy.tier is None:
            return None
        if units_offload:
            raise ValueError("ShardedOptimizer(offload_policy=...): the units already keep the optimizer "
                             "state in their tier (fully_shard(offload_policy=...)); offload one way")
        comm = self.units[0].comm
        return OptimizerOffload(policy, [p for g in self.param_groups for p in g["params"]],
                                comm.rank, comm.tracer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
