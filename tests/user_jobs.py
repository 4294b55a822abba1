"""Rank tasks for tests/test_user_jobs.py: a new user's own training script under
``minishard.watch`` — PyTorch's DDP, DDP with ``ZeroRedundancyOptimizer``, or FSDP2 (one unit a
block, then the root) — with one of the six bugs users bring, planted on rank ``ODD`` in step
``AT``:

    lr            its optimizer was built with another learning rate
    skip          it skips ``optimizer.step()`` once
    eval_forward  it runs one extra forward under ``torch.no_grad()`` (an evaluation) before
                  the training forward
    raise         its loss function raises
    sigkill       it is SIGKILLed in the middle of backward
    seeds         it builds its model from another seed (and says so with ``built=``)

Whether each is a bug depends on the strategy: DDP broadcasts rank 0's weights when it wraps the
model, so "seeds" is harmless there; a no-grad forward issues no collective under DDP, and an
all-gather per unit under FSDP2.
"""
import os
import signal

import torch

import minishard

ODD = 1
AT = 1
STEPS = 3
BUGS = ("lr", "skip", "eval_forward", "raise", "sigkill", "seeds")
KINDS = ("ddp", "zero", "fsdp")


def _die_in_backward(module, args, out) -> None:
    out.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))


def user_job(rank, kind: str, bug: str | None, out: str) -> str:
    odd = rank.rank == ODD
    seed = 1 if (odd and bug == "seeds") else 0
    torch.manual_seed(seed)
    cfg = minishard.model_config("nano")
    net = minishard.GPT(cfg, seed=seed)
    built = minishard.fingerprint(net)
    lr = 0.2 if (odd and bug == "lr") else 0.1
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in net.blocks:
            fully_shard(block)
        model = fully_shard(net)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(net)
        if kind == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
    with minishard.watch(model, opt, trace=out, built=built) as w:
        for step in range(STEPS):
            planted = odd and step == AT
            x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            if planted and bug == "eval_forward":
                with torch.no_grad():
                    model(x, y)
            if planted and bug == "raise":
                raise RuntimeError("the loss came out NaN")
            if planted and bug == "sigkill":                  # when backward reaches block 0
                net.blocks[0].register_forward_hook(_die_in_backward)
            model(x, y).backward()
            if not (planted and bug == "skip"):
                opt.step()
            opt.zero_grad()
            w.step()
    return "done"
