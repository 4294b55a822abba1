"""Property-based tests (hypothesis): the sharding mechanics on random sizes, not chosen ones.

The example tests check each mechanism at a few sizes picked by hand; these draw the sizes —
empty tensors, sizes that do not divide by N, fewer rows than ranks, 0-d parameters — and check
what every size must satisfy:

* the point-to-point all-gather and reduce-scatter (``minishard.core.comm``, gloo): the concatenation
  in rank order, and the sum in rank order, bit for bit; in place and not, async and not;
* bucket planning (``minishard.strategies.buckets.plan_buckets``): the rules its docstring states;
* FSDP's two layouts and ZeRO's buckets: every element held by exactly one rank, padding zero,
  the all-gather / reduce-scatter packing round trip;
* the checkpoint's read plan (``minishard.checkpoint.plan_reads``): every needed element read
  exactly once, whole checksum blocks of one piece, merged.

Examples are drawn reproducibly (``derandomize``) and bounded; the collectives run a batch of
cases per example in one task on the session's warm pools, so a pool is never started per case.
"""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import rank_tasks  # noqa: E402
from minishard.strategies.buckets import plan_buckets  # noqa: E402
from minishard.checkpoint import CheckpointError, plan_reads  # noqa: E402
from minishard.checkpoint.format import build_metadata, plan_file  # noqa: E402
from minishard.checkpoint.regions import Region  # noqa: E402
from minishard.core.comm import Comm  # noqa: E402
from minishard.strategies.fsdp.layout import FlatLayout, PerParamLayout  # noqa: E402
from minishard.strategies.fsdp.slots import collect_slots  # noqa: E402
from minishard.strategies.zero import ZeroOptimizer  # noqa: E402


def bounded(n: int, **kw):
    """Reproducible (same examples every run), bounded, no example database written."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large], **kw)


BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
        torch.float16: torch.int16, torch.uint8: torch.uint8}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: equal bits, not merely equal values (-0.0 is not 0.0)."""
    return t.detach().contiguous().reshape(-1).view(BITS[t.dtype])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.numel() == want.numel(), (what, got.numel(), want.numel())
    if not torch.equal(bits(got), bits(want)):
        bad = (bits(got) != bits(want)).nonzero().reshape(-1)[:5].tolist()
        raise AssertionError(f"{what}: differs at elements {bad}: got "
                             f"{got.reshape(-1)[bad].tolist()}, want {want.reshape(-1)[bad].tolist()}")


# ====================================================================== a. the collectives

@st.composite
def collective_case(draw):
    op = draw(st.sampled_from(["all_gather", "reduce_scatter"]))
    dtypes = ["float32", "float64", "bfloat16"] + (["uint8"] if op == "all_gather" else [])
    return {"op": op,
            "n": draw(st.one_of(st.integers(0, 9), st.integers(10, 3000))),   # 0: an empty block
            "dtype": draw(st.sampled_from(dtypes)),
            "async": draw(st.booleans()),
            "in_place": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**20))}


def expected_collective(case: dict, N: int, r: int) -> torch.Tensor:
    """What rank r's output must hold, computed here: the all-gather is every rank's input in
    rank order; the reduce-scatter is block r of x0 + x1 + ... + x_{N-1}, added left to right in
    the dtype (PairwiseReduceScatter.wait: "adds the rest in rank order, so every rank sums its
    slice the same way"; on rank 0, x1 + x0, equal to x0 + x1 bit for bit)."""
    n, seed, dtype = case["n"], case["seed"], case["dtype"]
    if case["op"] == "all_gather":
        return torch.cat([rank_tasks.prop_values(seed, q, n, dtype) for q in range(N)])
    blocks = [rank_tasks.prop_values(seed, q, N * n, dtype).view(N, -1)[r] for q in range(N)]
    acc = blocks[0].clone()
    for b in blocks[1:]:
        acc.add_(b)
    return acc


