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

**Who answers.** The checkpoint asks, it never reads a strategy's internals
(:meth:`CheckpointRegions.checkpoint_regions`): a describer enters into a :class:`Holdings`
the global tensors it holds parts of and the regions it holds. Two kinds answer:

* an optimizer that lays out the state itself — ``ZeroOptimizer`` (its bucket chunks),
  ``strategies.MasterWeights`` (fp32 masters of bf16 replicas) — or a model that does (a
  strategy of one's own): it describes *everything*;
* each FSDP unit of the model (``fully_shard``): the parameters it sharded or keeps whole,
  with their state in *whichever* torch optimizer steps them — ``fsdp.ShardedOptimizer``'s, or a
  plain ``torch.optim.SGD(model.parameters())`` as FSDP2 users write it.

Every parameter no describer claimed is a replica (single process, DDP). Every parameter of the
optimizer must have been described — an optimizer whose parameters the model does not know (the
torch optimizer *inside* a ZeroOptimizer, say) is refused by name rather than saved without its
state — and every replica must be equal on every rank (checked at save: a model trained on N
ranks without DDP is not a replica, and saving rank r's chunk of each would mix N models).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

from minishard.core.comm import Comm
from minishard.strategies.optim_state import ensure_optimizer_state
from minishard.strategies.registry import layout_name
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
    replica: bool = False       # the whole tensor, which every rank must hold equal

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
    param_groups: list[dict] | None = None     # the hyperparameters as the user's optimizer holds
                                               # them (a scheduler changes the outer ones)


class Holdings:
    """What one rank holds, filled in by the describers' ``checkpoint_regions``.

    A describer declares each global tensor with :meth:`tensor` and enters what it holds with
    :meth:`add` (a region), :meth:`add_replica` (a tensor every rank holds whole) or
    :meth:`add_replicated_param` (a parameter every rank holds whole, with its optimizer state);
    it reads per-element optimizer state with :meth:`optimizer_state` (so that the checkpoint
    knows which of the optimizer's parameters were described) and claims the model's parameters
    it answered for with :meth:`claim`. A describer of everything names the layout
    (``strategy``, recorded in metadata.json) and may give the model order (``order``); units
    add their layout's name with :meth:`layout`. Either asks the registry for the name
    (:meth:`layout_name`).
    """

    def __init__(self, rank: int, world_size: int, model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None):
        self.rank, self.world_size = rank, world_size
        self.model = model                            # the model: its parameters' names
        self.optimizer = optimizer                    # the torch optimizer holding the state
        self.names = {p: n for n, p in model.named_parameters()} if model is not None else {}
        self.strategy: str | None = None
        self.layouts: set[str] = set()
        self.order: list[str] = []
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.regions: list[Region] = []
        self.claimed: set[int] = set()                # ids of the model parameters described
        self.stated: set[int] = set()                 # ids of the optimizer parameters described
        self._prefix = ({id(m): n for n, m in model.named_modules()} if model is not None else {})

    def tensor(self, name: str, shape, dtype: torch.dtype) -> None:
        """Global tensor ``name`` (``param/<fqn>`` or ``<state kind>/<fqn>``) has this shape and
        dtype (the dtype it is saved in)."""
        self.tensors.setdefault(name, (tuple(shape), dtype))

    def add(self, name: str, start: int, view: torch.Tensor, *, save: bool = True,
            load: bool = True, cast: bool = False, replica: bool = False) -> None:
        """This rank holds elements ``[start, start + view.numel())`` of ``name`` in ``view``."""
        if view.numel():
            self.regions.append(Region(name, start, view, save, load, cast, replica))

    def add_replica(self, name: str, full: torch.Tensor) -> None:
        """Every rank holds the whole tensor: each needs all of it, rank r saves chunk r."""
        n = full.numel()
        c = math.ceil(n / self.world_size)
        lo, hi = min(self.rank * c, n), min((self.rank + 1) * c, n)
        self.add(name, 0, full, save=False, replica=True)
        self.add(name, lo, full[lo:hi], load=False)

    def add_replicated_param(self, fqn: str, p: torch.Tensor, optimizer: torch.optim.Optimizer | None,
                             master: torch.Tensor | None = None) -> None:
        """Parameter ``fqn`` whole on every rank (``p``), with its optimizer state; with an fp32
        ``master`` copy, the master is what is saved and ``p`` its rounded working copy."""
        src = p if master is None else master
        self.claim(p)
        self.tensor(f"param/{fqn}", p.shape, src.dtype)
        self.add_replica(f"param/{fqn}", src.detach().reshape(-1))
        if master is not None:
            self.add(f"param/{fqn}", 0, p.detach().reshape(-1), save=False, cast=True)
        for kind, t in self.optimizer_state(optimizer, src, fqn).items():
            self.tensor(f"{kind}/{fqn}", p.shape, t.dtype)
            self.add_replica(f"{kind}/{fqn}", t)


    def claim(self, *params: torch.Tensor) -> None:
        """These parameters of the model are described: they are not replicas."""
        self.claimed.update(id(p) for p in params)

    def layout(self, name: str) -> None:
        """A unit of the model is laid out as ``name`` (``fsdp``, ``fsdp_flat``, ``hsdp``)."""
        self.layouts.add(name)

    def layout_name(self, stage: int, *, flat: bool = False, shard_size: int | None = None) -> str:
        """The registry's name for a layout over this world (:func:`minishard.strategies.layout_name`):
        describers ask here, since importing the registry would import their own builders back."""
        return layout_name(stage, self.world_size, flat=flat, shard_size=shard_size)

    def fqn(self, module: nn.Module, name: str) -> str:
        """The name of parameter ``name`` of ``module`` in the model."""
        prefix = self._prefix[id(module)]
        return f"{prefix}.{name}" if prefix else name

    def optimizer_state(self, optimizer: torch.optim.Optimizer | None, p: torch.Tensor,
                        where: str) -> dict[str, torch.Tensor]:
        """The per-element optimizer state of ``p``, flat, by kind (``exp_avg`` ...)."""
        if optimizer is None:
            return {}
        self.stated.add(id(p))
        st = optimizer.state.get(p, {})
        unknown = set(st) - set(STATE_KINDS) - {"step"}
        if unknown:
            raise CheckpointError(f"optimizer state {sorted(unknown)} of {where} is not per-element "
                                  f"state this checkpoint format knows ({', '.join(STATE_KINDS)})")
        return {k: st[k].detach().reshape(-1) for k in STATE_KINDS if k in st}


@runtime_checkable
class CheckpointRegions(Protocol):
    """What a strategy implements to be checkpointed: it knows its own layout (see the module
    docstring). An optimizer wrapper — ZeRO's, FSDP's — has ``optimizer``: the torch optimizer
    whose per-element state its regions alias."""

    def checkpoint_regions(self, holdings: Holdings) -> None:
        """Enter into ``holdings`` every global tensor this rank holds a part of and the regions
        it holds (see :class:`Holdings`). Called between steps, after the optimizer's state
        exists."""


def describe(model: nn.Module, optimizer, comm: Comm | None = None) -> ShardedState:
    """What this rank holds of the training state, as regions of global tensors (see the module
    docstring). ``optimizer`` may be None (weights only); ``comm``: the ranks saving together
    (default: the default process group). Creates missing optimizer state."""
    comm = Comm() if comm is None else comm
    net = getattr(model, "module", model)            # DDP wrappers hold the replica in .module
    _refuse_foreign(net, optimizer)
    inner = _torch_optimizer(optimizer)
    if inner is not None:
        ensure_optimizer_state(inner)
    h = Holdings(comm.rank, comm.world_size, net, inner)
    whole = next((x for x in (optimizer, model, net) if isinstance(x, CheckpointRegions)), None)
    units = _units(net)
    if whole is not None and units:
        raise CheckpointError(f"{type(whole).__name__} describes the whole training state, but the "
                              f"model also has FSDP units ({units[0].name}, ...): a model is sharded "
                              f"by fully_shard or by {type(whole).__name__}, not both")
    for describer in [whole] if whole is not None else units:
        describer.checkpoint_regions(h)
    if whole is None:                                # every parameter no unit took: a replica
        for fqn, p in net.named_parameters():
            if id(p) not in h.claimed:
                h.add_replicated_param(fqn, p, inner)
        h.strategy = _combined_layout(h)
    if not h.strategy:
        raise CheckpointError(f"{type(whole).__name__}.checkpoint_regions named no strategy")
    _refuse_undescribed(inner, h, net)
    tensors, regions = _in_model_order(h)
    cfg = getattr(net, "cfg", None)
    groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
    return ShardedState(h.strategy, comm.rank, comm.world_size, tensors, regions, inner,
                        dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None,
                        groups if groups is not None else (inner.param_groups if inner else None))


def _torch_optimizer(optimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer whose per-element state is saved: ``optimizer`` itself, or the one a
    wrapper steps (ZeroOptimizer's, ShardedOptimizer's, MasterWeights')."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "optimizer", None)
    inner = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise CheckpointError(f"cannot checkpoint a {type(optimizer).__name__}: expected a torch "
                              f"optimizer, or a strategy that describes its own regions")
    return inner


def _units(net: nn.Module) -> list:
    """The FSDP units of the model (``fully_shard``), each a describer of its own parameters."""
    return [m._fsdp_unit for m in net.modules() if isinstance(getattr(m, "_fsdp_unit", None),
                                                              CheckpointRegions)]


def _combined_layout(h: Holdings) -> str:
    """The layout of a model whose units named theirs: replicas if none did, ``hsdp`` if one
    shards in groups, else the one FSDP layout — or ``fsdp_mixed``, a checkpoint-only name."""
    layouts = h.layouts
    if not layouts:
        return h.layout_name(0)
    if "hsdp" in layouts:
        return "hsdp"
    return layouts.pop() if len(layouts) == 1 else "fsdp_mixed"


def _refuse_undescribed(inner: torch.optim.Optimizer | None, h: Holdings, net: nn.Module) -> None:
    """Every parameter the optimizer steps was described, so its state is saved: an optimizer
    over tensors the model does not know would lose its state silently."""
    if inner is None:
        return
    for g, group in enumerate(inner.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in h.stated:
                raise CheckpointError(
                    f"the optimizer's parameter {i} of group {g} (shape {list(p.shape)}) is not a "
                    f"parameter of the model nor a shard the model's strategy describes, so its "
                    f"state would not be saved: pass the optimizer that steps the model — the "
                    f"ZeroOptimizer, ShardedOptimizer or torch optimizer over model.parameters() — "
                    f"not the torch optimizer inside a strategy")


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
    """Tensors and regions in model order — by the module that owns each parameter, then as
    described — each parameter followed by its optimizer states: files and exports read well."""
    order = h.order or _model_order(h)
    rank_of = {f: i for i, f in enumerate(order)}
    kind_of = {k: i for i, k in enumerate(("param",) + STATE_KINDS)}

    def key(name):
        kind, fqn = name.split("/", 1)
        return rank_of[fqn], kind_of[kind]

    tensors = {n: h.tensors[n] for n in sorted(h.tensors, key=key)}
    return tensors, sorted(h.regions, key=lambda g: (key(g.name), g.start))


def _model_order(h: Holdings) -> list[str]:
    fqns = [n.split("/", 1)[1] for n in h.tensors if n.startswith("param/")]
    if h.model is None:
        return fqns
    position = {name: i for i, (name, _) in enumerate(h.model.named_modules())}
    seen = {f: i for i, f in enumerate(fqns)}
    return sorted(fqns, key=lambda f: (position.get(f.rpartition(".")[0], -1), seen[f]))


def local_state(model: nn.Module, optimizer, comm: Comm | None = None
                ) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """A copy of what this rank holds: tensor name -> [(start, values)] (tests assemble these)."""
    out: dict[str, list] = {}
    for g in describe(model, optimizer, comm).regions:
        if g.load and not g.cast:
            out.setdefault(g.name, []).append((g.start, g.view.clone()))
    return out
