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

The first three are registered once, by :func:`register_hooks` (``fully_shard``; not with
``manual=True``). The next two belong to one forward's autograd graph and go with it, so they
are attached to that forward's tensors, by :func:`register_post_backward` (from the unit's
``pre_forward``) and :func:`register_pre_backward` (from its ``post_forward``). The root queues
the last one at the first ``pre_backward`` of each backward (:func:`queue_root_post_backward`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten

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
