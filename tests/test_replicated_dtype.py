"""Replicated parameters in their own dtype inside a low-precision unit (issue #28, item 5): the
norms kept whole in fp32 while the matmuls compute in fp32, bf16 or fp16 train like one process
running the same recipe, their gradients are all-reduced in fp32 whatever the policy's
``reduce_dtype``, a unit of nothing but replicated parameters gathers nothing, and the ledger
counts them at 4 bytes an element."""
import pytest
import torch

from minishard.core.comm import Comm
from minishard.strategies import fsdp
from minishard.core.model import GPT
from minishard.strategies.offload import CPUOffloadPolicy

from parity import assert_parity
import replicated_tasks as T

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAME = {None: "float32", BF16: "bfloat16", FP16: "float16", FP32: "float32"}
# (compute, reduce) policy, layout, static loss scale (fp16's gradients underflow without one),
# clip; and how close to one process, per tensor, as a fraction of how far the reference moved
# it — measured at N = 2 and 3: fp32 <= 2.8e-5, bf16 <= 1.2e-2, fp16 <= 1.4e-3 (the mean loss
# within 7.5e-3, 6.3e-4)
SCENARIOS = {
    "fp32": (dict(policy=(None, None), layout="per_param", scale=1, clip=None), dict(rtol=1e-3)),
    "bf16": (dict(policy=(BF16, FP32), layout="per_param", scale=1, clip=0.3),
             dict(rtol=5e-2, loss_rtol=2e-2)),
    "bf16-reduced-flat": (dict(policy=(BF16, BF16), layout="flat", scale=1, clip=None),
                          dict(rtol=5e-2, loss_rtol=2e-2)),
    "fp16": (dict(policy=(FP16, FP32), layout="per_param", scale=1024, clip=None),
             dict(rtol=1e-2, loss_rtol=5e-3)),
}
UNITS = [f"blocks.{i}" for i in range(T.CFG.n_layer)] + ["ln_f", "root"]


@pytest.fixture(scope="module", params=[2, 3])
def runs(request, pools):
    """Every scenario at N ranks (3 divides neither the rows nor the flat buffers), one task."""
    N = request.param
    res = pools(N).run(T.scenarios_run, [sc for sc, _ in SCENARIOS.values()])
    return N, {name: [r[k] for r in res] for k, name in enumerate(SCENARIOS)}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_trains_like_one_process_running_the_same_recipe(runs, name):
    """From each rank's own weights (rank 0's broadcast, the norms too) to the reference's
    training; the norms whole and identical on every rank, in fp32, with fp32 gradients, fed
    fp32 inputs and handing on outputs in the compute dtype."""
    N, res = runs
    sc, tol = SCENARIOS[name]
    ref = T.reference(sc["policy"], N, sc["scale"], sc["clip"])
    assert_parity(res[name], ref, what=f"{name} N={N}", **tol)
    for r in res[name]:
        assert r["whole"].keys() == res[name][0]["whole"].keys() and len(r["whole"]) == 4 * 3 + 2
        for n, t in r["whole"].items():
            assert t.dtype == FP32 and r["whole_grads"][n] == FP32, n
            assert torch.equal(t, res[name][0]["whole"][n]), (n, r["rank"])
        compute = sc["policy"][0] or FP32       # the matmuls' weights; the norms see fp32 in
        assert r["compute"] == {n: FP32 if T.is_norm(n) else compute for n in r["compute"]}
        assert r["seen"] == {n: (FP32, compute) for n in r["seen"]} and len(r["seen"]) == 7


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_collective_moves_the_dtype_claimed(runs, name):
    """Gathers in param_dtype, reduce-scatters in reduce_dtype (None: param_dtype), and the
    replicated gradients' all-reduce in fp32 — one per unit and step, of exactly their bytes;
    ln_f, a unit of nothing else, runs that all-reduce and no other collective."""
    N, res = runs
    sc, _ = SCENARIOS[name]
    compute, reduce = sc["policy"]
    d = T.CFG.d_model
    for r in res[name]:
        by = {}
        for op, tag, dtype, payload in r["collectives"]:
            if tag in UNITS:
                by.setdefault((tag, op), []).append((dtype, payload))
        assert by.pop(("ln_f", "all_reduce")) == [("float32", 4 * 2 * d)] * T.STEPS
        assert not [k for k in by if k[0] == "ln_f"]
        for i in range(T.CFG.n_layer):
            assert by.pop((f"blocks.{i}", "all_reduce")) == [("float32", 4 * 4 * d)] * T.STEPS
        dtypes = {op: {dt for (_, o), calls in by.items() if o == op for dt, _ in calls}
                  for op in ("all_gather", "reduce_scatter")}
        assert dtypes == {"all_gather": {NAME[compute]}, "reduce_scatter": {NAME[reduce or compute]}}
        assert {op for _, op in by} == {"all_gather", "reduce_scatter"}, by.keys()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_ledger_counts_replicated_parameters_at_their_own_bytes(runs, name):
    """numel x 4 for the fp32 norms and their gradients, whatever the compute dtype; under a
    lower compute dtype the fp32 shards are masters, and the norms plain parameters."""
    _, res = runs
    lower = SCENARIOS[name][0]["policy"][0] is not None
    for r in res[name]:
        whole, shards = r["expect"]["whole"], r["expect"]["shards"]
        assert whole == 4 * (4 * 3 + 2) * T.CFG.d_model
        held = r["ledger"]
        assert held["params"] == (whole if lower else whole + shards), held
        assert held.get("master", 0) == (shards if lower else 0), held
        assert held["grads"] == whole + shards, held
        assert not held.get("unsharded") and not held.get("comm_buffers"), held