@bounded(120)
@given(N=st.integers(1, 4), cases=st.lists(collective_case(), min_size=1, max_size=8),
       newest_first=st.booleans())
def test_pairwise_collectives_match_rank_order_reference(pools, N, cases, newest_first):
    results = pools(N).run(rank_tasks.prop_collectives, cases, newest_first)
    for r, per_case in enumerate(results):
        for k, (case, res) in enumerate(zip(cases, per_case)):
            what = (f"rank {r} of {N}, case {k} {case}")
            assert_bits_equal(res["output"], expected_collective(case, N, r), what)
            # the input is only read: all of it (out of place), or every block but the output
            n, seed, dtype = case["n"], case["seed"], case["dtype"]
            if case["op"] == "reduce_scatter":
                sent = rank_tasks.prop_values(seed, r, N * n, dtype)
                keep = [q for q in range(N) if not (case["in_place"] and q == r)]
                assert_bits_equal(res["input"].view(N, -1)[keep], sent.view(N, -1)[keep],
                                  f"{what}: the reduce-scatter changed its input")
            else:
                assert_bits_equal(res["input"], rank_tasks.prop_values(seed, r, n, dtype),
                                  f"{what}: the all-gather changed its input")


def test_rank_order_matters_for_the_drawn_values():
    """The reduce-scatter property can only see a changed summation order if the values make
    the float32 sum depend on it: they do (most elements differ between orders)."""
    xs = [rank_tasks.prop_values(123, q, 4000, "float32") for q in range(4)]
    left = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    for other in (((xs[3] + xs[2]) + xs[1]) + xs[0], (xs[0] + xs[1]) + (xs[2] + xs[3]),
                  ((xs[1] + xs[2]) + xs[0]) + xs[3]):
        assert (bits(left) != bits(other)).sum() > 100


# ====================================================================== b. bucket planning

SIZES = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 2, torch.float16: 2}
shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)   # () is 0-d, 0 is empty


@st.composite
def param_groups(draw, *, max_groups: int = 3, dtypes=tuple(SIZES)):
    groups = []
    for _ in range(draw(st.integers(1, max_groups))):
        ps = []
        for _ in range(draw(st.integers(0, 7))):
            p = nn.Parameter(torch.empty(draw(shapes), dtype=draw(st.sampled_from(dtypes))),
                             requires_grad=draw(st.sampled_from([True, True, True, False])))
            ps.append(p)
        groups.append(ps)
    return groups


def nbytes(p) -> int:
    return p.numel() * p.element_size()


@bounded(400)
@given(groups=param_groups(), cap_bytes=st.integers(1, 3000), first_bytes=st.integers(1, 3000),
       per_parameter=st.booleans())
def test_plan_buckets_rules(groups, cap_bytes, first_bytes, per_parameter):
    cap_mb, first_mb = cap_bytes / 2**20, first_bytes / 2**20       # exact: powers of two
    trainable = [(g, p) for g, ps in enumerate(groups) for p in ps if p.requires_grad]
    if not trainable:
        with pytest.raises(ValueError, match="no trainable"):
            plan_buckets(groups, cap_mb, first_mb, per_parameter=per_parameter)
        return
    plan = plan_buckets(groups, cap_mb, first_mb, per_parameter=per_parameter)

    # every trainable parameter in exactly one bucket, no frozen one, no empty bucket
    placed = [id(p) for _, ps in plan for p in ps]
    assert sorted(placed) == sorted(id(p) for _, p in trainable)
    assert all(ps for _, ps in plan)
    # a bucket never mixes groups, and its group index is the group its parameters come from
    group_of = {id(p): g for g, p in trainable}
    for g, ps in plan:
        assert {group_of[id(p)] for p in ps} == {g}
    # within a group: the parameters last first, the order backward produces their gradients
    for g in range(len(groups)):
        walked = [id(p) for bg, ps in plan if bg == g for p in ps]
        assert walked == [id(p) for p in reversed(groups[g]) if p.requires_grad]
    if per_parameter:
        assert [(g, [id(p) for p in ps]) for g, ps in plan] == \
               [(g, [id(p)]) for g, p in reversed(trainable)]
        return
    # a group's buckets, in order: each but the last reached its limit (the first bucket's is
    # min(first, cap), the others' cap) and closed with the parameter that reached it; the last
    # may be partly filled
    for g in range(len(groups)):
        mine = [ps for bg, ps in plan if bg == g]
        for k, ps in enumerate(mine):
            limit = (min(first_bytes, cap_bytes) if k == 0 else cap_bytes)
            size = sum(nbytes(p) for p in ps)
            if k < len(mine) - 1:
                assert size >= limit, (g, k, size, limit)
            assert size - nbytes(ps[-1]) < limit, (g, k, size, limit)


