"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients.

Under DDP every rank keeps the whole optimizer state and updates every parameter — N times the
same arithmetic on N copies of the same 12 bytes/param. ZeRO gives each rank one slice:

* **Stage 1** shards the optimizer state (fp32 master weights, Adam's m and v). After backward a
  rank needs the *summed* gradient of its slice only; it updates its slice, then the updated
  parameters are all-gathered so every rank has the full model again for the next forward.
  - ``reduce="all_reduce"``: the version most texts tell first — all-reduce the gradients as DDP
    does (2(N-1)/N·Ψ), then all-gather the parameters ((N-1)/N·Ψ): 3(N-1)/N·Ψ in all.
  - ``reduce="reduce_scatter"``: a rank only needs its slice of the sum, which is exactly what a
    reduce-scatter delivers ((N-1)/N·Ψ): 2(N-1)/N·Ψ in all — DDP's volume.
* **Stage 2** also shards the gradients: as backward fills a bucket, the bucket is
  reduce-scattered and dropped; each rank keeps only the summed gradient slice it will update.

Layout. The trainable parameters are packed, bucket by bucket, into one flat buffer that the
model's parameters alias. Each bucket is padded to a multiple of N and cut into N equal
*chunks*; rank r owns chunk r of every bucket. One code path serves both stages (the stage is a
threshold on what is sharded, see ``ledger.SHARDED_FROM_STAGE``) and the inner optimizer is any
element-wise ``torch.optim`` class, run on the rank's chunks as if they were parameters.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .comm import Comm, Work
from .ddp import BucketedReduction, plan_buckets
from .ledger import LiveLedger, track_optimizer_state

# Optimizers whose update is element-wise, so running them on flat slices is exact. Their state
# keys are the ones the sharder knows how to keep per slice.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
KNOWN_STATE = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}


@dataclass
class ShardedBucket:
    """A contiguous region of the flat buffers: ``N * chunk`` elements, rank r owns chunk r."""
    index: int
    start: int                      # offset of the region in the flat buffers
    numel: int                      # real elements (the rest of the region is padding)
    chunk: int                      # elements each rank owns
    params: list[nn.Parameter]
    offsets: list[int]              # of each parameter inside the region
    ready: set = field(default_factory=set)
    work: Work | None = None
    buffer: torch.Tensor | None = None   # stage 2: the bucket's local gradients, until reduced
    reduced: torch.Tensor | None = None  # stage 2: where the reduce-scatter delivers our slice


