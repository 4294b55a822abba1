"""What a unit holds and what it is doing: two states, as PyTorch's FSDP2 keeps them apart.

``MemoryState`` is what the unit's parameters occupy in memory right now (FSDP2: each
parameter's ``sharded_state``); every change is a ``unit`` event in the trace, which the player
and the course draw. ``TrainingState`` is where the unit is in the step (FSDP2: the parameter
group's ``_training_state``); it decides what a hook does — e.g. a forward during backward is a
recomputation, not a new step — and it is not traced.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class MemoryState(enum.Enum):
    """What a unit's parameters occupy. A unit rests in SHARDED or UNSHARDED (or, between its
    forward and its backward, SHARDED_POST_FORWARD); UNSHARDING and REDUCE_SCATTERING are the
    moments a collective is filling memory, shown because that is where time and bytes go."""
    SHARDED = "sharded"
    """Only this rank's shard of every parameter (1/N, padded) and the shard's gradient."""
    SHARDED_POST_FORWARD = "sharded_post_forward"
    """``reshard_after_forward=k``: between forward and backward, the shard and this rank's 1/k of
    the full parameters — its part of the all-gather that backward runs inside its group of k
    ranks (a node), instead of over all N."""
    UNSHARDING = "unsharding"
    """The shard, and an all-gather in flight into a fresh buffer (the flat layout's full buffer;
    the per-parameter layout's packed buffer, copied out into the parameters when it lands)."""
    UNSHARDED = "unsharded"
    """The full parameters, which the module computes with, next to the shard."""
    REDUCE_SCATTERING = "reduce_scattering"
    """The full parameters still, and the unit's full gradients packed into a reduce-scatter in
    flight; the shard's ``.grad`` receives this rank's summed shard when it lands."""


@dataclass
class AllGatherState:
    """An all-gather in flight (FSDP2's name): its work, the buffer it fills, and the buffer's
    autograd version before it (put back when it lands: the gathered values are the saved ones)."""
    work: object
    buffer: torch.Tensor
    version: int


@dataclass
class ReduceScatterState:
    """A reduce-scatter in flight: its work, the shard it fills, and the packed full gradients it
    reads (alive until it lands)."""
    work: object
    output: torch.Tensor
    input: torch.Tensor


@dataclass
class AllReduceState:
    """One all-reduce of replicated parameters' gradients in flight: its work, the flat buffer it
    sums, and the ``.grad`` tensors the sum goes back into."""
    work: object
    flat: torch.Tensor
    grads: list


class TrainingState(enum.Enum):
    """Where the unit is in the training step (what its hooks are doing)."""
    IDLE = "idle"
    """Between steps, or between its forward and its backward: no hook of the unit is running."""
    FORWARD = "forward"
    """Its forward runs: from the forward pre-hook (unshard) to the forward hook (reshard)."""
    PRE_BACKWARD = "pre_backward"
    """Backward reached its outputs: it is unsharded for, and computing, its gradients. A
    forward now is a recomputation (activation checkpointing) and changes nothing."""
    POST_BACKWARD = "post_backward"
    """Its gradients are all in: reduce-scatter issued, parameters resharded (the root stays
    unsharded). The root's end-of-backward callback brings every unit back to IDLE."""


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As PyTorch's: ``param_dtype`` for the gathered parameters and compute, ``reduce_dtype`` for
    the gradient reduce-scatter (None: in ``param_dtype``, as FSDP2 does — so a policy that names
    only bf16 compute also reduces in bf16). The sharded parameters keep their own dtype (fp32):
    they are the master weights the optimizer updates."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def after_forward_words(asked, kept) -> str:
    """What a unit does after forward, as the trace's unit-state table shows it: ``reshard``,
    ``keep`` or ``keep 1/k`` — and, where ``reshard_after_forward=None`` left it to the root's
    rule (FSDP2's clamp: the root keeps, every other unit reshards), says so."""
    what = "reshard" if kept is True else "keep" if kept is False else f"keep 1/{kept}"
    return what + (" (None: the root's rule)" if asked is None else "")


def root_rule(root, units: list) -> dict[str, str]:
    """FSDP2's rule for ``reshard_after_forward=None``, applied by the root at its first forward:
    the root keeps its parameters (backward starts with it at once), every other unit reshards.
    Returns what each unit does after forward, in words, for the trace."""
    told = {}
    for u in units:
        asked = u.reshard_after_forward
        if asked is None:
            u.reshard_after_forward = u is not root
        told[u.name] = after_forward_words(asked, u.reshard_after_forward)
    return told