def test_plan_buckets_lists_buckets_in_the_order_they_fill():
    """Walking the parameters last first, a bucket is full when its last parameter is reached:
    the plan should list the buckets in that order (they are launched in plan order)."""
    a = [nn.Parameter(torch.empty(256)) for _ in range(2)]          # 1 KiB each
    b = [nn.Parameter(torch.empty(256)) for _ in range(4)]
    plan = plan_buckets([a, b], 2048 / 2**20, 1024 / 2**20)
    walk = [id(p) for p in reversed(a + b)]
    filled_at = [max(walk.index(id(p)) for p in ps) for _, ps in plan]
    assert filled_at == sorted(filled_at), [(g, len(ps)) for g, ps in plan]


def test_plan_buckets_refuses_bad_sizes():
    p = nn.Parameter(torch.empty(3))
    for cap, first in ((0, 1), (1, 0), (-1, 1)):
        with pytest.raises(ValueError, match="positive"):
            plan_buckets([[p]], cap, first)


# ====================================================================== c. FSDP layouts, ZeRO buckets

def make_module(shapes_, dtypes, requires) -> nn.Module:
    """Parameters of the drawn shapes with distinct random values; every other one in a child
    module, so that collect_slots walks submodules too."""
    m, child = nn.Module(), nn.Module()
    m.child = child
    g = torch.Generator().manual_seed(len(shapes_) * 31 + sum(map(len, shapes_)))
    for i, (shape, dtype, rg) in enumerate(zip(shapes_, dtypes, requires)):
        values = torch.randn(shape, generator=g).to(dtype)
        # the first half in the module, the rest in its child: collect_slots keeps this order
        (child if 2 * i >= len(shapes_) else m).register_parameter(
            f"p{i}", nn.Parameter(values, requires_grad=rg))
    return m


def originals(m: nn.Module) -> list[torch.Tensor]:
    return [s.module._parameters[s.name].detach().clone() for s in collect_slots(m, {})]


