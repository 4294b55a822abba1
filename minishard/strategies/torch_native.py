"""PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2 as strategies: the oracles the parity
tests compare minishard's against, and the baselines of the benchmarks. They run the same
``train_step`` with the same knobs (bucket size, prefetch depth, accumulation), so a difference
in a result is a difference in the strategy, not in the loop around it.
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn as nn

from .ddp import MasterWeights
from .registry import Built, optimizer_spec


class TorchBuilt(Built):
    """A PyTorch wrapper: ``hold`` is the context its own API offers to accumulate without
    reducing (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)`` …), ``net`` the
    network under it."""

    def __init__(self, strategy, model: nn.Module, optimizer, comm, net: nn.Module, hold=None):
        super().__init__(strategy, model, optimizer, (comm,))
        self.net, self.hold = net, hold

    def accumulating(self, quiet: bool):
        return self.hold() if quiet and self.hold is not None else contextlib.nullcontext()

    def _parameters(self) -> dict[str, torch.Tensor]:
        return {n: getattr(p, "full_tensor", lambda p=p: p)() for n, p in self.net.named_parameters()}


def build_torch_ddp(strategy, net, config, comm, ledger, *, zero: bool = False) -> TorchBuilt:
    """PyTorch's DistributedDataParallel, with ZeroRedundancyOptimizer when ``zero``."""
    from torch.nn.parallel import DistributedDataParallel
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    if config.precision == "bf16_mixed":
        net.to(torch.bfloat16)
    model = DistributedDataParallel(net, bucket_cap_mb=config.bucket_cap_mb)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt_class = partial(ZeroRedundancyOptimizer, optimizer_class=opt_class)
    # bf16 weights are stepped through an fp32 master, as minishard's DDP does (PyTorch's DDP and
    # ZeroRedundancyOptimizer keep none: stepping the bf16 weights would round updates away)
    if config.precision == "bf16_mixed":
        opt = MasterWeights(net, opt_class, **opt_kwargs)
    else:
        opt = opt_class(net.parameters(), **opt_kwargs)
    return TorchBuilt(strategy, model, opt, comm, net, hold=model.no_sync)


def build_torch_fsdp(strategy, net, config, comm, ledger) -> TorchBuilt:
    """PyTorch's FSDP2 ``fully_shard``, one unit per block and the root (the oracle)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .fsdp import wrap_targets
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    mp = (MixedPrecisionPolicy(torch.bfloat16, torch.float32) if config.precision == "bf16_mixed"
          else MixedPrecisionPolicy())
    units = [m for _, m in wrap_targets(net, config.wrap)]
    for m in units:
        fully_shard(m, reshard_after_forward=config.reshard_after_forward, mp_policy=mp)
    fully_shard(net, mp_policy=mp)
    torch_prefetch(net, units, config.prefetch)
    opt = opt_class([p for p in net.parameters() if p.requires_grad], **opt_kwargs)
    hold = {None: partial(_no_gradient_sync, net), "no_sync": partial(_no_gradient_sync, net),
            "gathered": partial(_keep_gathered, net)}.get(config.accumulation)
    return TorchBuilt(strategy, net, opt, comm, net, hold=hold)


def torch_prefetch(net, units: list, depth: int) -> None:
    """minishard's ``prefetch`` depth on FSDP2's explicit lists, so that both run one schedule:
    in forward the root and each unit gather the next ``depth`` units; in backward FSDP2 gathers
    the unit before by itself (depth 1 even at ``prefetch=0``), and a deeper ``depth`` gives each
    unit the ``depth`` before it."""
    for i, m in enumerate([net, *units] if depth else []):
        if units[i:i + depth]:
            m.set_modules_to_forward_prefetch(units[i:i + depth])
    for i, m in enumerate(units if depth > 1 else []):
        if i:
            m.set_modules_to_backward_prefetch(units[max(0, i - depth):i][::-1])


@contextlib.contextmanager
def _no_gradient_sync(net):
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


@contextlib.contextmanager
def _keep_gathered(net):
    net.set_reshard_after_backward(False)
    try:
        yield
    finally:
        net.set_reshard_after_backward(True)
