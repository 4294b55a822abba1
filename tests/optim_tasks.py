"""Rank tasks of the ShardedOptimizer tests: ``fully_shard``'s units stepped by
``ShardedOptimizer`` beside the same model, whole, stepped by the same ``torch.optim``
optimizer on the same batches — and every difference a user of torch.optim could see, in words:
the state entries each parameter has, their values, the step counts, ``zero_grad``'s gradients.

Every rank trains on the same batch, so the reduced gradient is the one-process gradient (the
mean of N equal ones: exact on one rank and two, rounded on three)."""
from __future__ import annotations

import copy
import tempfile

import torch
import torch.nn as nn

from minishard.checkpoint.regions import describe
from minishard.core.comm import Comm
from minishard.strategies import fsdp
from minishard.strategies.offload import CPUOffloadPolicy, DiskOffloadPolicy, OffloadPolicy

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# the course's optimizers, as TrainConfig names them (registry.optimizer_spec) and ZeRO allows them
COURSE = {"sgd": ("sgd", {"lr": 0.1}), "sgd_momentum": ("sgd", {"lr": 0.1, "momentum": 0.9}),
          "adam": ("adam", {"lr": 1e-2}), "adamw": ("adamw", {"lr": 1e-2, "weight_decay": 0.01})}
OFFLOADS = (None, "host", "disk", "optimizer")   # the units' tier, or the optimizer's alone


class Net(nn.Module):
    """70 parameters — 3 does not divide them, nor a block's 24 or the head's 4 (whose 1 row
    leaves two of three ranks an empty shard): every shard size the layouts make."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 3)])
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x).pow(2).sum()


def _offloads(offload: str | None, folder: str) -> tuple[OffloadPolicy, OffloadPolicy]:
    """(the units' policy, the optimizer's)."""
    if offload == "optimizer":
        return OffloadPolicy(), CPUOffloadPolicy()
    if offload == "disk":
        return DiskOffloadPolicy(folder), OffloadPolicy()
    return (CPUOffloadPolicy() if offload == "host" else OffloadPolicy()), OffloadPolicy()


def _zero_grad(opt, how: str) -> None:
    if how == "default":
        opt.zero_grad()
    else:
        opt.zero_grad(set_to_none=how == "none")


def _state_tensors(opt) -> dict:
    return {(i, k): v for i, p in enumerate(opt.optimizer.param_groups[0]["params"])
            for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v) and k != "step"}


def against_torch(comm: Comm, cases: list[dict]) -> list[list[str]]:
    """Each case's differences from torch.optim (empty: none). A case: ``optimizer`` (a key of
    OPTIMIZERS), ``hyper`` (its keyword arguments), ``layout``, ``offload`` (OFFLOADS),
    ``threshold`` (the persistence threshold, or None), ``zero_grad`` (per step: "default",
    "none" or "zeros"), ``seed``."""
    return [_case(comm, c) for c in cases]


def _case(comm: Comm, case: dict) -> list[str]:
    cls, hyper = OPTIMIZERS[case["optimizer"]], case["hyper"]
    torch.manual_seed(case["seed"])
    net = Net()
    ref = copy.deepcopy(net)
    with tempfile.TemporaryDirectory(prefix="optim-tasks-") as folder:
        units, optimizer_side = _offloads(case["offload"], folder)
        fsdp.apply_fsdp(net, comm=comm, layout=case["layout"], offload_policy=units,
                        param_persistence_threshold=case["threshold"])
        opt = fsdp.ShardedOptimizer(net, cls(net.parameters(), **hyper), offload_policy=optimizer_side)
        made = _state_tensors(opt)            # made ahead, in the tier: they must stay there
        ropt = cls(ref.parameters(), **hyper)
        try:
            problems = _train_and_compare(comm, case, net, ref, opt, ropt)
        finally:
            for u in fsdp.units(net):
                u.release_tier()
            if opt.offload is not None:
                opt.offload.release()
    moved = [k for k, v in made.items() if _state_tensors(opt).get(k) is not v]
    if moved:
        problems.append(f"state made ahead replaced by the step (left its tier): {moved}")
    return problems


def _train_and_compare(comm, case, net, ref, opt, ropt) -> list[str]:
    problems = []
    inner = [p for g in opt.optimizer.param_groups for p in g["params"]]
    for step, how in enumerate(case["zero_grad"]):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(case["seed"] + step))
        net(x).backward()
        ref(x).backward()
        opt.step()
        ropt.step()
        _zero_grad(opt, how)
        _zero_grad(ropt, how)
        want = [p.grad is None for p in ref.parameters()]
        got = [p.grad is None for p in inner]
        if set(got) != set(want):
            problems.append(f"step {step}: zero_grad({how}) left gradients None: {got}; torch: {want}")
        if any(g is not None and g.count_nonzero() for g in (p.grad for p in inner)):
            problems.append(f"step {step}: zero_grad({how}) left a gradient that is not zero")
    problems += _compare_state(comm, case, net, ref, opt, ropt)
    return problems


def _compare_state(comm, case, net, ref, opt, ropt) -> list[str]:
    problems = []
    kinds = {frozenset(s) for s in ropt.state.values()} or {frozenset()}
    for i, p in enumerate(opt.optimizer.param_groups[0]["params"]):
        have = frozenset(opt.state.get(p, {}))
        if {have} != kinds:
            problems.append(f"parameter {i} of the optimizer has state {sorted(have)}; torch's: "
                            f"{[sorted(k) for k in kinds]}")
    steps = {float(s["step"]) for s in opt.state.values() if "step" in s}
    want = {float(s["step"]) for s in ropt.state.values() if "step" in s}
    if steps != want:
        problems.append(f"step counts {sorted(steps)}; torch's {sorted(want)}")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]
    if groups != [{k: v for k, v in g.items() if k != "params"} for g in ropt.state_dict()["param_groups"]]:
        problems.append(f"hyperparameters {groups} differ from torch's")
    # the values, element by element, through what a checkpoint says each rank holds
    exact = comm.world_size < 3
    names = dict(ref.named_parameters())
    for r in describe(net, opt, comm).regions:
        if r.cast:
            continue
        kind, fqn = r.name.split("/", 1)
        full = names[fqn] if kind == "param" else ropt.state[names[fqn]][kind]
        want = full.detach().reshape(-1)[r.start:r.start + r.numel]
        if not (torch.equal(r.view, want) if exact else torch.allclose(r.view, want, rtol=1e-5, atol=1e-7)):
            worst = (r.view - want).abs().max().item()
            problems.append(f"{r.name}[{r.start}:{r.start + r.numel}] differs from torch's by up to {worst:.3g}")
    return problems


def rank_against_torch(rank, cases: list[dict]) -> list[list[str]]:
    return against_torch(Comm(rank.tracer), cases)
