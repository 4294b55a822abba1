"""ZeRO-3 as PyTorch's FSDP does it: units that gather their parameters just in time.

``fully_shard(block)`` for every transformer block, then ``fully_shard(model)`` for the root,
makes each one a *unit*. From then on a rank stores 1/N of every parameter (its shard; that is
what ``model.parameters()`` returns, so any element-wise ``torch.optim`` optimizer works, and
:class:`ShardedOptimizer` steps it at its place), and each unit lives through this cycle every
step::

    forward reaches the unit   unshard: all-gather the full parameters      SHARDED -> UNSHARDED
    compute
    forward leaves the unit    reshard: free the non-local part             UNSHARDED -> SHARDED
    backward reaches the unit  unshard again (the activations need them)    SHARDED -> UNSHARDED
    compute the gradients
    all gradients are in       reduce-scatter: keep the summed shard only   -> REDUCE_SCATTERING
                               reshard                                      -> SHARDED
    after backward             the optimizer steps on the shards

``reshard_after_forward=False`` keeps the full parameters from forward to backward (one
all-gather per step, like ZeRO-2's traffic, for more memory). The root unit is never resharded
after forward: backward needs it at once.

One file per idea, in the order of the lifecycle:

    state.py    what a unit holds (MemoryState) and what it is doing (TrainingState); the root's
                context every unit shares (its units, their forward order, the end of backward)
    slots.py    ParamSlot: one parameter of a unit, where it lives in its module
    layout.py   how a unit's parameters are laid out: per parameter (FSDP2) or flat (FSDP1)
    unit.py     FSDPUnit: unshard, reshard, forward, backward, reduce-scatter, prefetch
    limits.py   DeepSpeed's ZeRO-3 bounds: prefetch bucket, max live parameters, persistence
    replicated.py  parameters kept whole on every rank, in their own dtype; units of nothing else
    hooks.py    every hook, each a single call to a named method of the unit
    api.py      fully_shard, MixedPrecisionPolicy, prefetch settings (FSDP2's default: the unit
                before in backward, none in forward), no_sync, clip_grad_norm_,
                full_parameters
    recipe.py   apply_fsdp: the GPT sharded one unit per block (or Linear), then the root; the
                fsdp / fsdp_flat / hsdp strategies built on it (FSDPBuilt)
    optim.py    ShardedOptimizer: the optimizer step on the shards (and in the offload tier)
"""
from .api import (MixedPrecisionPolicy, clip_grad_norm_, full_parameters, fully_shard, keep_gathered,
                  no_sync, set_modules_to_backward_prefetch, set_modules_to_forward_prefetch,
                  set_prefetch, units)
from .limits import set_stage3_limits
from ..offload import CPUOffloadPolicy, DiskOffloadPolicy, OffloadPolicy
from .optim import ShardedOptimizer
from .recipe import apply_fsdp, wrap_targets
from .state import MemoryState, TrainingState
from .unit import FSDPUnit

__all__ = ["fully_shard", "apply_fsdp", "wrap_targets", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy", "DiskOffloadPolicy", "MemoryState", "TrainingState",
           "FSDPUnit", "ShardedOptimizer", "set_prefetch", "set_modules_to_forward_prefetch",
           "set_modules_to_backward_prefetch", "units", "no_sync", "keep_gathered", "clip_grad_norm_",
           "full_parameters", "set_stage3_limits"]
