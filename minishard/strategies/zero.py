"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients.

Under DDP every rank keeps the whole optimizer state and updates every parameter — N times the
same arithmetic on N copies of the same 12 bytes/param. ZeRO gives each rank one shard:

* **Stage 1** shards the optimizer state (fp32 master weights, Adam's m and v). After backward a
  rank needs the *summed* gradient of its shard only; it updates its shard, then the updated
  parameters are all-gathered so every rank has the full model again for the next forward.
  - ``reduce="all_reduce"``: the version most texts tell first — all-reduce the gradients as DDP
    does (2(N-1)/N·Ψ), then all-gather the parameters ((N-1)/N·Ψ): 3(N-1)/N·Ψ in all.
  - ``reduce="reduce_scatter"``: a rank only needs its shard of the sum, which is exactly what a
    reduce-scatter delivers ((N-1)/N·Ψ): 2(N-1)/N·Ψ in all — DDP's volume.
* **Stage 2** also shards the gradients: as backward fills a bucket, the bucket is
  reduce-scattered and dropped; each rank keeps only the summed gradient shard it will update.

Layout. The trainable parameters are packed, bucket by bucket, into one flat buffer that the
model's parameters alias. Each bucket is padded to a multiple of N and cut into N equal
*chunks*; chunk r of every bucket is rank r's *shard* of it. One code path serves both stages
(the stage is a threshold on what is sharded, see ``analytic.SHARDED_FROM_STAGE``) and the inner
optimizer is any element-wise ``torch.optim`` class, run on the rank's shards as if they were
parameters — one inner parameter group per parameter group given (a bucket never mixes groups).
The bucket mechanics (hooks, launch order, end of backward) are shared with DDP
(``minishard.strategies.buckets``); what is ZeRO's own is the collective and where the reduced shard goes.

``ZeroOptimizer`` is a ``torch.optim.Optimizer``: its ``param_groups`` hold the model's
parameters and the hyperparameters, which a learning-rate scheduler may change; they reach the
inner optimizer before every step.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .buckets import Bucket, BucketedReduction, offsets_of, plan_buckets
from minishard.core.comm import Comm
from .clipping import clip_sharded_grad_norm_
from minishard.core.ledger import LiveLedger, track_optimizer_state
from .registry import Built, optimizer_spec

# Optimizers whose update is element-wise, so running them on flat shards is exact. Their state
# keys are the ones the sharder knows how to keep per shard.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
KNOWN_STATE = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}
NOT_HYPERPARAMETERS = ("params", "param_names")


