"""What a rank holds, said the same way for every strategy: regions of global tensors.

Every tensor of the training state — each parameter, and each optimizer state of each
parameter (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) — is a flat index space of
``numel`` elements (row-major). What a rank holds is a list of :class:`Region` s: elements
``[start, start + numel)`` of tensor ``name``, aliased by a 1-D ``view`` into the live
parameter shard or optimizer state::

    strategy      parameters                                 optimizer state
    single, ddp   the whole tensor (a replica)               the whole tensor (a replica)
    zero1, zero2  the whole tensor (a replica)               its chunk of each bucket, cut at
                                                             the parameters' boundaries
    fsdp          its rows [r*c, (r+1)*c) of dim 0           the same rows
    fsdp_flat     its chunk of the unit's flat buffer, cut   the same elements
                  at the parameters' boundaries

A replica is saved once, not N times: rank r writes chunk r of it. Padding is never saved.
Loading is the same table read the other way: a rank needs every element its regions hold.

**The protocol.** A strategy answers one question, :meth:`CheckpointRegions.checkpoint_regions`:
it enters into a :class:`Holdings` the global tensors it holds parts of and the regions it
holds. ZeRO (``ZeroOptimizer``), FSDP (``fsdp.ShardedOptimizer``) and bf16 replicas
(``strategies.MasterWeights``) answer it themselves; a plain module with a plain torch optimizer
— single process, DDP — is a replica of everything, described here. Nothing in this package knows
how any strategy lays out its state.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

from ..comm import Comm
from ..optim_state import ensure_optimizer_state
from .format import STATE_KINDS, CheckpointError


@dataclass
class Region:
    """Elements ``[start, start + numel)`` of checkpoint tensor ``name``, held in ``view``."""
    name: str                   # "param/blocks.0.attn.qkv.weight", "exp_avg/blocks.0.attn.qkv.weight"
    start: int
    view: torch.Tensor          # 1-D, aliasing the live parameter shard or optimizer state
    save: bool = True           # this rank writes these elements
    load: bool = True           # this rank must be given these elements
    cast: bool = False          # a working copy in another dtype (bf16 weights of an fp32 master):
                                # loaded from the master's values, never saved

    @property
    def numel(self) -> int:
        return self.view.numel()


@dataclass
class ShardedState:
    """This rank's part of the training state, described strategy-independently."""
    strategy: str
    rank: int
    world_size: int
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]   # name -> (global shape, dtype)
    regions: list[Region]
    optimizer: torch.optim.Optimizer | None                   # whose state the regions alias
    model_config: dict | None


class Holdings:
    """What one rank holds, filled in by a strategy's ``checkpoint_regions``.

    The strategy sets ``strategy`` (the layout's name, recorded in metadata.json) and ``order``
    (parameter names in model order: files and exports list tensors in it), declares each global
    tensor with :meth:`tensor` and enters what it holds with :meth:`add` or :meth:`replica`.
    """

    def __init__(self, rank: int, world_size: int, model: nn.Module | None = None):
        self.rank, self.world_size = rank, world_size
        self.model = model                            # the model: its parameters' names
        self.names = {p: n for n, p in model.named_parameters()} if model is not None else {}
        self.strategy: str | None = None
        self.order: list[str] = []
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.regions: list[Region] = []

    def tensor(self, name: str, shape, dtype: torch.dtype) -> None:
        """Global tensor ``name`` (``param/<fqn>`` or ``<state kind>/<fqn>``) has this shape and
        dtype (the dtype it is saved in)."""
        self.tensors.setdefault(name, (tuple(shape), dtype))

    def add(self, name: str, start: int, view: torch.Tensor, *, save: bool = True,
            load: bool = True, cast: bool = False) -> None:
        """This rank holds elements ``[start, start + view.numel())`` of ``name`` in ``view``."""
        if view.numel():
            self.regions.append(Region(name, start, view, save, load, cast))

    def replica(self, name: str, full: torch.Tensor) -> None:
        """Every rank holds the whole tensor: each needs all of it, rank r saves chunk r."""
        n = full.numel()
        c = math.ceil(n / self.world_size)
        lo, hi = min(self.rank * c, n), min((self.rank + 1) * c, n)
        self.add(name, 0, full, save=False)
        self.add(name, lo, full[lo:hi], load=False)

    def replicated(self, fqn: str, p: torch.Tensor, optimizer: torch.optim.Optimizer | None,
                   master: torch.Tensor | None = None) -> None:
        """Parameter ``fqn`` whole on every rank (``p``), with its optimizer state; with an fp32
        ``master`` copy, the master is what is saved and ``p`` its rounded working copy."""
        src = p if master is None else master
        self.tensor(f"param/{fqn}", p.shape, src.dtype)
        self.replica(f"param/{fqn}", src.detach().reshape(-1))
        if master is not None:
            self.add(f"param/{fqn}", 0, p.detach().reshape(-1), save=False, cast=True)
        for kind, t in self.optimizer_state(optimizer, src, fqn).items():
            self.tensor(f"{kind}/{fqn}", p.shape, t.dtype)
            self.replica(f"{kind}/{fqn}", t)

    @staticmethod
    def optimizer_state(optimizer: torch.optim.Optimizer | None, p: torch.Tensor,
                        where: str) -> dict[str, torch.Tensor]:
        """The per-element optimizer state of ``p``, flat, by kind (``exp_avg`` ...)."""
        st = optimizer.state.get(p, {}) if optimizer is not None else {}
        unknown = set(st) - set(STATE_KINDS) - {"step"}
        if unknown:
            raise CheckpointError(f"optimizer state {sorted(unknown)} of {where} is not per-element "
                                  f"state this checkpoint format knows ({', '.join(STATE_KINDS)})")
        return {k: st[k].detach().reshape(-1) for k in STATE_KINDS if k in st}


