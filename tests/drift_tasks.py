"""Rank tasks for tests/test_drift.py: a user's own job under ``minishard.watch`` — PyTorch's DDP,
DDP with ZeroRedundancyOptimizer, FSDP2 ``fully_shard`` on each block and the root — trained
``STEPS`` steps of the nano GPT, healthy or with one of the two silent bugs of issue 50 on rank
``ODD``:

    lr     rank ODD builds its optimizer with another learning rate (``ODD_LR``)
    skip   rank ODD skips ``optimizer.step()`` once, at step ``SKIPPED`` (its gradients are still
           reduced; it zeroes them and goes on)

Every collective matches in both: the doctor can only see them in the replicas' fingerprints,
the optimizers' settings and their step counts the watch records."""
import torch

import minishard

ODD = 1
LR, ODD_LR = 1e-2, 2e-2
SKIPPED = 3
STEPS = 5
JOBS = ("ddp", "zero", "fsdp2")


def _build(job: str, lr: float):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    net = minishard.GPT(minishard.model_config("nano"), seed=0)
    if job in ("fsdp2", "hsdp2"):
        # HSDP: a mesh of (replicas, shards) — here every rank a replica of a one-rank shard group
        from torch.distributed.device_mesh import init_device_mesh
        import torch.distributed as dist
        mesh = {"mesh": init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
                } if job == "hsdp2" else {}
        for block in net.blocks:
            fully_shard(block, **mesh)
        return fully_shard(net, **mesh), torch.optim.AdamW(net.parameters(), lr=lr)
    model = DistributedDataParallel(net)
    if job == "zero":
        return model, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    return model, torch.optim.AdamW(net.parameters(), lr=lr)


def users_job(rank, job: str, bug: str | None, out: str, steps: int = STEPS, every: int = 10,
              skipped: int = SKIPPED) -> str:
    odd = rank.rank == ODD
    model, opt = _build(job, ODD_LR if bug == "lr" and odd else LR)
    cfg = minishard.model_config("nano")
    with minishard.watch(model, opt, trace=out, fingerprint_every=every) as w:
        for step in range(steps):
            x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            model(x, y).backward()
            if not (bug == "skip" and odd and step == skipped):
                opt.step()
            opt.zero_grad()
            w.step()
    return "done"


def nudged(rank, out: str, step_at: int, name: str, every: int, steps: int = STEPS) -> list[str]:
    """PyTorch's DDP under watch, where rank ``ODD`` adds 1e-3 to parameter ``name`` right after
    its optimizer's step ``step_at`` (an edit of its own replica that no collective carries).
    Returns the parameters' names, as the watch fingerprints them."""
    model, opt = _build("ddp", LR)
    cfg = minishard.model_config("nano")
    with minishard.watch(model, opt, trace=out, fingerprint_every=every) as w:
        for step in range(steps):
            x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            model(x, y).backward()
            opt.step()
            if rank.rank == ODD and step == step_at:
                with torch.no_grad():
                    model.module.get_parameter(name).add_(1e-3)
            opt.zero_grad()
            w.step()
    return [n for n, _ in model.module.named_parameters()]


def own_job(rank, kind: str, bug: str | None, out: str) -> str:
    """minishard's own DDP, ZeroOptimizer (stage 2) or fully_shard, built by hand as a user builds
    them, under watch; ``bug`` "lr": rank ``ODD``'s optimizer with ``ODD_LR``."""
    from minishard.strategies.fsdp import ShardedOptimizer
    net = minishard.GPT(minishard.model_config("nano"), seed=0)
    comm = minishard.Comm()
    lr = ODD_LR if bug == "lr" and rank.rank == ODD else LR
    if kind == "fsdp":
        for i, block in enumerate(net.blocks):
            minishard.fully_shard(block, comm=comm, name=f"blocks.{i}")
        model = minishard.fully_shard(net, comm=comm, name="root")
        opt = ShardedOptimizer(net, torch.optim.AdamW(net.parameters(), lr=lr))
    elif kind == "ddp":
        model, opt = minishard.DDP(net, comm=comm), torch.optim.AdamW(net.parameters(), lr=lr)
    else:
        model = net
        opt = minishard.ZeroOptimizer(net.parameters(), torch.optim.AdamW, stage=2, comm=comm, lr=lr)
    return _train_watched(rank, model, opt, out)


def pairs_job(rank, out: str, bug: str | None = None, seeds: str = "apart") -> str:
    """4 ranks, PyTorch's DDP on two groups of two ranks (``process_group=``), as a job that
    shards its model another way across the pairs holds them (tensor or pipeline parallelism
    beside DDP): each pair replicas of its own — with ``seeds`` "apart", each pair built from a
    seed of its own, so the pairs' weights differ by design. ``bug`` "lr": rank 3's optimizer
    with ``ODD_LR`` (its pair's other rank, 2, is its reference — not rank 0 or 1)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = rank.rank // 2
    net = minishard.GPT(minishard.model_config("nano"), seed=pair if seeds == "apart" else 0)
    model = DistributedDataParallel(net, process_group=pairs[pair])
    opt = torch.optim.AdamW(net.parameters(), lr=ODD_LR if bug == "lr" and rank.rank == 3 else LR)
    return _train_watched(rank, model, opt, out)


def _train_watched(rank, model, opt, out: str) -> str:
    """``STEPS`` plain steps of the nano GPT under ``minishard.watch``: the user's loop, as the
    jobs above all run it."""
    cfg = minishard.model_config("nano")
    with minishard.watch(model, opt, trace=out) as w:
        for step in range(STEPS):
            x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            w.step()
    return "done"
