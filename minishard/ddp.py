"""DDP: every rank keeps a full replica; gradients are averaged with all-reduce.

Two versions, both trained by the parity tests:

* :class:`NaiveDDP` — the idea in ten lines: after ``backward()`` the training loop calls
  ``sync_gradients()``, which all-reduces every gradient, one collective per parameter, while the
  CPU/GPU sits idle.
* :class:`DDP` — what PyTorch's DDP does: gradients live in a few large flat *buckets*; as
  backward produces the last gradient of a bucket, that bucket's all-reduce starts
  asynchronously and overlaps with the rest of backward. Fewer, larger messages (less latency)
  and communication hidden behind compute.

Both average: each rank divides its bucket by N before the sum, so the result is the gradient
of the mean loss over the *global* batch — what one process training on all N micro-batches
would compute. Memory: every rank holds params + grads + optimizer state in full: the
redundancy ZeRO removes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .comm import Comm, Work
from .ledger import LiveLedger


class NaiveDDP(nn.Module):
    """All-reduce each gradient after backward; the training loop calls ``sync_gradients()``."""

    def __init__(self, module: nn.Module, comm: Comm, ledger: LiveLedger | None = None):
        super().__init__()
        self.module, self.comm = module, comm
        comm.replicate_from_rank0(module.parameters(), ledger)
        if ledger is not None:
            for name, p in module.named_parameters():
                ledger.track("params", p, f"param:{name}")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        for name, p in self.module.named_parameters():
            if p.grad is not None:
                p.grad.div_(self.comm.world_size)
                self.comm.all_reduce(p.grad, tag=f"grad:{name}")


def plan_buckets(module: nn.Module, cap_mb: float, first_mb: float = 1.0
                 ) -> list[list[tuple[str, nn.Parameter]]]:
    """Group trainable parameters into buckets, last layers first (the order backward produces
    their gradients). The first bucket is small (at most ``first_mb``) so communication starts
    early; a bucket closes once it reaches its size limit (PyTorch's rule, so layouts compare)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{type(module).__name__} has no trainable parameters")
    if cap_mb <= 0 or first_mb <= 0:
        raise ValueError(f"bucket sizes must be positive (got cap {cap_mb} MiB, first {first_mb} MiB)")
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"parameters on mixed devices {sorted(map(str, devices))}; move the "
                         f"model to one device before wrapping it")
    groups, current, size = [], [], 0
    limit = min(first_mb, cap_mb) * 2**20
    for name, p in reversed(named):
        current.append((name, p))
        size += p.numel() * p.element_size()
        if size >= limit:
            groups.append(current)
            current, size, limit = [], 0, cap_mb * 2**20
    if current:
        groups.append(current)
    return groups


class BucketedReduction:
    """What DDP and ZeRO share: as backward marks gradients ready, launch each bucket's reduction
    as soon as it is full — strictly in bucket order, so every rank issues the same collectives
    in the same order — and queue one end-of-backward callback that finishes the rest.
    Subclasses provide ``buckets``, ``_reduce_bucket(b)`` and ``_finish_gradient_sync()``."""

    _next_launch = 0
    _callback_queued = False

    def _mark_ready(self, bucket, index: int) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_gradient_sync)
        bucket.ready.add(index)
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.ready) < len(b.params):
                return
            self._reduce_bucket(b)
            self._next_launch += 1


@dataclass
class Bucket:
    """A flat gradient buffer: its parameters' ``.grad`` are views into it."""
    index: int
    buffer: torch.Tensor
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    ready: set = field(default_factory=set)
    work: Work | None = None


class DDP(BucketedReduction, nn.Module):
    """Bucketed, overlapped gradient all-reduce (see the module docstring).

    Buckets are filled in reverse parameter order (roughly the order backward produces
    gradients); the first bucket is small (``first_bucket_mb``) so communication starts early,
    the others hold up to ``bucket_cap_mb`` — PyTorch's defaults are 1 and 25 MiB. Buckets are
    launched strictly in index order so that every rank issues the same collectives in the same
    order. ``no_sync()`` skips the all-reduce for gradient accumulation.
    """

    owns_gradients = True          # every .grad is a view into one of its buckets

    def __init__(self, module: nn.Module, comm: Comm, ledger: LiveLedger | None = None, *,
                 bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0):
        super().__init__()
        self.module, self.comm, self.ledger = module, comm, ledger
        comm.replicate_from_rank0(module.parameters(), ledger)
        self.buckets = self._build_buckets(bucket_cap_mb, first_bucket_mb)
        if ledger is not None:
            for name, p in module.named_parameters():
                ledger.track("params", p, f"param:{name}")
            for b in self.buckets:
                ledger.track("grads", b.buffer, f"grad_bucket:{b.index}")
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._sync = True
        # the one place hooks are registered: each is a single call to a named method
        for p in self._where:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ---- construction
    def _build_buckets(self, cap_mb: float, first_mb: float) -> list[Bucket]:
        groups = plan_buckets(self.module, cap_mb, first_mb)
        buckets = []
        for i, group in enumerate(groups):
            dtype = group[0][1].dtype
            if any(p.dtype != dtype for _, p in group):
                raise ValueError("DDP buckets need one dtype per bucket; got mixed parameter dtypes")
            numel = sum(p.numel() for _, p in group)
            buf = torch.zeros(numel, dtype=dtype, device=group[0][1].device)
            offsets, off = [], 0
            for _, p in group:
                offsets.append(off)
                p.grad = buf[off:off + p.numel()].view_as(p)       # grads live in the bucket
                off += p.numel()
            buckets.append(Bucket(i, buf, [p for _, p in group], [n for n, _ in group], offsets))
        return buckets

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for the backwards inside."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    # ---- during backward
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket, i = self._where[p]
        view = bucket.buffer[bucket.offsets[i]:bucket.offsets[i] + p.numel()].view_as(p)
        if p.grad.data_ptr() != view.data_ptr():
            # zero_grad(set_to_none=True) dropped our view and autograd made a fresh .grad;
            # move it into the bucket (one copy) and point .grad back at the bucket
            view.copy_(p.grad)
            p.grad = view
        if self._sync:
            self._mark_ready(bucket, i)

    def _reduce_bucket(self, b: Bucket) -> None:
        b.buffer.div_(self.comm.world_size)           # sum of grads / N = grad of the mean loss
        b.work = self.comm.all_reduce(b.buffer, async_op=True, tag=f"bucket{b.index}")

    def _finish_gradient_sync(self) -> None:
        """Runs once at the end of backward: launch buckets whose params got no gradient (unused
        in this forward), then wait for every all-reduce."""
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            for i, p in enumerate(b.params):
                if i not in b.ready and p.grad is None:        # unused: contributes zero
                    b.buffer[b.offsets[i]:b.offsets[i] + p.numel()].zero_()
            self._reduce_bucket(b)
            self._next_launch += 1
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work, b.ready = None, set()
        self._next_launch, self._callback_queued = 0, False
