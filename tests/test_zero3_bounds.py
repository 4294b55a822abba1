"""ZeRO-3 à la DeepSpeed beside FSDP (``fsdp/limits.py``): a prefetch bucket instead of a depth,
a cap on live gathered parameters, a persistence threshold — each counted in elements, as
DeepSpeed's ``stage3_*`` keys count them — measured on real ranks against the formulas, to
the byte, and against one process."""
import pytest
import torch

from minishard.strategies import fsdp
from minishard.core.comm import Comm
from minishard.course.ch07 import stage3_train
from minishard.core.model import GPT
from minishard.strategies.offload import CPUOffloadPolicy
from minishard.training.loop import TrainConfig

from parity import assert_parity, reference

# the tiny GPT with a vocabulary of 512: the root unit is smaller than a block (as test_prefetch)
RUN = dict(model="tiny", model_overrides={"vocab_size": 512}, micro_batch=1, steps=2,
           track_activations=False)
BLOCK = 789_760                         # elements of one block (all its parameters sharded)
ROOT = 512 * 256 * 2 + 128 * 256 + 2 * 256      # 295,424: embeddings, head, final norm
PSI = ROOT + 6 * BLOCK
SMALL_PER_BLOCK = 6 * 256 + 768 + 1024  # numel <= 1024: norms and biases, 3,328 per block
SMALL = 6 * SMALL_PER_BLOCK + 2 * 256   # and the final norm: 20,480
GATHERS = 1 + 2 * 6                     # per step: the root once, every block twice


def _run(pool, prefetch=0, strategy="fsdp_flat", **limits):
    return pool.run(stage3_train, TrainConfig(strategy=strategy, prefetch=prefetch, **RUN), **limits)