@dataclass(eq=False, kw_only=True)
class ShardedBucket(Bucket):
    """A bucket laid out in the flat buffers: ``N * shard_numel`` elements, cut into N equal
    chunks; chunk r is rank r's shard."""
    start: int                      # offset of the bucket in the flat buffers
    numel: int                      # real elements (the rest of the bucket is padding)
    shard_numel: int                # elements of each rank's shard
    reduced: torch.Tensor | None = None  # stage 2: where the reduce-scatter delivers our shard


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2 sharded optimizer (see the module docstring).

    ``ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-3)`` — or parameter
    groups, as with any torch optimizer — then the usual loop: ``loss.backward(); opt.step();
    opt.zero_grad()``. ``comm`` (default: the default process group) is the group it shards
    over. Gradients are reduced during backward (hooks on the parameters), the parameters
    all-gathered at the end of ``step()``. ``master_dtype`` (default: the parameters' dtype) is
    the precision of the sharded copy the optimizer updates: bf16 parameters with an fp32 master
    is the mixed-precision setting. Keyword arguments left over are the inner optimizer's.
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, stage: int = 1,
                 comm: Comm | None = None, ledger: LiveLedger | None = None,
                 reduce: str = "reduce_scatter", master_dtype: torch.dtype | None = None,
                 bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0, **defaults):
        _check_arguments(stage, reduce, optimizer_class)
        if isinstance(params, nn.Module):
            raise TypeError("ZeroOptimizer takes parameters or parameter groups, as every torch "
                            "optimizer does: ZeroOptimizer(model.parameters(), ...)")
        super().__init__(params, defaults)
        self.comm = comm if comm is not None else Comm()
        self.ledger, self.stage, self.reduce = ledger, stage, reduce
        self.comm.broadcast_from_rank0([p for g in self.param_groups for p in g["params"]], ledger)
        self.buckets = self._lay_out(bucket_cap_mb, first_bucket_mb)
        self._allocate_gradients()
        self._build_inner_optimizer(optimizer_class, master_dtype)
        if ledger is not None:
            ledger.track("params", self.flat_params, "flat_params")
            if stage == 1:
                ledger.track("grads", self.flat_grads, "flat_grads")
            else:
                ledger.track("grads", self.flat_grad_shards, "grad_shard")
            if self.master is not None:
                ledger.track("master", self.master, "master_shard")
        if stage == 1:
            # reduce-scattered, .grad holds the sum in this rank's shard only (all-reduced: all)
            self.reduction = BucketedReduction(self.buckets, reduce=self._reduce_gradients, ledger=ledger,
                                               partial=reduce == "reduce_scatter")
        else:   # at most two buckets in flight: gradient memory stays at a few buckets
            self.reduction = BucketedReduction(self.buckets, reduce=self._reduce_scatter_bucket,
                                               land=self._keep_shard, grads_in_buckets=False,
                                               max_in_flight=2, ledger=ledger)

    # ------------------------------------------------------------------ construction
    def _lay_out(self, cap_mb: float, first_mb: float) -> list[ShardedBucket]:
        """Buckets of whole parameters, each padded to N equal chunks (the ranks' shards),
        packed into one flat buffer that the parameters then alias."""
        plan = plan_buckets([g["params"] for g in self.param_groups], cap_mb, first_mb)
        p0 = plan[0][1][0]
        if any(p.dtype != p0.dtype for _, params in plan for p in params):
            raise ValueError("ZeroOptimizer needs one parameter dtype; got a mix")
        N, buckets, start = self.comm.world_size, [], 0
        for i, (group, params) in enumerate(plan):
            numel = sum(p.numel() for p in params)
            shard_numel = math.ceil(numel / N)
            buckets.append(ShardedBucket(index=i, group=group, params=params, offsets=offsets_of(params),
                                         size=shard_numel * N, start=start, numel=numel,
                                         shard_numel=shard_numel))
            start += shard_numel * N
        self.flat_params = torch.zeros(start, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for b in buckets:                      # the model's parameters now alias the buffer
                for p, off in zip(b.params, b.offsets):
                    view = self.flat_params[b.start + off:b.start + off + p.numel()].view_as(p)
                    view.copy_(p)
                    p.data = view
        return buckets

    def _allocate_gradients(self) -> None:
        """Stage 1: the full flat gradient buffer, each bucket's stretch of it the bucket's
        buffer. Stage 2: only our shards (the buckets' buffers come and go during backward)."""
        if self.stage == 1:
            self.flat_grads = torch.zeros_like(self.flat_params)
            for b in self.buckets:
                b.buffer = self.flat_grads[b.start:b.start + b.size]
            self.grad_shards = [self._shard_of(self.flat_grads, b) for b in self.buckets]
        else:
            sizes = [b.shard_numel for b in self.buckets]
            self.flat_grad_shards = torch.zeros(sum(sizes), dtype=self.flat_params.dtype,
                                                device=self.flat_params.device)
            self.grad_shards = list(self.flat_grad_shards.split(sizes))

    def _build_inner_optimizer(self, optimizer_class, master_dtype: torch.dtype | None) -> None:
        """What the inner optimizer updates: our shards of the parameters (aliases: updated in
        place), or an fp32 copy of them; one inner group per parameter group."""
        dtype = self.flat_params.dtype
        self.master_dtype = master_dtype or dtype
        param_shards = [self._shard_of(self.flat_params, b) for b in self.buckets]
        if not {"foreach", "fused"} & self.defaults.keys():
            # torch's CPU default is the per-tensor loop, made for many small parameters. On a
            # shard of millions of elements each of its full-size temporaries is handed back
            # to the OS and faults in again every step (measured: docs/architecture.md, "The
            # measurements behind the code"); the multi-tensor path updates in place.
            self.defaults = {**self.defaults, "foreach": True}
        if self.master_dtype == dtype:
            self.master = None
            self.shards = [nn.Parameter(c) for c in param_shards]
            for s, g in zip(self.shards, self.grad_shards):
                s.grad = g
        else:
            self.master = torch.cat(param_shards).to(self.master_dtype)
            sizes = [b.shard_numel for b in self.buckets]
            self.shards = [nn.Parameter(c) for c in self.master.split(sizes)]
        groups = [{**_hyperparameters(g), "params": [s for s, b in zip(self.shards, self.buckets) if b.group == i]}
                  for i, g in enumerate(self.param_groups)]
        self.optimizer = optimizer_class(groups, **self.defaults)
        self._shards_by_bucket = nn.ParameterList(self.shards)     # ("0", shard 0), ("1", ...)
        self.defaults = dict(self.optimizer.defaults)   # every hyperparameter, as schedulers expect
        _copy_hyperparameters(self.optimizer.param_groups, self.param_groups)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "buckets", None) is not None:
            raise NotImplementedError("ZeroOptimizer lays out its flat buffers once, at construction: "
                                      "pass every parameter group to the constructor")
        super().add_param_group(param_group)

    def _shard_of(self, flat: torch.Tensor, b: ShardedBucket) -> torch.Tensor:
        """This rank's shard of bucket ``b`` in a flat buffer (a view)."""
        lo = b.start + self.comm.rank * b.shard_numel
        return flat[lo:lo + b.shard_numel]

    # ------------------------------------------------------------------ during backward
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full local gradients, reduce once on the last micro-batch. Stage 1 holds
        them anyway. Stage 2 then holds them too — in its buckets, the memory stage 2 exists to
        save (DeepSpeed refuses ``no_sync`` under stage 2); outside this context it
        reduce-scatters every micro-batch and accumulates the reduced shards: more traffic,
        less memory."""
        prev, self.reduction.sync = self.reduction.sync, False
        try:
            yield
        finally:
            self.reduction.sync = prev

    def _reduce_gradients(self, b: ShardedBucket) -> None:
        """Stage 1: the bucket's gradients, a view of the full gradient buffer, reduced in place."""
        N = self.comm.world_size
        grads = b.buffer
        grads.div_(N)
        if self.reduce == "all_reduce":
            b.work = self.comm.all_reduce(grads, async_op=True, tag=f"bucket{b.index}")
        else:   # in place: our shard of the bucket receives our shard of the sum
            b.work = self.comm.reduce_scatter(self.grad_shards[b.index], grads, async_op=True,
                                              tag=f"bucket{b.index}")

    def _reduce_scatter_bucket(self, b: ShardedBucket) -> None:
        """Stage 2: the bucket's temporary buffer, reduce-scattered into a fresh shard."""
        b.buffer.div_(self.comm.world_size)
        b.reduced = torch.empty(b.shard_numel, dtype=b.buffer.dtype, device=b.buffer.device)
        b.work = self.comm.reduce_scatter(b.reduced, b.buffer, async_op=True, tag=f"bucket{b.index}")

    def _keep_shard(self, b: ShardedBucket) -> None:
        """Stage 2: accumulate the reduced shard, drop the bucket's buffer."""
        self.grad_shards[b.index].add_(b.reduced)
        b.reduced = None
        if self.ledger is not None:
            self.ledger.free(f"grad_bucket:{b.index}")
        b.buffer = None

    # ------------------------------------------------------------------ the step
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the *global* norm (``clipping.py``) over this rank's gradient shards."""
        return clip_sharded_grad_norm_(self.grad_shards, self.comm, max_norm)

    @torch.no_grad()
    def step(self, closure=None):
        """Update our shard, then all-gather the parameters so every rank has the whole model."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _copy_hyperparameters(self.param_groups, self.optimizer.param_groups)   # a scheduler's lr
        if self.master is not None:       # mixed precision: the fp32 master sees fp32 gradients
            for s, g in zip(self.shards, self.grad_shards):
                s.grad = g.to(self.master_dtype)
        self.optimizer.step()
        unknown = {k for st in self.optimizer.state.values() for k in st} - KNOWN_STATE
        if unknown:
            raise ValueError(f"{type(self.optimizer).__name__} keeps state {sorted(unknown)} that "
                             f"ZeroOptimizer does not know how to shard")
        if self.ledger is not None:     # named by bucket: unique across parameter groups
            track_optimizer_state(self.ledger, self.optimizer, self._shards_by_bucket, prefix="shard_")
        self._all_gather_parameters()
        return loss

    def _all_gather_parameters(self) -> None:
        works = []
        for b, s in zip(self.buckets, self.shards):
            shard = self._shard_of(self.flat_params, b)
            if self.master is not None:
                shard.copy_(s)                  # round the updated master to the working dtype
                s.grad = None
            # gather into the bucket, in place: our shard already sits where it belongs (NCCL
            # gathers in place; on gloo, Comm sends it from there). All buckets' gathers are
            # started before waiting on any: they travel together.
            full = self.flat_params[b.start:b.start + b.shard_numel * self.comm.world_size]
            works.append(self.comm.all_gather(full, shard, async_op=True, tag=f"params{b.index}"))
        for w in works:
            w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place, whatever ``set_to_none`` says: they live in flat buffers
        the hooks rely on."""
        if self.stage == 1:
            self.flat_grads.zero_()
        else:
            self.flat_grad_shards.zero_()

    # ------------------------------------------------------------------ sharded state
    def recorders(self) -> tuple[list, list]:
        """What records this optimizer's collectives and bytes (for ``minishard.watch``)."""
        return [self.comm], [self.ledger]

    def shard_numel(self) -> tuple[int, int]:
        """Elements of the bucketed parameters (padding included): (what a replica of them holds,
        what this rank's shards hold). Frozen parameters stay plain replicas, outside the buckets."""
        return sum(b.size for b in self.buckets), sum(b.shard_numel for b in self.buckets)

    def layout(self) -> dict:
        return {"stage": self.stage, "world_size": self.comm.world_size,
                "buckets": [(b.start, b.numel, b.shard_numel) for b in self.buckets]}

    def checkpoint_regions(self, h) -> None:
        """What this rank holds, for ``minishard.checkpoint``: the parameters are replicas (the
        flat buffer is whole on every rank); the optimizer state (and, in mixed precision, the
        fp32 master) of rank r is its shard of every bucket, which may start or end inside a
        parameter. Parameters in no bucket (frozen) are plain replicas."""
        r = h.rank
        h.strategy = h.layout_name(self.stage)
        h.order = [h.names[p] for p in h.names]
        for b, shard in zip(self.buckets, self.shards):
            lo_s, hi_s = r * b.shard_numel, (r + 1) * b.shard_numel   # our shard, in bucket coordinates
            states = h.optimizer_state(self.optimizer, shard, f"ZeRO bucket {b.index}")
            for p, off in zip(b.params, b.offsets):
                fqn = h.names[p]
                full = self.flat_params[b.start + off:b.start + off + p.numel()]
                lo, hi = max(off, lo_s), min(off + p.numel(), hi_s)   # our elements of p (bucket coords)
                ours = slice(lo - lo_s, max(hi, lo) - lo_s)            # ... in shard coordinates
                if self.master is None:                                # the shard aliases the buffer
                    h.tensor(f"param/{fqn}", p.shape, p.dtype)
                    h.add(f"param/{fqn}", 0, full, save=False, replica=True)
                    h.add(f"param/{fqn}", lo - off, shard.detach()[ours], load=False)
                else:                                                  # fp32 master shard + bf16 copy
                    h.tensor(f"param/{fqn}", p.shape, self.master_dtype)
                    h.add(f"param/{fqn}", lo - off, shard.detach()[ours])
                    h.add(f"param/{fqn}", 0, full, save=False, cast=True)
                for kind, t in states.items():
                    h.tensor(f"{kind}/{fqn}", p.shape, t.dtype)
                    h.add(f"{kind}/{fqn}", lo - off, t[ours])
        bucketed = {p for b in self.buckets for p in b.params}
        for p, fqn in h.names.items():                               # frozen: not ZeRO's
            if p not in bucketed:
                h.add_replicated_param(fqn, p, None)

    def state_dict(self) -> dict:
        """This rank's shard: its optimizer state, its master shard, and the layout they fit."""
        _copy_hyperparameters(self.param_groups, self.optimizer.param_groups)
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
        _copy_hyperparameters(self.optimizer.param_groups, self.param_groups)
        if self.master is not None:
            self.master.copy_(state["master"])


