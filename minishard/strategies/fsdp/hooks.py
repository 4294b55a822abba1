"""Every hook FSDP uses, in one place. Each hook calls a named method of the unit (or of the
root's context); the unit never calls back here.

    when                                 hook                               calls
    forward reaches the unit             module forward pre-hook            unit.pre_forward()
    forward leaves the unit              module forward hook                unit.post_forward()
    a full gradient was accumulated      post-accumulate-grad hook, per     unit.on_grad_ready(i)
                                         gradient leaf
    backward reaches the unit's outputs  gradient hook on each output       unit.pre_backward()
    the unit's backward is done          identity node on its inputs        unit.post_backward()
    backward is over                     callback queued on the autograd    context.post_backward()
                                         engine, once per backward
    forward reaches / leaves a module    module forward pre-hook / hook     (casts, no unit method)
    computing in its replicated
    parameters' own dtype

:func:`register_hooks` (``fully_shard``; not with ``manual=True``) registers the first three for
the unit's whole life. The next two belong to one forward's autograd graph and go with it: the
forward hooks attach them to that forward's tensors — not to a recomputation's (activation
checkpointing: its graph is never walked back). The first unit backward reaches queues the
end-of-backward callback (the root's context says which is first). The casts around a module that
computes in its replicated parameters' dtype are no lifecycle step: ``fully_shard`` registers
them even with ``manual=True`` (:func:`register_dtype_boundaries`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minishard.core.autograd_private import queue_callback, tree_flatten, tree_map

if TYPE_CHECKING:
    from .unit import FSDPUnit


def register_hooks(unit: "FSDPUnit") -> None:
    """The hooks a unit keeps for its whole life."""
    unit.module.register_forward_pre_hook(lambda mod, args: _pre_forward(unit, args))
    unit.module.register_forward_hook(lambda mod, args, out: _post_forward(unit, out))
    for i, leaf in enumerate(unit.layout.grad_leaves()):
        leaf.register_post_accumulate_grad_hook(lambda p, i=i: unit.on_grad_ready(i))


def _pre_forward(unit: "FSDPUnit", args: tuple) -> tuple:
    """The inputs pass through an identity node whose backward is the unit's post-backward:
    it runs after the gradients w.r.t. those inputs, i.e. after every gradient of the unit's
    parameters was accumulated (counting gradient hooks could not tell, with frozen
    parameters). Made before the unshard makes the flat layout's views, so that autograd runs
    it after them (later nodes run first)."""
    if not unit.in_backward:
        args = _RegisterPostBackward.apply(unit, *args)
    unit.pre_forward()
    return args


class _RegisterPostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None, *grads)


def _post_forward(unit: "FSDPUnit", output):
    """Then a gradient hook on every output that needs a gradient: the first to fire means
    backward has reached the unit."""
    recomputing = unit.in_backward
    unit.post_forward()
    if not recomputing:
        for t in tree_flatten(output)[0]:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda grad: _pre_backward(unit))   # (None: the gradient unchanged)
    return output


def _pre_backward(unit: "FSDPUnit") -> None:
    """The first unit backward reaches queues the end of backward on the autograd engine: it
    runs when the engine has finished this backward."""
    if unit.context.first_in_backward():
        queue_callback(unit.context.post_backward)
    unit.pre_backward()


def register_dtype_boundaries(boundaries: dict[torch.nn.Module, torch.dtype],
                              out_dtype: torch.dtype | None) -> None:
    """Each module of ``boundaries`` computes in its dtype (its replicated parameters') inside a
    unit computing in ``out_dtype``: its floating inputs are cast to that dtype on the way in
    (FSDP2's ``cast_forward_inputs``) and its floating outputs to ``out_dtype`` on the way out
    (FSDP2's ``output_dtype``); autograd casts the gradients back through both. Registered after
    the unit's hooks, the cast in runs after the unit's pre-hook and the cast out (prepended)
    before its forward hook: the unit sees on both sides what flows between units."""
    def to(d):
        def cast(t):
            return t.to(d) if torch.is_tensor(t) and t.is_floating_point() and t.dtype != d else t
        return lambda tree: tree_map(cast, tree)
    for module, dtype in boundaries.items():
        module.register_forward_pre_hook(
            lambda mod, args, kwargs, d=dtype: (to(d)(args), to(d)(kwargs)), with_kwargs=True)
        module.register_forward_hook(lambda mod, args, out: to(out_dtype)(out), prepend=True)
