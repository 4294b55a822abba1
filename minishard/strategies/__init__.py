"""The strategies: how each one splits the training state across ranks, one file (or folder) each.

    registry.py     one record per strategy name; ``build`` wraps a model with the one asked for
                    into a ``Built``: what a training step asks of every strategy
    ddp.py          DDP: every rank holds everything; gradients all-reduced in buckets
    buckets.py      the gradient buckets DDP and ZeRO reduce (and the order they fill in)
    zero.py         ZeRO-1 and ZeRO-2: the optimizer state (and gradients) sharded
    fsdp/           ZeRO-3 as PyTorch's FSDP2: units that gather their parameters just in time
    clipping.py     one global gradient norm from sharded gradients
    offload.py      state kept in host memory (or on disk) between steps
    torch_native.py PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2: the oracles
    tp.py           tensor parallelism, for comparison
    local_grad.py, optim_state.py   two small helpers the strategies share

Read ``ddp.py`` first, then ``zero.py``, then ``fsdp/`` (its own map is in ``fsdp/__init__.py``).
"""
from .ddp import MasterWeights
from .registry import (PLANNED, STAGES, STRATEGIES, Built, Strategy, build, described, get,
                       layout_name, names, optimizer_spec)

__all__ = ["PLANNED", "STAGES", "STRATEGIES", "Built", "MasterWeights", "Strategy", "build",
           "described", "get", "layout_name", "names", "optimizer_spec"]
