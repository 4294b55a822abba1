"""DDP: every rank keeps a full replica; gradients are averaged with all-reduce.

Two versions, both trained by the parity tests:

* :class:`NaiveDDP` — the idea in ten lines: after ``backward()`` the training loop calls
  ``sync_gradients()``, which all-reduces every gradient, one collective per parameter, while the
  CPU/GPU sits idle.
* :class:`DDP` — what PyTorch's DDP does: gradients live in a few large flat *buckets*; as
  backward produces the last gradient of a bucket, that bucket's all-reduce starts
  asynchronously and overlaps with the rest of backward. Fewer, larger messages (less latency)
  and communication hidden behind compute. The bucket mechanics are shared with ZeRO
  (``minishard.strategies.buckets``); what is DDP's own is the collective: an all-reduce of the whole bucket.

Both average: each rank divides its bucket by N before the sum, so the result is the gradient
of the mean loss over the *global* batch — what one process training on all N micro-batches
would compute. Memory: every rank holds params + grads + optimizer state in full: the
redundancy ZeRO removes.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from . import buckets as _buckets
from .buckets import Bucket, BucketedReduction, offsets_of
from minishard.core.comm import Comm
from minishard.core.ledger import LiveLedger, track_optimizer_state
from .registry import Built, optimizer_spec


class NaiveDDP(nn.Module):
    """All-reduce each gradient after backward; the training loop calls ``sync_gradients()``."""

    def __init__(self, module: nn.Module, *, comm: Comm | None = None, ledger: LiveLedger | None = None):
        super().__init__()
        self.module, self.comm = module, comm if comm is not None else Comm()
        self.comm.broadcast_from_rank0(module.parameters(), ledger)
        if ledger is not None:
            ledger.track_parameters(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def recorders(self) -> tuple[list, list]:
        """What records this wrapper's collectives and bytes (for ``minishard.watch``)."""
        return [self.comm], []

    @torch.no_grad()
    def sync_gradients(self) -> None:
        for name, p in self.module.named_parameters():
            if p.grad is not None:
                p.grad.div_(self.comm.world_size)
                self.comm.all_reduce(p.grad, tag=f"grad:{name}")


def named_buckets(module: nn.Module, cap_mb: float, first_mb: float = 1.0
                  ) -> list[list[tuple[str, nn.Parameter]]]:
    """DDP's buckets for ``module`` as :func:`minishard.strategies.buckets.plan_buckets` plans them, each a
    list of ``(name, parameter)``: last layers first, the first bucket at most ``first_mb`` MiB,
    the others ``cap_mb``."""
    names = {p: n for n, p in module.named_parameters()}
    return [[(names[p], p) for p in params]
            for _, params in _buckets.plan_buckets([list(module.parameters())], cap_mb, first_mb)]


