"""How an FSDP unit lays out its parameters: per-parameter (FSDP2) or flat (FSDP1).

A layout answers four questions for the unit lifecycle (``unit.py``), which asks them through
the :class:`Layout` protocol and never looks inside:

1. what does ``model.parameters()`` show while sharded (what the optimizer updates)?
2. what does this rank contribute to the unit's all-gather, and where does the result go
   (``begin_unshard`` gives the buffer it fills, ``finish_unshard`` takes it when it lands)?
3. how are the full parameters put in place for compute, and taken away again (``reshard``)?
4. which gradients go into the reduce-scatter, and where does the reduced shard land?

A layout allocates the full parameters and the gather's buffers, so it enters them in the
ledger itself (``account``): the unit need not know which of them a layout has.

**Per-parameter sharding** (:class:`PerParamLayout`, PyTorch FSDP2). Each parameter is cut along
dim 0 into N shards of ``ceil(rows / N)`` rows (the last padded); rank r keeps shard r as its own
``nn.Parameter`` in the module, so names, shapes per rank and ``requires_grad`` stay per
parameter. One all-gather per unit still suffices: every rank packs its shards into its chunk of
one buffer,
and the gathered result is copied out into each parameter ("copy-out"); gradients are copied
into a packed buffer for one reduce-scatter ("copy-in"). Frozen and trainable parameters can
share a unit; each keeps its own dtype.

**Flat parameter** (:class:`FlatLayout`, PyTorch FSDP1). The unit's parameters are concatenated
into one 1-D buffer, padded to a multiple of N and sharded as one tensor: the module shows a
single ``_flat_param`` shard, the original parameters become views into the gathered buffer
during compute. No copies (the all-gather writes straight into the buffer the views read), but
one dtype and one ``requires_grad`` per unit, and a checkpoint sees a 1-D blob, not named
tensors.

Full parameters are freed by shrinking their storage to zero bytes and brought back by growing
it and filling it again — the tensors autograd saved for backward stay the same objects, so
backward sees the re-gathered values.

Both layouts can also gather the shards in another dtype into fresh tensors (``dtype=`` of
``all_gather_input``/``all_gather_output``, then ``unpack``): how ``full_parameters`` reads the
fp32 master weights of a unit that computes in bf16, without touching the unit's own state.
"""
from __future__ import annotations

import contextlib
import math
from typing import Protocol

import torch
import torch.nn as nn

from minishard.core.autograd_private import chunk_cat, preserve_version_counter
from minishard.strategies.local_grad import local
from .slots import ParamSlot

_preserve_version = preserve_version_counter


def _set_storage(t: torch.Tensor, nbytes: int) -> None:
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


class Layout(Protocol):
    """What a unit asks of its layout: :class:`PerParamLayout`, :class:`FlatLayout` and
    ``replicated.NoShards`` answer it."""
    kind: str
    N: int
    device: torch.device
    slots: list[ParamSlot]
    reduce_dtype: torch.dtype

    def account(self, ledger, unit: str) -> None: ...
    def shard_tensors(self) -> list[torch.Tensor]: ...
    def all_gather_input(self, device: torch.device, dtype: torch.dtype | None = None,
                         into: torch.Tensor | None = None) -> torch.Tensor: ...
    def all_gather_output(self, dtype: torch.dtype | None = None) -> torch.Tensor: ...
    def begin_unshard(self) -> torch.Tensor: ...
    def finish_unshard(self, gathered: torch.Tensor) -> None: ...
    def reshard(self) -> None: ...
    def pack_chunks(self, ranks: range) -> torch.Tensor: ...
    def unpack(self, gathered: torch.Tensor) -> list[torch.Tensor]: ...
    def full_values(self) -> list[torch.Tensor]: ...
    def grad_leaves(self) -> list[nn.Parameter]: ...
    def reduce_scatter_input(self, dtype: torch.dtype) -> torch.Tensor: ...
    def reduce_scatter_output(self, dtype: torch.dtype) -> torch.Tensor: ...
    def accumulate_reduced(self, reduced: torch.Tensor) -> None: ...
    def drop_unsharded_grads(self) -> None: ...
    def shard_of(self, i: int) -> tuple[torch.Tensor, int, int, int]: ...