def random_grads(full: list[torch.Tensor], present: list[bool], requires: list[bool], dtypes) -> list:
    """Full gradients (values a float32 reduction carries exactly), None where missing."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(t.shape, generator=g).to(d) if (have and rg) else None
            for t, have, rg, d in zip(full, present, requires, dtypes)]


layout_shapes = st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple),
                         min_size=1, max_size=5)


@bounded(200)
@given(data=st.data(), N=st.integers(1, 5), shapes_=layout_shapes,
       mode=st.sampled_from(["float32", "mixed", "bf16_compute"]))
def test_per_param_layout_partition_and_round_trips(data, N, shapes_, mode):
    k = len(shapes_)
    dtypes = (data.draw(st.lists(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
                                 min_size=k, max_size=k)) if mode == "mixed" else [torch.float32] * k)
    requires = data.draw(st.lists(st.booleans(), min_size=k, max_size=k))
    present = data.draw(st.lists(st.booleans(), min_size=k, max_size=k))
    param_dtype = torch.bfloat16 if mode == "bf16_compute" else None
    m = make_module(shapes_, dtypes, requires)
    full = originals(m)
    mods = [copy.deepcopy(m) for _ in range(N)]
    L = [PerParamLayout(collect_slots(mods[r], {}), r, N, param_dtype) for r in range(N)]

    # 1. every element of every parameter held by exactly one rank, with its own value; the
    #    shards have one shape on every rank, the rest of a shard is zero padding, and the
    #    module shows the shard
    for i, t in enumerate(full):
        covered = torch.zeros(t.numel(), dtype=torch.int64)
        for r in range(N):
            shard, start, count, off = L[r].shard_of(i)
            assert shard is L[r].sharded[i] and off == 0
            assert shard.shape == L[0].sharded[i].shape and shard.dtype == t.dtype
            assert shard.requires_grad == requires[i]
            flat = shard.detach().reshape(-1)
            assert_bits_equal(flat[off:off + count], t.reshape(-1)[start:start + count], (i, r))
            assert not flat[off + count:].any(), f"parameter {i}, rank {r}: padding not zero"
            covered[start:start + count] += 1
            fqn = L[r].slots[i].fqn
            assert dict(mods[r].named_parameters())[fqn] is shard
        assert (covered == 1).all(), f"parameter {i} {tuple(t.shape)} on {N} ranks: {covered.tolist()}"

    # 2. the all-gather: each rank packs its blocks (straight into its block of the output, as
    #    the unit does); copied out, the gather is every full parameter, bit for bit
    for r in range(N):
        out = L[r].all_gather_output()
        assert out.numel() == N * L[r].gather_per_rank
        with torch.no_grad():                   # as the unit packs
            for q in range(N):
                L[q].all_gather_input(torch.device("cpu"), into=out.view(N, -1)[q])
        assert_bits_equal(out, torch.cat([L[q].all_gather_input(torch.device("cpu")) for q in range(N)]),
                          "packing into the output and packing alone")
        L[r].alloc_unsharded()
        L[r].copy_out(out)
        for i, t in enumerate(full):
            assert_bits_equal(L[r].full_values()[i], t.to(param_dtype or t.dtype), (r, i))
    # ... and a gather for reading, in float64 into fresh tensors
    wide = torch.cat([L[q].all_gather_input(torch.device("cpu"), dtype=torch.float64) for q in range(N)])
    for i, v in enumerate(L[N - 1].unpack(wide)):
        assert_bits_equal(v, full[i].double(), i)

    # 3. the reduce-scatter: full gradients packed rank-major (the same packing on every rank);
    #    rank r's slice, accumulated, is exactly rank r's rows of each gradient
    grads = random_grads(full, present, requires, [param_dtype or d for d in dtypes])
    packed = []
    for r in range(N):
        for p, gr in zip(L[r].unsharded, grads):
            p.grad = None if gr is None else gr.clone()
        packed.append(L[r].reduce_scatter_input(L[r].reduce_dtype))
        assert packed[r].numel() == N * L[r].per_rank
        assert_bits_equal(packed[r], packed[0], f"rank {r} packs its gradients otherwise")
    for r in range(N):
        L[r].accumulate_reduced(packed[r].view(N, -1)[r].clone())
        for i, t in enumerate(full):
            shard = L[r].sharded[i]
            if not requires[i]:
                assert shard.grad is None
                continue
            _, start, count, _ = L[r].shard_of(i)
            want = torch.zeros(shard.numel(), dtype=shard.dtype)
            if grads[i] is not None:
                want[:count] = grads[i].reshape(-1)[start:start + count].to(shard.dtype)
            assert_bits_equal(shard.grad, want, f"gradient of parameter {i} on rank {r}")


def test_mixed_dtype_gather_with_a_misaligned_parameter():
    """(Found by the properties: a raw-byte gather of mixed dtypes once viewed a parameter's bytes
    at an offset its dtype cannot be viewed at; each block now starts 8-byte aligned.)"""
    m = nn.Module()
    m.a = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))    # 6 bytes
    m.b = nn.Parameter(torch.full((2,), 2.0))                    # float32 at byte 6
    layout = PerParamLayout(collect_slots(m, {}), 0, 1, None)
    out = layout.all_gather_output()
    layout.all_gather_input(torch.device("cpu"), into=out)
    layout.alloc_unsharded()
    layout.copy_out(out)
    assert [v.tolist() for v in layout.full_values()] == [[1.0] * 3, [2.0] * 2]


def test_mixed_dtype_gradients_all_present():
    """(Found by the properties: with every gradient present the one-operation packing was given
    gradients of several dtypes; a mixed unit reduces in fp32.)"""
    m = nn.Module()
    m.a = nn.Parameter(torch.ones(2, dtype=torch.float32))
    m.b = nn.Parameter(torch.ones(2, dtype=torch.float64))
    layout = PerParamLayout(collect_slots(m, {}), 0, 1, None)
    layout.alloc_unsharded()
    for p in layout.unsharded:
        p.grad = torch.full_like(p, 3.0)
    packed = layout.reduce_scatter_input(layout.reduce_dtype)
    assert packed.dtype == torch.float32 and packed.tolist() == [3.0] * 4


@bounded(200)
@given(N=st.integers(1, 5), shapes_=layout_shapes,
       mode=st.sampled_from(["float32", "bfloat16", "bf16_compute", "frozen"]))
def test_flat_layout_partition_and_round_trips(N, shapes_, mode):
    k = len(shapes_)
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    param_dtype = torch.bfloat16 if mode == "bf16_compute" else None
    trainable = mode != "frozen"
    m = make_module(shapes_, [dtype] * k, [trainable] * k)
    full = originals(m)
    mods = [copy.deepcopy(m) for _ in range(N)]
    L = [FlatLayout(collect_slots(mods[r], {}), r, N, param_dtype, mods[r]) for r in range(N)]
    numel = sum(t.numel() for t in full)
    chunk = math.ceil(numel / N)

    # 1. chunk r of the flat buffer, cut at the parameters' boundaries: every element held once,
    #    the held elements fill the shard from its start, padding (zero) only after them
    covered = [torch.zeros(t.numel(), dtype=torch.int64) for t in full]
    for r in range(N):
        shard = L[r].flat_shard.detach()
        assert shard.numel() == chunk and L[r].shard_numel == chunk
        in_shard = torch.zeros(chunk, dtype=torch.int64)
        for i, t in enumerate(full):
            s, start, count, off = L[r].shard_of(i)
            assert s is L[r].flat_shard and count >= 0
            assert_bits_equal(shard[off:off + count], t.reshape(-1)[start:start + count], (i, r))
            covered[i][start:start + count] += 1
            in_shard[off:off + count] += 1
        real = min(max(numel - r * chunk, 0), chunk)
        assert (in_shard[:real] == 1).all() and not in_shard[real:].any(), (r, in_shard.tolist())
        assert not shard[real:].any(), f"rank {r}: padding not zero"
    for i, c in enumerate(covered):
        assert (c == 1).all(), f"parameter {i} on {N} ranks: {c.tolist()}"

    # 2. the all-gather writes the full flat buffer in place; the views are the parameters
    for r in range(N):
        L[r].alloc_unsharded()
        out = L[r].all_gather_output()
        assert out is L[r].flat_full and out.numel() == N * chunk
        with torch.no_grad():                   # as the unit packs
            for q in range(N):
                L[q].all_gather_input(torch.device("cpu"), into=out.view(N, -1)[q])
        for i, t in enumerate(full):
            assert_bits_equal(L[r].full_values()[i], t.to(param_dtype or dtype), (r, i))
    wide = torch.cat([L[q].all_gather_input(torch.device("cpu"), dtype=torch.float64) for q in range(N)])
    for i, v in enumerate(L[0].unpack(wide)):
        assert_bits_equal(v, full[i].double(), i)

    # 3. the reduce-scatter: rank r's chunk of the flat gradient lands in its shard's .grad
    if not trainable:
        assert L[0].grad_leaves() == [] and L[0].trainable() == []
        return
    grads = random_grads(full, [True] * k, [True] * k, [param_dtype or dtype] * k)
    flat = torch.zeros(N * chunk, dtype=param_dtype or dtype)
    flat[:numel] = torch.cat([g.reshape(-1) for g in grads]) if grads else flat[:0]
    for r in range(N):
        L[r].flat_full.grad = flat.clone()
        packed = L[r].reduce_scatter_input(L[r].reduce_dtype)
        L[r].accumulate_reduced(packed.view(N, -1)[r].clone())
        g = L[r].flat_shard.grad
        for i, t in enumerate(full):
            _, start, count, off = L[r].shard_of(i)
            assert_bits_equal(g[off:off + count], grads[i].reshape(-1)[start:start + count].to(dtype),
                              f"gradient of parameter {i} on rank {r}")


class _OneRankOf(Comm):
    """Rank ``rank`` of ``world_size``, without a process group: enough to build ZeroOptimizer's
    layout (its constructor's only collective, the broadcast from rank 0, is a no-op here —
    every 'rank' starts from the same copy)."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(alone=True)
        self.rank, self.world_size = rank, world_size

    def broadcast_from_rank0(self, tensors, ledger=None) -> None:
        pass


