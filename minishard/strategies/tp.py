"""Tensor parallelism, for contrast: split the matrix multiply itself, never gather a weight.

FSDP *stores* 1/N of every weight but *computes* each layer whole: before a layer runs, its full
weight is all-gathered onto every rank. Tensor parallelism (Megatron-LM) never materialises a
full weight: an MLP's first matrix is split by columns and its second by rows, so

    x (b,s,h) on every rank
    h_r = gelu(x @ W1[:, cols of rank r])     (b,s,h_ff/N)   no communication
    y_r = h_r @ W2[rows of rank r, :]         (b,s,h)     a partial sum
    y   = all_reduce(y_r)                                  activations cross the wire, not weights

Naming: "columns" and "rows" are Megatron's, of the matrix W in Y = X W (W1 is h x h_ff). PyTorch's
``nn.Linear`` stores W transposed (``weight`` is out x in), so the first matrix's columns are
rows of ``fc.weight`` (``fc.weight[r·h_ff/N:(r+1)·h_ff/N, :]``) and the second's rows are columns of
``proj.weight`` (``proj.weight[:, r·h_ff/N:(r+1)·h_ff/N]``).

and backward mirrors it (the gradient w.r.t. x is all-reduced). What moves is proportional to
the activations (b·s·h), not to the weights (h·h_ff) — and each rank does 1/N of the arithmetic.
The price: a collective inside every layer, on the critical path, which wants NVLink.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minishard.core.comm import Comm
from minishard.core.ledger import LiveLedger


class _CopyToParallel(torch.autograd.Function):
    """Forward: x is used by every rank as is. Backward: each rank holds only its part of dL/dx,
    so the parts are summed."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad, tag="tp:grad_x")
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Forward: sum the partial outputs of the row-parallel matrix. Backward: identity."""

    @staticmethod
    def forward(ctx, y, comm):
        y = y.contiguous()
        comm.all_reduce(y, tag="tp:y")
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelMLP(nn.Module):
    """The GPT MLP (h -> h_ff -> h, GELU) split over the ranks of ``comm``: rank r keeps columns
    [r·h_ff/N, (r+1)·h_ff/N) of the first weight and the same rows of the second."""

    def __init__(self, full: nn.Module, comm: Comm, ledger: LiveLedger | None = None):
        super().__init__()
        N, r = comm.world_size, comm.rank
        F_ = full.fc.out_features
        if F_ % N:
            raise ValueError(f"hidden size {F_} is not divisible by {N} ranks")
        part = slice(r * F_ // N, (r + 1) * F_ // N)
        self.comm = comm
        self.fc_w = nn.Parameter(full.fc.weight.detach()[part].clone())       # (h_ff/N, h)
        self.fc_b = nn.Parameter(full.fc.bias.detach()[part].clone())
        self.proj_w = nn.Parameter(full.proj.weight.detach()[:, part].clone())  # (h, h_ff/N)
        self.proj_b = nn.Parameter(full.proj.bias.detach().clone())           # added once, after
        if ledger is not None:
            ledger.track_parameters(self, prefix="tp")

    def forward(self, x):                                   # (b, s, h) on every rank
        x = _CopyToParallel.apply(x, self.comm)
        h = F.gelu(F.linear(x, self.fc_w, self.fc_b))       # (b, s, h_ff/N): this rank's columns
        y = F.linear(h, self.proj_w)                        # (b, s, h): a partial sum
        return _ReduceFromParallel.apply(y, self.comm) + self.proj_b
