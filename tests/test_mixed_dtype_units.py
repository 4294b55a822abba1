"""FSDP units whose parameters have several dtypes (issue 39, A), in every order: fp32 first, bf16
first, interleaved. A per-parameter unit must take each parameter's dtype from that parameter,
never from the unit's first one (the bug class: "a dtype taken from the first element passes
every test whose first parameter is fp32").

For every order and mixed-precision policy, on 2 and 3 gloo ranks, checked against values this
file computes itself from the shapes, the dtypes and the policy:

* every shard keeps its parameter's dtype and holds that parameter's rows, exactly;
* every gathered parameter has the compute dtype (the policy's ``param_dtype``, else its own)
  and the original's values, exactly (rounded once to ``param_dtype``);
* every gradient shard has the shard's dtype and the value of the rank-order sum over ranks of
  each rank's gradient cast to the reduction dtype and divided by N, cast to the shard's dtype;
* the bytes and dtype of each collective: with no ``param_dtype`` the gather moves each shard's
  raw bytes (8-byte aligned blocks) and the reduce-scatter runs in fp32; with one, both move
  ``param_dtype`` / ``reduce_dtype`` elements;
* the ledger counts a shard as a master weight exactly when its dtype is not the compute dtype.

The model is element-wise (loss_i = sum(p_i * (x_i + p_i / 2)), gradient x_i + p_i in the compute
dtype): its gradients are the same bits whatever kernels run, so the sums compare exactly.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from minishard.strategies import fsdp
from minishard.core.comm import Comm
from minishard.core.ledger import LiveLedger

F32, BF16 = torch.float32, torch.bfloat16
# parameter shapes: rows that divide by neither 2 nor 3, a 1-D one, a bf16 block of odd bytes
SHAPES = [(5, 3), (7,), (3, 5), (4, 3)]
ORDERS = {
    "fp32_first": (F32, F32, BF16, BF16),
    "bf16_first": (BF16, BF16, F32, F32),
    "interleaved_fp32_first": (F32, BF16, F32, BF16),
    "interleaved_bf16_first": (BF16, F32, BF16, F32),
}
POLICIES = [(None, None), (BF16, F32), (BF16, None)]


class Toy(nn.Module):
    """Parameters of ``dtypes``; an element-wise loss, each parameter computing in the dtype the
    unit gives it."""

    def __init__(self, dtypes):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        for i, (shape, dtype) in enumerate(zip(SHAPES, dtypes)):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape, generator=g).to(dtype)))

    def forward(self, *xs):
        ps = [getattr(self, f"p{i}") for i in range(len(SHAPES))]
        return sum((p.float() * (x + 0.5 * p.float())).sum() for p, x in zip(ps, xs))


def data(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s inputs: fp32 values (not bf16-representable), different on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def mixed_run(rank) -> list[dict]:
    """Rank task: every order and policy; what the unit holds, gathers, reduces and sends."""
    out = []
    for order, dtypes in ORDERS.items():
        for param_dtype, reduce_dtype in POLICIES:
            comm, ledger = Comm(rank.tracer), LiveLedger()
            net = fsdp.fully_shard(Toy(dtypes), comm=comm, ledger=ledger, name="toy",
                                   mp_policy=fsdp.MixedPrecisionPolicy(param_dtype, reduce_dtype))
            categories = dict(ledger.current())
            first = len(rank.tracer.events)
            gathered = fsdp.full_parameters(net)
            read = [e for e in rank.tracer.events[first:] if e["kind"] == "collective"]
            first = len(rank.tracer.events)
            net(*data(rank.rank)).backward()
            step = [e for e in rank.tracer.events[first:] if e["kind"] == "collective"]
            out.append({
                "order": order, "policy": (param_dtype, reduce_dtype), "categories": categories,
                "shards": [p.detach().clone() for p in net.parameters()],
                "grads": [p.grad.as_subclass(torch.Tensor).clone() for p in net.parameters()],
                "gathered": [gathered[f"p{i}"] for i in range(len(SHAPES))],
                "read": [(e["op"], e["dtype"], e["payload"]) for e in read],
                "step": [(e["op"], e["dtype"], e["payload"]) for e in step],
            })
    return out


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rows_of(shape, N: int) -> tuple[int, int]:
    """(rows per shard, elements per row) of per-parameter sharding along dim 0."""
    rows = shape[0] if shape else 1
    return math.ceil(rows / N), math.prod(shape) // rows


def expected_wire(dtypes, policy, N: int) -> list[tuple[str, str, int]]:
    """The all-gather and the reduce-scatter of one step: (op, dtype, bytes of the buffer)."""
    param_dtype, reduce_dtype = policy
    per_rank = [c * inner for c, inner in (rows_of(s, N) for s in SHAPES)]
    mixed = param_dtype is None and len(set(dtypes)) > 1
    if mixed:       # raw bytes, each shard's block rounded up to 8 bytes
        gather = ("uint8", N * sum(-(-n * d.itemsize // 8) * 8 for n, d in zip(per_rank, dtypes)))
    else:
        d = param_dtype or dtypes[0]
        gather = (name(d), N * sum(per_rank) * d.itemsize)
    rd = reduce_dtype or param_dtype or (F32 if mixed else dtypes[0])
    return [("all_gather", *gather), ("reduce_scatter", name(rd), N * sum(per_rank) * rd.itemsize)]


def expected_grads(dtypes, policy, N: int) -> list[torch.Tensor]:
    """Every parameter's reduced full gradient, in fp64-exact steps: each rank's gradient (one
    process, the compute dtype), cast to the reduction dtype, divided by N, summed in rank order,
    cast to the shard's dtype."""
    param_dtype, reduce_dtype = policy
    mixed = param_dtype is None and len(set(dtypes)) > 1
    rd = reduce_dtype or param_dtype or (F32 if mixed else dtypes[0])
    total = None
    for r in range(N):
        net = Toy(dtypes)
        if param_dtype is not None:
            net = net.to(param_dtype)
        net(*data(r)).backward()
        part = [p.grad.to(rd) / N for p in net.parameters()]
        total = part if total is None else [a + b for a, b in zip(total, part)]
    return [t.to(d) for t, d in zip(total, dtypes)]