@bounded(150)
@given(N=st.integers(1, 5), groups=param_groups(dtypes=(torch.float32,)),
       cap_bytes=st.integers(4, 400), first_bytes=st.integers(4, 400), stage=st.sampled_from([1, 2]))
def test_zero_buckets_partition_every_parameter(N, groups, cap_bytes, first_bytes, stage):
    if not any(p.requires_grad for ps in groups for p in ps):
        return
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for ps in groups:
            for p in ps:
                p.copy_(torch.randn(p.shape, generator=g))
    values = {id(p): p.detach().clone() for ps in groups for p in ps}
    plan = plan_buckets(groups, cap_bytes / 2**20, first_bytes / 2**20)
    owners = {}                             # (id(p), element) -> ranks that own it
    for r in range(N):
        copies = copy.deepcopy(groups)      # each rank its own parameters (they get aliased)
        ident = {id(c): id(p) for cs, ps in zip(copies, groups) for c, p in zip(cs, ps)}
        opt = ZeroOptimizer([{"params": ps} for ps in copies if ps], torch.optim.SGD, stage=stage,
                            comm=_OneRankOf(r, N), bucket_cap_mb=cap_bytes / 2**20,
                            first_bucket_mb=first_bytes / 2**20, lr=0.1)
        # the buckets are the plan's, laid end to end: N equal chunks each, padding at the end
        assert [[ident[id(p)] for p in b.params] for b in opt.buckets] == \
               [[id(p) for p in ps] for _, ps in plan]
        start = 0
        for b in opt.buckets:
            assert b.start == start and b.numel == sum(p.numel() for p in b.params)
            assert b.shard_numel == math.ceil(b.numel / N) and b.size == b.shard_numel * N
            assert 0 <= b.size - b.numel < max(N, 1)
            start += b.size
        flat = opt.flat_params
        assert flat.numel() == start
        for b, shard in zip(opt.buckets, opt.shards):
            whole = flat[b.start:b.start + b.size]
            assert not whole[b.numel:].any(), "padding not zero"
            ours = opt._shard_of(flat, b)
            lo = ours.storage_offset() - flat.storage_offset()
            assert ours.numel() == b.shard_numel and lo == b.start + r * b.shard_numel
            assert shard.numel() == b.shard_numel
            for p, off in zip(b.params, b.offsets):
                # the parameter aliases its place in the flat buffer, with its own values
                assert p.data_ptr() == flat[b.start + off:].data_ptr() or p.numel() == 0
                assert_bits_equal(p.detach(), values[ident[id(p)]], "parameter moved into the buffer")
                a, e = max(off, r * b.shard_numel), min(off + p.numel(), (r + 1) * b.shard_numel)
                for j in range(a, e):
                    owners.setdefault((ident[id(p)], j - off), []).append(r)
    for ps in groups:
        for p in ps:
            if p.requires_grad:
                for j in range(p.numel()):
                    assert owners.get((id(p), j)) is not None and len(owners[(id(p), j)]) == 1, \
                        (tuple(p.shape), j, owners.get((id(p), j)))
    assert len(owners) == sum(p.numel() for ps in groups for p in ps if p.requires_grad)


