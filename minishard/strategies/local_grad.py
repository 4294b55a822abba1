"""A gradient this rank holds only part of, which refuses to be mistaken for the whole.

Under ``fully_shard`` a parameter's ``.grad`` after backward is this rank's shard of the summed
gradient; under ZeRO-1 (reduce-scatter) it is the summed gradient in this rank's chunk and the
rank's own unreduced gradient elsewhere. Both are right for the optimizer step that follows — it
updates only what this rank owns — but a norm of them is not the model's gradient norm:
``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` would find a different total on every
rank and clip each rank differently, silently. FSDP2 avoids that with DTensor gradients whose
norm communicates; minishard's gradients are plain tensors of this subclass instead, which behave
as plain tensors in every operation except a norm, where they raise and name the clip that is
right (it sums the squares over ranks: ``fsdp.clip_grad_norm_``, ``ZeroOptimizer.clip_grad_norm_``).
"""
from __future__ import annotations

import torch

from minishard.core.autograd_private import disabled_torch_function_impl, foreach_norm

_NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm, foreach_norm}
if hasattr(torch.nn.utils, "get_total_norm"):
    _NORMS.add(torch.nn.utils.get_total_norm)

MESSAGE = ("this gradient is only this rank's part of the model's (fully_shard: its shard; ZeRO-1: "
           "the summed gradient in its chunk only), so its norm is not the model's and "
           "torch.nn.utils.clip_grad_norm_ would clip every rank differently. Clip by the global "
           "norm with minishard.strategies.fsdp.clip_grad_norm_(model, max_norm) under fully_shard, or "
           "optimizer.clip_grad_norm_(max_norm) under ZeroOptimizer; for this rank's own share, "
           "take the norm of grad.as_subclass(torch.Tensor)")


class LocalGradient(torch.Tensor):
    """A plain tensor in everything but a norm (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _NORMS:
            raise RuntimeError(MESSAGE)
        return disabled_torch_function_impl(func, types, args, kwargs or {})


def local(t: torch.Tensor) -> torch.Tensor:
    """``t`` (same memory) as a :class:`LocalGradient`."""
    return t if isinstance(t, LocalGradient) else t.as_subclass(LocalGradient)
