"""Rank tasks of the drop-in checkpoint tests: the training state set up the way a PyTorch user
writes it — ``DDP(model)``, ``ZeroOptimizer(...)``, ``fully_shard`` each block and the root —
with minishard's optimizer wrapper or a plain ``torch.optim`` optimizer, in fp32 and bf16, two
parameter groups and a learning-rate schedule. Many cases per launch: a nano model's step, save
or load takes milliseconds, starting ranks seconds."""
import os

import torch

from minishard import checkpoint
from minishard.core.comm import Comm
from minishard.core.model import GPT, batch, config

MODEL, MICRO_BATCH = "nano", 2
KINDS = ("wrapper", "plain")                 # minishard's optimizer wrapper, or a torch optimizer
PRECISIONS = ("fp32", "bf16")
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "fsdp_flat", "hsdp")


def groups(params, optimizer: str):
    """Two parameter groups with their own hyperparameters: matrices decay, the rest does not."""
    params = [p for p in params if p.requires_grad]
    lr = 1e-2 if optimizer == "adamw" else 0.1
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1, "lr": lr},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": lr / 2}]


def optimizer_class(optimizer: str):
    return torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD


def setup(rank, strategy: str, kind: str, precision: str, optimizer: str, seed: int):
    """(model to call, optimizer to step, the torch optimizer a scheduler drives, comm)."""
    from minishard import DDP, ZeroOptimizer
    from minishard.strategies import fsdp
    from minishard.strategies import MasterWeights
    comm = Comm(rank.tracer)
    net = GPT(config(MODEL), seed=seed)
    bf16 = precision == "bf16"
    cls = optimizer_class(optimizer)
    extra = {"momentum": 0.9} if optimizer == "sgd" else {}
    if strategy == "ddp":
        if bf16:
            net.to(torch.bfloat16)
        model = DDP(net, comm=comm, bucket_cap_mb=0.15)
        if kind == "wrapper":       # bf16 weights stepped through an fp32 master (fp32: a copy)
            opt = MasterWeights(net, cls, lr=1e-2 if optimizer == "adamw" else 0.1, **extra)
            return model, opt, opt.optimizer, comm
        opt = cls(groups(net.parameters(), optimizer), **extra)
        return model, opt, opt, comm
    if strategy in ("zero1", "zero2"):
        if bf16:
            net.to(torch.bfloat16)
        opt = ZeroOptimizer(groups(net.parameters(), optimizer), cls, stage=int(strategy[-1]),
                            comm=comm, bucket_cap_mb=0.15,
                            master_dtype=torch.float32 if bf16 else None, **extra)
        return net, opt if kind == "wrapper" else opt.optimizer, opt, comm
    kw = dict(comm=comm, layout="flat" if strategy == "fsdp_flat" else "per_param",
              mp_policy=fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None)
    if strategy == "hsdp":
        kw["comm"], kw["replicate"] = comm.split(2)
    fsdp.apply_fsdp(net, **kw)
    inner = cls(groups(net.parameters(), optimizer), **extra)
    opt = fsdp.ShardedOptimizer(net, inner) if kind == "wrapper" else inner
    return net, opt, inner, comm


def schedule(inner):
    """Each group its own decay: after a step the lrs differ from the initial ones, and by group."""
    n = len(inner.param_groups)
    return torch.optim.lr_scheduler.LambdaLR(inner, [lambda s: 0.5 ** s, lambda s: 1 / (1 + s)][:n])


def step(rank, model, opt, sched, k: int) -> None:
    cfg = config(MODEL)
    x, y = batch(cfg, k, MICRO_BATCH, rank.rank, rank.world_size)
    model(x, y).backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def full_params(model, strategy: str) -> dict[str, torch.Tensor]:
    """The model every rank trains, whole: FSDP's gathered fp32 shards (the masters), the
    others' replicas (bf16 working copies where an fp32 master is saved)."""
    from minishard.strategies import fsdp
    net = getattr(model, "module", model)
    if strategy.startswith(("fsdp", "hsdp")):
        return fsdp.full_parameters(net, torch.float32)
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def differs(saved: torch.Tensor, t: torch.Tensor) -> bool:
    """The saved tensor is not ``t`` (a bf16 working copy: not the saved master, rounded)."""
    return not torch.equal(saved.reshape(t.shape).to(t.dtype), t)


def hyperparameters(opt) -> list[dict]:
    groups = getattr(opt, "param_groups", None) or opt.optimizer.param_groups
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def snapshot(model, opt, comm) -> dict:
    return {n: [(s, v.clone()) for s, v in parts]
            for n, parts in checkpoint.local_state(model, opt, comm).items()}