# ====================================================================== d. the checkpoint's read plan

DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
               torch.float16: "float16"}
DTYPE_NAMES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


@st.composite
def saved_checkpoint(draw):
    """metadata.json of an imagined save by N ranks: each tensor's elements cut into contiguous
    pieces, at most one per rank (as real saves), in random files and order; fake checksums (one
    string per block: plan_reads only slices them)."""
    N = draw(st.integers(1, 5))
    block_bytes = draw(st.integers(2, 32)) * 8      # 16 .. 256: a multiple of every element size
    tensors = {}
    for k in range(draw(st.integers(1, 4))):
        shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=2).map(tuple))
        tensors[f"t{k}"] = (shape, draw(st.sampled_from(list(DTYPE_NAMES))))
    regions = {r: [] for r in range(N)}
    for name, (shape, dtype) in tensors.items():
        numel = math.prod(shape)
        if numel == 0:
            continue
        n_pieces = draw(st.integers(1, min(N, numel)))
        cuts = sorted(draw(st.lists(st.integers(1, numel - 1), min_size=n_pieces - 1,
                                    max_size=n_pieces - 1, unique=True))) if numel > 1 else []
        bounds = [0, *cuts, numel]
        ranks = draw(st.permutations(range(N)))[:n_pieces]
        for (a, b), r in zip(zip(bounds, bounds[1:]), ranks):
            regions[r].append(Region(name, a, torch.empty(b - a, dtype=dtype)))
    infos = []
    described = {n: (list(s), DTYPE_NAMES[d]) for n, (s, d) in tensors.items()}
    for r in range(N):
        order = draw(st.permutations(regions[r]))
        state = SimpleNamespace(rank=r, world_size=N, regions=list(order),
                                tensors={n: (s, d) for n, (s, d) in tensors.items()})
        _, _, records, size = plan_file(state)
        for rec in records:
            esize = tensors[rec["tensor"]][1].itemsize
            rec["checksums"] = [f"{rec['file']}:{rec['key']}:{b}"
                                for b in range(math.ceil(rec["numel"] * esize / block_bytes))]
        infos.append({"rank": r, "bytes": size, "records": records, "strategy": "test",
                      "model": None, "optimizer": None, "tensors": described})
    return build_metadata(infos, step=0, block_bytes=block_bytes)