def test_a_prefetch_bucket_of_k_blocks_is_depth_k(pools):
    """The bucket counts elements ahead of the computing unit: k equal blocks fill it exactly
    as depth k does; a bucket between k and k+1 blocks holds k. The all-gathers stay 13 a step:
    prefetch moves them earlier, it never adds one."""
    pool = pools(2)
    for bucket, ahead in ((0, 0), (BLOCK, 1), (3 * BLOCK // 2, 1), (2 * BLOCK, 2)):
        r = _run(pool, prefetch_bucket_size=bucket)[0]
        assert r["ledger"]["category_peaks"]["unsharded"] == 4 * (ROOT + (1 + ahead) * BLOCK), bucket
        assert r["by_op"]["all_gather"]["calls"] == 2 * GATHERS
    # the per-parameter layout: the k blocks ahead wait in packed buffers, one unpacked at a time
    g = _run(pool, strategy="fsdp", prefetch_bucket_size=2 * BLOCK)[0]["gathered"]
    assert (g["unsharded"], g["in_flight"]) == (4 * (ROOT + BLOCK), 4 * 2 * BLOCK)


@pytest.mark.parametrize("N", [2, 4])
def test_max_live_parameters_caps_a_deep_prefetch(pools, N):
    """Depth 3 would hold root + 4 blocks; a cap of root + 2.5 blocks stops the prefetch at
    root + 2 blocks — under the cap, to the byte — and a cap below one unit still gathers the
    unit that must compute (root + 1 block, as no prefetch)."""
    pool = pools(N)
    deep = _run(pool, prefetch=3)[0]["ledger"]["category_peaks"]["unsharded"]
    assert deep == 4 * (ROOT + 4 * BLOCK)
    cap = ROOT + 5 * BLOCK // 2
    for r in _run(pool, prefetch=3, max_live_parameters=cap):
        assert r["ledger"]["category_peaks"]["unsharded"] == 4 * (ROOT + 2 * BLOCK) <= 4 * cap
        assert r["by_op"]["all_gather"]["calls"] == 2 * GATHERS
    low = _run(pool, prefetch=3, max_live_parameters=1)[0]
    assert low["ledger"]["category_peaks"]["unsharded"] == 4 * (ROOT + BLOCK)


@pytest.mark.parametrize("N", [2, 4])
def test_persistent_parameters_leave_the_gathers_and_cost_their_full_size(pools, N):
    """Threshold 1024 elements: 20,480 small parameters kept whole. The state per rank becomes
    16 ((Psi - P)/N + P) bytes; the all-gathers and reduce-scatters carry P elements less, and
    one all-reduce per unit a step (7) carries their gradients, 4 P bytes."""
    pool = pools(N)
    base = _run(pool)[0]
    for r in _run(pool, param_persistence_threshold=1024):
        for category in ("params", "grads", "exp_avg", "exp_avg_sq"):
            assert r["ledger"]["final"][category] == 4 * ((PSI - SMALL) // N + SMALL)
            assert base["ledger"]["final"][category] == 4 * PSI // N
        ops, was = r["by_op"], base["by_op"]
        steps = RUN["steps"]
        assert ops["all_gather"]["calls"] == was["all_gather"]["calls"] == steps * GATHERS
        assert was["all_gather"]["payload"] - ops["all_gather"]["payload"] == \
            steps * 4 * (2 * 256 + 2 * 6 * SMALL_PER_BLOCK)          # root once, blocks twice
        assert was["reduce_scatter"]["payload"] - ops["reduce_scatter"]["payload"] == steps * 4 * SMALL
        assert (ops["all_reduce"]["calls"], ops["all_reduce"]["payload"]) == (steps * 7, steps * 4 * SMALL)
        assert "all_reduce" not in was
        assert r["ledger"]["category_peaks"]["unsharded"] == 4 * (ROOT + BLOCK - 512 - SMALL_PER_BLOCK)


@pytest.mark.parametrize("N", [2, 4])
def test_the_three_bounds_keep_parity(pools, N):
    kw = dict(model="nano", steps=3, optimizer="sgd_momentum", lr=0.05)
    nano_block = sum(p.numel() for p in GPT("nano", device="meta").blocks[0].parameters())
    for strategy in ("fsdp", "fsdp_flat"):
        ours = pools(N).run(stage3_train, TrainConfig(strategy=strategy, micro_batch=2, prefetch=2,
                                                      return_params=True, **kw),
                            prefetch_bucket_size=nano_block, max_live_parameters=3 * nano_block,
                            param_persistence_threshold=256)
        assert_parity(ours, reference(N, 2, **kw), what=strategy)


def _sharded(threshold=None, **kw):
    net = GPT("nano")
    for b in net.blocks:
        fsdp.fully_shard(b, comm=Comm(), param_persistence_threshold=threshold, **kw)
    return net


def test_the_bounds_are_counted_in_elements_and_refused_when_wrong():
    net = _sharded(256)
    fsdp.fully_shard(net, comm=Comm(), param_persistence_threshold=256)
    kept = sum(len(u.replicated) for u in fsdp.units(net))
    assert kept == sum(p.numel() <= 256 for p in GPT("nano", device="meta").parameters()) == 3 * 8 + 2
    for bad in (-1, 1.5, True, "1e6"):
        with pytest.raises(ValueError, match="number of parameters .elements"):
            fsdp.set_stage3_limits(net, prefetch_bucket_size=bad)
        with pytest.raises(ValueError, match="number of parameters .elements"):
            fsdp.set_stage3_limits(net, max_live_parameters=bad)
    whole = _sharded(16384)            # every parameter of a block that small: nothing to gather
    assert all(not u.layout.shard_tensors() and len(u.replicated) == 12 for u in fsdp.units(whole))
    host = CPUOffloadPolicy()
    with pytest.raises(ValueError, match="param_persistence_threshold with offload"):
        _sharded(256, offload_policy=host)
    _sharded(32, offload_policy=host)          # nothing that small: nothing persistent, nothing refused
    with pytest.raises(ValueError, match="param_persistence_threshold with param_dtype"):
        _sharded(256, mp_policy=fsdp.MixedPrecisionPolicy(torch.bfloat16))


def test_every_unit_not_back_to_its_shard_counts_as_live():
    """The cap counts a unit's elements whole from the moment its gather starts until it is back
    to its shard: unsharding, unsharded, reduce-scattering (its parameters still whole) — and,
    after a forward that kept 1/k of them, still: backward gathers it again."""
    from types import SimpleNamespace

    from minishard.strategies.fsdp.limits import live_elements
    from minishard.strategies.fsdp.state import MemoryState
    units = [SimpleNamespace(layout=SimpleNamespace(slots=[SimpleNamespace(numel=10 ** i)]),
                             memory_state=state) for i, state in enumerate(MemoryState)]
    everything = sum(10 ** i for i in range(len(units)))
    sharded = 10 ** list(MemoryState).index(MemoryState.SHARDED)
    assert live_elements(SimpleNamespace(units=units)) == everything - sharded


# --------------------------------------------------------------------------- each bound met exactly
# DeepSpeed 0.19.8 at its bounds (deepspeed/runtime/zero/): a parameter persists when
# ``param.ds_numel <= param_threshold`` (parameter_offload.py, mark_persistent_parameters); the
# prefetch takes the next parameters of the trace ``while numel_prefetching <
# max_params_to_prefetch``, with ``max_params_to_prefetch = min(max_live - n_available,
# prefetch_bucket_size)`` (partitioned_param_coordinator.py, fetch_sub_module). Met exactly, every
# bound admits what meets it — there minishard does as DeepSpeed does. One element short,
# DeepSpeed's loop still takes the parameter that crosses it; minishard stops before the unit.

def _deepspeed_prefetch(ahead: list[int], budget: int) -> list[int]:
    """DeepSpeed's prefetch loop over parameters of ``ahead`` elements each."""
    taken, numel = [], 0
    for n in ahead:
        if not numel < budget:
            break
        taken.append(n)
        numel += n
    return taken


def _units(computing: int, ahead: list[int]):
    """A root context with one unit computing (gathered) and one-parameter units ahead."""
    from types import SimpleNamespace

    from minishard.strategies.fsdp.state import MemoryState

    def unit(numel, state):
        return SimpleNamespace(layout=SimpleNamespace(slots=[SimpleNamespace(numel=numel)]), memory_state=state)
    now = unit(computing, MemoryState.UNSHARDED)
    later = [unit(n, MemoryState.SHARDED) for n in ahead]
    return SimpleNamespace(units=[now, *later], stage3_limits=None), later


@pytest.mark.parametrize("over", [-1, 0, 1])
def test_a_prefetch_bucket_met_exactly_holds_the_units_that_fill_it(over):
    from minishard.strategies.fsdp.limits import window
    from minishard.strategies.fsdp.state import Stage3Limits
    ahead = [4, 6, 5]
    context, later = _units(10, ahead)
    context.stage3_limits = Stage3Limits(prefetch_bucket_size=4 + 6 + over)
    got = [u.layout.slots[0].numel for u in window(context, later, depth=0)]
    assert got == {-1: [4], 0: [4, 6], 1: [4, 6]}[over]
    if over == 0:
        assert got == _deepspeed_prefetch(ahead, 4 + 6)
    else:                                   # DeepSpeed passes the bucket by a parameter
        assert sum(got) <= 4 + 6 + over < sum(_deepspeed_prefetch(ahead, 4 + 6 + over))


@pytest.mark.parametrize("over", [-1, 0, 1])
def test_live_parameters_met_exactly_admit_the_prefetch_that_meets_them(over):
    """10 elements gathered for the unit computing; a cap of 20 admits the units of 4 and 6
    ahead (20 live), as DeepSpeed's budget of 20 - 10 does; 19 admits the 4 alone."""
    from minishard.strategies.fsdp.limits import live_elements, window
    from minishard.strategies.fsdp.state import Stage3Limits
    ahead = [4, 6, 5]
    for bucket in (None, 100):
        context, later = _units(10, ahead)
        cap = 10 + 4 + 6 + over
        context.stage3_limits = Stage3Limits(prefetch_bucket_size=bucket, max_live_parameters=cap)
        got = [u.layout.slots[0].numel for u in window(context, later, depth=3)]
        assert got == {-1: [4], 0: [4, 6], 1: [4, 6]}[over], bucket
        assert live_elements(context) + sum(got) <= cap
        if over == 0:
            assert got == _deepspeed_prefetch(ahead, min(cap - live_elements(context), bucket or cap))


@pytest.mark.parametrize("over", [-1, 0, 1])
def test_a_parameter_the_size_of_the_persistence_threshold_is_kept_whole(over):
    """Linear(3, 4): a weight of 12 elements, a bias of 4. Threshold 11: the bias alone is kept
    whole; 12 — DeepSpeed's ``numel <= threshold`` — and 13: both."""
    block = torch.nn.Linear(3, 4)
    fsdp.fully_shard(block, comm=Comm(), param_persistence_threshold=12 + over)
    kept = sorted(s.fqn for s in fsdp.units(block)[0].replicated_slots)
    assert kept == (["bias"] if over < 0 else ["bias", "weight"])


# --------------------------------------------------------------------------- the cap, drawn
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minishard.strategies.fsdp.state import MemoryState as _State  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(computing=st.integers(1, 30),
       ahead=st.lists(st.tuples(st.integers(1, 30), st.sampled_from(list(_State))), max_size=6),
       cap=st.integers(0, 120))
def test_the_cap_admits_the_longest_prefetch_under_it_counting_each_unit_once(computing, ahead, cap):
    """Units ahead in any state — some already gathered or in flight (an earlier prefetch, a
    forward that kept 1/k), the others sharded — and any cap: the prefetch is the units ahead in
    their order, up to the first *sharded* one whose gather would take the live elements over
    the cap. A unit already gathered is counted once, in the live elements — never again as if
    gathered anew, never the one that stops the prefetch — so the prefetch stops only where the
    cap says, and never passes it because of a gather it started."""
    from types import SimpleNamespace

    from minishard.strategies.fsdp.limits import live_elements, window
    from minishard.strategies.fsdp.state import Stage3Limits

    def unit(numel, state):
        return SimpleNamespace(layout=SimpleNamespace(slots=[SimpleNamespace(numel=numel)]), memory_state=state)
    later = [unit(n, state) for n, state in ahead]
    context = SimpleNamespace(units=[unit(computing, _State.UNSHARDED), *later],
                              stage3_limits=Stage3Limits(max_live_parameters=cap))
    live = live_elements(context)
    assert live == computing + sum(n for n, state in ahead if state is not _State.SHARDED)
    got = window(context, later, depth=len(later))
    assert got == later[:len(got)]                                   # in their order, a prefix
    new = sum(u.layout.slots[0].numel for u in got if u.memory_state is _State.SHARDED)
    assert live + new <= max(cap, live)                              # never over it by a prefetch
    if len(got) < len(later):                                        # stopped: by the cap alone
        stop = later[len(got)]
        assert stop.memory_state is _State.SHARDED and live + new + stop.layout.slots[0].numel > cap
