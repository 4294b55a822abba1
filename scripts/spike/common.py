"""Shared harness for the watch spike: 2 gloo ranks, a tiny model, torch's own wrappers.

    from common import spawn, build
    spawn(fn, world=2, args=(...))      # fn(rank, world, *args) runs in each rank, 1 thread
    model, opt = build("fsdp", "nano")  # "ddp" | "zero" | "fsdp" (+ "fsdp_mp" bf16 params)
"""
from __future__ import annotations

import os
import sys
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _entry(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn, world: int = 2, args=()):
    mp.spawn(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True)


def build(kind: str, size: str = "nano", reshard_after_forward=True):
    from minishard.core.model import GPT
    net = GPT(size)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net, bucket_cap_mb=0.25 if size == "nano" else 4)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    elif kind == "zero":
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model = DDP(net, bucket_cap_mb=0.25 if size == "nano" else 4)
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    elif kind.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        mpp = (MixedPrecisionPolicy(torch.bfloat16, torch.float32) if kind == "fsdp_mp"
               else MixedPrecisionPolicy())
        for b in net.blocks:
            fully_shard(b, reshard_after_forward=reshard_after_forward, mp_policy=mpp)
        fully_shard(net, mp_policy=mpp)
        model = net
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    else:
        raise ValueError(kind)
    return model, opt


def data(size: str, step: int, rank: int, world: int, micro_batch: int = 2):
    from minishard.core.model import batch, config
    return batch(config(size), step, micro_batch, rank, world)


def train_step(model, opt, x, y):
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def out_dir(name: str) -> str:
    d = os.path.join(tempfile.gettempdir(), "watch_spike", name)
    os.makedirs(d, exist_ok=True)
    return d


def warmed(rank, world, kind):
    """The model and optimizer of ``kind`` after two steps: what the experiments then measure."""
    model, opt = build(kind, "nano")
    for s in range(2):
        train_step(model, opt, *data("nano", s, rank, world))
    return model, opt