def same(a: dict, b: dict) -> list[str]:
    """Tensor names whose held elements differ (bitwise) between two snapshots."""
    return sorted(n for n in a.keys() | b.keys()
                  if n not in a or n not in b or len(a[n]) != len(b[n])
                  or any(s != t or not torch.equal(u, v) for (s, u), (t, v) in zip(a[n], b[n])))


def save_and_reload(rank, root: str, cases: list) -> list[dict]:
    """For each ``(strategy, kind, precision, optimizer)``: train 2 steps (a scheduler changing
    each group's lr), save to ``root/<case>``, then scramble the weights and the optimizer
    state, load it back on the same ranks, and train a third step next to the run that was never
    interrupted. Returns, per case, what differs (or the refusal's message)."""
    out = []
    for case in cases:
        strategy, kind, precision, optimizer = case
        path = os.path.join(root, "-".join(case))
        model, opt, inner, comm = setup(rank, strategy, kind, precision, optimizer, seed=rank.rank)
        sched = schedule(inner)
        for k in range(2):
            step(rank, model, opt, sched, k)
        try:
            checkpoint.save(model, opt, path, comm=comm, step=2)
        except checkpoint.CheckpointError as e:
            out.append({"case": case, "refused": str(e)})
            continue
        saved = checkpoint.read_full(path)
        truth = full_params(model, strategy)
        wrong_saved = sorted(n for n, t in truth.items() if differs(saved[f"param/{n}"], t))
        before, groups_before = snapshot(model, opt, comm), hyperparameters(opt)
        # the uninterrupted run goes on; a second one, from other weights, resumes from the file
        step(rank, model, opt, sched, 2)
        after_step = full_params(model, strategy)
        model2, opt2, inner2, _ = setup(rank, strategy, kind, precision, optimizer, seed=100 + rank.rank)
        sched2 = schedule(inner2)
        with torch.no_grad():
            for p in getattr(model2, "module", model2).parameters():
                p.add_(1.0)
        checkpoint.load(model2, opt2, path, comm=comm)
        loaded = snapshot(model2, opt2, comm)
        groups_loaded = hyperparameters(opt2)
        step(rank, model2, opt2, sched2, 2)
        resumed = full_params(model2, strategy)
        out.append({"case": case, "refused": None, "wrong_saved": wrong_saved,
                    "wrong_loaded": same(before, loaded),
                    "groups": groups_before == groups_loaded, "lrs": [g["lr"] for g in groups_before],
                    "wrong_resumed": sorted(n for n in after_step if not torch.equal(after_step[n], resumed[n]))})
    return out


def load_elsewhere(rank, root: str, cases: list) -> list[dict]:
    """For each ``(strategy, kind, precision, optimizer)`` saved by other ranks: the same set-up
    from other weights loads it; every element this rank holds must be the checkpoint's, and the
    model it then trains must be the checkpoint's model."""
    out = []
    for case in cases:
        strategy, kind, precision, optimizer = case
        path = os.path.join(root, "-".join(case))
        model, opt, inner, comm = setup(rank, strategy, kind, precision, optimizer, seed=7)
        checkpoint.load(model, opt, path, comm=comm)
        full = {n: t.reshape(-1) for n, t in checkpoint.read_full(path).items()}
        wrong = []
        for g in checkpoint.describe(model, opt, comm).regions:
            want = full[g.name][g.start:g.start + g.numel]
            if not torch.equal(g.view, want.to(g.view.dtype) if g.cast else want):
                wrong.append(g.name)
        truth = full_params(model, strategy)
        wrong += [n for n, t in truth.items() if differs(full[f"param/{n}"], t)]
        out.append({"case": case, "wrong": sorted(set(wrong)), "lrs": [g["lr"] for g in hyperparameters(opt)]})
    return out


def unsynchronised(rank, path: str) -> str | None:
    """A model trained on every rank with no strategy at all (each rank its own seed and data):
    its parameters are not replicas, and saving rank r's chunk of each would mix the ranks'
    models. Returns the save's refusal (None: it saved)."""
    net = GPT(config(MODEL), seed=rank.rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(config(MODEL), 0, MICRO_BATCH, rank.rank, rank.world_size)
    net(x, y).backward()
    opt.step()
    try:
        checkpoint.save(net, opt, path, step=1)      # comm: the default process group
    except checkpoint.CheckpointError as e:
        return str(e)
    return None