class ZeroOptimizer(BucketedReduction):
    """ZeRO-1/2 sharded optimizer (see the module docstring).

    ``ZeroOptimizer(model, torch.optim.AdamW, stage=1, comm=comm, lr=1e-3)``; then the usual loop:
    ``loss.backward(); opt.step(); opt.zero_grad()``. Communication of gradients happens during
    backward (hooks on the parameters), the parameter all-gather at the end of ``step()``.
    ``master_dtype`` (default: the parameters' dtype) is the precision of the sharded copy the
    optimizer updates: bf16 parameters with an fp32 master is the mixed-precision setting.
    """

    def __init__(self, module: nn.Module, optimizer_class=torch.optim.AdamW, *, stage: int,
                 comm: Comm, ledger: LiveLedger | None = None, reduce: str = "reduce_scatter",
                 master_dtype: torch.dtype | None = None, bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements stages 1 and 2, got stage={stage!r}; "
                             f"stage 3 shards the parameters too: use minishard.fsdp")
        if reduce not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"reduce must be 'reduce_scatter' or 'all_reduce', got {reduce!r}")
        if stage == 2 and reduce == "all_reduce":
            raise ValueError("stage 2 keeps only a gradient slice, so it must reduce-scatter")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE_OPTIMIZERS)):
            raise ValueError(
                f"{getattr(optimizer_class, '__name__', optimizer_class)} is not an element-wise "
                f"optimizer this sharder understands ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); "
                f"an optimizer with per-tensor state (norms, factored moments) cannot be run on flat slices")
        self.module, self.comm, self.ledger = module, comm, ledger
        self.stage, self.reduce = stage, reduce
        N = comm.world_size
        comm.replicate_from_rank0(module.parameters(), ledger)

        # ---- the flat layout: buckets of whole parameters, each padded to N equal chunks
        groups = plan_buckets(module, bucket_cap_mb, first_bucket_mb)
        p0 = groups[0][0][1]
        if any(p.dtype != p0.dtype for g in groups for _, p in g):
            raise ValueError("ZeroOptimizer needs one parameter dtype; got a mix")
        self.buckets, start = [], 0
        for i, group in enumerate(groups):
            numel = sum(p.numel() for _, p in group)
            chunk = math.ceil(numel / N)
            offsets = [sum(p.numel() for _, p in group[:k]) for k in range(len(group))]
            self.buckets.append(ShardedBucket(i, start, numel, chunk, [p for _, p in group], offsets))
            start += chunk * N
        self.flat_params = torch.zeros(start, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for b in self.buckets:                 # the model's parameters now alias the buffer
                for p, off in zip(b.params, b.offsets):
                    view = self.flat_params[b.start + off:b.start + off + p.numel()].view_as(p)
                    view.copy_(p)
                    p.data = view
        self._where = {p: (b, k) for b in self.buckets for k, p in enumerate(b.params)}

        # ---- gradients: full flat buffer (stage 1) or only our chunks (stage 2)
        if stage == 1:
            self.flat_grads = torch.zeros_like(self.flat_params)
            for b in self.buckets:
                for p, off in zip(b.params, b.offsets):
                    p.grad = self.flat_grads[b.start + off:b.start + off + p.numel()].view_as(p)
            grad_chunks = [self._mine(self.flat_grads, b) for b in self.buckets]
        else:
            self.grad_shard = torch.zeros(sum(b.chunk for b in self.buckets), dtype=p0.dtype,
                                          device=p0.device)
            grad_chunks = list(self.grad_shard.split([b.chunk for b in self.buckets]))
        self.grad_chunks = grad_chunks

        # ---- what the inner optimizer updates: our chunks of the parameters, or an fp32 copy
        self.master_dtype = master_dtype or p0.dtype
        param_chunks = [self._mine(self.flat_params, b) for b in self.buckets]
        if self.master_dtype == p0.dtype:
            self.master = None
            self.shards = [nn.Parameter(c) for c in param_chunks]     # aliases: updates in place
            for s, g in zip(self.shards, grad_chunks):
                s.grad = g
        else:
            self.master = torch.cat(param_chunks).to(self.master_dtype)
            self.shards = [nn.Parameter(c) for c in self.master.split([b.chunk for b in self.buckets])]
        self.optimizer = optimizer_class(self.shards, **optimizer_kwargs)
        self.param_groups = self.optimizer.param_groups

        if ledger is not None:
            ledger.track("params", self.flat_params, "flat_params")
            if stage == 1:
                ledger.track("grads", self.flat_grads, "flat_grads")
            else:
                ledger.track("grads", self.grad_shard, "grad_shard")
            if self.master is not None:
                ledger.track("master", self.master, "master_shard")

        self._sync = True
        self._in_flight: list[ShardedBucket] = []
        # the one place hooks are registered: each is a single call to a named method
        for p in self._where:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _mine(self, flat: torch.Tensor, b: ShardedBucket) -> torch.Tensor:
        """This rank's chunk of bucket ``b`` in a flat buffer (a view)."""
        lo = b.start + self.comm.rank * b.chunk
        return flat[lo:lo + b.chunk]

    # ------------------------------------------------------------------ during backward
    @contextlib.contextmanager
    def no_sync(self):
        """Stage 1: accumulate full local gradients, reduce once on the last micro-batch.
        Stage 2 keeps no full gradient, so it reduce-scatters every micro-batch and accumulates
        the reduced slices: more traffic, less memory. There, this context changes nothing."""
        prev, self._sync = self._sync, self.stage == 2
        try:
            yield
        finally:
            self._sync = prev

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, k = self._where[p]
        if self.stage == 1:
            view = self.flat_grads[b.start + b.offsets[k]:b.start + b.offsets[k] + p.numel()].view_as(p)
            if p.grad.data_ptr() != view.data_ptr():   # after zero_grad(set_to_none=True)
                view.copy_(p.grad)
                p.grad = view
        else:
            # stage 2: move the gradient into the bucket's temporary buffer and drop it
            if b.buffer is None:
                b.buffer = torch.zeros(b.chunk * self.comm.world_size, dtype=p.dtype, device=p.device)
                if self.ledger is not None:
                    self.ledger.track("comm_buffers", b.buffer, f"grad_bucket:{b.index}")
            b.buffer[b.offsets[k]:b.offsets[k] + p.numel()].copy_(p.grad.view(-1))
            p.grad = None
        if self._sync:
            self._mark_ready(b, k)

    def _reduce_bucket(self, b: ShardedBucket) -> None:
        N = self.comm.world_size
        tag = f"bucket{b.index}"
        if self.stage == 1:
            region = self.flat_grads[b.start:b.start + b.chunk * N]
            region.div_(N)
            if self.reduce == "all_reduce":
                b.work = self.comm.all_reduce(region, async_op=True, tag=tag)
            else:   # our chunk of the region receives our slice of the sum
                b.work = self.comm.reduce_scatter(self._mine(self.flat_grads, b), region,
                                                  async_op=True, tag=tag)
        else:
            # double buffering: at most two buckets in flight, so gradient memory stays at a few
            # buckets however large the model (waiting for the older one is what bounds it)
            if len(self._in_flight) == 2:
                self._finish_bucket(self._in_flight.pop(0))
            b.buffer.div_(N)
            b.reduced = torch.empty(b.chunk, dtype=b.buffer.dtype, device=b.buffer.device)
            b.work = self.comm.reduce_scatter(b.reduced, b.buffer, async_op=True, tag=tag)
            self._in_flight.append(b)

    def _finish_bucket(self, b: ShardedBucket) -> None:
        if b.work is not None:
            b.work.wait()
            b.work = None
        if self.stage == 2 and b.reduced is not None:
            self.grad_chunks[b.index].add_(b.reduced)     # accumulate the reduced slice
            b.reduced = None
            if self.ledger is not None:
                self.ledger.free(f"grad_bucket:{b.index}")
            b.buffer = None
        b.ready = set()

    def _finish_gradient_sync(self) -> None:
        """End of backward: reduce buckets whose parameters got no gradient, wait for all."""
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if self.stage == 2 and b.buffer is None:
                b.buffer = torch.zeros(b.chunk * self.comm.world_size, dtype=self.flat_params.dtype)
                if self.ledger is not None:
                    self.ledger.track("comm_buffers", b.buffer, f"grad_bucket:{b.index}")
            self._reduce_bucket(b)
            self._next_launch += 1
        for b in self.buckets:
            self._finish_bucket(b)
        self._in_flight = []
        self._next_launch, self._callback_queued = 0, False

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the *global* norm: each rank sums the squares of its slice, one all-reduce of
        a single number adds them up. Same rule as ``torch.nn.utils.clip_grad_norm_``."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.flat_params.device)
        for g in self.grad_chunks:
            sq += g.double().pow(2).sum()
        self.comm.all_reduce(sq, tag="grad_norm")
        total = sq.sqrt().to(torch.float32)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in self.grad_chunks:
            g.mul_(coef.to(g.dtype))
        return total

    @torch.no_grad()
    def step(self) -> None:
        """Update our slice, then all-gather the parameters so every rank has the whole model."""
        if self.master is not None:       # mixed precision: the fp32 master sees fp32 gradients
            for s, g in zip(self.shards, self.grad_chunks):
                s.grad = g.to(self.master_dtype)
        self.optimizer.step()
        unknown = {k for st in self.optimizer.state.values() for k in st} - KNOWN_STATE
        if unknown:
            raise ValueError(f"{type(self.optimizer).__name__} keeps state {sorted(unknown)} that "
                             f"ZeroOptimizer does not know how to shard")
        if self.ledger is not None:
            track_optimizer_state(self.ledger, self.optimizer, prefix="shard_")
        works = []
        for b, s in zip(self.buckets, self.shards):
            mine = self._mine(self.flat_params, b)
            if self.master is not None:
                mine.copy_(s)                   # round the updated master to the working dtype
                s.grad = None
            # gather into the region; our own chunk goes in as a copy (gloo wants no aliasing).
            # All buckets' gathers are started before waiting on any: they travel together.
            region = self.flat_params[b.start:b.start + b.chunk * self.comm.world_size]
            works.append(self.comm.all_gather(region, mine.clone(), async_op=True,
                                              tag=f"params{b.index}"))
        for w in works:
            w.wait()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients in place (they live in flat buffers the hooks rely on)."""
        if self.stage == 1:
            self.flat_grads.zero_()
        else:
            self.grad_shard.zero_()

    # ------------------------------------------------------------------ sharded state
    def layout(self) -> dict:
        return {"stage": self.stage, "world_size": self.comm.world_size,
                "buckets": [(b.start, b.numel, b.chunk) for b in self.buckets]}

    def state_dict(self) -> dict:
        """This rank's shard: its optimizer state, its master slice, and the layout they fit."""
        return {"zero": {**self.layout(), "rank": self.comm.rank},
                "optimizer": self.optimizer.state_dict(),
                "master": None if self.master is None else self.master.clone()}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("zero", {})
        if saved.get("world_size") != self.comm.world_size or saved.get("rank") != self.comm.rank:
            raise ValueError(
                f"this ZeRO state was saved by rank {saved.get('rank')} of {saved.get('world_size')}, "
                f"and is being loaded by rank {self.comm.rank} of {self.comm.world_size}: a sharded "
                f"state only fits its own layout. Loading under another world size needs resharding "
                f"(minishard.checkpoint, course chapter 09)")
        if saved.get("buckets") != self.layout()["buckets"]:
            raise ValueError("this ZeRO state was saved with another bucket layout "
                             "(different model or bucket_cap_mb); it cannot be loaded here")
        self.optimizer.load_state_dict(state["optimizer"])
        if self.master is not None:
            self.master.copy_(state["master"])
