"""What a caller may wrap around one run's objects, the training loop not knowing why.

``train(rank, config, hooks=...)`` calls these at four moments: when the communicator is made, the model as built (before a strategy wraps it), the wrapped model, and the
communicators just before the first step. Each does nothing here. Chapter 11's planted failures
(``minishard.instruments.faults``) are the one user in the course: each wraps the object that
would make its mistake, so that the engine carries no fault of its own.
"""
from __future__ import annotations

import torch

from minishard.core.comm import Comm


class RunHooks:
    def comm(self, tracer, ledger, alone: bool) -> Comm:
        """The run's communicator (the groups a strategy splits from it are made of its class)."""
        return Comm(tracer, ledger=ledger, alone=alone)

    def check(self, config, world_size: int | None = None) -> None:
        """Refuse, before anything is built, a run these hooks cannot wrap."""

    def model(self, net: torch.nn.Module, config, rank: int) -> torch.nn.Module:
        """The model this rank starts from, as built: returned (changed or not) to be wrapped."""
        return net

    def wrapped(self, built, config, rank: int) -> None:
        """The model wrapped by its strategy (``built``), before the first step."""

    def starting(self, comms, config, rank: int, first_step: int, last_step: int) -> None:
        """Every communicator of this rank, before ``first_step`` (after a resume's load)."""