class Accounted:
    """A layout's ledger entries, under its unit's name: the full parameters (``unsharded``,
    ``{unit}:full{i}``) and a buffer the all-gather fills before they exist (``{unit}:ag``);
    and the reshard, which both layouts do alike."""
    _ledger = None
    _unit = ""

    def account(self, ledger, unit: str) -> None:
        self._ledger, self._unit = ledger, unit

    def reshard(self) -> None:
        """The module holds the shards again; the full parameters' storage is freed."""
        self.to_sharded()
        self.free_unsharded()
        self._untrack_unsharded()

    def _track_unsharded(self) -> None:
        if self._ledger is not None:
            for i, t in enumerate(self.unsharded_tensors()):
                self._ledger.track("unsharded", t, f"{self._unit}:full{i}")

    def _untrack_unsharded(self) -> None:
        if self._ledger is not None:
            for i in range(len(self.unsharded_tensors())):
                self._ledger.free(f"{self._unit}:full{i}")


class PerParamLayout(Accounted):
    """FSDP2: every parameter sharded on its own along dim 0 (see the module docstring)."""
    kind = "per_param"

    def __init__(self, slots: list[ParamSlot], rank: int, world_size: int,
                 param_dtype: torch.dtype | None):
        self.slots, self.rank, self.N = slots, rank, world_size
        self.param_dtype = param_dtype
        self.device = slots[0].module._parameters[slots[0].name].device    # where compute runs
        self.sharded: list[nn.Parameter] = []
        self.unsharded: list[nn.Parameter] = []
        self.rows, self.inner = [], []              # rows per shard; elements per row
        for s in slots:
            full = s.module._parameters[s.name].detach()
            rows0 = s.shape[0] if len(s.shape) else 1
            c = math.ceil(rows0 / world_size)
            inner = s.numel // rows0 if rows0 else 0
            rows = torch.zeros((c,) + tuple(s.shape[1:]), dtype=s.dtype, device=full.device)
            ours = full.reshape(rows0, *s.shape[1:])[rank * c:(rank + 1) * c]
            rows[:ours.shape[0]] = ours              # the last ranks' shards carry the padding
            shard = nn.Parameter(rows, requires_grad=s.requires_grad)
            shard._fsdp_shard = True
            dtype = param_dtype or s.dtype
            unsharded = nn.Parameter(torch.empty(s.shape, dtype=dtype, device=full.device),
                                     requires_grad=s.requires_grad)
            _set_storage(unsharded, 0)               # born freed: a unit starts sharded
            self.sharded.append(shard)
            self.unsharded.append(unsharded)
            self.rows.append(c)
            self.inner.append(inner)
            s.module._parameters[s.name] = shard    # what model.parameters() shows now
        # rank-major packing, a chunk per rank: [rank 0: shard of p0 | shard of p1 | ...][rank 1: ...]
        self.sizes = [c * i for c, i in zip(self.rows, self.inner)]
        self.per_rank = sum(self.sizes)
        # parameters of several dtypes and no common compute dtype: gather their raw bytes (a
        # cast to one dtype would round the others), reduce their gradients in fp32
        self.mixed = param_dtype is None and len({s.dtype for s in slots}) > 1
        self.bytes_per = [s.dtype.itemsize if self.mixed else 1 for s in slots]
        # raw bytes: each parameter's shard starts 8-byte aligned, so it can be viewed back as
        # its dtype (a bf16 shard of odd length would leave the next fp32 one at byte 6)
        self.raw_sizes = [-(-n * b // 8) * 8 for n, b in zip(self.sizes, self.bytes_per)]
        self.gather_per_rank = sum(self.raw_sizes) if self.mixed else self.per_rank
        self.reduce_dtype = torch.float32 if self.mixed else slots[0].dtype

    # ---- what the ledger and the optimizer see
    def shard_tensors(self) -> list[torch.Tensor]:
        return list(self.sharded)

    def unsharded_tensors(self) -> list[torch.Tensor]:
        return list(self.unsharded)

    def trainable(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.requires_grad]

    @property
    def gather_dtype(self) -> torch.dtype:
        return torch.uint8 if self.mixed else (self.param_dtype or self.slots[0].dtype)

    # ---- 2. the all-gather
    def all_gather_input(self, device: torch.device, dtype: torch.dtype | None = None,
                         into: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shards, packed on the compute device and cast to the compute dtype (or to
        ``dtype``: a gather for reading, see ``unpack``). ``into``: pack them there — this
        rank's chunk of the all-gather's output, so the gather itself copies nothing locally."""
        if self.mixed and dtype is None:
            shards = []
            for p, raw in zip(self.sharded, self.raw_sizes):
                shards.append(p.detach().reshape(-1).view(torch.uint8).to(device))
                if raw > shards[-1].numel():
                    shards.append(torch.zeros(raw - shards[-1].numel(), dtype=torch.uint8, device=device))
        else:   # copy to the device first, cast there: what crosses is the shard as stored
            shards = [p.detach().reshape(-1).to(device).to(dtype or self.gather_dtype)
                      for p in self.sharded]
        return torch.cat(shards) if into is None else torch.cat(shards, out=into)

    def all_gather_output(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if dtype is not None:
            return torch.empty(self.N * self.per_rank, dtype=dtype, device=self.device)
        return torch.empty(self.N * self.gather_per_rank, dtype=self.gather_dtype,
                           device=self.device)

    def begin_unshard(self) -> torch.Tensor:
        """A packed buffer for the all-gather (a communication buffer in the ledger). The full
        parameters are allocated only at the copy-out, when it lands: a unit still in flight
        (prefetched) holds one copy of its parameters, not two."""
        out = self.all_gather_output()
        if self._ledger is not None:
            self._ledger.alloc("comm_buffers", out.numel() * out.element_size(), f"{self._unit}:ag")
        return out

    def finish_unshard(self, gathered: torch.Tensor) -> None:
        """The gathered shards copied out into the full parameters, which the module computes
        with from now on."""
        self.alloc_unsharded()
        self._track_unsharded()
        self.copy_out(gathered)
        if self._ledger is not None:
            self._ledger.free(f"{self._unit}:ag")
        self.to_unsharded()

    def alloc_unsharded(self) -> None:
        for p in self.unsharded:
            _set_storage(p, p.numel() * p.element_size())

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Rank q's shard of parameter p goes to rows [q*c, (q+1)*c) of the full parameter."""
        if self.mixed or not all(self.inner):
            self._unpack_into(gathered, self.unsharded, raw=self.mixed)
        else:
            self._split_into(gathered, self.unsharded)

    def _split_into(self, gathered: torch.Tensor, into: list[torch.Tensor]) -> None:
        """The copy-out as one operation for the whole unit (FSDP2 does the same): seen as N rows
        of ``per_rank``, the gather's column span i holds parameter i's shards in rank order,
        which *is* parameter i when its rows divide by N. The others (the last shards carry
        padding) land in a scratch first and their real rows are copied on."""
        outs, ragged = [], []
        for p, c, inner in zip(into, self.rows, self.inner):
            if p.numel() == self.N * c * inner:
                outs.append(p.view(self.N, c * inner))
            else:
                outs.append(torch.empty(self.N, c * inner, dtype=p.dtype, device=p.device))
                ragged.append((p, outs[-1]))
        with torch.no_grad(), contextlib.ExitStack() as keep:
            for p in into:                           # autograd saved these for backward
                keep.enter_context(_preserve_version(p))
            torch.split_with_sizes_copy(gathered.view(self.N, self.per_rank), self.sizes, dim=1,
                                        out=outs)
            for p, scratch in ragged:
                p.view(-1).copy_(scratch.view(-1)[:p.numel()])

    def unpack(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Fresh full tensors from a gather in one dtype (``all_gather_output(dtype)``)."""
        out = [torch.empty(s.shape, dtype=gathered.dtype, device=gathered.device) for s in self.slots]
        self._unpack_into(gathered, out, raw=False)
        return out

    def _unpack_into(self, gathered: torch.Tensor, into: list[torch.Tensor], raw: bool) -> None:
        """``raw``: the gather moved raw bytes (mixed dtypes), each shard is viewed back."""
        by_rank = gathered.view(self.N, self.gather_per_rank if raw else self.per_rank)
        offset = 0
        for p, c, inner, size, b in zip(into, self.rows, self.inner, self.raw_sizes if raw else self.sizes,
                                        self.bytes_per if raw else [1] * len(into)):
            rows = p.view(-1, inner) if inner else p.view(-1, 1)
            with torch.no_grad(), _preserve_version(p):
                for q in range(self.N):
                    lo, hi = q * c, min((q + 1) * c, rows.shape[0])
                    if hi > lo:
                        shard = by_rank[q, offset:offset + (hi - lo) * max(inner, 1) * b]
                        if raw:
                            shard = shard.view(p.dtype)       # the raw bytes, as they were
                        rows[lo:hi].copy_(shard.view(hi - lo, -1))
            offset += size

    def pack_chunks(self, ranks: range) -> torch.Tensor:
        """The chunks of ``ranks``, packed from the full parameters exactly as the all-gather
        laid them out (``reshard_after_forward=k`` keeps them for backward's gather). The
        padding rows are zeros: the copy-out never reads them."""
        out = torch.zeros(len(ranks), self.gather_per_rank, dtype=self.gather_dtype, device=self.device)
        offset = 0
        for p, c, inner, size in zip(self.unsharded, self.rows, self.inner,
                                     self.raw_sizes if self.mixed else self.sizes):
            rows = p.detach().view(-1, inner) if inner else p.detach().view(-1, 1)
            for k, q in enumerate(ranks):
                lo, hi = q * c, min((q + 1) * c, rows.shape[0])
                if hi > lo:
                    shard = rows[lo:hi].reshape(-1)
                    shard = shard.view(torch.uint8) if self.mixed else shard
                    out[k, offset:offset + shard.numel()].copy_(shard)
            offset += size
        return out.view(-1)

    def free_unsharded(self) -> None:
        for p in self.unsharded:
            _set_storage(p, 0)

    # ---- 3. swapping what the module computes with
    def to_unsharded(self) -> None:
        for s, p in zip(self.slots, self.unsharded):
            s.module._parameters[s.name] = p

    def to_sharded(self) -> None:
        for s, p in zip(self.slots, self.sharded):
            s.module._parameters[s.name] = p

    # ---- 4. gradients
    def grad_leaves(self) -> list[nn.Parameter]:
        """The tensors whose gradients backward accumulates (hooks mark the unit ready)."""
        return [self.unsharded[i] for i in self.trainable()]

    def reduce_scatter_input(self, dtype: torch.dtype) -> torch.Tensor:
        """Gradients packed rank-major like the all-gather (the copy-in); frozen and missing
        gradients contribute zeros."""
        grads = [p.grad for p in self.unsharded]
        if all(g is not None for g in grads) and all(self.inner) and not self.mixed:
            # one operation, as FSDP2's chunk_cat: each gradient cut into N shards of c rows
            # (the last padded with zeros), laid rank-major, cast on the way
            packed = torch.empty(self.N, self.per_rank, dtype=dtype, device=self.device)
            chunk_cat([g.reshape(-1, inner) for g, inner in zip(grads, self.inner)], dim=0,
                      num_chunks=self.N, out=packed)
            return packed.view(-1)
        packed = torch.zeros(self.N, self.per_rank, dtype=dtype, device=self.device)
        offset = 0
        for p, c, inner, size in zip(self.unsharded, self.rows, self.inner, self.sizes):
            if p.grad is not None:
                g = p.grad.reshape(-1, max(inner, 1))
                for q in range(self.N):
                    lo, hi = q * c, min((q + 1) * c, g.shape[0])
                    if hi > lo:
                        packed[q, offset:offset + (hi - lo) * max(inner, 1)].copy_(g[lo:hi].reshape(-1))
            offset += size
        return packed.view(-1)

    def reduce_scatter_output(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.per_rank, dtype=dtype, device=self.device)

    def accumulate_reduced(self, reduced: torch.Tensor) -> None:
        """Add the reduced shard into each sharded parameter's ``.grad``."""
        for p, part in zip(self.sharded, reduced.split(self.sizes)):
            if p.requires_grad:
                g = part.view(p.shape).to(device=p.device, dtype=p.dtype)
                if p.grad is None:
                    p.grad = local(g.clone())
                else:
                    p.grad.add_(g)

    def drop_unsharded_grads(self) -> None:
        for p in self.unsharded:
            p.grad = None

    def shard_of(self, i: int) -> tuple[torch.Tensor, int, int, int]:
        """Parameter ``i`` on this rank: the shard tensor holding it, the first element held (in
        the parameter's own index space), how many, and where they begin in the shard — rows
        ``[r*c, (r+1)*c)`` of dim 0 (a checkpoint saves and loads exactly these)."""
        s, c = self.slots[i], self.rows[i]
        rows = s.shape[0] if len(s.shape) else 1
        lo, hi = min(self.rank * c, rows), min((self.rank + 1) * c, rows)
        return self.sharded[i], lo * self.inner[i], (hi - lo) * self.inner[i], 0

    def full_values(self) -> list[torch.Tensor]:
        """Each parameter's full value (after an unshard)."""
        return [p.detach() for p in self.unsharded]


class FlatLayout(Accounted):
    """FSDP1: the unit's parameters as one flat padded buffer, sharded as one tensor."""
    kind = "flat"

    def __init__(self, slots: list[ParamSlot], rank: int, world_size: int,
                 param_dtype: torch.dtype | None, owner: nn.Module):
        if len({s.dtype for s in slots}) > 1:
            raise ValueError(f"the flat layout needs one dtype per unit; got "
                             f"{sorted(str(s.dtype) for s in slots)}: use the per-parameter layout")
        if len({s.requires_grad for s in slots}) > 1:
            frozen = [s.fqn for s in slots if not s.requires_grad]
            # PyTorch FSDP1 refuses this too with use_orig_params=False (the layout built here);
            # with use_orig_params=True it accepts the unit but still keeps gradient memory for
            # the frozen parameters' part of the flat buffer.
            raise ValueError(f"the flat layout cannot mix frozen and trainable parameters in one "
                             f"unit (frozen: {frozen[:3]}...): the flat buffer has one requires_grad "
                             f"(as FSDP1 with use_orig_params=False). Use the per-parameter layout, "
                             f"or put frozen parameters in their own unit")
        self.slots, self.rank, self.N, self.param_dtype = slots, rank, world_size, param_dtype
        self.offsets = [sum(s.numel for s in slots[:k]) for k in range(len(slots))]
        self.numel = sum(s.numel for s in slots)
        self.shard_numel = math.ceil(self.numel / world_size)
        self.per_rank = self.shard_numel
        device = self.device = slots[0].module._parameters[slots[0].name].device
        full = torch.zeros(self.shard_numel * world_size, dtype=slots[0].dtype, device=device)
        for s, off in zip(slots, self.offsets):
            full[off:off + s.numel].copy_(s.module._parameters[s.name].detach().reshape(-1))
        self.flat_shard = nn.Parameter(full[rank * self.shard_numel:(rank + 1) * self.shard_numel].clone(),
                                       requires_grad=slots[0].requires_grad)
        self.flat_shard._fsdp_shard = True
        self.reduce_dtype = slots[0].dtype
        self.flat_full = nn.Parameter(torch.empty(self.shard_numel * world_size,
                                                  dtype=param_dtype or slots[0].dtype, device=device),
                                      requires_grad=slots[0].requires_grad)
        _set_storage(self.flat_full, 0)
        for s in slots:                          # the originals are gone; views appear on demand
            del s.module._parameters[s.name]
        owner.register_parameter("_flat_param", self.flat_shard)
        self.sharded = [self.flat_shard]

    def shard_tensors(self) -> list[torch.Tensor]:
        return [self.flat_shard]

    def unsharded_tensors(self) -> list[torch.Tensor]:
        return [self.flat_full]

    def trainable(self) -> list[int]:
        return [0] if self.flat_shard.requires_grad else []

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.flat_full.dtype

    def all_gather_input(self, device: torch.device, dtype: torch.dtype | None = None,
                         into: torch.Tensor | None = None) -> torch.Tensor:
        if into is not None:
            return into.copy_(self.flat_shard.detach())
        return self.flat_shard.detach().to(device, copy=True).to(dtype or self.gather_dtype)

    def all_gather_output(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if dtype is not None:                     # a gather for reading, into a fresh buffer
            return torch.empty(self.shard_numel * self.N, dtype=dtype, device=self.device)
        return self.flat_full                     # gathered in place: no copy-out

    def unpack(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's full value, as views of a gather in one dtype."""
        return [gathered[off:off + s.numel].view(s.shape) for s, off in zip(self.slots, self.offsets)]

    def begin_unshard(self) -> torch.Tensor:
        """The full flat buffer, allocated now: the all-gather writes it in place, nothing is
        copied out when it lands."""
        self.alloc_unsharded()
        self._track_unsharded()
        return self.flat_full

    def finish_unshard(self, gathered: torch.Tensor) -> None:
        self.to_unsharded()

    def alloc_unsharded(self) -> None:
        _set_storage(self.flat_full, self.flat_full.numel() * self.flat_full.element_size())

    def pack_chunks(self, ranks: range) -> torch.Tensor:
        """The chunks of ``ranks`` of the full flat buffer (a copy: the buffer is freed next)."""
        return self.flat_full.detach()[ranks.start * self.shard_numel:ranks.stop * self.shard_numel].clone()

    def free_unsharded(self) -> None:
        _set_storage(self.flat_full, 0)

    def to_unsharded(self) -> None:
        # views into the gathered buffer; autograd routes their gradients into flat_full.grad
        for s, off in zip(self.slots, self.offsets):
            setattr(s.module, s.name, self.flat_full[off:off + s.numel].view(s.shape))

    def to_sharded(self) -> None:
        pass                                      # the views stay, pointing at freed storage

    def grad_leaves(self) -> list[nn.Parameter]:
        return [self.flat_full] if self.flat_full.requires_grad else []

    def reduce_scatter_input(self, dtype: torch.dtype) -> torch.Tensor:
        g = self.flat_full.grad
        if g is None:
            return torch.zeros(self.shard_numel * self.N, dtype=dtype, device=self.device)
        return g.to(dtype) if g.dtype != dtype else g

    def reduce_scatter_output(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.shard_numel, dtype=dtype, device=self.device)

    def accumulate_reduced(self, reduced: torch.Tensor) -> None:
        g = reduced.to(device=self.flat_shard.device, dtype=self.flat_shard.dtype)
        if self.flat_shard.grad is None:
            self.flat_shard.grad = local(g.clone())
        else:
            self.flat_shard.grad.add_(g)

    def drop_unsharded_grads(self) -> None:
        self.flat_full.grad = None

    def shard_of(self, i: int) -> tuple[torch.Tensor, int, int, int]:
        """Parameter ``i`` on this rank: the flat shard, the first element of the parameter held,
        how many, and where they begin in the shard — chunk r of the unit's flat buffer cut at
        the parameter's boundaries (a checkpoint saves and loads exactly these)."""
        s, off, lo_c = self.slots[i], self.offsets[i], self.rank * self.shard_numel
        lo, hi = max(off, lo_c), min(off + s.numel, lo_c + self.shard_numel)
        return self.flat_shard, lo - off, max(hi - lo, 0), lo - lo_c

    def full_values(self) -> list[torch.Tensor]:
        return [self.flat_full.detach()[off:off + s.numel].view(s.shape)
                for s, off in zip(self.slots, self.offsets)]
