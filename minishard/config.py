"""``TrainConfig``: everything one training run is told, typed, documented and checked once.

Every knob a chapter teaches is a field here, with the value PyTorch (or the course) uses by
default; ``train(rank, TrainConfig(...))`` runs it, under ``Ranks``, ``torchrun`` or in one
process. Bad values are refused when the config is made — before any rank starts — with a
message that names the field and the values it accepts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")
PRECISIONS = ("fp32", "bf16_mixed")
WRAPS = ("block", "model", "linear")
OFFLOADS = (None, "host", "disk")


@dataclass(frozen=True)
class TrainConfig:
    # what is trained, and how long
    strategy: str = "ddp"            # a name or alias of minishard.strategies (ddp, zero1, fsdp, ...)
    steps: int = 3                   # optimizer steps
    model: str = "tiny"              # a minishard.model config name
    model_overrides: dict = field(default_factory=dict)   # e.g. {"n_layer": 2}: config fields to change
    micro_batch: int = 4             # sequences per rank per forward
    accum: int = 1                   # micro-batches per optimizer step (gradient accumulation)
    seed: int = 0                    # initial weights (the same on every rank)
    rank_seeds: bool = False         # rank r builds its model from seed + r, as processes that
                                     # never agreed on a seed would: DDP, ZeRO and FSDP make every
                                     # rank start from rank 0's weights anyway
    data_seed: int = 1234            # the synthetic token stream
    # the optimizer and the numbers it works with
    optimizer: str = "adamw"         # adamw (weight decay 0.01), sgd, sgd_momentum (0.9)
    lr: float = 1e-3
    precision: str = "fp32"          # fp32, or bf16_mixed: bf16 compute, fp32 master and moments
    clip: float | None = None        # clip the global gradient norm to this
    freeze: tuple[str, ...] = ()     # parameters whose name starts with one of these get no grads
    # data parallelism: buckets (DDP, ZeRO-1/2) and units (FSDP)
    bucket_cap_mb: float = 25.0      # gradient bucket size, MiB (PyTorch's default)
    wrap: str = "block"              # FSDP units below the root: each block, each Linear, or none
    reshard_after_forward: bool = True   # free a unit's gathered parameters after its forward
    reshard_root: bool = False       # the root too (the textbook ZeRO-3 schedule; FSDP2 keeps it)
    prefetch: int = 0                # FSDP units gathered ahead, forward and backward
    # DeepSpeed's ZeRO-3 bounds, in elements (fsdp/limits.py): None leaves FSDP's depth rule
    prefetch_bucket_size: int | None = None   # stage3_prefetch_bucket_size: gathered ahead
    max_live_parameters: int | None = None    # stage3_max_live_parameters: gathered at once
    param_persistence_threshold: int | None = None   # stage3_param_persistence_threshold
    fsdp_accumulate_unsharded: bool = False   # accum > 1: keep full grads, one reduce-scatter
    shard_size: int = 2              # hsdp: ranks per shard group ("a node")
    # memory
    recompute: bool = False          # activation recomputation: keep each block's input only
    loss_chunk_tokens: int | None = None   # compute the loss in chunks of this many tokens
    device_budget: int | None = None       # bytes: the ledger raises DeviceOutOfMemory past it
    offload: str | None = None       # FSDP's sharded state in "host" memory or on "disk"
    offload_dir: str | None = None   # where "disk" keeps its files (default: a temporary folder)
    # what the run records and returns
    track_activations: bool = True   # enter what autograd saves in the ledger
    trace: bool = True               # record events (the player replays them)
    return_params: bool = False      # the final parameters, gathered (parity tests)
    return_state: bool = False       # this rank's optimizer state_dict
    resume_from: str | None = None   # start from a checkpoint (any world size or strategy)
    save_to: str | None = None       # save a checkpoint after the last step

    def __post_init__(self):
        from . import strategies                # (the registry: names and aliases)
        from .model import CONFIGS
        strategy = strategies.get(self.strategy)
        object.__setattr__(self, "strategy", strategy.name)
        if self.offload is not None and not strategy.offloads:
            raise ValueError(f"offload={self.offload!r} needs an FSDP strategy (fsdp, fsdp_flat, hsdp); "
                             f"{strategy.name!r} keeps its state on the device")
        object.__setattr__(self, "freeze", tuple(self.freeze))
        for name in ("steps", "micro_batch", "accum", "shard_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0, got {self.prefetch!r}")
        for name in ("prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} is a number of elements (an integer >= 0) or None, got {value!r}")
            if value is not None and not strategy.offloads:
                raise ValueError(f"{name} bounds ZeRO-3's gathers: it needs an FSDP strategy (fsdp, "
                                 f"fsdp_flat, hsdp), not {strategy.name!r}")
        _one_of("model", self.model, tuple(CONFIGS))
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("wrap", self.wrap, WRAPS)
        _one_of("offload", self.offload, OFFLOADS)
        if not self.lr > 0 or not self.bucket_cap_mb > 0:
            raise ValueError(f"lr and bucket_cap_mb must be positive (got {self.lr}, {self.bucket_cap_mb})")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be a positive norm or None, got {self.clip!r}")
        if self.device_budget is not None and not self.device_budget > 0:
            raise ValueError(f"device_budget must be a positive number of bytes, got {self.device_budget!r}")
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1, got {self.loss_chunk_tokens!r}")
        if self.offload_dir is not None and self.offload is None:
            raise ValueError("offload_dir is where offload='disk' keeps its files; set offload too")

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {[a for a in allowed]}")
