"""Prefetch: the next unit's all-gather travels while this one computes — and its full
parameters sit in memory meanwhile. Depth k costs k more gathered units at the peak."""
import pytest
import torch

from minishard.strategies import fsdp
from minishard.core.comm import Comm
from minishard.core.launch import RankError
from minishard.core.ledger import DeviceOutOfMemory
from minishard.planner.analytic import gpt_activation_bytes
from minishard.core.model import GPT, config
from minishard.course.ch07 import gathered_peaks
from minishard.training.loop import TrainConfig, train

from chain import Chain
from parity import assert_parity, reference
import rank_tasks

CFG = config("tiny")
BLOCK = 4 * 789_760                                   # one block's full fp32 parameters
ROOT = 4 * (CFG.vocab_size * CFG.d_model * 2 + CFG.seq_len * CFG.d_model + 2 * CFG.d_model)


# a vocabulary of 512 makes the root unit smaller than one block, so that k blocks in flight
# show whatever k is (with the tiny model's own 4096, the root's buffer would hide k <= 2)
SMALL_ROOT = dict(model="tiny", model_overrides={"vocab_size": 512})
ROOT_512 = 4 * (512 * CFG.d_model * 2 + CFG.seq_len * CFG.d_model + 2 * CFG.d_model)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_flat"])
def test_gathered_parameters_peak_at_root_plus_k_plus_1_blocks(pools, strategy):
    assert ROOT_512 < BLOCK
    for k in range(4):
        pool = pools(2)
        r = pool.run(train, TrainConfig(strategy=strategy, micro_batch=1, steps=2, prefetch=k, track_activations=False, **SMALL_ROOT))[0]
        held = gathered_peaks(pool.last_events)
        # while block i computes, blocks i+1..i+k are already being gathered; the root stays
        if strategy == "fsdp_flat":      # gathered in place: in flight = already allocated
            assert r["ledger"]["category_peaks"]["unsharded"] == ROOT_512 + (k + 1) * BLOCK
            assert held["in_flight"] == 0
        else:                            # in flight in packed buffers, copied out one at a time
            assert held["unsharded"] == ROOT_512 + BLOCK
            assert held["in_flight"] == (k * BLOCK if k else BLOCK)   # k blocks; at k = 0 one at a time
        assert held["both"] >= ROOT_512 + (k + 1) * BLOCK               # every byte of full parameters


@pytest.mark.parametrize("N", [3])
def test_peak_memory_grows_by_one_unit_per_depth(pools, N):
    """Activations dominate (micro-batch 4): the peak is the start of backward, where the root
    computes and k blocks are already prefetched: 16 Psi/N + root + k blocks + activations.
    (On 3 ranks, which divide no unit evenly; chapter 07's notebook asserts the same formula for
    every depth and both layouts on 2 ranks, and ``make test`` runs it.)"""
    for strategy in ("fsdp_flat", "fsdp"):
        for k in (0, 1, 3):
            r = pools(N).run(train, TrainConfig(strategy=strategy, model="tiny", micro_batch=4, steps=2, prefetch=k))[0]
            state = sum(v for c, v in r["ledger"]["estimate"].items() if c != "activations")
            formula = state + ROOT + k * BLOCK + gpt_activation_bytes(CFG, 4)
            assert abs(r["ledger"]["peak"] - formula) <= 0.02 * formula, (strategy, k)


def test_prefetch_gathers_the_next_unit_before_this_one_is_freed(pools):
    plain = pools(2).run(rank_tasks.fsdp_forward_order, 0)[0]
    ahead = pools(2).run(rank_tasks.fsdp_forward_order, 1)[0]
    assert plain.index("blocks.1:unsharding") > plain.index("blocks.0:sharded")
    assert ahead.index("blocks.1:unsharding") < ahead.index("blocks.0:sharded")
    assert ahead.index("blocks.2:unsharding") < ahead.index("blocks.1:sharded")


@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_prefetch_keeps_parity(pools, N):
    for k in (1, 2):
        kw = dict(model="nano", steps=3, optimizer="sgd_momentum", lr=0.05, prefetch=k)
        for strategy in ("fsdp", "fsdp_flat"):
            ours = pools(N).run(train, TrainConfig(strategy=strategy, micro_batch=2, return_params=True, **kw))
            kw_ref = {a: b for a, b in kw.items() if a != "prefetch"}
            assert_parity(ours, reference(N, 2, **kw_ref))


