"""``reshard_after_forward=k`` (FSDP2's int): after forward a unit keeps 1/k of its full
parameters, and backward gathers them inside groups of k consecutive ranks (a node) instead of
over all N. The values gathered are the same bytes, so training is bit-identical to
``reshard_after_forward=True``; what changes is the group every backward all-gather uses, the
bytes each link class carries, and the memory held between forward and backward — each checked
here against its formula, from the trace."""
import pytest
import torch

from minishard.training.config import ConfigError, TrainConfig
from minishard.planner.links import link_bytes, next_in_ring
from minishard.viewers.playback import ring_caption
from minishard.core.trace import Replay
from minishard.training.loop import train

from parity import assert_parity, reference
import reshard_tasks

STEPS, MB = 2, 2
KW = dict(model="nano", steps=STEPS, optimizer="sgd_momentum", lr=0.05)


def run(pool, k, strategy="fsdp"):
    out = pool.run(train, TrainConfig(strategy=strategy, micro_batch=MB, reshard_after_forward=k,
                                      return_params=True, **KW))
    return out, pool.last_events


def same_training(a: list[dict], b: list[dict]) -> bool:
    return ([r["losses"] for r in a] == [r["losses"] for r in b]
            and all(torch.equal(a[0]["params"][n], b[0]["params"][n]) for n in a[0]["params"]))


