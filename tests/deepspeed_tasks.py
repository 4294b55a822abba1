"""Rank tasks for the DeepSpeed tests: a user's own DeepSpeed job, watched as the README says
(``deepspeed.initialize``, then ``minishard.watch(engine, optimizer, trace=DIR)`` around the loop),
with DeepSpeed's own comms logger on beside it — the independent count the watch is checked
against."""
from __future__ import annotations

import os

import torch

import minishard


def user_job(rank, stage: int, out: str | None, zero: dict | None = None, steps: int = 2,
             micro_batch: int = 2, bucket_cap_mb: float = 0.15, live: list[str] = (),
             users_gather: bool = False) -> dict:
    """Train the nano GPT under DeepSpeed's ZeRO ``stage`` for ``steps`` steps, watched into
    ``out``. Returns DeepSpeed's own comms log (op -> message sizes, in order of size), the
    parameters' sizes in model order, what the watch held at the end and at its peak, and for
    each ``Class#attribute`` of ``live`` whether this engine's objects have it, and the torchrun
    variables the rank sees. ``users_gather``: one more step in which the user all-gathers into
    a list through ``deepspeed.comm``, and rank 0 all-reduces in a group of its own."""
    import deepspeed
    import deepspeed.comm as ds_comm
    from minishard.strategies.deepspeed_native import deepspeed_config
    from minishard.training.config import TrainConfig
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    net = minishard.GPT("nano")
    numels = [p.numel() for p in net.parameters()]
    config = deepspeed_config(TrainConfig(strategy=f"deepspeed_zero{stage}", model="nano",
                                          micro_batch=micro_batch, bucket_cap_mb=bucket_cap_mb), stage)
    config["zero_optimization"].update(zero or {})
    engine, optimizer, _, _ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(), config=config,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01))
    ds_comm.comms_logger.comms_dict.clear()
    ds_comm.configure(enabled=True, prof_all=True, verbose=False)
    try:
        with minishard.watch(engine, optimizer, trace=out) as w:
            for step in range(steps):
                x, y = minishard.batch(net.cfg, step, micro_batch, rank.rank, rank.world_size)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                w.step()
            if users_gather:                 # the user's own collective of several tensors,
                parts = [torch.zeros(3) for _ in range(rank.world_size)]
                ds_comm.all_gather(parts, torch.full((3,), float(rank.rank)))
                alone = ds_comm.new_group([0])       # and one in a group of rank 0 alone
                if rank.rank == 0:
                    ds_comm.all_reduce(torch.ones(2), group=alone)
                w.step()
    finally:
        ds_comm.configure(enabled=False)
    logged = {op: sorted(size for size, (count, *_) in sizes.items() for _ in range(count))
              for op, sizes in ds_comm.comms_logger.comms_dict.items()}
    return {"logged": logged, "numels": numels, "held": dict(w.held), "peak": w.peak,
            "live": {name: _has(engine, name) for name in live},
            "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}}


def _has(engine, name: str) -> bool:
    """Whether the live object of ``module.Class#attribute`` (the engine's ZeRO optimizer, its
    parameter coordinator, DeepSpeed's comm backend) has the attribute."""
    import deepspeed.comm.comm as ds_comm
    path, _, attribute = name.partition("#")
    cls = path.rsplit(".", 1)[1]
    opt = engine.optimizer
    objects = {"comm": ds_comm, "DeepSpeedZeroOptimizer": opt, "DeepSpeedZeroOptimizer_Stage3": opt}
    obj = objects.get(cls)
    return obj is not None and type(obj).__name__ in (cls, "module") and hasattr(obj, attribute)


def linear_module(rank) -> str:
    """Where this rank's ``torch.nn.functional.linear`` comes from (DeepSpeed's ZeRO-3 replaces it
    for good in the process that ran it)."""
    return torch.nn.functional.linear.__module__
