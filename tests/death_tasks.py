"""Rank tasks for tests/test_deaths.py: a rank dies the ways that leave no dump — and a healthy
run of each job beside them.

Each job trains 2 steps with its flight recorder on disk (minishard's own engine through
``train(..., flight_dir=)``; PyTorch's DDP and FSDP2 under ``minishard.watch(trace=)``). In step 1
the dying rank (``DYING``) does one of:

    mismatch  issues one extra all-reduce of 4 elements: the others' next collective pairs with
              it, gloo finds the sizes differ and aborts *every* process in C++
    sigkill   SIGKILLs itself in the middle of backward
    abort     calls ``os.abort()`` just after issuing a collective (inside it)
    early     returns cleanly one step early; the others wait in step 1 until the collective
              timeout and raise
"""
import os
import signal

import torch
import torch.distributed as dist

import minishard
from minishard.core.comm import Comm
from minishard.training.hooks import RunHooks
from minishard.training.loop import TrainConfig, train

DYING = 1
STEP = 1
DEATHS = ("mismatch", "sigkill", "abort", "early")


def _die(death: str, extra=None) -> None:
    """The death, where a collective of step ``STEP``'s backward is about to be issued."""
    if death == "mismatch":
        extra(torch.zeros(4))
    elif death == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


class _DyingComm(Comm):
    """minishard's communicator on the dying rank: in step ``STEP``'s backward, its first
    all-reduce is where the rank dies."""
    death = None

    def _sibling(self, group, name, *, alone=False):
        twin = super()._sibling(group, name, alone=alone)
        twin.death = self.death
        return twin

    def all_reduce(self, tensor, *, async_op=False, tag=""):
        tr = self.tracer
        if self.death and tr.step == STEP and tr.current_phase == "backward":
            death, self.death = self.death, None
            if death == "abort":
                super().all_reduce(tensor, async_op=True, tag=tag)
                os.abort()
            _die(death, lambda t: super(_DyingComm, self).all_reduce(t, tag="extra"))
        return super().all_reduce(tensor, async_op=async_op, tag=tag)


class _Dying(RunHooks):
    def __init__(self, death):
        self.death = death

    def comm(self, tracer, ledger, alone):
        c = _DyingComm(tracer, ledger=ledger, alone=alone)
        c.death = self.death
        return c


def minishard_engine(rank, death, out):
    """minishard's DDP (buckets reduced during backward), 2 steps, the recorder in ``out``."""
    mine = death if rank.rank == DYING and death != "early" else None
    steps = STEP if (rank.rank == DYING and death == "early") else 2
    config = TrainConfig(strategy="ddp", model="nano", steps=steps, micro_batch=2, bucket_cap_mb=0.05,
                         flight_dir=out)
    train(rank, config, hooks=_Dying(mine) if mine else None)
    return "done"


def torch_job(rank, kind, death, out):
    """PyTorch's DDP or FSDP2 (one unit per block, then the root) under ``minishard.watch``."""
    torch.manual_seed(0)
    cfg = minishard.model_config("nano")
    net = minishard.GPT(cfg)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in net.blocks:
            fully_shard(block)
        model = fully_shard(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dying = rank.rank == DYING and death is not None
    with minishard.watch(model, opt, trace=out) as w:
        for step in range(2):
            if dying and death == "early" and step == STEP:
                return "left early"
            if dying and step == STEP:
                # mid-backward: when the gradient reaches the first block's output (the later
                # blocks' gradients are made and on their way)
                def on_output(module, args, out):
                    out.register_hook(lambda g: _torch_death(death))
                net.blocks[0].register_forward_hook(on_output)
            x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            w.step()
    return "done"


def _torch_death(death):
    if death == "abort":
        dist.all_reduce(torch.zeros(8), async_op=True)
        os.abort()
    _die(death, lambda t: dist.all_reduce(t))


def fsdp2_own_seeds(rank, out, fingerprinted: bool):
    """A user's FSDP2 job where every rank seeds its model itself (rank 1 differently): FSDP2
    broadcasts nothing, so each rank shards its own weights. ``fingerprinted``: the script takes
    ``minishard.fingerprint(net)`` before ``fully_shard`` and gives it to the watch."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(rank.rank if rank.rank == DYING else 0)
    cfg = minishard.model_config("nano")
    net = minishard.GPT(cfg, seed=rank.rank if rank.rank == DYING else 0)
    built = minishard.fingerprint(net) if fingerprinted else None
    for block in net.blocks:
        fully_shard(block)
    model = fully_shard(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with minishard.watch(model, opt, trace=out, built=built) as w:
        x, y = minishard.batch(cfg, 0, 2, rank.rank, rank.world_size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        w.step()
    return "done"


def deepspeed_job(rank, stage, death, out):
    """A user's DeepSpeed job at ZeRO ``stage`` under ``minishard.watch``: the engine's own
    backward and step. The dying rank dies as the torch jobs' does, mid-backward of step
    ``STEP``; its extra collective goes through DeepSpeed's own ``deepspeed.comm.all_reduce``."""
    import deepspeed
    import deepspeed.comm as ds_comm
    from minishard.strategies.deepspeed_native import deepspeed_config
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    cfg = minishard.model_config("nano")
    net = minishard.GPT(cfg)
    bounds = dict(param_persistence_threshold=0, max_live_parameters=0) if stage == 3 else {}
    config = deepspeed_config(TrainConfig(strategy=f"deepspeed_zero{stage}", model="nano", micro_batch=2,
                                          bucket_cap_mb=0.05, **bounds), stage)
    engine, opt, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config,
                                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    dying = rank.rank == DYING and death is not None
    with minishard.watch(engine, opt, trace=out) as w:
        for step in range(2):
            if dying and death == "early" and step == STEP:
                return "left early"
            if dying and step == STEP:
                def on_output(module, args, out):
                    out.register_hook(lambda g: _deepspeed_death(death, ds_comm))
                net.blocks[0].register_forward_hook(on_output)
            x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            w.step()
    return "done"


def _deepspeed_death(death, ds_comm):
    if death == "abort":
        ds_comm.all_reduce(torch.zeros(8), async_op=True)
        os.abort()
    _die(death, lambda t: ds_comm.all_reduce(t))
