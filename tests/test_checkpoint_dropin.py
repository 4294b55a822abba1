"""The checkpoint as PyTorch users use it: ``DDP(model)``, ``ZeroOptimizer``, ``fully_shard`` each
block and the root — with minishard's optimizer wrapper or a *plain* ``torch.optim`` optimizer —
in fp32 and bf16, ranks started from different weights, two parameter groups under a schedule.

For every case: the file holds the model the ranks train (each ``param/`` tensor the gathered
parameter or its fp32 master); saved and loaded back on the same ranks, every held element —
parameters and optimizer state — is bit-identical and every group's hyperparameters are the
scheduled ones; the resumed run's next step equals the uninterrupted run's, bit for bit; loaded
on another number of ranks, every element is the checkpoint's and the model is its model; the
export holds the same weights. What cannot be described is refused by name.
(Until this test, a plain optimizer over ``fully_shard``'s shards was saved as DDP replicas:
every tensor changed on a round trip, silently.)"""
import itertools

import pytest
import torch

from minishard import checkpoint

import dropin_tasks

CASES = [c for c in itertools.product(("ddp", "zero1", "zero2", "fsdp", "fsdp_flat"), dropin_tasks.KINDS,
                                      dropin_tasks.PRECISIONS, ("adamw",))]
CASES += [("fsdp", "plain", "fp32", "sgd"), ("zero2", "wrapper", "fp32", "sgd"), ("ddp", "plain", "fp32", "sgd")]
HYBRID = [("hsdp", kind, "fp32", "adamw") for kind in dropin_tasks.KINDS]
REFUSED = {c for c in CASES if c[0].startswith("zero") and c[1] == "plain"}


def _check_saved_and_reloaded(results: list[list[dict]], cases: list, N: int) -> None:
    for k, case in enumerate(cases):
        per_rank = [r[k] for r in results]
        what = f"{case} on {N} ranks"
        if case in REFUSED:               # the torch optimizer inside ZeroOptimizer: its
            for r in per_rank:            # parameters are chunks the model does not know
                assert r["refused"] and "not the torch optimizer inside a strategy" in r["refused"], what
            continue
        for r in per_rank:
            assert r["refused"] is None, (what, r["refused"])
            assert r["wrong_saved"] == [], (what, "the file is not the model", r["wrong_saved"][:3])
            assert r["wrong_loaded"] == [], (what, "changed by a round trip", r["wrong_loaded"][:3])
            assert r["groups"], (what, "hyperparameters not restored")
            assert r["wrong_resumed"] == [], (what, "the resumed step differs", r["wrong_resumed"][:3])
        lrs = per_rank[0]["lrs"]           # the schedule moved each group's lr its own way
        assert len(set(lrs)) == len(lrs) and lrs[0] != (1e-2 if case[3] == "adamw" else 0.1), (what, lrs)


# On 2 ranks the fp32 cases: bf16 differs from fp32 in what each rank holds (a master beside the
# weights), not in how many ranks hold it, and the 3 ranks (which divide no tensor) see both.
FP32_CASES = [c for c in CASES if c[2] == "fp32"]


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    """Every case saved and reloaded on 3 ranks, the fp32 ones on 2 (hybrid sharding on 4): the
    roots, and what each rank found."""
    roots, results = {}, {}
    for N, cases in ((2, FP32_CASES), (3, CASES), (4, HYBRID)):
        roots[N] = tmp_path_factory.mktemp(f"dropin{N}")
        results[N] = (pools(N).run(dropin_tasks.save_and_reload, str(roots[N]), cases), cases)
    return roots, results


@pytest.mark.parametrize("N", [2, 3, 4])
def test_a_round_trip_on_the_same_ranks_changes_no_tensor_for_any_strategy_and_optimizer(saved, N):
    results, cases = saved[1][N]
    _check_saved_and_reloaded(results, cases, N)


@pytest.mark.parametrize("N, M", [(2, 3), (3, 2), (4, 2)])
def test_n_to_m_loads_the_checkpoints_model(pools, saved, N, M):
    cases = [c for c in saved[1][N][1] if c not in REFUSED]
    results = pools(M).run(dropin_tasks.load_elsewhere, str(saved[0][N]), cases)
    for k, case in enumerate(cases):
        for r in (res[k] for res in results):
            assert r["wrong"] == [], (f"{case} {N} -> {M}", r["wrong"][:3])


def test_the_export_holds_the_saved_weights(saved, tmp_path):
    for case in [c for c in CASES if c not in REFUSED and c[1] == "plain"]:
        path = saved[0][3] / "-".join(case)
        checkpoint.export(path, tmp_path / "-".join(case))
        exported = checkpoint.load_exported(tmp_path / "-".join(case))
        full = checkpoint.read_full(path)
        params = {n.split("/", 1)[1]: t for n, t in full.items() if n.startswith("param/")}
        assert exported.keys() == params.keys(), case
        assert all(torch.equal(exported[n], params[n]) for n in params), case


def test_ranks_holding_different_replicas_are_refused_not_mixed(pools, tmp_path):
    for answer in pools(2).run(dropin_tasks.unsynchronised, str(tmp_path / "ck")):
        assert answer and "tok_emb.weight differs between rank 0 and rank 1" in answer, answer
        assert "Wrap the model (DDP, ZeroOptimizer, fully_shard)" in answer
    assert not (tmp_path / "ck").exists()


def test_a_model_with_both_fsdp_layouts_is_saved_as_fsdp_mixed_and_loads_into_either(tmp_path):
    """One process (a world of one): blocks per parameter, the root flat."""
    from minishard import GPT
    from minishard.strategies import fsdp
    from minishard.core.model import config

    def sharded(layouts, seed):
        net = GPT(config("nano"), seed=seed)
        return fsdp.apply_fsdp(net, blocks=dict(layout=layouts[0]), root=dict(layout=layouts[1]))

    net = sharded(("per_param", "flat"), seed=0)
    checkpoint.save(net, None, tmp_path / "ck", step=0)
    assert checkpoint.read_metadata(tmp_path / "ck")["strategy"] == "fsdp_mixed"
    want = fsdp.full_parameters(net, torch.float32)
    for layouts in (("per_param", "per_param"), ("flat", "flat")):
        other = sharded(layouts, seed=1)
        checkpoint.load(other, None, tmp_path / "ck")
        got = fsdp.full_parameters(other, torch.float32)
        assert all(torch.equal(got[n], want[n]) for n in want), layouts
