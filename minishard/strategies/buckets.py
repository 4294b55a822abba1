"""Gradient buckets: the reduction DDP and ZeRO share.

Reducing each gradient on its own costs one collective per tensor, and waiting for backward to
finish first leaves the wire idle while the CPU/GPU computes. Both strategies instead group
gradients into a few flat *buckets* and reduce a bucket as soon as backward has produced its last
gradient, while backward goes on with earlier layers. This file is that mechanism, once:

1. **plan** — which parameters share a bucket (:func:`plan_buckets`): last layers first, the
   order backward produces their gradients; a small first bucket so communication starts early;
   never two optimizer parameter groups in one bucket.
2. **post_accumulate_grad** — autograd has finished a parameter's gradient: make sure it sits in
   its bucket (see below), and mark it ready.
3. **launch** — buckets are reduced strictly in bucket order, so every rank issues the same
   collectives in the same order (a rank that launched bucket 3 before bucket 2 would pair its
   collective with another rank's bucket 2: a hang, or a wrong sum).
4. **finish_gradient_synchronization** — at the end of backward (one callback queued on the
   autograd engine): launch the buckets whose parameters got no gradient in this forward (they
   contribute zeros), wait for every reduction, land each result.

Where a gradient lives is the one choice a strategy makes here. DDP and ZeRO-1 keep every
gradient *in* its bucket (``.grad`` is a view into the bucket's buffer, so there is nothing to
copy); ``zero_grad(set_to_none=True)`` drops those views, autograd then allocates a fresh
``.grad``, and the hook moves it back into the bucket. ZeRO-2 keeps no full gradient: the hook
copies each gradient into a temporary bucket buffer and drops it, and the buffer is freed once
its reduce-scatter has delivered this rank's shard.

What differs between the strategies — the collective (all-reduce or reduce-scatter) and where
the reduced values go — is passed in as two functions, ``reduce(bucket)`` and ``land(bucket)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn

from minishard.core.autograd_private import queue_callback
from minishard.core.comm import Work
from minishard.core.ledger import LiveLedger
from .local_grad import local


def plan_buckets(param_groups: Sequence[Sequence[nn.Parameter]], cap_mb: float,
                 first_mb: float = 1.0, *, per_parameter: bool = False
                 ) -> list[tuple[int, list[nn.Parameter]]]:
    """The trainable parameters, grouped into buckets: ``(group index, parameters)`` per bucket,
    in the order the buckets fill. Each group fills buckets of its own, walking its parameters
    last first (the order backward produces gradients); its first bucket is small (at most
    ``first_mb`` MiB) so that communication starts early, the others close once they reach
    ``cap_mb`` MiB (PyTorch DDP's rule, so that layouts compare). ``per_parameter``: one bucket
    per parameter. Frozen parameters (``requires_grad=False``) get no bucket."""
    trainable = [(g, p) for g, ps in enumerate(param_groups) for p in ps if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: every parameter has requires_grad=False")
    if cap_mb <= 0 or first_mb <= 0:
        raise ValueError(f"bucket sizes must be positive (got cap {cap_mb} MiB, first {first_mb} MiB)")
    devices = {p.device for _, p in trainable}
    if len(devices) > 1:
        raise ValueError(f"parameters on mixed devices {sorted(map(str, devices))}; move the "
                         f"model to one device before wrapping it")
    if per_parameter:
        return [(g, [p]) for g, p in reversed(trainable)]
    plan, filling, size, limit = [], {}, {}, {}
    walk = list(reversed(trainable))
    for i, (g, p) in enumerate(walk):
        filling.setdefault(g, []).append(p)
        size[g] = size.get(g, 0) + p.numel() * p.element_size()
        if size[g] >= limit.get(g, min(first_mb, cap_mb) * 2**20):
            plan.append((g, filling.pop(g)))
            size[g], limit[g] = 0, cap_mb * 2**20
        if g in filling and (i + 1 == len(walk) or walk[i + 1][0] != g):
            plan.append((g, filling.pop(g)))    # the group's last, partly filled bucket: full
    return plan                                 # when its walk ends, before the next group's


@dataclass(eq=False, kw_only=True)
class Bucket:
    """Parameters whose gradients are reduced together, in one flat buffer of ``size`` elements:
    parameter ``k``'s gradient is ``buffer[offsets[k]:offsets[k] + params[k].numel()]``."""
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    size: int                                  # the buffer's elements (ZeRO: padding included)
    group: int = 0                             # the optimizer parameter group it serves
    buffer: torch.Tensor | None = None         # None while a copied-in bucket has no gradient yet
    ready: set = field(default_factory=set)    # indices of the parameters whose gradient is in
    work: Work | None = None                   # its reduction, while in flight

    def grad_view(self, k: int) -> torch.Tensor:
        p = self.params[k]
        return self.buffer[self.offsets[k]:self.offsets[k] + p.numel()].view_as(p)


def offsets_of(params: Sequence[nn.Parameter]) -> list[int]:
    """Where each parameter starts when ``params`` are laid end to end."""
    out, off = [], 0
    for p in params:
        out.append(off)
        off += p.numel()
    return out


class BucketedReduction:
    """Reduce ``buckets`` during backward, each as soon as it is full (see the module docstring).

    ``reduce(bucket)`` starts the bucket's collective (asynchronously: it sets ``bucket.work``);
    ``land(bucket)`` (optional) moves the result where it belongs once the collective is done.
    ``grads_in_buckets``: ``.grad`` is a view into the bucket's buffer (DDP, ZeRO-1); otherwise
    each gradient is copied into a temporary buffer and dropped (ZeRO-2; the buffer is allocated
    on the first gradient and entered in ``ledger`` as ``comm_buffers``). ``max_in_flight``
    bounds the buckets whose reduction is in flight: the memory of copied-in buckets.
    """

    def __init__(self, buckets: list[Bucket], *, reduce: Callable[[Bucket], None],
                 land: Callable[[Bucket], None] | None = None, grads_in_buckets: bool = True,
                 max_in_flight: int | None = None, ledger: LiveLedger | None = None,
                 partial: bool = False):
        self.buckets, self.ledger = buckets, ledger
        self.partial = partial                 # .grad is not the whole sum (ZeRO-1): no norm
        self._reduce, self._land = reduce, land
        self.grads_in_buckets, self.max_in_flight = grads_in_buckets, max_in_flight
        self.sync = True                       # False: accumulate locally (no_sync)
        self._next_launch = 0                  # the next bucket to launch, in bucket order
        self._in_flight: list[Bucket] = []    # launched, not yet landed, oldest first
        self._callback_queued = False
        self._unsynced = False                 # gradients accumulated since the last sync
        self._where = {p: (b, k) for b in buckets for k, p in enumerate(b.params)}
        if grads_in_buckets:
            for b in buckets:
                for k, p in enumerate(b.params):
                    p.grad = self._grad_view(b, k)
        # the one place the hooks are registered: each is a single call to a named method
        for p in self._where:
            p.register_post_accumulate_grad_hook(self.post_accumulate_grad)

    # ---- during backward
    def post_accumulate_grad(self, p: nn.Parameter) -> None:
        """Autograd has finished ``p``'s gradient for this backward."""
        b, k = self._where[p]
        self._unsynced = True
        if self.grads_in_buckets:
            if p.grad.data_ptr() != b.buffer.data_ptr() + b.offsets[k] * b.buffer.element_size():
                # zero_grad(set_to_none=True) dropped our view and autograd made a fresh .grad;
                # move it into the bucket (one copy) and point .grad back at the bucket
                view = self._grad_view(b, k)
                view.copy_(p.grad)
                p.grad = view
        else:   # added, not copied: inside no_sync the buffer sums the micro-batches
            self._buffer_of(b)[b.offsets[k]:b.offsets[k] + p.numel()].add_(p.grad.view(-1))
            p.grad = None                      # no full gradient stays behind
        if self.sync:
            self._mark_ready(b, k)

    def _grad_view(self, b: Bucket, k: int) -> torch.Tensor:
        return local(b.grad_view(k)) if self.partial else b.grad_view(k)

    def _mark_ready(self, b: Bucket, k: int) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            queue_callback(self.finish_gradient_synchronization)
        b.ready.add(k)
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.params):
                return
            self._launch(nxt)

    def _buffer_of(self, b: Bucket) -> torch.Tensor:
        """A copied-in bucket's buffer, allocated (zeros: a missing gradient counts as zero) by
        the first gradient that arrives."""
        if b.buffer is None:
            p = b.params[0]
            b.buffer = torch.zeros(b.size, dtype=p.dtype, device=p.device)
            if self.ledger is not None:     # held across micro-batches (no_sync): gradients
                self.ledger.track("comm_buffers" if self.sync else "grads", b.buffer,
                                  f"grad_bucket:{b.index}")
        return b.buffer

    def _launch(self, b: Bucket) -> None:
        if self.max_in_flight is not None and len(self._in_flight) >= self.max_in_flight:
            self._complete(self._in_flight.pop(0))   # waiting for the oldest bounds the memory
        self._reduce(b)
        self._in_flight.append(b)
        self._next_launch += 1

    def _complete(self, b: Bucket) -> None:
        if b.work is not None:
            b.work.wait()
            b.work = None
        if self._land is not None:
            self._land(b)

    # ---- end of backward
    def finish_gradient_synchronization(self) -> None:
        """Reduce every gradient accumulated since the last synchronization and wait for all.
        Runs by itself at the end of every backward outside ``no_sync``; call it yourself after
        backwards run inside ``no_sync`` to synchronise what they accumulated. Does nothing
        when there is nothing to synchronise."""
        if not self._unsynced and not self._in_flight:
            return
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if self.grads_in_buckets:
                for k, p in enumerate(b.params):
                    if k not in b.ready and p.grad is None:   # no gradient since set_to_none
                        b.grad_view(k).zero_()
            else:
                self._buffer_of(b)             # a bucket that got no gradient reduces zeros
            self._launch(b)
        for b in self._in_flight:
            self._complete(b)
        for b in self.buckets:
            b.ready = set()
        self._in_flight, self._next_launch = [], 0
        self._callback_queued = self._unsynced = False
