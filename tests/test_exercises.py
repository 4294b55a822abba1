"""Every exercise's check passes with the reference solution, says "not done yet" for the
untouched stub, and rejects a typical wrong answer with a hint.

The checks run on the session's warm rank pools (``conftest.pools``), as a notebook's would on
its own ``Ranks``.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import minishard.exercises as exercises
from minishard.exercises import ExerciseFailed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))            # solutions/ is a folder at the repository root, not installed

CHAPTERS = sorted(m.name for m in pkgutil.iter_modules(exercises.__path__) if m.name.startswith("ch"))


def checks(module):
    """``(check, stub name)`` for every ``check_<name>`` of a chapter module."""
    return [(getattr(module, n), n[len("check_"):]) for n in dir(module) if n.startswith("check_")]


@pytest.fixture
def ranks(pools):
    return {n: pools(n) for n in (2, 3, 4)}


def test_every_chapter_has_an_exercise_and_a_solution():
    assert CHAPTERS == [f"ch{i:02d}" for i in range(len(CHAPTERS))] and len(CHAPTERS) >= 5
    for ch in CHAPTERS:
        module = importlib.import_module(f"minishard.exercises.{ch}")
        solution = importlib.import_module(f"solutions.{ch}")
        assert checks(module), f"{ch} has no check_* function"
        for check, name in checks(module):
            assert callable(getattr(module, name)), f"{ch}: no stub {name} for {check.__name__}"
            assert callable(getattr(solution, name)), f"solutions/{ch}.py has no {name}"


@pytest.mark.parametrize("ch", CHAPTERS)
def test_check_passes_with_the_reference_solution(ch, ranks, capsys):
    module = importlib.import_module(f"minishard.exercises.{ch}")
    solution = importlib.import_module(f"solutions.{ch}")
    for check, name in checks(module):
        assert check(getattr(solution, name), ranks=ranks) is True, capsys.readouterr().out
        assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("ch", CHAPTERS)
def test_the_stub_is_not_done_yet(ch, ranks, capsys):
    module = importlib.import_module(f"minishard.exercises.{ch}")
    for check, name in checks(module):
        with pytest.raises(NotImplementedError):
            _call_stub(getattr(module, name))
        assert check(ranks=ranks) is False
        assert "not done yet" in capsys.readouterr().out


def _call_stub(stub):
    import inspect
    args = [None] * len([p for p in inspect.signature(stub).parameters.values()
                         if p.default is inspect.Parameter.empty])
    stub(*args)


# ---------------------------------------------------------------- typical mistakes are caught
def test_ring_bytes_that_forget_the_second_half_of_the_all_reduce_fail(ranks):
    from minishard.exercises import ch02

    def ring_bytes(op, nbytes, world_size):
        return (world_size - 1) * nbytes // world_size
    with pytest.raises(ExerciseFailed, match="all_reduce"):
        ch02.check_ring_bytes(ring_bytes, ranks=ranks)


def test_zero1_with_an_all_reduce_is_right_but_sends_too_much(ranks):
    from minishard.exercises import ch03

    def zero1_step(comm, flat_param, flat_grad, shard, optimizer):
        N, r = comm.world_size, comm.rank
        chunk = flat_param.numel() // N
        comm.all_reduce(flat_grad)                        # the 1.5x version
        shard.grad = flat_grad[r * chunk:(r + 1) * chunk] / N
        optimizer.step()
        comm.all_gather(flat_param, shard.detach().clone())
    with pytest.raises(ExerciseFailed, match="DDP sends"):
        ch03.check_zero1_step(zero1_step, ranks=ranks)


def test_zero2_hook_that_keeps_the_gradient_fails(ranks):
    from minishard.exercises import ch04
    from solutions.ch04 import make_bucket_hook as right

    def make_bucket_hook(comm, params, offsets, chunk, out):
        import torch
        N = comm.world_size
        seen = []

        def hook(p):
            seen.append(p)
            if len(seen) == len(params):                  # reduce at the end, keep every p.grad
                buf = torch.zeros(N * chunk)
                for q, off in zip(params, offsets):
                    buf[off:off + q.numel()] = q.grad.reshape(-1)
                mine = torch.empty(chunk)
                comm.reduce_scatter(mine, buf)
                out.add_(mine / N)
        return hook
    assert right                                           # (the right one is in solutions/)
    with pytest.raises(ExerciseFailed, match="full gradient"):
        ch04.check_make_bucket_hook(make_bucket_hook, ranks=ranks)
