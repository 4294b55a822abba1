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
import torch

import minishard.course.exercises as exercises
from minishard.course.exercises import ExerciseFailed

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
        module = importlib.import_module(f"minishard.course.exercises.{ch}")
        solution = importlib.import_module(f"solutions.{ch}")
        assert checks(module), f"{ch} has no check_* function"
        for check, name in checks(module):
            assert callable(getattr(module, name)), f"{ch}: no stub {name} for {check.__name__}"
            assert callable(getattr(solution, name)), f"solutions/{ch}.py has no {name}"


@pytest.mark.parametrize("ch", CHAPTERS)
def test_check_passes_with_the_reference_solution(ch, ranks, capsys):
    module = importlib.import_module(f"minishard.course.exercises.{ch}")
    solution = importlib.import_module(f"solutions.{ch}")
    for check, name in checks(module):
        assert check(getattr(solution, name), ranks=ranks) is True, capsys.readouterr().out
        assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("ch", CHAPTERS)
def test_the_stub_is_not_done_yet(ch, ranks, capsys):
    module = importlib.import_module(f"minishard.course.exercises.{ch}")
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
    from minishard.course.exercises import ch02

    def ring_bytes(op, nbytes, world_size):
        return (world_size - 1) * nbytes // world_size
    with pytest.raises(ExerciseFailed, match="all_reduce"):
        ch02.check_ring_bytes(ring_bytes, ranks=ranks)


def test_zero1_with_an_all_reduce_is_right_but_sends_too_much(ranks):
    from minishard.course.exercises import ch03

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
    from minishard.course.exercises import ch04
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


def test_a_lifecycle_that_keeps_blocks_gathered_through_forward_fails(ranks):
    from minishard.course.exercises import ch06

    def manual_step(model, idx, targets):
        import torch
        root, blocks = model._fsdp_unit, [b._fsdp_unit for b in model.blocks]
        root.unshard()
        x = model.tok_emb(idx) + model.pos_emb.weight[:idx.shape[1]]
        for b, u in zip(model.blocks, blocks):
            u.unshard()                              # gathered, never freed before backward:
            x = b(x)                                 # the right numbers, none of the saving
        loss = torch.nn.functional.cross_entropy(model.head(model.ln_f(x)).flatten(0, 1),
                                                 targets.flatten())
        loss.backward()
        for u in [*reversed(blocks), root]:
            u.reduce_scatter_grads()
            u.reshard()
        return loss.detach()
    with pytest.raises(ExerciseFailed, match="free each block"):
        ch06.check_manual_step(manual_step, ranks=ranks)


def test_a_read_plan_that_ignores_the_uneven_last_chunk_fails():
    from minishard.course.exercises import ch09

    def read_plan(numel, saved_world_size, world_size):
        old, new = numel // saved_world_size, numel // world_size      # floor: drops the tail
        return [[(s, max(r * new, s * old), min((r + 1) * new, (s + 1) * old))
                 for s in range(saved_world_size)
                 if max(r * new, s * old) < min((r + 1) * new, (s + 1) * old)]
                for r in range(world_size)]
    with pytest.raises(ExerciseFailed, match="new rank"):
        ch09.check_read_plan(read_plan)


def test_a_survivor_that_loads_the_complete_but_unrenamed_new_checkpoint_fails():
    """The newest complete directory is not the checkpoint: .ck.saving with its metadata was
    never renamed into place, and a load never reads it."""
    from minishard.course.exercises import ch09

    def survivor(entries):
        for name in (".ck.saving", "ck", ".ck.old"):
            if entries.get(name):
                return name
        return None
    with pytest.raises(ExerciseFailed, match="the rename is the commit"):
        ch09.check_survivor(survivor)


def test_a_ch09_survivor_that_never_looks_aside_at_the_old_checkpoint_fails():
    """A save killed between its two renames left no ck: the load reads .ck.old, the previous
    checkpoint renamed aside. A survivor that only knows ck says there is nothing to load."""
    from minishard.course.exercises import ch09

    def survivor(entries):
        return "ck" if entries.get("ck") else None
    with pytest.raises(ExerciseFailed, match=r"killed between the two renames.*'\.ck\.old'"):
        ch09.check_survivor(survivor)


def test_tensor_parallel_that_gathers_the_weight_fails(ranks):
    from minishard.course.exercises import ch10

    def tp_mlp_forward(comm, x, fc_w, fc_b, proj_w, proj_b):
        import torch
        import torch.nn.functional as F
        N = comm.world_size
        full_fc = torch.empty(N * fc_w.numel())
        comm.all_gather(full_fc, fc_w.reshape(-1).contiguous())      # FSDP's way, not TP's
        full_b = torch.empty(N * fc_b.numel())
        comm.all_gather(full_b, fc_b.contiguous())
        full_proj = torch.empty(N * proj_w.numel())
        comm.all_gather(full_proj, proj_w.t().reshape(-1).contiguous())
        h = F.gelu(F.linear(x, full_fc.view(-1, x.shape[-1]), full_b))
        return F.linear(h, full_proj.view(-1, x.shape[-1]).t()) + proj_b
    with pytest.raises(ExerciseFailed, match="never gathers a weight"):
        ch10.check_tp_mlp_forward(tp_mlp_forward, ranks=ranks)