def shard_rows(full: torch.Tensor, r: int, N: int) -> torch.Tensor:
    """Rank r's shard of ``full``: its rows, the last ranks' padded with zero rows."""
    c, inner = rows_of(tuple(full.shape), N)
    rows = full.reshape(-1, inner)
    out = torch.zeros(c, inner, dtype=full.dtype)
    mine = rows[r * c:(r + 1) * c]
    out[:mine.shape[0]] = mine
    return out.reshape((c,) + tuple(full.shape[1:]))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view({F32: torch.int32, BF16: torch.int16}[t.dtype])


def assert_exact(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    assert torch.equal(bits(got), bits(want)), (what, got.reshape(-1)[:6].tolist(), want.reshape(-1)[:6].tolist())


@pytest.fixture(scope="module", params=[2, 3])
def runs(request, pools):
    N = request.param
    return N, pools(N).run(mixed_run)


@pytest.mark.parametrize("order", list(ORDERS))
def test_mixed_dtype_unit_keeps_every_dtype_in_every_order(runs, order):
    N, res = runs
    dtypes = ORDERS[order]
    originals = [p.detach() for p in Toy(dtypes).parameters()]
    for policy in POLICIES:
        want_grads = expected_grads(dtypes, policy, N)
        compute = [policy[0] or d for d in dtypes]
        for r, rank_runs in enumerate(res):
            got = next(x for x in rank_runs if x["order"] == order and x["policy"] == policy)
            what = (order, policy, f"rank {r} of {N}")
            # the shards: each parameter's own dtype, its rows
            for i, (shard, full) in enumerate(zip(got["shards"], originals)):
                assert_exact(shard, shard_rows(full, r, N), (*what, f"shard p{i}"))
            # the gathered parameters: the compute dtype, the original's values
            for i, (value, full, d) in enumerate(zip(got["gathered"], originals, compute)):
                assert_exact(value, full.to(d), (*what, f"gathered p{i}"))
            # the gradient shards: the shard's dtype, the reduced sum's rows
            for i, (grad, full) in enumerate(zip(got["grads"], want_grads)):
                assert_exact(grad, shard_rows(full, r, N), (*what, f"gradient of p{i}"))
            # the collectives: reading the parameters gathers as the unit does; one step gathers
            # once (the root keeps its parameters for backward) and reduce-scatters once
            wire = expected_wire(dtypes, policy, N)
            assert got["read"] == wire[:1], (what, got["read"], wire)
            assert got["step"] == wire, (what, got["step"], wire)
            # the ledger: a shard is a master weight where the unit computes in another dtype
            shard_bytes = [shard_rows(o, r, N).numel() * d.itemsize for o, d in zip(originals, dtypes)]
            master = sum(b for b, d, c in zip(shard_bytes, dtypes, compute) if c != d)
            cats = got["categories"]
            assert (cats.get("master", 0), cats.get("params", 0)) == (master, sum(shard_bytes) - master), \
                (what, cats)
