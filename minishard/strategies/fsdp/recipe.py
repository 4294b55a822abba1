"""The recipe that shards minishard's GPT, the way torchtitan's ``apply_fsdp`` shards a Llama:
one unit per wrap target — each block by default — bottom-up, then the root for what is left
(the embeddings, the final norm, the head). The engine's FSDP strategies, the course, the
exercises and the tests all shard through it, so "one unit per block" means the same units
everywhere.
"""
from __future__ import annotations

import torch.nn as nn

from .api import fully_shard


def wrap_targets(net: nn.Module, wrap: str) -> list[tuple[str, nn.Module]]:
    """The modules that become FSDP units below the root: each block, each Linear, or none."""
    if wrap == "block":
        return [(f"blocks.{i}", b) for i, b in enumerate(net.blocks)]
    if wrap == "linear":
        return [(n, m) for n, m in net.named_modules() if isinstance(m, nn.Linear)]
    if wrap == "model":
        return []
    raise ValueError(f"unknown wrap policy {wrap!r}; expected block, model or linear")


def apply_fsdp(net: nn.Module, *, wrap: str = "block", blocks: dict | None = None, root: dict | None = None,
               **common) -> nn.Module:
    """``fully_shard`` every wrap target (named by its place, ``blocks.0`` …), then the root
    (named ``root``). ``common``: ``fully_shard``'s arguments for every unit; ``blocks`` and
    ``root``: more for the units below the root, and for the root alone (its own
    ``reshard_after_forward``, say). Returns ``net``."""
    for name, module in wrap_targets(net, wrap):
        fully_shard(module, name=name, **common, **(blocks or {}))
    return fully_shard(net, name="root", **common, **(root or {}))