def test_a_unit_of_replicated_parameters_only_stays_sharded_between_reductions(runs):
    """ln_f's states: at rest SHARDED (all it holds is what it keeps), REDUCE_SCATTERING as it
    issues its all-reduce, never UNSHARDING or UNSHARDED (nothing to gather)."""
    _, res = runs
    for r in res["bf16"]:
        states = [s for u, s in r["states"] if u == "ln_f"]
        assert states == ["reduce_scattering", "sharded"] * T.STEPS, states


@pytest.mark.parametrize("N,layout", [(2, "per_param"), (3, "flat")])
def test_save_and_load_resume_the_same_training(pools, tmp_path, N, layout):
    """The fp32 norms (the all-replicated ln_f too) are saved in fp32 with their momentum; a model
    built from other weights loads them and takes the third step bit for bit as the original."""
    for r in pools(N).run(T.checkpoint_run, str(tmp_path / "ckpt"), layout):
        saved, loaded = r["runs"]
        assert set(r["saved"].values()) == {"float32"} and "param/ln_f.weight" in r["saved"]
        assert set(loaded["dtypes"].values()) == {FP32}
        for key in ("before", "momentum", "after"):
            assert saved[key].keys() == loaded[key].keys()
            assert all(torch.equal(saved[key][n], loaded[key][n]) for n in saved[key]), key
        assert saved["loss"] == loaded["loss"]


def test_what_cannot_keep_its_own_dtype_is_refused():
    """A module computing in two dtypes — a norm's weight kept whole in fp32, its bias sharded
    in bf16 — has no dtype to cast its inputs to; offload keeps the sharded state in its tier."""
    bf16 = fsdp.MixedPrecisionPolicy(BF16)
    two = "replicate_params with param_dtype .*ln1 would compute in two dtypes"
    with pytest.raises(ValueError, match=two):
        fsdp.fully_shard(GPT("nano").blocks[0], replicate_params=("ln1.weight",), mp_policy=bf16)
    with pytest.raises(ValueError, match="param_persistence_threshold with param_dtype .*attn.qkv"):
        fsdp.fully_shard(GPT("nano").blocks[0], param_persistence_threshold=256, mp_policy=bf16)
    with pytest.raises(ValueError, match="replicate_params with offload"):
        fsdp.fully_shard(GPT("nano").ln_f, replicate_params=("weight", "bias"), mp_policy=bf16,
                         offload_policy=CPUOffloadPolicy())
    with pytest.raises(ValueError, match="has no parameters of its own"):
        fsdp.fully_shard(torch.nn.ReLU())


def test_names_match_whole_modules_and_one_module_keeps_one_dtype():
    """``replicate_params`` names a parameter or a submodule, not a prefix of one (``"ln"`` is
    neither ``ln1`` nor ``ln2``); a module whose replicated parameters hold two dtypes has no
    one dtype to compute in."""
    with pytest.raises(ValueError, match="has no parameter or submodule"):
        fsdp.fully_shard(GPT("nano").blocks[0], replicate_params=("ln",))
    block = GPT("nano").blocks[1]
    fsdp.fully_shard(block, replicate_params=("ln1",))
    assert [s.fqn for s in block._fsdp_unit.replicated_slots] == ["ln1.weight", "ln1.bias"]
    mixed = GPT("nano").blocks[0]
    mixed.ln1.bias.data = mixed.ln1.bias.data.to(BF16)
    with pytest.raises(ValueError, match="two dtypes"):
        fsdp.fully_shard(mixed, replicate_params=("ln1",), mp_policy=fsdp.MixedPrecisionPolicy(BF16))


def test_a_unit_of_whole_parameters_under_hybrid_sharding_trains_like_one_process(pools):
    """Hybrid sharding on 4 ranks (shard groups of 2): every block small enough to be kept whole
    (``param_persistence_threshold``), so each block is a unit that only all-reduces — over the
    shard group, then across — and the gradient must still be the global mean."""
    from minishard.training.loop import TrainConfig, train
    from parity import reference
    kw = dict(model="nano", steps=2, optimizer="sgd_momentum", lr=0.05)
    out = pools(4).run(train, TrainConfig(strategy="hsdp", shard_size=2, micro_batch=2, return_params=True,
                                          param_persistence_threshold=16384, **kw))
    assert_parity(out, reference(4, 2, **kw))


def test_full_parameters_of_a_unit_with_nothing_to_shard_are_a_snapshot():
    """``full_parameters`` hands back values, not the live weights: a user who keeps them (to
    compare before and after a step, or to export) must find them unchanged after training moves
    the model on. A unit whose every parameter is kept whole (here a norm) gathers nothing, so
    its values are the parameters themselves unless they are copied."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with torch.no_grad():
        net[1].weight.add_(torch.linspace(-0.5, 0.5, 8))
    comm = Comm()
    fsdp.fully_shard(net[1], name="norm", comm=comm, replicate_params=("weight", "bias"))
    fsdp.fully_shard(net, name="root", comm=comm)
    assert isinstance(net[1]._fsdp_unit, fsdp.api.ReplicatedOnlyUnit)
    opt = fsdp.ShardedOptimizer(net, torch.optim.SGD(net.parameters(), lr=0.5))
    kept = {dtype: fsdp.full_parameters(net, dtype) for dtype in (None, FP32)}  # as computed; fp32
    was = {n: t.clone() for n, t in kept[None].items()}
    assert all(torch.equal(t, was[n]) for n, t in kept[FP32].items())
    (net(torch.linspace(-1, 1, 16).view(2, 8)) ** 3).sum().backward()
    opt.step()
    assert not torch.equal(net[1].weight, was["1.weight"])    # the step moved the norm
    for dtype, values in kept.items():
        for n, t in values.items():
            assert torch.equal(t, was[n]), f"{n} ({dtype}): the values handed out changed with the model"
