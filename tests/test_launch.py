"""Ranks start warm, run many tasks, and fail loudly: the failing rank's own error, fast."""
import time

import psutil
import pytest

from minishard.core.launch import RankError, Ranks, run

import rank_tasks


def test_pool_runs_many_tasks_on_the_same_processes(pools):
    pool = pools(3)
    first = pool.run(rank_tasks.whoami)
    second = pool.run(rank_tasks.whoami)
    assert [r["rank"] for r in first] == [0, 1, 2]
    assert {r["world_size"] for r in first} == {3}
    assert [r["pid"] for r in first] == [r["pid"] for r in second]


def test_what_a_rank_reports_reaches_the_caller_in_its_order(pools):
    got = []
    out = pools(2).run(rank_tasks.report_three, on_report=lambda rank, obj: got.append((rank, obj)))
    assert out == [0, 1]
    assert [obj for r, obj in got if r == 0] == [0, 1, 2] and [obj for r, obj in got if r == 1] == [10, 11, 12]
    pools(2).run(rank_tasks.report_three)                     # nobody listens: dropped, no error


def test_failing_rank_reports_its_own_traceback_fast_and_leaves_no_orphans():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    pool = Ranks(3)
    pids = pool.pids
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(rank_tasks.raise_on, 2)
    assert time.monotonic() - t0 < 10
    assert info.value.rank == 2
    assert "boom on rank 2" in str(info.value)
    assert "raise_on" in info.value.rank_traceback            # the rank's own frame, not a peer's
    assert "Connection closed" not in str(info.value).split("---")[0]
    assert not pool.alive
    with pytest.raises(RuntimeError, match="closed .*a rank failed"):
        pool.run(rank_tasks.whoami)
    time.sleep(0.2)
    alive = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not (alive & set(pids)), "rank processes left behind"


def test_timeout_names_the_silent_ranks():
    pool = Ranks(2)
    with pytest.raises(TimeoutError, match=r"no answer from ranks \[0, 1\]"):
        pool.run(rank_tasks.sleep, 30, timeout=1.5)
    assert not pool.alive


def test_a_pools_collective_timeout_ends_a_stuck_collective():
    """``Ranks(collective_timeout=...)`` is how a notebook or a test makes a hang end quickly:
    a collective whose peers never come must raise on its rank after about that long, not after
    the 60 s default (the task timeout here, 20 s, would then end it instead, as a TimeoutError)."""
    pool = Ranks(2, backend="gloo", collective_timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(rank_tasks.one_rank_in_a_collective, 0, timeout=20)
    seconds = time.monotonic() - t0
    assert info.value.rank == 0                               # the rank left waiting raised
    assert 1.5 < seconds < 15, seconds                        # its timeout, not 60 s
    assert not pool.alive


def test_one_shot_run_and_bad_input():
    assert [r["rank"] for r in run(rank_tasks.whoami, 2)] == [0, 1]
    with pytest.raises(ValueError, match="world_size"):
        Ranks(0)
    pool_fn = lambda rank: 1   # noqa: E731
    with pytest.raises(ValueError, match="module-level function"):
        run(pool_fn, 1)


def test_a_rank_that_died_of_a_signal_is_named_by_the_signal_not_a_start_up_crash():
    from minishard.core.launch import _death
    assert "killed by SIGABRT" in _death(-6, at_start=False) and "__main__" not in _death(-6, at_start=False)
    assert "killed by SIGKILL" in _death(-9, at_start=True)
    assert "__main__" in _death(1, at_start=True) and "__main__" not in _death(1, at_start=False)
