"""Which parameters a new FSDP unit takes over: one :class:`ParamSlot` each, found by
:func:`collect_slots` — those of its module that no unit below it holds already."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class ParamSlot:
    """One parameter of the unit: where it lives in the module, and its global shape."""
    module: nn.Module
    name: str
    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def collect_slots(module: nn.Module, taken: dict[int, str]) -> list[ParamSlot]:
    """The parameters a new unit owns: those of ``module`` not already in a unit. ``taken`` maps
    the ids of parameters (and of shards) that earlier units took over to those units' names;
    a shard or a parameter a unit keeps replicated is skipped, an original a unit replaced is a
    tied weight."""
    slots, seen = [], {}
    for mod_name, mod in module.named_modules():
        for name, p in list(mod._parameters.items()):
            fqn = f"{mod_name + '.' if mod_name else ''}{name}"
            if p is None:
                continue
            if id(p) in taken:
                if getattr(p, "_fsdp_shard", False) or getattr(p, "_fsdp_replicated", False):
                    continue                     # held by a child unit: not ours
                raise ValueError(f"parameter {fqn} is shared with unit {taken[id(p)]!r}, which "
                                 f"already sharded it (tied weights across units): put every "
                                 f"module that uses it in one unit, or untie the weights")
            if id(p) in seen:
                raise ValueError(f"parameter {fqn} is the same tensor as {seen[id(p)]} (tied "
                                 f"weights inside one unit): minishard does not shard a tied "
                                 f"parameter; untie the weights")
            seen[id(p)] = fqn
            slots.append(ParamSlot(mod, name, fqn, p.shape, p.dtype, p.requires_grad))
    return slots
