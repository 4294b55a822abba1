"""The optimizer state a first step would create, created before it — in one place.

Offload wants Adam's moments in the tier before the first step allocates them on the device; a
checkpoint needs state to load into, and a save before the first step must be complete. Zeros
change nothing: Adam starts from zero moments (and a step count of 0), and SGD's first update of
a zero momentum buffer (dampening 0) equals its clone of the gradient.
"""
from __future__ import annotations

from typing import Callable

import torch


def ensure_optimizer_state(optimizer: torch.optim.Optimizer,
                           zeros_like: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like) -> None:
    """Give every parameter of ``optimizer`` that has no state yet the state its first step would
    create, allocated by ``zeros_like`` (e.g. an offload tier's)."""
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            if adam:
                state = {"step": torch.tensor(0.0), "exp_avg": zeros_like(p), "exp_avg_sq": zeros_like(p)}
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = zeros_like(p)
            elif isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0):
                state = {"momentum_buffer": zeros_like(p)}
            else:
                continue
            optimizer.state[p] = state
