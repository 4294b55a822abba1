"""Collectives move the bytes the ring formulas say — checked against the OS's own count."""
import pytest
import torch

from minishard.core.comm import Comm, ring_wire_bytes

import rank_tasks


def test_ring_formulas():
    S = 1200
    assert ring_wire_bytes("all_reduce", S, 4) == 2 * 3 * S // 4
    assert ring_wire_bytes("reduce_scatter", S, 4) == 3 * S // 4
    assert ring_wire_bytes("all_gather", S, 3) == 2 * S // 3
    assert ring_wire_bytes("all_reduce", S, 1) == 0
    # binomial-tree broadcast from rank 0 on 4 ranks: 0 sends twice, 1 once, 2 and 3 never
    assert [ring_wire_bytes("broadcast", S, 4, r) for r in range(4)] == [2 * S, S, 0, 0]
    with pytest.raises(ValueError, match="unknown collective"):
        ring_wire_bytes("all_to_some", S, 2)


@pytest.mark.parametrize("N", [2, 3, 4])
def test_recorded_wire_bytes_equal_what_the_os_saw_sent(pools, N):
    numel = 1_000_003                                   # ~4 MB, not divisible by N
    for r, res in enumerate(pools(N).run(rank_tasks.collective_bytes, numel)):
        for op, m in res.items():
            assert m["recorded"] == ring_wire_bytes(op, m["bytes"], N, r)
            # gloo adds a few bytes of headers per message: a few KB at most
            assert 0 <= m["os"] - m["recorded"] <= 4096 + 0.001 * m["recorded"], (op, r, m)


@pytest.mark.parametrize("N", [2, 4])
def test_minishard_reduce_scatter_sends_half_of_gloos(pools, N):
    """gloo's reduce_scatter_tensor runs a full all-reduce; ours (point to point + local sum) sends
    the ring volume (N-1)/N * S, half as much."""
    res = pools(N).run(rank_tasks.collective_bytes, 1_000_000, ops=("reduce_scatter", "all_reduce"))
    for m in res:
        assert m["reduce_scatter"]["os"] < 0.51 * m["all_reduce"]["os"]


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("async_op", [False, True])
def test_collectives_compute_the_right_values(pools, N, async_op):
    numel = 1201
    n = numel - numel % N
    base = torch.arange(n, dtype=torch.float32)
    total = sum(base * (r + 1) for r in range(N))
    for r, res in enumerate(pools(N).run(rank_tasks.collective_results, numel, async_op)):
        assert torch.equal(res["rs"], total.view(N, -1)[r])
        assert torch.equal(res["ag"], torch.cat([base + q for q in range(N)]))
        assert torch.allclose(res["ar"], total)


def test_collective_events_carry_op_bytes_and_times(pools):
    pool = pools(2)
    pool.run(rank_tasks.collective_bytes, 4096, ops=("all_gather",))
    evs = [e for e in pool.last_events if e["kind"] == "collective"]
    assert {e["rank"] for e in evs} == {0, 1}
    for e in evs:
        assert e["op"] == "all_gather" and e["payload"] == 2 * 4096 * 4
        assert e["wire"] == 4096 * 4 and e["t_end"] >= e["t"] and e["dtype"] == "float32"


def test_async_events_end_when_the_collective_completed_and_no_helper_outlives_wait(pools):
    """A trace stamps when an async collective *completed*, not when someone waited for it; the
    helper thread that stamps it is joined by ``wait()``, so none is left running."""
    pool = pools(2)
    res = pool.run(rank_tasks.completion_stamps)
    evs = [e for e in pool.last_events if e["kind"] == "collective"]
    assert sorted(e["op"] for e in evs) == sorted(["all_gather", "all_reduce", "reduce_scatter"] * 2)
    for e in evs:
        assert e["t"] <= e["t_end"] < res[e["rank"]]["waited_at"]
    assert [r["helpers"] for r in res] == [[], []]


@pytest.mark.parametrize("N", [2, 3, 4])
def test_reduce_scatter_receives_straight_into_the_output_and_in_place(pools, N):
    """On gloo the slices arrive point to point: one straight into the output, so the receive
    buffer holds N-2 slices (none on two ranks); in place — the output is this rank's own block,
    which must survive until the sum — N-1. Both sum to the same slice."""
    numel = 1201
    n = numel - numel % N
    total = sum(torch.arange(n, dtype=torch.float32) * (q + 1) for q in range(N))
    for r, res in enumerate(pools(N).run(rank_tasks.reduce_scatter_in_place_and_buffers, numel)):
        for case, rows in (("out_of_place", N - 2), ("in_place", N - 1)):
            assert torch.equal(res[case]["slice"], total.view(N, -1)[r]), (case, r)
            assert res[case]["buffers"] == ([("comm_buffers", rows * (n // N) * 4)] if rows else []), case


def by_op_run(rank, numel: int) -> dict:
    """Rank task: one of each collective on ``numel`` fp32 elements; the per-op counters."""
    comm = Comm(rank.tracer)
    N = comm.world_size
    x = torch.ones(numel)
    comm.all_reduce(x.clone())
    comm.all_gather(torch.empty(N * numel), x)
    comm.reduce_scatter(torch.empty(numel // N), x.clone())
    comm.broadcast(x.clone(), 0)
    return comm.by_op


def test_bytes_by_collective_are_each_ops_wire_and_payload(pools):
    """The per-collective table a run reports (``by_op``) must add up what each op put on the
    wire, not the size of its buffer: on 3 ranks the two differ for every op. Known by hand for
    S = 4800 bytes (1200 fp32): all-reduce 2·2/3·S, all-gather (of 3 S) 2/3·3 S, reduce-scatter
    2/3·S, and a broadcast's binomial tree, where rank 0 sends twice and the others never."""
    S = 1200 * 4
    for r, by_op in enumerate(pools(3).run(by_op_run, 1200)):
        assert by_op == {"all_reduce": {"payload": S, "wire": 6400, "calls": 1},
                         "all_gather": {"payload": 3 * S, "wire": 9600, "calls": 1},
                         "reduce_scatter": {"payload": S, "wire": 3200, "calls": 1},
                         "broadcast": {"payload": S, "wire": 2 * S if r == 0 else 0, "calls": 1}}, r


def test_a_companion_group_is_made_once_per_name_over_the_same_ranks(pools):
    """``Comm.companion(name)``: the same ranks in a process group of their own (a background
    save's exchange must not pair up with the training's collectives), made at the first call
    and kept with the communicator — not a new group for every save."""
    for r in pools(2).run(rank_tasks.companions):
        assert r["same"] and r["own_group"] and r["rank"] and r["ranks"] == [0, 1]
        assert r["sum"] == [3.0, 3.0] and r["name"] == "checkpoint[0, 1]"
        # one recorder per rank; each group numbers its own collectives from 0
        assert r["entries"] == [("world", 0), ("checkpoint[0, 1]", 0)]


def test_a_companion_group_waits_as_long_as_the_group_it_accompanies(pools):
    """A background save's collectives give up when the training's would: a companion group is
    made with its communicator's collective timeout, not the default half hour a new group gets."""
    from datetime import timedelta
    for r in pools(2).run(rank_tasks.companion_timeouts):
        assert r["world"] is not None and r["world"] < timedelta(minutes=30), r
        assert r["companion"] == r["world"], r