def test_aggressive_prefetch_runs_out_of_a_memory_budget_that_depth_1_fits(pools):
    """Many FSDP OOMs are prefetch, not sharding: the same model and budget, deeper prefetch."""
    budget = 136_000_000          # bytes: between the peaks of depth 1 and depth 3 (2 ranks)
    kw = dict(strategy="fsdp_flat", model="tiny", micro_batch=4, steps=2, device_budget=budget)
    assert pools(2).run(train, TrainConfig(prefetch=1, **kw))[0]["ledger"]["peak"] <= budget
    with pytest.raises(RankError, match="over its budget"):
        pools(2).run(train, TrainConfig(prefetch=3, **kw))


def test_bad_prefetch_depth_is_named():
    net = fsdp.apply_fsdp(GPT("nano"), comm=Comm())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch depth must be a non-negative integer"):
            fsdp.set_prefetch(net, forward=bad)
    with pytest.raises(DeviceOutOfMemory, match="over its budget"):
        train(None, TrainConfig(strategy="fsdp", model="nano", steps=1, micro_batch=1, device_budget=10_000))


def test_prefetch_follows_the_order_forward_ran_the_units_in():
    """As FSDP2: the root records the order of its first forward and prefetches by it, not by
    the order the modules were declared in. Depth 1, second step: each unit is gathered just
    before it runs — in forward 2, 0, 1; in backward 1, 0, 2."""
    from minishard.core.trace import Tracer
    tracer = Tracer()
    net = Chain(order=(2, 0, 1))
    for i, b in enumerate(net.blocks):
        fsdp.fully_shard(b, comm=Comm(tracer), name=f"b{i}")
    fsdp.fully_shard(net, comm=Comm(tracer), name="root")
    fsdp.set_prefetch(net, 1, 1)
    for step in range(2):
        tracer.step = step
        net(torch.ones(2, 8)).backward()
    assert [u.name for u in net._fsdp_unit.context.forward_order()] == ["b2", "b0", "b1"]
    gathers = [e["name"] for e in tracer.events if e["kind"] == "unit" and e.get("step") == 1
               and e["state"] == "unsharding"]
    assert gathers == ["root", "b2", "b0", "b1", "b1", "b0", "b2"]


def _units_ahead(events: list[dict], order: list[str], done: str) -> list[int]:
    """For each unit after the first of a pass (its units in ``order``), how many units before
    it had not yet finished (their ``done`` state) when its all-gather started: how far ahead
    it was prefetched (0: gathered when it was needed)."""
    at = {(e["name"], e["state"]): i for i, e in enumerate(events)}
    return [sum(at[(v, done)] > at[(u, "unsharding")] for v in order[1:j])
            for j, u in enumerate(order) if j >= 1]


@pytest.mark.parametrize("forward,backward", [(1, 1), (0, 2), (2, 0)])
def test_each_pass_prefetches_by_its_own_depth_in_the_recorded_order(forward, backward):
    """Forward runs the units 2, 0, 1 after the root, backward 1, 0, 2: with depth d each unit is
    gathered d units ahead (as far as there are units before it), in each pass by its own depth
    — the unit forward ran first included, backward's last."""
    from minishard.core.trace import Tracer
    tracer = Tracer()
    net = Chain(order=(2, 0, 1))
    for i, b in enumerate(net.blocks):
        fsdp.fully_shard(b, comm=Comm(tracer), name=f"b{i}")
    fsdp.fully_shard(net, comm=Comm(tracer), name="root")
    fsdp.set_prefetch(net, forward, backward)
    for step in range(2):
        tracer.step = step
        net(torch.ones(2, 8)).backward()
    step1 = [e for e in tracer.events if e["kind"] == "unit" and e.get("step") == 1]
    middle = next(i for i, e in enumerate(step1) if e["name"] == "b1" and e["state"] == "sharded")
    fwd, bwd = step1[:middle + 1], step1[middle + 1:]
    assert _units_ahead(fwd, ["root", "b2", "b0", "b1"], "sharded") == [min(forward, j) for j in range(3)]
    assert _units_ahead(bwd, ["root", "b1", "b0", "b2"], "reduce_scattering") == \
        [min(backward, j) for j in range(3)]


def test_the_gpts_recorded_order_is_its_module_order():
    """For the GPT the recorded order is the declared one: prefetch is unchanged by recording."""
    net = GPT("nano")
    fsdp.apply_fsdp(net)
    net(torch.zeros(1, 4, dtype=torch.long))
    assert net._fsdp_unit.context.forward_order() == [b._fsdp_unit for b in net.blocks]