@runtime_checkable
class CheckpointRegions(Protocol):
    """What a strategy implements to be checkpointed: it knows its own layout. (A wrapper of a
    torch optimizer — ZeRO's, FSDP's — also has ``optimizer``: the torch optimizer whose
    per-element state its regions alias.)"""

    def checkpoint_regions(self, holdings: Holdings) -> None:
        """Enter into ``holdings`` every global tensor this rank holds a part of and the regions
        it holds; name the layout (``holdings.strategy``) and the model order
        (``holdings.order``). Called between steps, after the optimizer's state exists."""


def describe(model: nn.Module, optimizer, comm: Comm) -> ShardedState:
    """What this rank holds of the training state, as regions of global tensors (see the module
    docstring). ``optimizer`` may be None (weights only). Creates missing optimizer state."""
    net = getattr(model, "module", model)            # DDP wrappers hold the replica in .module
    _refuse_foreign(net, optimizer)
    describer = next((x for x in (optimizer, model, net) if isinstance(x, CheckpointRegions)), None)
    inner = getattr(describer, "optimizer", optimizer) if describer is not None else optimizer
    if inner is not None and not isinstance(inner, torch.optim.Optimizer):
        raise CheckpointError(f"cannot checkpoint a {type(optimizer).__name__}: expected a torch "
                              f"optimizer, or a strategy that describes its own regions")
    if inner is not None:
        ensure_optimizer_state(inner)
    h = Holdings(comm.rank, comm.world_size, net)
    if describer is not None:
        describer.checkpoint_regions(h)
    else:                                            # single process, DDP: replicas of everything
        h.strategy = "single" if comm.world_size == 1 else "ddp"
        for fqn, p in net.named_parameters():
            h.order.append(fqn)
            h.replicated(fqn, p, inner)
    if not h.strategy:
        raise CheckpointError(f"{type(describer).__name__}.checkpoint_regions named no strategy")
    tensors, regions = _in_model_order(h)
    cfg = getattr(net, "cfg", None)
    return ShardedState(h.strategy, comm.rank, comm.world_size, tensors, regions, inner,
                        dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None)


def _refuse_foreign(net: nn.Module, optimizer) -> None:
    """PyTorch's own sharded states keep layouts of their own: DCP is their checkpoint."""
    if isinstance(optimizer, _if_imported("torch.distributed.optim", "ZeroRedundancyOptimizer")):
        raise CheckpointError("PyTorch's ZeroRedundancyOptimizer keeps its own layout: use "
                              "minishard's zero1 strategy, or torch.distributed.checkpoint")
    dtensor = _if_imported("torch.distributed.tensor", "DTensor")
    if dtensor and any(isinstance(p, dtensor) for p in net.parameters()):
        raise CheckpointError("PyTorch's fully_shard (DTensor) parameters: use "
                              "torch.distributed.checkpoint, or minishard's fsdp strategy")


def _if_imported(module: str, name: str) -> tuple[type, ...]:
    """PyTorch's class ``module.name`` if its module was imported, else none: no object can be
    an instance of a class never imported. (Importing them here would cost a second — DTensor's
    module 0.5 s, ZeroRedundancyOptimizer's 0.7 s, jit-scripting PyTorch's functional optimizers.)"""
    loaded = sys.modules.get(module)
    return (getattr(loaded, name),) if loaded is not None else ()


def _in_model_order(h: Holdings) -> tuple[dict, list[Region]]:
    """Tensors and regions in model order, each parameter followed by its optimizer states:
    files and exports read well."""
    order = h.order or [n.split("/", 1)[1] for n in h.tensors if n.startswith("param/")]
    rank_of = {f: i for i, f in enumerate(order)}
    kind_of = {k: i for i, k in enumerate(("param",) + STATE_KINDS)}

    def key(name):
        kind, fqn = name.split("/", 1)
        return rank_of[fqn], kind_of[kind]

    tensors = {n: h.tensors[n] for n in sorted(h.tensors, key=key)}
    return tensors, sorted(h.regions, key=lambda g: (key(g.name), g.start))


def local_state(model: nn.Module, optimizer, comm: Comm) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """A copy of what this rank holds: tensor name -> [(start, values)] (tests assemble these)."""
    out: dict[str, list] = {}
    for g in describe(model, optimizer, comm).regions:
        if g.load and not g.cast:
            out.setdefault(g.name, []).append((g.start, g.view.clone()))
    return out
