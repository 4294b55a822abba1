"""Every hook FSDP uses, in one place. Each hook is a single call to a named method of the unit.

    when                                 hook                               calls
    forward reaches the unit             module forward pre-hook            unit.pre_forward(args)
    forward leaves the unit              module forward hook                unit.post_forward(output)
    a full gradient was accumulated      post-accumulate-grad hook, per     unit.on_grad_ready(i)
                                         gradient leaf
    backward reaches the unit's outputs  gradient hook on each output       unit.pre_backward()
    the unit's backward is done          identity node on its inputs        unit.post_backward()
    backward is over                     callback queued on the autograd    root.root_post_backward()
                                         engine, once per backward
    forward reaches / leaves a module    module forward pre-hook / hook     (casts, no unit method)
    computing in its replicated
    parameters' own dtype

The first three are registered once, by :func:`register_hooks` (``fully_shard``; not with
``manual=True``). The next two belong to one forward's autograd graph and go with it, so they
are attached to that forward's tensors, by :func:`register_post_backward` (from the unit's
``pre_forward``) and :func:`register_pre_backward` (from its ``post_forward``). The root queues
the end-of-backward callback at the first ``pre_backward`` of each backward
(:func:`queue_root_post_backward`). The casts around a module that computes in its replicated
parameters' dtype are no lifecycle step: ``fully_shard`` registers them even with
``manual=True`` (:func:`register_dtype_boundaries`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten, tree_map

if TYPE_CHECKING:
    from .unit import FSDPUnit


def register_hooks(unit: "FSDPUnit") -> None:
    """The hooks a unit keeps for its whole life."""
    unit.module.register_forward_pre_hook(lambda mod, args: unit.pre_forward(args))
    unit.module.register_forward_hook(lambda mod, args, out: unit.post_forward(out))
    for i, leaf in enumerate(unit.layout.grad_leaves()):
        leaf.register_post_accumulate_grad_hook(lambda p, i=i: unit.on_grad_ready(i))


def register_post_backward(unit: "FSDPUnit", args: tuple) -> tuple:
    """Pass the unit's inputs through an identity node: in backward it runs after the gradients
    w.r.t. those inputs, i.e. after every gradient of the unit's parameters was accumulated
    (counting gradient hooks could not tell, with frozen parameters). Made before the flat
    layout's views, so that autograd runs it after them (later nodes run first)."""
    return _RegisterPostBackward.apply(unit, *args)


class _RegisterPostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None, *grads)


def register_pre_backward(unit: "FSDPUnit", output) -> None:
    """A gradient hook on every output that needs a gradient: the first to fire means backward
    has reached the unit."""
    for t in tree_flatten(output)[0]:
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(lambda grad: unit.pre_backward())   # (None: the gradient unchanged)


def queue_root_post_backward(root: "FSDPUnit") -> None:
    """Run ``root.root_post_backward`` when the autograd engine has finished this backward."""
    torch.autograd.Variable._execution_engine.queue_callback(root.root_post_backward)


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
