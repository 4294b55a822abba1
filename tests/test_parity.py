"""Every data-parallel strategy trains like one process on the same global batch — and a wrong
one does not.

Each strategy runs with several buckets or units of different sizes (``bucket_cap_mb=0.15`` on
the nano model: four gradient buckets in fp32, three in bf16; FSDP: the root and three blocks),
on N = 2 and 3 ranks (3 divides neither the parameter count nor every row count), in four
settings, against one process training on the whole global batch (``parity.assert_parity``):

* **fp32 SGD** — the update is linear in the gradient, so a missing or doubled 1/N, a bucket
  left unreduced or a shard never gathered moves some tensor by ~100% of its movement, where
  summation order moves it by < 1e-4 (measured; the bound is 1e-3);
* **fp32 AdamW** — the course's optimizer: blind to a constant gradient scale, not to a stale
  tensor (noise up to 3.4e-4 per tensor at N = 3; the bound is 2e-3);
* **bf16 mixed, SGD and AdamW (lr 1e-2)** — bf16 rounding moves barely-moving tensors a lot, so
  the whole model is compared: measured 0.7–2.5e-2 (SGD) and 2.9–7.3e-2 (AdamW) of its
  movement, bounds 0.1 and 0.25; weights that never receive the update score 1.0.
"""
import pytest
import torch

from minishard.training.loop import TrainConfig, train

from parity import assert_parity, reference

STRATEGIES = ("ddp", "ddp_naive", "zero1", "zero1_allreduce", "zero2", "fsdp", "fsdp_flat")
SETTINGS = {
    "fp32-sgd": (dict(optimizer="sgd", lr=0.5), dict(rtol=1e-3)),
    "fp32-adamw": (dict(optimizer="adamw", lr=1e-3), dict(rtol=2e-3)),
    "bf16-sgd": (dict(optimizer="sgd", lr=0.5, precision="bf16_mixed"), dict(overall=0.1, loss_rtol=3e-2)),
    "bf16-adamw": (dict(optimizer="adamw", lr=1e-2, precision="bf16_mixed"),
                   dict(overall=0.25, loss_rtol=3e-2)),
}
MB = 2


def reductions_per_step(out: dict, strategy: str) -> int:
    """How many gradient collectives one step ran (buckets, tensors or units)."""
    op = "all_reduce" if strategy.startswith("ddp") or strategy == "zero1_allreduce" else "reduce_scatter"
    return out["by_op"][op]["calls"] // len(out["losses"])


@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trains_like_one_process_with_several_buckets(pools, strategy, N):
    for setting, (opt_kw, tolerance) in SETTINGS.items():
        kw = dict(model="nano", steps=3, bucket_cap_mb=0.15, **opt_kw)
        ours = pools(N).run(train, TrainConfig(strategy=strategy, micro_batch=MB, return_params=True, **kw))
        ref = reference(N, MB, **kw)
        assert reductions_per_step(ours[0], strategy) >= 3, (setting, ours[0]["by_op"])
        if "layout" in ours[0]:                                  # ZeRO: buckets of several sizes
            assert len({numel for _, numel, _ in ours[0]["layout"]["buckets"]}) >= 2
        # the reference itself trained: the whole model moved by over 1% of its norm
        assert _norm(ref["params"], ref["init"]) > 0.01 * _norm(ref["init"]), setting
        assert_parity(ours, ref, **tolerance, what=f"{strategy}, N={N}, {setting}")


def _norm(a: dict, b: dict | None = None) -> float:
    return torch.cat([(a[n] - (b[n] if b else 0)).reshape(-1) for n in a]).norm().item()


EQUALISING = ("ddp", "ddp_naive", "zero1", "zero1_allreduce", "zero2", "fsdp", "fsdp_flat")


