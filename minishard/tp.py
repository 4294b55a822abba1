"""Tensor parallelism, for contrast: split the matrix multiply itself, never gather a weight.

FSDP *stores* 1/N of every weight but *computes* each layer whole: before a layer runs, its full
weight is all-gathered onto every rank. Tensor parallelism (Megatron-LM) never materialises a
full weight: an MLP's first matrix is split by columns and its second by rows, so

    x (B,T,C) on every rank
    h_r = gelu(x @ W1[:, cols of rank r])     (B,T,F/N)   no communication
    y_r = h_r @ W2[rows of rank r, :]         (B,T,C)     a partial sum
    y   = all_reduce(y_r)                                  activations cross the wire, not weights

Naming: "columns" and "rows" are Megatron's, of the matrix A in Y = X A (W1 is C x F). PyTorch's
``nn.Linear`` stores A transposed (``weight`` is out x in), so the first matrix's columns are
rows of ``fc.weight`` (``fc.weight[r F/N:(r+1) F/N, :]``) and the second's rows are columns of
``proj.weight`` (``proj.weight[:, r F/N:(r+1) F/N]``).

and backward mirrors it (the gradient w.r.t. x is all-reduced). What moves is proportional to
the activations (B·T·C), not to the weights (C·F) — and each rank does 1/N of the arithmetic.
The price: a collective inside every layer, on the critical path, which wants NVLink.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import Comm
from .launch import RankContext
from .ledger import LiveLedger


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
    """The GPT MLP (C -> F -> C, GELU) split over the ranks of ``comm``: rank r keeps columns
    [r F/N, (r+1) F/N) of the first weight and the same rows of the second."""

    def __init__(self, full: nn.Module, comm: Comm, ledger: LiveLedger | None = None):
        super().__init__()
        N, r = comm.world_size, comm.rank
        F_ = full.fc.out_features
        if F_ % N:
            raise ValueError(f"hidden size {F_} is not divisible by {N} ranks")
        part = slice(r * F_ // N, (r + 1) * F_ // N)
        self.comm = comm
        self.fc_w = nn.Parameter(full.fc.weight.detach()[part].clone())       # (F/N, C)
        self.fc_b = nn.Parameter(full.fc.bias.detach()[part].clone())
        self.proj_w = nn.Parameter(full.proj.weight.detach()[:, part].clone())  # (C, F/N)
        self.proj_b = nn.Parameter(full.proj.bias.detach().clone())           # added once, after
        if ledger is not None:
            for name, p in self.named_parameters():
                ledger.track("params", p, f"tp:{name}")

    def forward(self, x):                                   # (B, T, C) on every rank
        x = _CopyToParallel.apply(x, self.comm)
        h = F.gelu(F.linear(x, self.fc_w, self.fc_b))       # (B, T, F/N): this rank's columns
        y = F.linear(h, self.proj_w)                        # (B, T, C): a partial sum
        return _ReduceFromParallel.apply(y, self.comm) + self.proj_b


def compare_with_fsdp(rank: RankContext, micro_batch: int = 2, model: str = "tiny") -> dict:
    """One MLP forward+backward, tensor-parallel and FSDP-sharded, on real ranks: what each
    rank stores at its peak, what crosses the wire, and whether the results are the single-
    process ones. (A rank task; core question 3 of the course.)"""
    from . import fsdp
    from .model import GPT, config

    cfg = config(model)
    full = GPT(cfg, seed=0).blocks[0].mlp                   # the same weights on every rank
    x = torch.randn(micro_batch, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(1))
    ref_x = x.clone().requires_grad_(True)
    ref = full(ref_x)
    ref.sum().backward()
    out = {}

    tracer = rank.tracer
    ledger = LiveLedger(tracer)
    comm = Comm(tracer, ledger=ledger)
    tp = TensorParallelMLP(full, comm, ledger)
    tx = x.clone().requires_grad_(True)
    y = tp(tx)
    y.sum().backward()
    # this rank's slices of the unsharded MLP's weight gradients (proj.bias: whole on every rank)
    N, F_ = comm.world_size, full.fc.out_features
    part = slice(rank.rank * F_ // N, (rank.rank + 1) * F_ // N)
    want = {"fc_w": full.fc.weight.grad[part], "fc_b": full.fc.bias.grad[part],
            "proj_w": full.proj.weight.grad[:, part], "proj_b": full.proj.bias.grad}
    out["tp"] = {"output_matches": torch.allclose(y, ref, atol=1e-5),
                 "grad_x_matches": torch.allclose(tx.grad, ref_x.grad, atol=1e-5),
                 "grad_w_gap": {n: (getattr(tp, n).grad - g).abs().max().item() for n, g in want.items()},
                 "grad_w_scale": {n: g.abs().max().item() for n, g in want.items()},
                 "peak_weight_bytes": ledger.category_peaks.get(("params", "device"), 0),
                 "wire": comm.totals["wire"], "calls": comm.totals["calls"]}

    ledger2 = LiveLedger(tracer)
    comm2 = Comm(tracer, ledger=ledger2)
    sharded = GPT(cfg, seed=0).blocks[0].mlp
    fsdp.fully_shard(sharded, comm=comm2, ledger=ledger2, reshard_after_forward=True, name="mlp")
    comm2.reset_counters()
    fx = x.clone().requires_grad_(True)
    y2 = sharded(fx)
    y2.sum().backward()
    peaks = {c: b for (c, d), b in ledger2.category_peaks.items()}
    out["fsdp"] = {"output_matches": torch.allclose(y2, ref, atol=1e-5),
                   "peak_weight_bytes": peaks.get("params", 0) + peaks.get("unsharded", 0),
                   "gathered_full_weights": peaks.get("unsharded", 0),
                   "wire": comm2.totals["wire"], "calls": comm2.totals["calls"]}
    out["full_weight_bytes"] = sum(p.numel() * 4 for p in full.parameters())
    out["activation_bytes"] = x.numel() * 4
    return out