class DDP(nn.Module):
    """Bucketed, overlapped gradient all-reduce (see the module docstring).

    ``DDP(model)`` averages over the default process group (``comm``: another :class:`Comm`;
    ``ledger``: where its buffers are entered). Buckets are filled in reverse parameter order
    (roughly the order backward produces gradients); the first bucket is small
    (``first_bucket_mb``) so communication starts early, the others hold up to ``bucket_cap_mb``
    — PyTorch's defaults are 1 and 25 MiB. ``per_parameter=True``: one bucket per parameter, each
    gradient all-reduced asynchronously as soon as it (and every gradient before it in bucket
    order) is ready. Buckets are launched strictly in order so that every rank issues the same
    collectives in the same order. ``no_sync()`` skips the all-reduce for gradient accumulation;
    ``finish_gradient_synchronization()`` waits for every outstanding all-reduce (backward does
    it by itself; after backwards inside ``no_sync`` it synchronises what they accumulated).
    """

    owns_gradients = True          # every .grad is a view into one of its buckets

    def __init__(self, module: nn.Module, *, comm: Comm | None = None,
                 ledger: LiveLedger | None = None, bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, per_parameter: bool = False):
        super().__init__()
        self.module, self.ledger = module, ledger
        self.comm = comm if comm is not None else Comm()
        self.comm.broadcast_from_rank0(module.parameters(), ledger)
        plan = _buckets.plan_buckets([list(module.parameters())], bucket_cap_mb, first_bucket_mb,
                                     per_parameter=per_parameter)
        self.buckets = [self._allocate_bucket(i, params) for i, (_, params) in enumerate(plan)]
        if ledger is not None:
            ledger.track_parameters(module)
            for b in self.buckets:
                ledger.track("grads", b.buffer, f"grad_bucket:{b.index}")
        self.reduction = BucketedReduction(self.buckets, reduce=self._all_reduce, ledger=ledger)

    @staticmethod
    def _allocate_bucket(index: int, params: list[nn.Parameter]) -> Bucket:
        dtype = params[0].dtype
        if any(p.dtype != dtype for p in params):
            raise ValueError("DDP buckets need one dtype per bucket; got mixed parameter dtypes")
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=dtype, device=params[0].device)
        return Bucket(index=index, params=params, offsets=offsets_of(params), size=numel,
                      buffer=buffer)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def recorders(self) -> tuple[list, list]:
        """What records this wrapper's collectives and bytes (for ``minishard.watch``)."""
        return [self.comm], [self.ledger]

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for the backwards inside."""
        prev, self.reduction.sync = self.reduction.sync, False
        try:
            yield
        finally:
            self.reduction.sync = prev

    def finish_gradient_synchronization(self) -> None:
        """Wait until every gradient is averaged over the ranks (see the class docstring)."""
        self.reduction.finish_gradient_synchronization()

    def _all_reduce(self, b: Bucket) -> None:
        b.buffer.div_(self.comm.world_size)           # sum of grads / N = grad of the mean loss
        b.work = self.comm.all_reduce(b.buffer, async_op=True, tag=f"bucket{b.index}")


# ---------------------------------------------------------------------------- as a strategy

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
        h.strategy = h.layout_name(0)
        masters = dict(zip(self.params, self.master))
        for p, fqn in h.names.items():
            h.order.append(fqn)
            h.add_replicated_param(fqn, p, self.optimizer, masters.get(p))


class ReplicasBuilt(Built):
    """single, ddp_naive, ddp: every rank holds everything. ``model`` is the wrapper (DDP,
    NaiveDDP) or the network itself; ``net`` is always the network."""

    def __init__(self, strategy, model, optimizer, comm: Comm, net: nn.Module):
        super().__init__(strategy, model, optimizer, (comm,))
        self.net = net

    def accumulating(self, quiet: bool):
        # DDP's no_sync holds the buckets back; naive DDP and one process reduce nothing in backward
        if quiet and isinstance(self.model, DDP):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def synchronise(self, tracer=None) -> None:
        # naive DDP's one all-reduce per gradient, after backward: a phase of its own in the trace
        if isinstance(self.model, NaiveDDP):
            with tracer.phase("sync_gradients") if tracer is not None else contextlib.nullcontext():
                self.model.sync_gradients()

    def track_state(self, ledger) -> None:
        if ledger is None:
            return
        if isinstance(self.optimizer, MasterWeights):
            track_optimizer_state(ledger, self.optimizer.optimizer, prefix="master_")
        else:
            track_optimizer_state(ledger, self.optimizer, self.net)

    def _parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.net.named_parameters())


def build_replicas(strategy, net: nn.Module, config, comm: Comm, ledger: LiveLedger | None,
                   *, wrapper: str | None = None) -> ReplicasBuilt:
    """single, ddp_naive, ddp: ``wrapper`` averages the gradients — ``"naive"`` one all-reduce
    per tensor after backward, ``"buckets"`` DDP's buckets during backward, none for the single
    process. Mixed precision keeps an fp32 master next to bf16 weights."""
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    if config.precision == "bf16_mixed":
        net.to(torch.bfloat16)
    if wrapper == "buckets":
        model = DDP(net, comm=comm, ledger=ledger, bucket_cap_mb=config.bucket_cap_mb)
    elif wrapper == "naive":
        model = NaiveDDP(net, comm=comm, ledger=ledger)
    else:
        model = net
        if ledger is not None:
            ledger.track_parameters(net)
    if not getattr(model, "owns_gradients", False):   # (DDP's gradients live in its buckets)
        for name, p in net.named_parameters():        # grads allocated up front, so that the
            if not p.requires_grad:                   # ledger sees them; a frozen weight has
                continue                              # none (a zero one would be decayed)
            p.grad = torch.zeros_like(p)
            if ledger is not None:
                ledger.track("grads", p.grad, f"grad:{name}")
    if config.precision == "bf16_mixed":
        opt = MasterWeights(net, opt_class, ledger, **opt_kwargs)
    else:
        opt = opt_class(net.parameters(), **opt_kwargs)
    return ReplicasBuilt(strategy, model, opt, comm, net)