def _check_arguments(stage: int, reduce: str, optimizer_class) -> None:
    if stage not in (1, 2):
        raise ValueError(f"ZeroOptimizer implements stages 1 and 2, got stage={stage!r}; "
                         f"stage 3 shards the parameters too: use minishard.strategies.fsdp")
    if reduce not in ("reduce_scatter", "all_reduce"):
        raise ValueError(f"reduce must be 'reduce_scatter' or 'all_reduce', got {reduce!r}")
    if stage == 2 and reduce == "all_reduce":
        raise ValueError("stage 2 keeps only a gradient shard, so it must reduce-scatter")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE_OPTIMIZERS)):
        raise ValueError(
            f"{getattr(optimizer_class, '__name__', optimizer_class)} is not an element-wise "
            f"optimizer this sharder understands ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); "
            f"an optimizer with per-tensor state (norms, factored moments) cannot be run on flat shards")


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in NOT_HYPERPARAMETERS}


def _copy_hyperparameters(src: list[dict], dst: list[dict]) -> None:
    """Group by group, every hyperparameter of ``src`` into ``dst`` (parameters stay)."""
    for s, d in zip(src, dst):
        d.update(_hyperparameters(s))


# ---------------------------------------------------------------------------- as a strategy

class ZeroBuilt(Built):
    """ZeRO-1 and ZeRO-2: replicas of the weights, the optimizer state (and gradients) sharded
    by the :class:`ZeroOptimizer`, which also clips and counts its shards."""

    def __init__(self, strategy, model: nn.Module, optimizer: ZeroOptimizer, comm: Comm, *, quiet: bool):
        super().__init__(strategy, model, optimizer, (comm,))
        self.quiet = quiet

    def accumulating(self, quiet: bool):
        # ZeRO-1 accumulates full gradients and reduces once; ZeRO-2 reduce-scatters every
        # micro-batch unless told to hold the full gradients (accumulation="no_sync")
        return self.optimizer.no_sync() if quiet and self.quiet else contextlib.nullcontext()

    def _clip(self, max_norm: float) -> torch.Tensor:
        return self.optimizer.clip_grad_norm_(max_norm)

    def layout_numel(self) -> dict:
        return {"numel": self.optimizer.shard_numel()}


def build_zero(strategy, net: nn.Module, config, comm: Comm, ledger: LiveLedger | None,
               *, reduce: str = "reduce_scatter") -> ZeroBuilt:
    """ZeRO-1 and ZeRO-2 (``strategy.stage``), on bf16 weights with an fp32 master under mixed
    precision."""
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    mixed = config.precision == "bf16_mixed"
    if mixed:
        net.to(torch.bfloat16)
    opt = ZeroOptimizer([p for p in net.parameters()], opt_class, stage=strategy.stage, comm=comm,
                        ledger=ledger, reduce=reduce, master_dtype=torch.float32 if mixed else None,
                        bucket_cap_mb=config.bucket_cap_mb, **opt_kwargs)
    return ZeroBuilt(strategy, net, opt, comm,
                     quiet=strategy.stage == 1 or config.accumulation == "no_sync")