@pytest.mark.parametrize("N", [2, 3])
def test_ranks_started_from_different_weights_train_like_one_process_from_rank_0s(pools, N):
    """Rank r builds its model from seed r (``rank_seeds``): every strategy that claims to make
    the ranks' weights equal must start them all from rank 0's — a strategy that never
    synchronised them would train N different models (FSDP2 users meet this one:
    pytorch#148756)."""
    kw = dict(model="nano", steps=2, optimizer="sgd", lr=0.5, bucket_cap_mb=0.15)
    ref = reference(N, MB, **kw)
    for strategy in EQUALISING:
        ours = pools(N).run(train, TrainConfig(strategy=strategy, micro_batch=MB, return_params=True,
                                               rank_seeds=True, **kw))
        assert_parity(ours, ref, rtol=1e-3, what=f"{strategy}, N={N}, ranks seeded 0..{N - 1}")


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_flat"])
def test_parameters_kept_whole_start_from_rank_0s_weights_too(pools, strategy):
    """Parameters a unit keeps whole on every rank (here every one of at most 4,096 elements:
    the LayerNorms, the biases, each attention output projection and the position embedding —
    the last two drawn from each rank's seed) never enter a gather: they too must start from
    rank 0's."""
    kw = dict(model="nano", steps=2, optimizer="sgd", lr=0.5, param_persistence_threshold=4096)
    ours = pools(2).run(train, TrainConfig(strategy=strategy, micro_batch=MB, return_params=True,
                                           rank_seeds=True, **kw))
    ref_kw = {k: v for k, v in kw.items() if k != "param_persistence_threshold"}
    assert_parity(ours, reference(2, MB, **ref_kw), rtol=1e-3, what=f"{strategy}, whole norms, seeds 0..1")


def test_hybrid_sharding_starts_every_replica_group_from_rank_0s_weights(pools):
    kw = dict(model="nano", steps=2, optimizer="sgd", lr=0.5, shard_size=2)
    ours = pools(4).run(train, TrainConfig(strategy="hsdp", micro_batch=MB, return_params=True,
                                           rank_seeds=True, **kw))
    assert_parity(ours, reference(4, MB, **kw), rtol=1e-3, what="hsdp 2x2, ranks seeded 0..3")


def test_rank_seeds_leave_the_one_process_reference_as_it_was():
    kw = dict(strategy="single", model="nano", steps=1, micro_batch=2, return_params=True,
              track_activations=False)
    a = train(None, TrainConfig(**kw))
    b = train(None, TrainConfig(rank_seeds=True, **kw))
    assert a["losses"] == b["losses"]
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def test_frozen_weights_stay_bitwise_unchanged_under_adamw_weight_decay(pools):
    """A frozen weight has no gradient, so no optimizer step touches it — not even AdamW's weight
    decay, which moves any weight that has a gradient, zero or not. (``single`` and ``ddp_naive``
    once gave frozen weights zero gradients up front, so their reference decayed them.)"""
    from minishard.core.model import GPT
    frozen = ("tok_emb", "blocks.0.ln1")
    kw = dict(model="nano", steps=1, micro_batch=1, optimizer="adamw", freeze=frozen, return_params=True)
    start = {n: p.detach() for n, p in GPT("nano").named_parameters() if n.startswith(frozen)}
    runs = {"single": train(None, TrainConfig(strategy="single", **kw))}
    for s in ("ddp_naive", "ddp", "zero2", "fsdp", "torch_ddp"):   # each way gradients are held
        runs[s] = pools(2).run(train, TrainConfig(strategy=s, **kw))[0]
    for s, out in runs.items():
        moved = [n for n in start if not torch.equal(out["params"][n], start[n])]
        assert not moved, f"{s}: frozen weights changed: {moved}"


def test_one_tensor_left_behind_fails_parity_that_the_whole_model_would_pass():
    """The measure itself (``minishard.training.parity.drift``): each tensor is judged against its own
    movement, so one tensor that never trained — a bucket skipped — fails ``within`` although
    the whole model, dominated by its large tensors, is close; a frozen model scores 1.0."""
    from minishard.core.model import GPT
    from minishard.training.parity import drift, params_of
    init = params_of(GPT("nano", seed=0))
    g = torch.Generator().manual_seed(1)
    ref = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in init.items()}
    small = min(ref, key=lambda n: ref[n].numel())                   # a norm's weight
    ours = dict(ref, **{small: init[small]})                          # its update lost
    d = drift(ours, ref, init)
    share = (ref[small].numel() / sum(t.numel() for t in ref.values())) ** 0.5
    assert d.worst_tensor == small and abs(d.worst - 1.0) < 1e-3      # it did not move at all
    tol = 2 * share                  # the whole model sees it as its share of the elements
    assert d.overall < tol and not d.within(tol)
    assert drift(ref, ref, init).within(0.0)                          # identical: 0
    frozen = drift(init, ref, init)
    assert abs(frozen.overall - 1.0) < 1e-6 and not frozen.within(0.5)


def test_max_diff_is_the_largest_absolute_difference_whichever_side_is_larger():
    from minishard.training.parity import max_diff
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    b = {"w": torch.tensor([1.5, 2.0]), "b": torch.tensor([0.0])}
    assert max_diff(a, b) == max_diff(b, a) == 0.5
    assert max_diff(a, a) == 0.0