@st.composite
def needs_of(draw, meta):
    """What M loading ranks need: a partition of every tensor into M contiguous ranges (a load
    under another world size), or random ranges, overlapping and repeated ones included."""
    M = draw(st.integers(1, 5))
    sizes = {n: math.prod(t["shape"]) for n, t in meta["tensors"].items()}
    out = [[] for _ in range(M)]
    if draw(st.booleans()):
        for name, n in sizes.items():
            c = math.ceil(n / M) if draw(st.booleans()) else None
            cuts = [min(q * c, n) for q in range(M + 1)] if c is not None else \
                [0, *sorted(draw(st.lists(st.integers(0, n), min_size=M - 1, max_size=M - 1))), n]
            for q in range(M):
                out[q].append((name, cuts[q], cuts[q + 1] - cuts[q]))
    else:
        for q in range(M):
            for _ in range(draw(st.integers(0, 5))):
                name = draw(st.sampled_from(sorted(sizes)))
                a = draw(st.integers(0, sizes[name]))
                out[q].append((name, a, draw(st.integers(0, sizes[name] - a))))
    return out


@bounded(400)
@given(data=st.data(), meta=saved_checkpoint())
def test_plan_reads_deliver_every_needed_element_once(data, meta):
    # plan_file: a file's pieces lie end to end after its header, up to the file's size
    spans = {}
    for t in meta["tensors"].values():
        for p in t["pieces"]:
            nb = p["numel"] * DTYPE_NAMES_BY_NAME[t["dtype"]].itemsize
            spans.setdefault(p["file"], []).append((p["offset"], p["offset"] + nb))
    for f, info in meta["files"].items():
        ss = sorted(spans.get(f, []))
        assert all(a[1] == b[0] for a, b in zip(ss, ss[1:])), (f, ss)
        assert (ss[-1][1] if ss else info["bytes"]) == info["bytes"] and all(a >= 8 for a, _ in ss)
    for needs in data.draw(needs_of(meta)):
        reads = plan_reads(meta, needs)
        wanted = {}
        for name, a, n in needs:
            wanted.setdefault(name, torch.zeros(math.prod(meta["tensors"][name]["shape"]), dtype=torch.bool))
            wanted[name][a:a + n] = True
        got = {name: torch.zeros(w.numel(), dtype=torch.int64) for name, w in wanted.items()}
        by_piece = {}
        for rd in reads:
            t = meta["tensors"][rd.tensor]
            size = DTYPE_NAMES_BY_NAME[t["dtype"]].itemsize
            piece = next(p for p in t["pieces"] if p["file"] == rd.file and p["key"] == rd.key)
            # inside its piece, whole checksum blocks, bytes where the piece's elements are
            assert rd.block == meta["block_bytes"] // size and rd.numel > 0
            assert 0 <= rd.piece_lo and rd.piece_lo + rd.numel <= piece["numel"], rd
            assert rd.start == piece["start"] + rd.piece_lo
            assert rd.offset == piece["offset"] + rd.piece_lo * size and rd.nbytes == rd.numel * size
            assert rd.piece_lo % rd.block == 0
            end = rd.piece_lo + rd.numel
            assert end % rd.block == 0 or end == piece["numel"], rd
            first, last = rd.piece_lo // rd.block, math.ceil(end / rd.block)
            assert rd.checksums == tuple(piece["checksums"][first:last]) and len(rd.checksums) == last - first
            # every block read holds a needed element (whole blocks, no more)
            for b in range(rd.start, rd.start + rd.numel, rd.block):
                assert wanted[rd.tensor][b:min(b + rd.block, rd.start + rd.numel)].any(), (rd, b)
            got[rd.tensor][rd.start:rd.start + rd.numel] += 1
            by_piece.setdefault((rd.file, rd.key), []).append(rd)
        # reads of one piece are merged: no two touch or overlap
        for rs in by_piece.values():
            rs.sort(key=lambda rd: rd.piece_lo)
            for a, b in zip(rs, rs[1:]):
                assert b.piece_lo > a.piece_lo + a.numel, (a, b)
        # every needed element read exactly once (pieces never overlap: no element twice)
        for name, w in wanted.items():
            assert (got[name][w] == 1).all(), (name, got[name].tolist(), w.tolist())
            assert (got[name] <= 1).all()
        # in metadata (model) order
        order = list(meta["tensors"])
        assert [order.index(rd.tensor) for rd in reads] == sorted(order.index(rd.tensor) for rd in reads)


def test_plan_reads_refuses_an_unknown_tensor():
    meta = {"tensors": {"a": {"shape": [2], "dtype": "float32", "pieces": []}}, "block_bytes": 16}
    with pytest.raises(CheckpointError, match="no tensor"):
        plan_reads(meta, [("b", 0, 1)])
