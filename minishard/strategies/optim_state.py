"""The optimizer state a first step would create, created before it — in one place.

Offload wants Adam's moments in the tier before the first step allocates them on the device; a
checkpoint needs state to load into, and a save before the first step must be complete. Zeros
change nothing for Adam: it starts from zero moments (and a step count of 0). SGD does not start
from a zero momentum buffer: its first step *copies* the gradient into a new one (``clone``),
where a zero buffer gives ``(1 - dampening) * grad`` — the same only without dampening — so a
buffer made ahead is handed back to torch's own first step (:class:`MadeAhead`).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


def ensure_optimizer_state(optimizer: torch.optim.Optimizer,
                           zeros_like: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like
                           ) -> list[torch.Tensor]:
    """Give every parameter of ``optimizer`` that has no state yet the state its first step would
    create, allocated by ``zeros_like`` (e.g. an offload tier's). Returns the parameters it gave
    state to. SGD without momentum keeps no state: none is made."""
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    made = []
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
            made.append(p)
    return made


class MadeAhead:
    """SGD momentum buffers made before the first step, kept where they were made (a tier) and
    still as made: nothing stepped, loaded or wrote into them (their version counter unchanged)."""

    def __init__(self, optimizer: torch.optim.Optimizer, made: list[torch.Tensor]):
        self.optimizer = optimizer
        self.buffers = {}
        if isinstance(optimizer, torch.optim.SGD):
            for p in made:
                buf = optimizer.state[p].get("momentum_buffer")
                if buf is not None:
                    self.buffers[p] = (buf, buf._version)

    @contextlib.contextmanager
    def first_steps(self):
        """Around the optimizer's step: each buffer still as made, of a parameter this step
        updates (it has a gradient), leaves the state, so that torch's first step makes its own
        from the gradient; its values then go into the buffer made ahead, which returns."""
        taken = {}
        for p, (buf, version) in list(self.buffers.items()):
            state = self.optimizer.state.get(p, {})
            if state.get("momentum_buffer") is not buf or buf._version != version:
                del self.buffers[p]          # loaded, replaced or stepped since: torch's now
            elif p.grad is not None:
                taken[p] = state.pop("momentum_buffer")
        try:
            yield
        finally:
            for p, buf in taken.items():
                state = self.optimizer.state[p]
                made = state.get("momentum_buffer")
                if made is not None:         # the step ran: its first buffer, in the tier's
                    buf.copy_(made)
                    del self.buffers[p]
                state["momentum_buffer"] = buf
