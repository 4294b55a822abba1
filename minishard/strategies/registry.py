"""The strategies: one registry, one name each, and what wrapping a model with each one builds.

Every other module asks this registry instead of comparing strategy names: the training loop
(``build``), the analytic ledger (which ZeRO stage), the planner, the checkpoint (what a save
under a strategy would hold, and what a layout is called: :func:`layout_name`) and the command
line (which names exist). A :class:`Strategy` is a small record; :func:`build` turns a freshly
made model into a :class:`Built` — the model to call, the optimizer to step, the communicators
to count, the FSDP units (each with its offload tier, if any).

    ddp   zero1   zero2   fsdp (ZeRO-3, per-parameter, as FSDP2)   fsdp_flat (FSDP1)   hsdp
    single (one process: the reference)   ddp_naive   zero1_allreduce
    torch_ddp   torch_zero1   torch_fsdp (PyTorch's own: oracles and benchmark baselines)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
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
    builder: Callable[..., "Built"] = field(repr=False, compare=False)
    aliases: tuple[str, ...] = ()      # other accepted spellings
    instrumented: bool = True          # minishard's code: every allocation and byte is recorded
    single_process: bool = False       # only on one rank
    offloads: bool = False             # can keep its sharded state in host memory or on disk
    hybrid: bool = False               # shards inside groups of shard_size ranks, replicates across
    buckets: bool = False              # reduces gradients in buckets of bucket_cap_mb
    mixed_precision: str = "bf16_mixed"   # the ledger's precision when a run asks for bf16_mixed

    def ledger_precision(self, precision: str) -> str:
        return self.mixed_precision if precision == "bf16_mixed" else precision


@dataclass
class Built:
    """A model wrapped by a strategy, ready to train. Every strategy answers the same questions
    of :func:`minishard.training.step.train_step` — :meth:`accumulating`, :meth:`synchronise`,
    :meth:`clip_grad_norm`, :meth:`track_state` — whatever it does for each (often nothing);
    the builders say what differs through the fields below."""
    strategy: Strategy
    model: nn.Module                   # call it: model(x, y) -> loss
    optimizer: Any                     # step it: .step(), .zero_grad(); may shard its state
    comms: tuple = ()                  # every process group's Comm (hybrid: shard and replica group)
    units: list = field(default_factory=list)   # FSDP units (empty for other strategies)
    no_sync: Callable[[], Any] | None = None    # context: accumulate without communicating
    sync_gradients: Callable[[], None] | None = None   # explicit sync after backward (naive DDP)
    gather: Callable[[], dict] | None = None    # the full parameters, by name
    clip: Callable[[float], torch.Tensor] | None = None   # clip by the global gradient norm
    new_state: Callable[[Any], None] | None = None       # enter new optimizer state in a ledger
    last_grad_norm: torch.Tensor | None = None  # the global norm the last clip scaled by

    def accumulating(self, quiet: bool):
        """The context of one micro-batch's forward and backward: for all but the last of a step
        (``quiet``), the strategy's way of holding its gradients back (``no_sync``), if it has
        one; otherwise the gradients reduce as backward makes them."""
        return self.no_sync() if quiet and self.no_sync is not None else contextlib.nullcontext()

    def synchronise(self, tracer=None) -> None:
        """The gradients summed over ranks after backward — naive DDP's one all-reduce, a phase
        of its own in the trace. Every other strategy reduced them while backward ran."""
        if self.sync_gradients is not None:
            with tracer.phase("sync_gradients") if tracer is not None else contextlib.nullcontext():
                self.sync_gradients()

    def track_state(self, ledger) -> None:
        """Enter in ``ledger`` (if any) the optimizer state the first step created (the moments)."""
        if ledger is not None and self.new_state is not None:
            self.new_state(ledger)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        params = self.gather() if self.gather is not None else dict(self.model.named_parameters())
        return {n: p.detach().cpu().float().clone() for n, p in params.items()}

    def layout_numel(self) -> dict:
        """What the strategy laid out on this rank, for the analytic ledger to count the same:
        ``numel`` — (elements a replicated category holds, elements a sharded one holds) of the
        trainable parameters, padding included (absent: unpadded) — and ``frozen``, the elements
        of frozen weights it keeps."""
        if hasattr(self.optimizer, "shard_numel"):          # ZeRO: its buckets' shards
            return {"numel": self.optimizer.shard_numel()}
        if self.units:                                     # FSDP: the shards the units keep
            trainable, frozen = (sum(n) for n in zip(*(u.shard_numel() for u in self.units)))
            n = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            return {"numel": (n, trainable), "frozen": frozen}
        return {"frozen": sum(p.numel() for p in self.model.parameters() if not p.requires_grad)}

    def transfer_bytes(self) -> tuple[int, int]:
        """Offload's bytes per micro-batch over every FSDP unit: (tier to device, device to tier)."""
        moves = [u.transfer_bytes() for u in self.units]
        return sum(h for h, _ in moves), sum(d for _, d in moves)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their norm *over every rank* is at most ``max_norm``;
        the norm is also kept as :attr:`last_grad_norm` (what the step was clipped by)."""
        if self.clip is not None:
            self.last_grad_norm = self.clip(max_norm)
        else:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return self.last_grad_norm


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
        raise ValueError(f"offload={config.offload!r} needs an FSDP strategy; {strategy.name!r} "
                         f"keeps its state on the device")
    return strategy.builder(strategy, net, config, comm, ledger)


def optimizer_spec(name: str, lr: float) -> tuple[type, dict]:
    if name == "adamw":
        return torch.optim.AdamW, dict(lr=lr, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD, dict(lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD, dict(lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; expected adamw, sgd or sgd_momentum")


class MasterWeights:
    """Mixed precision without sharding: bf16 working weights, an fp32 master copy that the
    optimizer updates, rounded back to bf16 after every step (what ZeRO then shards)."""

    def __init__(self, net: nn.Module, optimizer_class, ledger=None, **kwargs):
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.master = [nn.Parameter(p.detach().float()) for p in self.params]
        self.optimizer = optimizer_class(self.master, **kwargs)
        if ledger is not None:
            for i, m in enumerate(self.master):
                ledger.track("master", m, f"master:{i}")

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float()
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)
            m.grad = None

    def zero_grad(self, set_to_none: bool = False):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def checkpoint_regions(self, h) -> None:
        """For ``minishard.checkpoint``: replicas of everything; each bf16 weight is saved as its
        fp32 master (the weight is the master's rounded working copy)."""
        h.strategy = layout_name(0, h.world_size)
        masters = dict(zip(self.params, self.master))
        for p, fqn in h.names.items():
            h.order.append(fqn)
            h.add_replicated_param(fqn, p, self.optimizer, masters.get(p))


# ---------------------------------------------------------------------------- the builders

def _replicated(strategy, net, config, comm, ledger, *, wrapper=None) -> Built:
    """single, ddp_naive, ddp: every rank holds everything; ``wrapper`` averages the gradients
    (none for the single process). Mixed precision keeps an fp32 master next to bf16 weights."""
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    if config.precision == "bf16_mixed":
        net.to(torch.bfloat16)
    model = wrapper(net, comm, ledger, config) if wrapper is not None else net
    if model is net and ledger is not None:
        ledger.track_parameters(net)
    if not getattr(model, "owns_gradients", False):   # (DDP's gradients live in its buckets)
        for name, p in net.named_parameters():        # grads allocated up front, so that the
            if not p.requires_grad:                   # ledger sees them; a frozen weight has
                continue                              # none (a zero one would be decayed)
            p.grad = torch.zeros_like(p)
            if ledger is not None:
                ledger.track("grads", p.grad, f"grad:{name}")
    from minishard.core.ledger import track_optimizer_state
    if config.precision == "bf16_mixed":
        opt = MasterWeights(net, opt_class, ledger, **opt_kwargs)
        track = lambda led: track_optimizer_state(led, opt.optimizer, prefix="master_")   # noqa: E731
    else:
        opt = opt_class(net.parameters(), **opt_kwargs)
        track = lambda led: track_optimizer_state(led, opt, net)                          # noqa: E731
    return Built(strategy, model, opt, (comm,), no_sync=getattr(model, "no_sync", None),
                 sync_gradients=getattr(model, "sync_gradients", None),
                 gather=lambda: dict(net.named_parameters()),
                 clip=lambda c: torch.nn.utils.clip_grad_norm_(net.parameters(), c), new_state=track)


def _ddp(net, comm, ledger, config):
    from .ddp import DDP
    return DDP(net, comm=comm, ledger=ledger, bucket_cap_mb=config.bucket_cap_mb)


def _naive_ddp(net, comm, ledger, config):
    from .ddp import NaiveDDP
    return NaiveDDP(net, comm=comm, ledger=ledger)


def _zero(strategy, net, config, comm, ledger, *, reduce="reduce_scatter") -> Built:
    """ZeRO-1 and ZeRO-2: replicas of the weights, the optimizer state (and gradients) sharded."""
    from .zero import ZeroOptimizer
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    mixed = config.precision == "bf16_mixed"
    if mixed:
        net.to(torch.bfloat16)
    opt = ZeroOptimizer([p for p in net.parameters()], opt_class, stage=strategy.stage, comm=comm,
                        ledger=ledger, reduce=reduce, master_dtype=torch.float32 if mixed else None,
                        bucket_cap_mb=config.bucket_cap_mb, **opt_kwargs)
    # ZeRO-1 accumulates full gradients and reduces once; ZeRO-2 reduce-scatters every
    # micro-batch unless told to hold the full gradients (accumulation="no_sync")
    quiet = strategy.stage == 1 or config.accumulation == "no_sync"
    return Built(strategy, net, opt, (comm,), no_sync=opt.no_sync if quiet else None,
                 clip=opt.clip_grad_norm_)


def _fsdp(strategy, net, config, comm, ledger, *, layout="per_param", hybrid=False) -> Built:
    """ZeRO-3 / FSDP: every block a unit, the root takes the rest; hybrid shards inside groups
    of ``shard_size`` ranks and replicates across them."""
    from . import fsdp
    from .offload import OffloadPolicy, check_room, state_bytes
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    mp = fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if config.precision == "bf16_mixed" else None
    comms, replica_group = (comm,), None
    if hybrid:
        if comm.world_size % config.shard_size:
            raise ValueError(f"hsdp: world size {comm.world_size} is not a multiple of shard_size "
                             f"{config.shard_size}")
        comm, replica_group = comm.split(config.shard_size)
        comms = (comm, replica_group)
    offload = None
    if config.offload is not None:      # room for the whole state first: no unit half-made
        offload = OffloadPolicy(config.offload, config.offload_dir)
        check_room(offload, state_bytes(sum(p.numel() for p in net.parameters()) // comm.world_size))
    kw = dict(comm=comm, ledger=ledger, mp_policy=mp, offload_policy=offload, replicate=replica_group,
              layout=layout, param_persistence_threshold=config.param_persistence_threshold,
              quantized_weights=config.quantized_weights, quantized_gradients=config.quantized_gradients)
    fsdp.apply_fsdp(net, wrap=config.wrap, blocks=dict(reshard_after_forward=config.reshard_after_forward),
                    root=dict(reshard_after_forward=True if config.reshard_root else None), **kw)
    fsdp.set_prefetch(net, config.prefetch, config.prefetch)
    fsdp.set_stage3_limits(net, config.prefetch_bucket_size, config.max_live_parameters)
    # the step on the shards (with offload: the moments are made in the tier, the step runs there)
    opt = fsdp.ShardedOptimizer(net, opt_class([p for p in net.parameters() if p.requires_grad],
                                               **opt_kwargs))
    from minishard.core.ledger import track_optimizer_state
    no_sync = {"no_sync": lambda: fsdp.no_sync(net),
               "gathered": lambda: fsdp.keep_gathered(net)}.get(config.accumulation)
    return Built(strategy, net, opt, comms, units=fsdp.units(net), no_sync=no_sync,
                 gather=lambda: fsdp.full_parameters(net),
                 clip=lambda c: fsdp.clip_grad_norm_(net, c),
                 new_state=lambda led: track_optimizer_state(led, opt.optimizer, net, device=config.offload))


def _torch_fsdp(strategy, net, config, comm, ledger) -> Built:
    """PyTorch's FSDP2 ``fully_shard``, one unit per block and the root (the oracle)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .fsdp import wrap_targets
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    mp = (MixedPrecisionPolicy(torch.bfloat16, torch.float32) if config.precision == "bf16_mixed"
          else MixedPrecisionPolicy())
    units = [m for _, m in wrap_targets(net, config.wrap)]
    for m in units:
        fully_shard(m, reshard_after_forward=config.reshard_after_forward, mp_policy=mp)
    fully_shard(net, mp_policy=mp)
    _torch_prefetch(net, units, config.prefetch)
    opt = opt_class([p for p in net.parameters() if p.requires_grad], **opt_kwargs)
    no_sync = {None: lambda: _torch_fsdp_no_sync(net), "no_sync": lambda: _torch_fsdp_no_sync(net),
               "gathered": lambda: _torch_fsdp_keep_gathered(net)}.get(config.accumulation)
    return Built(strategy, net, opt, (comm,), no_sync=no_sync,
                 gather=lambda: {n: p.full_tensor() for n, p in net.named_parameters()})


def _torch_prefetch(net, units: list, depth: int) -> None:
    """minishard's ``prefetch`` depth on FSDP2's explicit lists, so that both run one schedule:
    in forward the root and each unit gather the next ``depth`` units; in backward FSDP2 gathers
    the unit before by itself (depth 1 even at ``prefetch=0``), and a deeper ``depth`` gives each
    unit the ``depth`` before it."""
    for i, m in enumerate([net, *units] if depth else []):
        if units[i:i + depth]:
            m.set_modules_to_forward_prefetch(units[i:i + depth])
    for i, m in enumerate(units if depth > 1 else []):
        if i:
            m.set_modules_to_backward_prefetch(units[max(0, i - depth):i][::-1])


def _torch_ddp(strategy, net, config, comm, ledger, *, zero=False) -> Built:
    """PyTorch's DistributedDataParallel, with ZeroRedundancyOptimizer when ``zero``."""
    from torch.nn.parallel import DistributedDataParallel
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    if config.precision == "bf16_mixed":
        net.to(torch.bfloat16)
    model = DistributedDataParallel(net, bucket_cap_mb=config.bucket_cap_mb)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt_class = partial(ZeroRedundancyOptimizer, optimizer_class=opt_class)
    # bf16 weights are stepped through an fp32 master, as minishard's DDP does (PyTorch's DDP and
    # ZeroRedundancyOptimizer keep none: stepping the bf16 weights would round updates away)
    if config.precision == "bf16_mixed":
        opt = MasterWeights(net, opt_class, **opt_kwargs)
    else:
        opt = opt_class(net.parameters(), **opt_kwargs)
    return Built(strategy, model, opt, (comm,), no_sync=model.no_sync,
                 gather=lambda: dict(net.named_parameters()),
                 clip=lambda c: torch.nn.utils.clip_grad_norm_(net.parameters(), c))


@contextlib.contextmanager
def _torch_fsdp_no_sync(net):
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


@contextlib.contextmanager
def _torch_fsdp_keep_gathered(net):
    net.set_reshard_after_backward(False)
    try:
        yield
    finally:
        net.set_reshard_after_backward(True)


_ALL = [
    Strategy("single", "one process (the reference)", 0, _replicated, single_process=True),
    Strategy("ddp_naive", "naive DDP (one all-reduce per tensor)", 0,
             partial(_replicated, wrapper=_naive_ddp)),
    Strategy("ddp", "DDP", 0, partial(_replicated, wrapper=_ddp), buckets=True),
    Strategy("zero1", "ZeRO-1", 1, _zero, aliases=("zero-1",), buckets=True),
    Strategy("zero1_allreduce", "ZeRO-1 (all-reduce, as first told)", 1,
             partial(_zero, reduce="all_reduce"), aliases=("zero1-allreduce",), buckets=True),
    Strategy("zero2", "ZeRO-2", 2, _zero, aliases=("zero-2",), buckets=True),
    Strategy("fsdp", "ZeRO-3 / FSDP (per-parameter, as FSDP2)", 3, _fsdp, aliases=("zero3", "zero-3"),
             offloads=True, mixed_precision="bf16_fsdp"),
    Strategy("fsdp_flat", "FSDP with flat parameters (as FSDP1)", 3, partial(_fsdp, layout="flat"),
             aliases=("fsdp-flat",), offloads=True, mixed_precision="bf16_fsdp"),
    Strategy("hsdp", "hybrid sharding (HSDP)", 3, partial(_fsdp, hybrid=True), offloads=True,
             hybrid=True, mixed_precision="bf16_fsdp"),
    Strategy("torch_ddp", "PyTorch DistributedDataParallel", 0, _torch_ddp, aliases=("torch-ddp",),
             instrumented=False, buckets=True),
    Strategy("torch_zero1", "PyTorch DDP + ZeroRedundancyOptimizer", 1, partial(_torch_ddp, zero=True),
             aliases=("torch-zero1",), instrumented=False, buckets=True),
    Strategy("torch_fsdp", "PyTorch FSDP2 fully_shard", 3, _torch_fsdp, aliases=("torch-fsdp",),
             instrumented=False, mixed_precision="bf16_fsdp"),
]
STRATEGIES: dict[str, Strategy] = {s.name: s for s in _ALL}
_ALIASES: dict[str, Strategy] = {a: s for s in _ALL for a in s.aliases}
# one per ZeRO stage, in the course's order: the planner compares these four; the ledger's
# calculator names them by stage (zero3 is fsdp's alias)
PLANNED = ("ddp", "zero1", "zero2", "fsdp")
STAGES = ("ddp", "zero1", "zero2", "zero3")
