"""The PyTorch-shaped API of DDP and ZeroOptimizer, each claim checked against PyTorch itself.

* ``DDP(model)`` needs no communicator (the default process group), ``DDP(model,
  per_parameter=True)`` all-reduces each gradient on its own, during backward, and
  ``finish_gradient_synchronization()`` synchronises what backwards inside ``no_sync``
  accumulated — each bit-identical to PyTorch's ``DistributedDataParallel`` on 2 ranks (there
  ``a/2 + b/2`` has one summation order).
* ``ZeroOptimizer`` is a ``torch.optim.Optimizer``: parameter groups with their own lr and weight
  decay, driven by ``LambdaLR``, train like PyTorch's ``ZeroRedundancyOptimizer`` with the same
  groups and schedule; its ``state_dict`` round trip resumes training exactly.

The rank tasks live here (rank processes import this module by name, as they do ``rank_tasks``).
"""
import contextlib
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from minishard.core.comm import Comm
from minishard.strategies.ddp import DDP
from minishard.core.model import GPT, batch, config
from minishard.core.trace import Tracer
from minishard.strategies.zero import ZeroOptimizer

from parity import as_reference, assert_parity, initial

MODEL, MB, STEPS = "nano", 2, 4
SCHEDULE = (1.0, 0.3, 2.0, 0.5, 1.5, 0.7)       # lr factor per step: up and down, never constant


def _replica(net) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _groups(net) -> list[dict]:
    """Two parameter groups, as a GPT recipe has them: matrices decayed, the rest not, at
    another learning rate."""
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]


# ---------------------------------------------------------------------------- rank tasks: DDP

def ddp_run(rank, impl: str, mode: str) -> dict:
    """Train STEPS AdamW steps under our DDP or PyTorch's. ``mode``: ``default`` (ours without a
    comm), ``per_parameter``, or ``accumulate`` (two micro-batches a step; ours runs both inside
    ``no_sync`` and then calls ``finish_gradient_synchronization()``)."""
    cfg = config(MODEL)
    net = GPT(cfg, seed=0)
    tracer = Tracer()
    if impl == "torch":
        model = DistributedDataParallel(net)
    elif mode == "per_parameter":
        model = DDP(net, comm=Comm(tracer), per_parameter=True)
    else:
        model = DDP(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ready_at = []                                  # when each gradient was ready (last step)
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: ready_at.append(tracer.now()))
    losses, micro = [], 2 if mode == "accumulate" else 1
    for step in range(STEPS):
        ready_at.clear()
        total = 0.0
        for k in range(micro):
            x, y = batch(cfg, step * micro + k, MB, rank.rank, rank.world_size)
            quiet = mode == "accumulate" and (impl == "ours" or k < micro - 1)
            with model.no_sync() if quiet else contextlib.nullcontext():
                loss = model(x, y) / micro
                loss.backward()
            total += loss.item()
        if mode == "accumulate" and impl == "ours":
            model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    out = {"rank": rank.rank, "losses": losses, "params": _replica(net)}
    if mode == "per_parameter" and impl == "ours":
        launches = sorted(e["t"] for e in tracer.events if e["kind"] == "collective"
                          and e["op"] == "all_reduce" and e["tag"].startswith("bucket"))
        half = sorted(ready_at)[len(ready_at) // 2]
        out.update(all_reduces=len(launches) // STEPS,
                   launched_by_half=sum(t < half for t in launches[-len(ready_at):]),
                   n_params=len(ready_at))
    return out


# ---------------------------------------------------------------------------- rank tasks: ZeRO

def _zero_setup(impl: str, stage: int):
    cfg = config(MODEL)
    net = GPT(cfg, seed=0)
    if impl == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model = DistributedDataParallel(net)
        opt = ZeroRedundancyOptimizer(_groups(net), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        model = net
        opt = ZeroOptimizer(_groups(net), torch.optim.AdamW, stage=stage, lr=1e-3, bucket_cap_mb=0.15)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: SCHEDULE[s])
    return cfg, net, model, opt, sched


def _zero_step(rank, cfg, model, opt, sched, step: int) -> float:
    x, y = batch(cfg, step, MB, rank.rank, rank.world_size)
    loss = model(x, y)
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.item()


def zero_schedule_run(rank, impl: str, stage: int = 1) -> dict:
    """STEPS steps of two parameter groups under LambdaLR, with our ZeroOptimizer (default
    process group: no comm given) or PyTorch's ZeroRedundancyOptimizer."""
    cfg, net, model, opt, sched = _zero_setup(impl, stage)
    losses = [_zero_step(rank, cfg, model, opt, sched, s) for s in range(STEPS)]
    return {"rank": rank.rank, "losses": losses, "params": _replica(net),
            "lr": [g["lr"] for g in opt.param_groups]}


def zero_resume_run(rank, stage: int) -> dict:
    """Train 2 steps, keep ``state_dict()`` of the optimizer and the scheduler, build everything
    afresh from them, and train 2 more steps on both: the two must stay bit-identical."""
    cfg, net, model, opt, sched = _zero_setup("ours", stage)
    for s in range(2):
        _zero_step(rank, cfg, model, opt, sched, s)
    saved = copy.deepcopy((net.state_dict(), opt.state_dict(), sched.state_dict()))   # as on disk
    _, net2, model2, opt2, sched2 = _zero_setup("ours", stage)
    net2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    lrs = ([g["lr"] for g in opt.param_groups], [g["lr"] for g in opt2.param_groups])
    losses = [[_zero_step(rank, cfg, m, o, sc, s) for s in (2, 3)]
              for m, o, sc in ((model, opt, sched), (model2, opt2, sched2))]
    same = all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))
    return {"lrs": lrs, "losses": losses, "same_params": same}


