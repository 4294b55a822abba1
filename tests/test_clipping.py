"""Clipping by the *global* gradient norm under sharding: every rank holds part of the gradient,
the norm is over all of it, and every rank scales by the same factor — as one process clipping
the whole gradient does. And ``torch.nn.utils.clip_grad_norm_`` on gradients a rank holds only
part of is refused, naming the clip that is right.

The threshold binds (it is below the global norm) and the ranks' own shares of the gradient have
different norms, so a clip that used a rank's local norm would scale each rank differently and
by the wrong factor — which the parity runs (SGD: the update is linear in the gradient) see."""
import pytest
import torch

from minishard.core.model import GPT, batch, config
from minishard.training.loop import TrainConfig, train

from parity import assert_parity, reference
import clip_tasks

SHARDED = ("zero1", "zero2", "fsdp", "fsdp_flat")
MAX_NORM = 0.3


def _one_process_norm(N: int) -> float:
    net = GPT(config("nano"), seed=0)
    x, y = batch(config("nano"), 0, clip_tasks.MB * N)
    net(x, y).backward()
    return torch.nn.utils.clip_grad_norm_(net.parameters(), float("inf")).item()


@pytest.mark.parametrize("N", [2, 3])
def test_the_clip_sees_the_global_norm_on_every_rank(pools, N):
    res = pools(N).run(clip_tasks.norms, list(SHARDED), MAX_NORM)
    whole = _one_process_norm(N)
    assert whole > 3 * MAX_NORM                          # the threshold binds
    for s in SHARDED:
        totals = [r[s]["total"] for r in res]
        local = [r[s]["local"] for r in res]
        assert all(abs(t - whole) <= 1e-4 * whole for t in totals), (s, totals, whole)
        # the shares differ from rank to rank, each well below the whole, and add up (squares)
        assert len(set(local)) == N and max(local) ** 0.5 < 0.9 * whole, (s, local, whole)
        assert abs(sum(local) ** 0.5 - whole) <= 1e-4 * whole, (s, local, whole)


@pytest.mark.parametrize("N", [2, 3])
def test_clipped_training_matches_one_process_clipping(pools, N):
    kw = dict(model="nano", steps=3, optimizer="sgd", lr=0.5, clip=MAX_NORM, bucket_cap_mb=0.15)
    ref = reference(N, clip_tasks.MB, **kw)
    for s in SHARDED:
        ours = pools(N).run(train, TrainConfig(strategy=s, micro_batch=clip_tasks.MB, return_params=True, **kw))
        assert_parity(ours, ref, rtol=1e-3, what=f"{s}, N={N}, clip {MAX_NORM}")


def test_torchs_clip_on_a_ranks_part_of_the_gradient_is_refused_by_name(pools):
    res = pools(2).run(clip_tasks.torch_clip, ["ddp", "zero1_allreduce", "zero1", "fsdp", "fsdp_flat"])
    whole = _one_process_norm(2)
    for r in res:
        for s in ("ddp", "zero1_allreduce"):              # whole, averaged gradients: it works
            assert abs(r[s] - whole) <= 1e-4 * whole, (s, r[s])
        for s in ("zero1", "fsdp", "fsdp_flat"):
            assert isinstance(r[s], str) and "minishard.strategies.fsdp.clip_grad_norm_(model, max_norm)" in r[s] \
                and "optimizer.clip_grad_norm_(max_norm)" in r[s], (s, r[s])


@pytest.mark.parametrize("N", [2, 3])
def test_parameters_kept_whole_count_once_in_the_global_norm(pools, N):
    """LayerNorms kept whole on every rank (``replicate_params``) are in every rank's gradient:
    their squares are added once, not once per rank."""
    whole = _one_process_norm(N)
    for total in pools(N).run(clip_tasks.fsdp_with_whole_norms, MAX_NORM):
        assert abs(total - whole) <= 1e-4 * whole, (total, whole)


def test_every_norm_of_a_ranks_part_of_the_gradient_is_refused():
    """Each way of taking a norm — functional, method, multi-tensor, torch's total — raises on
    a gradient a rank holds only part of, and nothing else does."""
    from minishard.strategies.local_grad import LocalGradient, local
    g = local(torch.arange(6.0).reshape(2, 3))
    forms = {"Tensor.norm": lambda: g.norm(), "torch.norm": lambda: torch.norm(g),
             "linalg.vector_norm": lambda: torch.linalg.vector_norm(g),
             "linalg.norm": lambda: torch.linalg.norm(g), "_foreach_norm": lambda: torch._foreach_norm([g]),
             "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_([_param_with(g)], 1.0)}
    if hasattr(torch.nn.utils, "get_total_norm"):
        forms["get_total_norm"] = lambda: torch.nn.utils.get_total_norm([g])
    for name, form in forms.items():
        with pytest.raises(RuntimeError, match="minishard.strategies.fsdp.clip_grad_norm_"):
            form()
    plain = (g * 2).sum() + g.double().pow(2).sum()            # everything else: plain tensors
    assert type(plain) is torch.Tensor and isinstance(g, LocalGradient)
    assert torch.equal(g.as_subclass(torch.Tensor).norm(), torch.arange(6.0).norm())


def _param_with(grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(grad.shape))
    p.grad = grad
    return p