def gathers(events, rank: int, step: int) -> dict[str, list[dict]]:
    """Each unit's all-gathers on ``rank`` in ``step``, in the order issued (forward first)."""
    out: dict[str, list[dict]] = {}
    for e in events:
        if e["kind"] == "collective" and e["op"] == "all_gather" and e["rank"] == rank and e.get("step") == step:
            out.setdefault(e["tag"], []).append(e)
    return out


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_flat"])
def test_on_4_ranks_k_2_gathers_backward_inside_pairs_and_trains_as_true(pools, strategy):
    pool = pools(4)
    none, ev_none = run(pool, False, strategy)
    half, ev_half = run(pool, 2, strategy)
    full, ev_full = run(pool, True, strategy)
    assert_parity(half, reference(4, MB, **KW))
    assert same_training(half, full)                 # the same bytes, gathered by fewer ranks
    assert Replay(ev_half).after_forward(len(ev_half) - 1) == {     # what the unit-state table says
        "root": "keep (None: the root's rule)", **{f"blocks.{b}": "keep 1/2" for b in range(3)}}
    blocks = 0
    for rank in range(4):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        for step in range(STEPS):
            by_unit = gathers(ev_half, rank, step)
            assert len(by_unit.pop("root")) == 1     # the root keeps its parameters (the clamp)
            for unit, (fwd, bwd) in by_unit.items():
                assert "members" not in fwd and fwd["group"] == 4, unit        # forward: all 4
                assert bwd["members"] == pair and bwd["group"] == 2, unit      # backward: the pair
                assert bwd["payload"] == fwd["payload"] and bwd["wire"] == fwd["payload"] // 2
                assert f"among ranks {pair}" in ring_caption(bwd, 4).head      # what the player says
            blocks = sum(fwd["payload"] for fwd, _ in by_unit.values())
    # memory: 1/k of each block's gathered bytes held from its forward to its backward
    held = {e["tag"]: e["bytes"] for e in ev_half if e["kind"] == "alloc" and e["rank"] == 0
            and e["tag"].endswith(":post_forward")}
    first = gathers(ev_half, 0, 0)
    assert held and held == {f"{u}:post_forward": g[0]["payload"] // 2 for u, g in first.items() if u != "root"}
    assert not any(e["tag"].endswith(":post_forward") for e in ev_full + ev_none if e["kind"] == "alloc")
    # bytes by link, nodes of 2: k = 2 adds 4 x S/2 inside the nodes per block and step, nothing
    # across; True adds a 4-rank ring's gather, half of whose senders cross nodes
    links = {k: link_bytes(ev, node_size=2, world_size=4) for k, ev in
             (("none", ev_none), (2, ev_half), ("full", ev_full))}
    assert links[2]["across"] == links["none"]["across"]
    assert links[2]["inside"] - links["none"]["inside"] == STEPS * 4 * blocks // 2
    assert links["full"]["across"] - links["none"]["across"] == STEPS * 2 * (3 * blocks // 4)
    assert links["full"]["inside"] - links["none"]["inside"] == STEPS * 2 * (3 * blocks // 4)


@pytest.mark.parametrize("N", [2, 3, 4])
def test_an_int_of_1_is_false_and_of_the_group_size_is_true(pools, N):
    """FSDP2's reading of the int: 1 keeps the full parameters, N reshards to the shard (no
    group of its own: every gather is over all N, and nothing is held after forward)."""
    pool = pools(N)
    for k, same in ((1, False), (N, True)):
        got, ev = run(pool, k)
        want, ev_want = run(pool, same)
        assert same_training(got, want), (k, same)
        assert not any("members" in e for e in ev if e["kind"] == "collective")
        ops = lambda evs: sorted((e["rank"], e["op"], e["tag"], e["wire"]) for e in evs    # noqa: E731
                                 if e["kind"] == "collective" and e.get("step") is not None)
        assert ops(ev) == ops(ev_want), (k, same)         # (True and False train alike)


def test_the_root_clamp_keeps_the_root_gathered_unless_told(pools):
    """``None`` on the root means False (backward starts with it at once); an int given to the
    root itself is kept, as FSDP2 keeps it."""
    clamped, explicit = (pools(4).run(reshard_tasks.root_clamp_states, root) for root in (None, 2))
    for after_forward, after_backward in clamped:
        assert after_forward == {"root": "unsharded", **{f"blocks.{i}": "sharded_post_forward" for i in range(3)}}
        assert set(after_backward.values()) == {"sharded"}
    for after_forward, after_backward in explicit:
        assert after_forward["root"] == "sharded_post_forward"
        assert set(after_backward.values()) == {"sharded"}


def test_a_ring_sends_to_the_next_member_and_bad_values_are_refused():
    assert next_in_ring(1, [0, 1]) == 0 and next_in_ring(3, [0, 1, 2, 3]) == 0 and next_in_ring(2, [2, 3]) == 3
    assert link_bytes([{"kind": "collective", "rank": 1, "wire": 6, "op": "all_gather"}], 2, 4) == \
        {"inside": 0, "across": 6}
    with pytest.raises(ValueError, match="do not divide"):
        link_bytes([], 3, 4)
    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(ConfigError, match="reshard_after_forward"):
            TrainConfig(strategy="fsdp", reshard_after_forward=bad)
    from minishard.strategies import fsdp
    from minishard.core.comm import Comm
    with pytest.raises(ValueError, match="reshard_after_forward=3 must be"):
        fsdp.fully_shard(torch.nn.Linear(4, 4), comm=Comm(alone=True), reshard_after_forward=3)


def test_fsdp2s_own_int_moves_the_same_bytes_over_the_same_groups(pools):
    """PyTorch's ``fully_shard(reshard_after_forward=2)`` under watch, beside minishard's: the
    same collectives on every rank — op, unit, group members, payload, wire bytes — and so the
    same bytes on each link class. (The order differs: FSDP2 gathers one unit ahead in backward.)"""
    pool = pools(4)
    ours, ev_ours = run(pool, 2)
    theirs, ev_theirs = run(pool, 2, "torch_fsdp")
    assert_parity(theirs, reference(4, MB, **KW))

    def collectives(events, rank):
        return sorted((e["op"], e["tag"], e["group"], e.get("members"), e["payload"], e["wire"])
                      for e in events if e["kind"] == "collective" and e["rank"] == rank
                      and e.get("step") is not None)
    for rank in range(4):
        assert collectives(ev_ours, rank) == collectives(ev_theirs, rank), rank
    steps = lambda evs: [e for e in evs if e.get("step") is not None]          # noqa: E731
    assert link_bytes(steps(ev_ours), 2, 4) == link_bytes(steps(ev_theirs), 2, 4)


def test_with_offload_backward_gathers_from_the_kept_part_not_the_tier(pools):
    """Offload keeps the shards in host memory; the part kept after forward stays on the device,
    so backward's gather fetches nothing from the tier: each step brings every unit's shard over
    once (h2d), and the formula says so."""
    out = pools(4).run(train, TrainConfig(strategy="fsdp", micro_batch=MB, reshard_after_forward=2,
                                          offload="host", **KW))
    for r in out:
        shards = r["ledger"]["transfer_formula"]["h2d_bytes"]
        assert [s["h2d_bytes"] for s in r["transfer"]] == [shards] * STEPS
    whole = pools(4).run(train, TrainConfig(strategy="fsdp", micro_batch=MB, offload="host", **KW))
    again = whole[0]["ledger"]["transfer_formula"]["h2d_bytes"]   # True: the blocks twice, the root once
    assert [s["h2d_bytes"] for s in whole[0]["transfer"]] == [again] * STEPS and again > shards


def test_on_6_ranks_each_keeps_n_over_k_blocks_and_a_full_reshard_drops_them(pools):
    """Where N/k is not k (6 ranks): k = 2 keeps 3 of the 6 shard blocks, k = 3 keeps 2 — each
    1/k of the block's gathered bytes — and the gradients are those of True, bit for bit. A unit
    resharded fully between its forward and its backward drops its kept part (nothing left live
    in the ledger) and backward gathers it over all six."""
    pool = pools(6)
    ref = pool.run(reshard_tasks.k_groups_of_six, True)
    for k in (2, 3):
        for r, want in zip(pool.run(reshard_tasks.k_groups_of_six, k), ref):
            assert r["kept"] == {u: b // k for u, b in r["full"].items()}, (k, r["kept"])
            assert r["dropped"] and r["live"] == []
            assert r["grads"].keys() == want["grads"].keys()
            assert all(torch.equal(r["grads"][n], want["grads"][n]) for n in r["grads"]), k


def test_consecutive_groups_are_made_inside_each_group(pools):
    """``Comm.consecutive`` on one of several groups (hybrid sharding's): a rank's group of one
    is itself, inside its replicate group as inside its shard group."""
    for rank, (rep_one, shard_one) in enumerate(pools(4).run(reshard_tasks.consecutive_inside_groups)):
        assert rep_one == shard_one == [rank]
