"""``fsdp.ShardedOptimizer`` is torch.optim's optimizer, as a PyTorch user knows it: after the
same steps on the same gradients its state holds the entries torch's holds (SGD without momentum
none, with momentum a buffer, Adam and AdamW their moments and a step count), with torch's
values, and ``zero_grad()`` sets the gradients to None — ``zero_grad(set_to_none=False)`` to
zeros — as torch's does. For every optimizer the course trains with, every layout and every
offload (the units' tier in host memory or files, the optimizer's side alone), on one rank and
on 2 and 3 warm ranks (3 divides no parameter count of the model: uneven and empty shards);
then the optimizers' other options, drawn (``hypothesis``)."""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

import optim_tasks  # noqa: E402
from minishard.core.comm import Comm  # noqa: E402
from optim_tasks import COURSE, OFFLOADS, Net  # noqa: E402
from test_properties import bounded  # noqa: E402

ZERO_GRADS = ("default", "none", "zeros")


def run(N: int, pools, cases: list[dict]) -> list[list[str]]:
    """Each case's differences from torch on every rank (one rank: in this process)."""
    if N == 1:
        return [optim_tasks.against_torch(Comm(), cases)]
    return pools(N).run(optim_tasks.rank_against_torch, cases)


def assert_as_torch(results: list[list[str]], cases: list[dict]) -> None:
    bad = [f"rank {r}, {cases[k]}: {p}" for r, per_case in enumerate(results)
           for k, p in enumerate(per_case) if p]
    assert not bad, "\n".join(bad)


def course_cases(N: int) -> list[dict]:
    """Every optimizer the course trains with × offload × layout (on ranks, where a case costs
    some 30 collectives: × offload, the layouts taken in turn), two steps: ``zero_grad`` to
    zeros, then by default."""
    cases = []
    for i, (optimizer, hyper) in enumerate(COURSE.values()):
        for j, offload in enumerate(OFFLOADS):
            layouts = ("per_param", "flat") if N == 1 else (("per_param", "flat")[(i + j) % 2],)
            cases += [dict(optimizer=optimizer, hyper=hyper, layout=layout, offload=offload,
                           threshold=None, zero_grad=["zeros", "default"], seed=i) for layout in layouts]
    if N == 1:      # and SGD with dampening, whose first buffer a zero one made ahead is not
        cases += [dict(optimizer="sgd", hyper={"lr": 0.1, "momentum": 0.9, "dampening": 0.5},
                       layout="per_param", offload=offload, threshold=None, zero_grad=["default"] * 2,
                       seed=5) for offload in OFFLOADS]
    return cases


@pytest.mark.parametrize("N", [1, 3])
def test_the_course_optimizers_keep_torchs_state_values_and_zero_grad(pools, N):
    assert sum(p.numel() for p in Net().parameters()) % 3 != 0
    cases = course_cases(N)
    assert_as_torch(run(N, pools, cases), cases)


@st.composite
def optimizer_case(draw) -> dict:
    """torch.optim's options for the course's optimizers (torch's own constraints: nesterov
    needs momentum and no dampening), ShardedOptimizer's layout and offload, 1-3 steps."""
    optimizer = draw(st.sampled_from(["sgd", "adam", "adamw"]))
    hyper = {"lr": draw(st.sampled_from([1e-2, 0.1])), "maximize": draw(st.booleans()),
             "weight_decay": draw(st.sampled_from([0.0, 0.1])),
             "foreach": draw(st.sampled_from([None, False, True]))}
    if optimizer == "sgd":
        momentum = draw(st.sampled_from([0.0, 0.9]))
        dampening = draw(st.sampled_from([0.0, 0.5])) if momentum else 0.0
        hyper |= {"momentum": momentum, "dampening": dampening,
                  "nesterov": bool(momentum) and not dampening and draw(st.booleans())}
    else:
        hyper |= {"amsgrad": draw(st.booleans()), "betas": draw(st.sampled_from([(0.9, 0.999), (0.5, 0.9)]))}
    offload = draw(st.sampled_from(OFFLOADS))
    return dict(optimizer=optimizer, hyper=hyper, layout=draw(st.sampled_from(["per_param", "flat"])),
                offload=offload,
                threshold=None if offload in ("host", "disk") else draw(st.sampled_from([None, 1, 5, 7])),
                zero_grad=draw(st.lists(st.sampled_from(ZERO_GRADS), min_size=1, max_size=3)),
                seed=draw(st.integers(0, 2 ** 16)))


@bounded(12)
@given(N=st.sampled_from([1, 2, 3]), cases=st.lists(optimizer_case(), min_size=1, max_size=3))
def test_every_option_keeps_torchs_state_values_and_zero_grad(pools, N, cases):
    assert_as_torch(run(N, pools, cases), cases)


def test_a_momentum_buffer_loaded_into_the_one_made_ahead_is_continued(tmp_path):
    """Units offloaded to host memory make SGD's buffers ahead, in the tier; loading a checkpoint
    copies its momentum into them (in place, where they are), and the first step after it must
    continue that momentum — ``momentum * buf + (1 - dampening) * grad`` — not start a new one
    from the gradient as a first step does: the resumed run is the uninterrupted run, bit for bit."""
    import torch

    from minishard import checkpoint
    from minishard.strategies import fsdp
    from minishard.strategies.offload import CPUOffloadPolicy

    hyper = dict(lr=0.1, momentum=0.9, dampening=0.5)

    def built():
        torch.manual_seed(0)
        net = fsdp.apply_fsdp(Net(), comm=Comm(), offload_policy=CPUOffloadPolicy())
        return net, fsdp.ShardedOptimizer(net, torch.optim.SGD(net.parameters(), **hyper))

    def step(net, opt, k):
        net(torch.randn(4, 5, generator=torch.Generator().manual_seed(k))).backward()
        opt.step()
        opt.zero_grad()

    net, opt = built()
    step(net, opt, 0)
    checkpoint.save(net, opt, tmp_path / "ckpt", comm=Comm(), step=1)
    step(net, opt, 1)
    resumed, ropt = built()
    checkpoint.load(resumed, ropt, tmp_path / "ckpt", comm=Comm())
    step(resumed, ropt, 1)
    for (name, p), q in zip(net.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
