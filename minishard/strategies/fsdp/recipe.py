"""The recipe that shards minishard's GPT, the way torchtitan's ``apply_fsdp`` shards a Llama:
one unit per wrap target — each block by default — bottom-up, then the root for what is left
(the embeddings, the final norm, the head). The engine's FSDP strategies (:func:`build_fsdp`,
whose :class:`FSDPBuilt` is what a training step asks of them), the course, the exercises and the
tests all shard through it, so "one unit per block" means the same units everywhere.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from minishard.core.ledger import track_optimizer_state
from ..registry import Built, optimizer_spec
from .api import (MixedPrecisionPolicy, clip_grad_norm_, full_parameters, fully_shard, keep_gathered,
                  no_sync, set_prefetch, units)
from .limits import set_stage3_limits
from .optim import ShardedOptimizer


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


# ---------------------------------------------------------------------------- as a strategy

class FSDPBuilt(Built):
    """fsdp, fsdp_flat, hsdp: the units of ``net`` (every block and the root), stepped by a
    :class:`ShardedOptimizer`. ``accumulation``: how micro-batches other than the last hold
    their gradients — ``None`` (reduce-scatter every one), ``"no_sync"`` (full gradients kept),
    ``"gathered"`` (parameters kept gathered between micro-batches)."""

    def __init__(self, strategy, net: nn.Module, optimizer: ShardedOptimizer, comms: tuple, *,
                 accumulation: str | None = None, offload: str | None = None):
        super().__init__(strategy, net, optimizer, comms, units(net))
        self.accumulation, self.offload = accumulation, offload

    def accumulating(self, quiet: bool):
        if quiet and self.accumulation == "no_sync":
            return no_sync(self.model)
        if quiet and self.accumulation == "gathered":
            return keep_gathered(self.model)
        return contextlib.nullcontext()

    def _clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(self.model, max_norm)

    def track_state(self, ledger) -> None:
        if ledger is not None:
            track_optimizer_state(ledger, self.optimizer.optimizer, self.model, device=self.offload)

    def _parameters(self) -> dict[str, torch.Tensor]:
        return full_parameters(self.model)

    def layout_numel(self) -> dict:
        trainable, frozen = (sum(n) for n in zip(*(u.shard_numel() for u in self.units)))
        n = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {"numel": (n, trainable), "frozen": frozen}

    def transfer_bytes(self) -> tuple[int, int]:
        moves = [u.transfer_bytes() for u in self.units]
        return sum(h for h, _ in moves), sum(d for _, d in moves)


def build_fsdp(strategy, net: nn.Module, config, comm, ledger, *, layout: str = "per_param",
               hybrid: bool = False) -> FSDPBuilt:
    """ZeRO-3 / FSDP: every block a unit, the root takes the rest; hybrid shards inside groups
    of ``shard_size`` ranks and replicates across them."""
    from ..offload import check_room, policy_of, state_bytes
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if config.precision == "bf16_mixed" else None
    comms, replica_group = (comm,), None
    if hybrid:
        if comm.world_size % config.shard_size:
            raise ValueError(f"hsdp: world size {comm.world_size} is not a multiple of shard_size "
                             f"{config.shard_size}")
        comm, replica_group = comm.split(config.shard_size)
        comms = (comm, replica_group)
    offload = policy_of(config.offload, config.offload_dir)    # None: OffloadPolicy(), no offload
    if config.offload is not None:      # room for the whole state first: no unit half-made
        check_room(offload, state_bytes(sum(p.numel() for p in net.parameters()) // comm.world_size))
    kw = dict(comm=comm, ledger=ledger, mp_policy=mp, offload_policy=offload, replicate=replica_group,
              layout=layout, param_persistence_threshold=config.param_persistence_threshold,
              quantized_weights=config.quantized_weights, quantized_gradients=config.quantized_gradients)
    apply_fsdp(net, wrap=config.wrap, blocks=dict(reshard_after_forward=config.reshard_after_forward),
               root=dict(reshard_after_forward=True if config.reshard_root else None), **kw)
    set_prefetch(net, config.prefetch, config.prefetch)
    set_stage3_limits(net, config.prefetch_bucket_size, config.max_live_parameters)
    # the step on the shards (with offload: the moments are made in the tier, the step runs there)
    opt = ShardedOptimizer(net, opt_class([p for p in net.parameters() if p.requires_grad], **opt_kwargs))
    return FSDPBuilt(strategy, net, opt, comms, accumulation=config.accumulation, offload=config.offload)