def test_a_hello_prediction_that_forgets_the_all_gather_half_fails(ranks):
    from minishard.course.exercises import ch00

    def predict_hello(world_size, payload_mb):
        nbytes = int(payload_mb * 2**20)
        return world_size * (world_size + 1) / 2, (world_size - 1) * nbytes // world_size
    with pytest.raises(ExerciseFailed, match="2\\(N-1\\)/N"):
        ch00.check_predict_hello(predict_hello, ranks=ranks)


def test_a_ledger_without_the_master_copy_fails():
    from minishard.course.exercises import ch01

    def ddp_state_bytes(n_params, precision):
        b = 2 if precision == "bf16_mixed" else 4          # forgets the fp32 master under bf16
        return {"params": b * n_params, "grads": b * n_params,
                "exp_avg": 4 * n_params, "exp_avg_sq": 4 * n_params}
    with pytest.raises(ExerciseFailed, match="bf16_mixed"):
        ch01.check_ddp_state_bytes(ddp_state_bytes, ranks={})


def test_zero1_that_forgets_to_average_the_gradient_fails(ranks):
    from minishard.course.exercises import ch03

    def zero1_step(comm, flat_param, flat_grad, shard, optimizer):
        N, r = comm.world_size, comm.rank
        chunk = flat_param.numel() // N
        mine = torch.empty(chunk)
        comm.reduce_scatter(mine, flat_grad)
        shard.grad = mine                                 # the sum over ranks, not the mean
        optimizer.step()
        comm.all_gather(flat_param, shard.detach().clone())
    with pytest.raises(ExerciseFailed, match="divide by N"):
        ch03.check_zero1_step(zero1_step, ranks=ranks)
    assert ranks[2].alive and ranks[4].alive


def test_an_unshard_that_keeps_the_padding_gets_a_hint_and_the_pool_survives(ranks):
    from minishard.course.exercises import ch05

    def unshard_param(comm, shard, shape):
        N = comm.world_size
        out = torch.empty(N * shard.numel(), dtype=shard.dtype)
        comm.all_gather(out, shard.reshape(-1).contiguous())
        return out.view(shape)                            # the padding rows are still there
    with pytest.raises(ExerciseFailed, match="padded"):
        ch05.check_unshard_param(unshard_param, ranks=ranks)
    assert ranks[2].alive and ranks[3].alive             # a wrong answer is a hint, not a dead pool


def test_a_prefetch_schedule_in_the_wrong_order_fails(ranks):
    from minishard.course.exercises import ch07

    def prefetch_targets(blocks, unit, depth, forward):
        order = list(blocks) if forward else list(reversed(blocks))
        i = -1 if unit == "root" else order.index(unit)
        return sorted(order[i + 1:i + 1 + depth])        # the right units, in name order
    with pytest.raises(ExerciseFailed, match="wrong order"):
        ch07.check_prefetch_targets(prefetch_targets, ranks=ranks)


def test_offload_bytes_that_gather_the_root_twice_fail(ranks):
    from minishard.course.exercises import ch08

    def offload_bytes(block_shard, root_shard, n_blocks):
        return 2 * (n_blocks * block_shard + root_shard), n_blocks * block_shard + root_shard
    with pytest.raises(ExerciseFailed, match="root: 1"):
        ch08.check_offload_bytes(offload_bytes, ranks=ranks)


def _majority(held_at: dict, ranks: list) -> list:
    """The ranks outside the largest set that agree (every rank on a tie) — the part of a
    first_desync every wrong answer below gets right."""
    sides = {}
    for r in ranks:
        sides.setdefault(held_at[r], []).append(r)
    groups = sorted(sides.values(), key=len, reverse=True)
    return ranks if len(groups) > 1 and len(groups[0]) == len(groups[1]) else \
        sorted(r for g in groups[1:] for r in g)


def test_a_desync_check_that_compares_only_sizes_misses_the_swapped_units():
    from minishard.course.exercises import ch11

    def first_desync(held):
        by_seq = {r: {e["seq"]: e for e in es} for r, es in held.items()}
        ranks = sorted(by_seq)
        for seq in sorted(set.intersection(*(set(s) for s in by_seq.values()))):
            what = {r: (by_seq[r][seq]["op"], str(by_seq[r][seq]["shapes"]), str(by_seq[r][seq]["dtypes"]))
                    for r in ranks}                       # what it is, not what it moves
            if len(set(what.values())) > 1:
                return seq, _majority(what, ranks)
        return None
    with pytest.raises(ExerciseFailed, match="compare what they move"):
        ch11.check_first_desync(first_desync)


def test_a_desync_check_that_aligns_ranks_by_position_fails_on_dropped_rings():
    from minishard.course.exercises import ch11

    def first_desync(held):
        ranks = sorted(held)
        for entries in zip(*(held[r] for r in ranks)):    # the i-th entry of each ring, not the seq
            what = {r: (e["op"], str(e["shapes"]), str(e["dtypes"]), e["tag"], e["step"])
                    for r, e in zip(ranks, entries)}
            if len(set(what.values())) > 1:
                return entries[0]["seq"], _majority(what, ranks)
        return None
    with pytest.raises(ExerciseFailed, match="align the ranks by seq"):
        ch11.check_first_desync(first_desync)
