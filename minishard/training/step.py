"""One training step: the algorithm every strategy runs, one verb per line.

``train_step`` is the one training step of the project: :func:`minishard.training.loop.train`,
the lessons and the tests all call it, so that every chapter compares like with like. What a
strategy does differently hides behind its answers to the same five questions (``built``:
:class:`minishard.strategies.registry.Built`); what the instruments note about a step they take
through the optimizer's own step hooks (``minishard.instruments.health.note_steps``), not here.
"""
from __future__ import annotations

import contextlib
from contextlib import nullcontext
from typing import Sequence

import torch

from minishard.core.ledger import LiveLedger
from minishard.core.trace import Tracer
from minishard.strategies.registry import Built


def train_step(built: Built, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
               clip: float | None = None, ledger: LiveLedger | None = None,
               tracer: Tracer | None = None, track_activations: bool = True) -> float:
    """One optimizer step over ``batches`` (one ``(x, y)`` per micro-batch): forward and
    backward each, the gradients synchronised once (``no_sync`` around all but the last), the
    gradient clipped by its global norm, the optimizer step, the gradients zeroed. Returns the
    step's loss (the mean over its micro-batches)."""
    accum = len(batches)
    loss_sum = 0.0
    counting = ledger.activations if (ledger is not None and track_activations) else nullcontext
    with _phase(None, tracer, "step"):
        for k, (x, y) in enumerate(batches):
            with built.accumulating(quiet=k < accum - 1):     # no reduction but after the last
                with _phase(ledger, tracer, "forward"), counting():
                    loss = built.model(x, y) / accum            # forward
                with _phase(ledger, tracer, "backward"):
                    built.backward(loss)                        # backward (most reduce meanwhile)
            loss_sum += loss.item()
        built.synchronise(tracer)                               # synchronise (naive DDP only)
        with _phase(ledger, tracer, "optimizer"):
            if clip is not None:
                built.clip_grad_norm(clip)                      # clip, by the global norm
            built.step()                                        # step
            built.track_state(ledger)                           # (the moments the first step made)
            built.zero_grad()                                   # zero, in place
    return loss_sum


def _phase(ledger: LiveLedger | None, tracer: Tracer | None, name: str):
    if ledger is not None:
        return ledger.phase(name)
    return tracer.phase(name) if tracer is not None else contextlib.nullcontext()
