"""The strategies: one registry, one name each, and what wrapping a model with each one builds.

Every other module asks this registry instead of comparing strategy names: the training loop
(``build``), the analytic ledger (which ZeRO stage), the planner, the checkpoint (what a save
under a strategy would hold, and what a layout is called: :func:`layout_name`) and the command
line (which names exist). A :class:`Strategy` is a small record; :func:`build` turns a freshly
made model into a :class:`Built` — the model to call, the optimizer to step, the communicators
to count, the FSDP units — whose methods are what a training step asks of a strategy.

Adding a strategy: a builder in its own module (or folder) that returns a :class:`Built` (a
subclass, where the strategy does something of its own in a step), and one line in ``_ALL``.

    ddp   zero1   zero2   fsdp (ZeRO-3, per-parameter, as FSDP2)   fsdp_flat (FSDP1)   hsdp
    single (one process: the reference)   ddp_naive   zero1_allreduce
    torch_ddp   torch_zero1   torch_fsdp (PyTorch's own: oracles and benchmark baselines)
    deepspeed_zero0 … deepspeed_zero3 (DeepSpeed's ZeRO, where the idea comes from)
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

if TYPE_CHECKING:                      # (the builders import lazily: the ledger imports this module)
    from minishard.core.comm import Comm
    from minishard.training.config import TrainConfig
    from minishard.core.ledger import LiveLedger


@dataclass(frozen=True)
class Strategy:
    name: str                          # the one spelling code uses
    course_name: str                   # what the course calls it
    stage: int                         # the ZeRO stage the analytic ledger applies (0: replicas)
    # what wraps a model: "module:function" in minishard.strategies (imported when a model is
    # built, so that naming a strategy imports none), or the function itself
    builder: str | Callable[..., "Built"] = field(repr=False, compare=False)
    options: dict = field(default_factory=dict, repr=False, compare=False)   # the builder's keywords
    aliases: tuple[str, ...] = ()      # other accepted spellings
    label: str = ""                    # the planner's short name (a planned strategy's)
    planned: bool = False              # one per ZeRO stage: what the planner and its advice compare
    instrumented: bool = True          # minishard's code: every allocation and byte is recorded
    single_process: bool = False       # only on one rank
    offloads: bool = False             # can keep its sharded state in host memory or on disk
    hybrid: bool = False               # shards inside groups of shard_size ranks, replicates across
    buckets: bool = False              # reduces gradients in buckets of bucket_cap_mb
    mixed_precision: str = "bf16_mixed"   # the ledger's precision when a run asks for bf16_mixed
    library: str = "minishard"         # whose code it is: minishard, torch, or deepspeed

    def ledger_precision(self, precision: str) -> str:
        return self.mixed_precision if precision == "bf16_mixed" else precision

    def build(self, net: nn.Module, config: "TrainConfig", comm: "Comm", ledger=None) -> "Built":
        make = self.builder
        if isinstance(make, str):
            module, _, function = make.partition(":")
            make = getattr(importlib.import_module(f"minishard.strategies.{module}"), function)
        return make(self, net, config, comm, ledger, **self.options)


class Built:
    """A model wrapped by a strategy, ready to train: the questions
    :func:`minishard.training.step.train_step` and the report ask of every strategy, each
    answered here for a strategy that does nothing special, and by the strategy's own subclass
    where it does (``ReplicasBuilt`` in ddp.py, ``ZeroBuilt`` in zero.py, ``FSDPBuilt`` in
    fsdp/recipe.py, PyTorch's own in torch_native.py)."""

    def __init__(self, strategy: Strategy, model: nn.Module, optimizer: Any, comms: tuple = (),
                 units: list | None = None):
        self.strategy = strategy
        self.model = model                 # call it: model(x, y) -> loss
        self.optimizer = optimizer         # step it: .step(), .zero_grad(); may shard its state
        self.comms = tuple(comms)          # every process group's Comm (hybrid: shard and replica)
        self.units = list(units or [])     # FSDP units (empty for other strategies)
        self.last_grad_norm: torch.Tensor | None = None   # the norm the last clip scaled by

    def accumulating(self, quiet: bool):
        """The context of one micro-batch's forward and backward: for all but the last of a step
        (``quiet``), the strategy's way of holding its gradients back, if it has one; otherwise
        the gradients reduce as backward makes them."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the model: autograd, whose hooks reduce as gradients become ready
        (DeepSpeed's engine runs its own)."""
        loss.backward()

    def step(self) -> None:
        """The optimizer's step (DeepSpeed's engine clips, steps and gathers in its own)."""
        self.optimizer.step()

    def zero_grad(self) -> None:
        """Zero the gradients in place: the buffers the ledger counts live for the whole run, as
        the memory formulas have them."""
        self.optimizer.zero_grad(set_to_none=False)

    def synchronise(self, tracer=None) -> None:
        """The gradients summed over ranks after backward: nothing to do for a strategy that
        reduced them while backward ran (all but naive DDP)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their norm *over every rank* is at most ``max_norm``;
        the norm is also kept as :attr:`last_grad_norm` (what the step was clipped by)."""
        self.last_grad_norm = self._clip(max_norm)
        return self.last_grad_norm

    def _clip(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def track_state(self, ledger) -> None:
        """Enter in ``ledger`` (if any) the optimizer state the first step created (the moments)."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value by name, in fp32 on the CPU (a collective where the
        strategy shards them: every rank calls it)."""
        return {n: p.detach().cpu().float().clone() for n, p in self._parameters().items()}

    def _parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def layout_numel(self) -> dict:
        """What the strategy laid out on this rank, for the analytic ledger to count the same:
        ``numel`` — (elements a replicated category holds, elements a sharded one holds) of the
        trainable parameters, padding included (absent: unpadded) — and ``frozen``, the elements
        of frozen weights it keeps."""
        return {"frozen": sum(p.numel() for p in self.model.parameters() if not p.requires_grad)}

    def transfer_bytes(self) -> tuple[int, int]:
        """Offload's bytes per micro-batch: (tier to device, device to tier); none without offload."""
        return 0, 0


def get(name: str) -> Strategy:
    """The strategy called ``name`` (or one of its aliases)."""
    s = STRATEGIES.get(name) or _ALIASES.get(name)
    if s is None:
        raise ValueError(f"unknown strategy {name!r}; expected one of {described()}")
    return s


def layout_name(stage: int, world_size: int, *, flat: bool = False, shard_size: int | None = None) -> str:
    """The name a checkpoint records for how the state is laid out over ``world_size`` ranks: the
    registry's name of the strategy that lays it out so. Stage 0 is replicas (``single`` alone,
    ``ddp`` otherwise), 1 and 2 ZeRO's bucket shards, 3 FSDP's shards — of each parameter
    (``fsdp``) or of a flat buffer (``fsdp_flat``), or ``hsdp`` when they are cut over groups of
    ``shard_size`` ranks, fewer than the world."""
    if stage == 0:
        name = "single" if world_size == 1 else "ddp"
    elif stage in (1, 2):
        name = f"zero{stage}"
    elif shard_size is not None and shard_size != world_size:
        name = "hsdp"
    else:
        name = "fsdp_flat" if flat else "fsdp"
    return get(name).name


def described() -> str:
    """Every strategy once, by its name, with another name the course uses beside it (``zero3``
    for ``fsdp``; a hyphen for an underscore, ``zero-1`` for ``zero1``, goes without saying)."""
    def plain(a: str) -> str:
        return a.replace("-", "").replace("_", "")
    return ", ".join(s.name + "".join(f" (= {a})" for a in dict.fromkeys(map(plain, s.aliases))
                                      if a != plain(s.name))
                     for s in STRATEGIES.values())


def names(with_aliases: bool = True) -> list[str]:
    out = list(STRATEGIES)
    return out + [a for a in _ALIASES if a not in out] if with_aliases else out


def build(net: nn.Module, config: "TrainConfig", comm: "Comm", ledger: "LiveLedger | None" = None) -> Built:
    """Wrap a freshly built ``net`` (the same weights on every rank) with ``config.strategy``."""
    strategy = get(config.strategy)
    if strategy.single_process and comm.world_size > 1:
        raise ValueError(f"strategy {strategy.name!r} trains one process; use world size 1")
    if config.offload is not None and not strategy.offloads:
        raise ValueError(f"offload={config.offload!r} needs an FSDP strategy or DeepSpeed's ZeRO; "
                         f"{strategy.name!r} keeps its state on the device")
    return strategy.build(net, config, comm, ledger)


def optimizer_spec(name: str, lr: float) -> tuple[type, dict]:
    if name == "adamw":
        return torch.optim.AdamW, dict(lr=lr, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD, dict(lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD, dict(lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; expected adamw, sgd or sgd_momentum")


_ALL = [
    Strategy("single", "one process (the reference)", 0, "ddp:build_replicas", single_process=True),
    Strategy("ddp_naive", "naive DDP (one all-reduce per tensor)", 0, "ddp:build_replicas",
             dict(wrapper="naive")),
    Strategy("ddp", "DDP", 0, "ddp:build_replicas", dict(wrapper="buckets"), label="DDP", planned=True,
             buckets=True),
    Strategy("zero1", "ZeRO-1", 1, "zero:build_zero", aliases=("zero-1",), label="ZeRO-1", planned=True,
             buckets=True),
    Strategy("zero1_allreduce", "ZeRO-1 (all-reduce, as first told)", 1, "zero:build_zero",
             dict(reduce="all_reduce"), aliases=("zero1-allreduce",), buckets=True),
    Strategy("zero2", "ZeRO-2", 2, "zero:build_zero", aliases=("zero-2",), label="ZeRO-2", planned=True,
             buckets=True),
    Strategy("fsdp", "ZeRO-3 / FSDP (per-parameter, as FSDP2)", 3, "fsdp.recipe:build_fsdp",
             aliases=("zero3", "zero-3"), label="ZeRO-3 / FSDP", planned=True, offloads=True,
             mixed_precision="bf16_fsdp"),
    Strategy("fsdp_flat", "FSDP with flat parameters (as FSDP1)", 3, "fsdp.recipe:build_fsdp",
             dict(layout="flat"), aliases=("fsdp-flat",), offloads=True, mixed_precision="bf16_fsdp"),
    Strategy("hsdp", "hybrid sharding (HSDP)", 3, "fsdp.recipe:build_fsdp", dict(hybrid=True), offloads=True,
             hybrid=True, mixed_precision="bf16_fsdp"),
    Strategy("torch_ddp", "PyTorch DistributedDataParallel", 0, "torch_native:build_torch_ddp",
             aliases=("torch-ddp",), instrumented=False, buckets=True, library="torch"),
    Strategy("torch_zero1", "PyTorch DDP + ZeroRedundancyOptimizer", 1, "torch_native:build_torch_ddp",
             dict(zero=True), aliases=("torch-zero1",), instrumented=False, buckets=True, library="torch"),
    Strategy("torch_fsdp", "PyTorch FSDP2 fully_shard", 3, "torch_native:build_torch_fsdp",
             aliases=("torch-fsdp",), instrumented=False, mixed_precision="bf16_fsdp", library="torch"),
    *(Strategy(f"deepspeed_zero{k}", f"DeepSpeed ZeRO stage {k}", k,
               "deepspeed_native:build_deepspeed", dict(stage=k), aliases=(f"deepspeed-zero{k}",),
               instrumented=False, buckets=True, offloads=k > 0, library="deepspeed") for k in range(4)),
]
STRATEGIES: dict[str, Strategy] = {s.name: s for s in _ALL}
_ALIASES: dict[str, Strategy] = {a: s for s in _ALL for a in s.aliases}
# one per ZeRO stage, in the course's order: the planner compares these; the ledger's calculator
# names them by stage (a stage-3 strategy by its alias ``zero3``, the course's name for ZeRO-3)
PLANNED = tuple(s.name for s in _ALL if s.planned)
STAGES = tuple("zero3" if STRATEGIES[n].stage == 3 else n for n in PLANNED)