# ---------------------------------------------------------------------------- the tests

def test_ddp_without_comm_matches_torch_ddp_bitwise(pools):
    pool = pools(2)
    ours = pool.run(ddp_run, "ours", "default")
    torchs = pool.run(ddp_run, "torch", "default")
    assert_parity(ours, as_reference(torchs, initial(MODEL)), loss_rtol=0, bitwise=True)


def test_per_parameter_ddp_reduces_each_gradient_during_backward(pools):
    pool = pools(2)
    ours = pool.run(ddp_run, "ours", "per_parameter")
    torchs = pool.run(ddp_run, "torch", "per_parameter")
    assert_parity(ours, as_reference(torchs, initial(MODEL)), loss_rtol=0, bitwise=True)
    for r in ours:
        assert r["all_reduces"] == r["n_params"]             # one all-reduce per parameter
        # by the time half the gradients are ready, most of the first half is on the wire
        assert r["launched_by_half"] >= r["n_params"] // 3, r["launched_by_half"]


def test_finish_gradient_synchronization_after_no_sync_matches_torch_ddp(pools):
    pool = pools(2)
    ours = pool.run(ddp_run, "ours", "accumulate")
    torchs = pool.run(ddp_run, "torch", "accumulate")
    assert_parity(ours, as_reference(torchs, initial(MODEL)), loss_rtol=0, bitwise=True)


@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_param_groups_and_lambda_lr_trains_like_torch_zero(pools, N, stage):
    pool = pools(N)
    torchs = pool.run(zero_schedule_run, "torch")
    ours = pool.run(zero_schedule_run, "ours", stage)
    # the schedule reached both: the last factor times each group's lr
    assert ours[0]["lr"] == pytest.approx([1e-3 * SCHEDULE[STEPS], 3e-3 * SCHEDULE[STEPS]])
    assert ours[0]["lr"] == torchs[0]["lr"]
    assert_parity(ours, as_reference(torchs, initial(MODEL)), loss_rtol=1e-6, rtol=2e-3)


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_round_trip_resumes_training_exactly(pools, stage):
    for r in pools(3).run(zero_resume_run, stage):
        assert r["lrs"][0] == r["lrs"][1]
        assert r["losses"][0] == r["losses"][1]
        assert r["same_params"]


def test_the_ledger_counts_the_optimizer_state_of_every_parameter_group():
    from minishard.core.ledger import LiveLedger
    ledger = LiveLedger(Tracer())
    net = GPT(MODEL, seed=0)
    opt = ZeroOptimizer(_groups(net), torch.optim.AdamW, stage=2, comm=Comm(), ledger=ledger,
                        lr=1e-3, bucket_cap_mb=0.15)
    net(*batch(config(MODEL), 0, MB)).backward()
    opt.step()
    psi_bytes = 4 * sum(p.numel() for p in net.parameters())
    assert ledger.current()["exp_avg"] == ledger.current()["exp_avg_sq"] == psi_bytes


def test_trainconfig_and_the_models_config_each_have_one_name():
    """``TrainConfig`` lives in ``minishard/training/config.py``; a model's config is
    ``minishard.model_config`` (``minishard.core.model.config``): no top-level ``config`` to mistake
    for either."""
    import minishard
    from minishard.training import config as module
    assert module.TrainConfig is minishard.TrainConfig
    assert minishard.model_config("nano") == minishard.core.model.config("nano")
    assert not hasattr(minishard, "config")
