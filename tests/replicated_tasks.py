"""Rank tasks and the single-process reference for ``test_replicated_dtype.py``: the nano GPT
with its norms kept whole in fp32 (``replicate_params``) while the matmuls compute in fp32,
bf16 or fp16, and ``ln_f`` a unit of its own with nothing to shard."""
import torch
import torch.nn as nn

from minishard import checkpoint
from minishard.strategies import fsdp
from minishard.core.comm import Comm
from minishard.core.ledger import LiveLedger
from minishard.core.model import GPT, batch, config
from minishard.training.parity import params_of

CFG = config("nano")
STEPS, MB, LR = 3, 2, 0.5
NORMS = ("ln1", "ln2")


def is_norm(name: str) -> bool:
    return ".ln" in name or name.startswith("ln_f")


def model(seed: int) -> GPT:
    """The nano GPT whose norms are neither 1 nor 0 and, like every weight, depend on ``seed``:
    ranks built with their own seed start apart, and only ``fully_shard``'s broadcast of rank
    0's weights (replicated ones included) makes them one model."""
    net = GPT(CFG, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if is_norm(name):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return net


def shard(net: GPT, comm: Comm, policy: tuple, layout: str, ledger=None) -> GPT:
    """Blocks keep ln1/ln2 whole; ln_f is a unit with every parameter whole; the root the rest."""
    kw = dict(comm=comm, ledger=ledger, layout=layout, mp_policy=fsdp.MixedPrecisionPolicy(*policy))
    for i, b in enumerate(net.blocks):
        fsdp.fully_shard(b, name=f"blocks.{i}", replicate_params=NORMS, **kw)
    fsdp.fully_shard(net.ln_f, name="ln_f", replicate_params=("weight", "bias"), **kw)
    return fsdp.fully_shard(net, name="root", **kw)


def _step(net, opt, x, y, scale: float, clip: float | None) -> float:
    loss = net(x, y)
    (loss * scale).backward()
    if scale != 1:                       # a static loss scale, undone on the fp32 gradients
        for p in net.parameters():
            p.grad.div_(scale)
    if clip is not None:
        fsdp.clip_grad_norm_(net, clip)
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.item()


def scenarios_run(rank, scenarios: list[dict]) -> list[dict]:
    """Rank task: each scenario trained ``STEPS`` SGD steps from this rank's own weights; what
    it ends with, the collectives and unit states it traced, and what the ledger holds."""
    out = []
    for sc in scenarios:
        comm, ledger = Comm(rank.tracer), LiveLedger()
        net = shard(model(seed=rank.rank), comm, sc["policy"], sc["layout"], ledger)
        opt = fsdp.ShardedOptimizer(net, torch.optim.SGD(net.parameters(), lr=LR))
        seen = {}                        # each norm's input dtype as it computes, and its output's
        for n, m in net.named_modules():
            if isinstance(m, nn.LayerNorm):
                m.register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].dtype))
                m.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, (seen[n], o.dtype)))
        first, losses = len(rank.tracer.events), []
        for s in range(STEPS):
            x, y = batch(CFG, s, MB, rank.rank, rank.world_size)
            losses.append(_step(net, opt, x, y, sc["scale"], sc["clip"]))
        events = rank.tracer.events[first:]
        whole = {n: p for n, p in net.named_parameters() if is_norm(n)}
        shards = [t for u in fsdp.units(net) for t in u.layout.shard_tensors()]
        out.append({
            "rank": rank.rank, "losses": losses, "seen": seen,
            "params": fsdp.full_parameters(net, dtype=torch.float32),
            "compute": {n: t.dtype for n, t in fsdp.full_parameters(net).items()},
            "whole": {n: p.detach().clone() for n, p in whole.items()},
            "whole_grads": {n: p.grad.dtype for n, p in whole.items()},
            "collectives": [(e["op"], e["tag"], e["dtype"], e["payload"]) for e in events
                            if e["kind"] == "collective"],
            "states": [(e["name"], e["state"]) for e in events if e["kind"] == "unit"],
            "ledger": ledger.current(),
            "expect": {"whole": sum(p.numel() * p.element_size() for p in whole.values()),
                       "shards": sum(t.numel() * t.element_size() for t in shards)}})
    return out


def reference(policy: tuple, world_size: int, scale: float = 1, clip: float | None = None) -> dict:
    """One process on the global batch, the same recipe built by hand: every weight but the norms
    in the compute dtype with an fp32 master beside it, the norms fp32 with their inputs cast to
    fp32 and their outputs back (the casts FSDP2 calls cast_forward_inputs and output_dtype)."""
    compute = policy[0]
    net = model(seed=0)
    init = params_of(net)
    # the masters are the fp32 weights as built (FSDP's shards are): not rounded through bf16
    masters = {n: p.detach().clone().requires_grad_() for n, p in net.named_parameters()}
    if compute is not None:
        for m in net.modules():
            if isinstance(m, nn.LayerNorm):
                m.register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
                m.register_forward_hook(lambda m, args, out: out.to(compute))
            elif not list(m.children()):                 # every other leaf: Linear, Embedding
                m.to(compute)
    opt = torch.optim.SGD(masters.values(), lr=LR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                     # one thread, like each rank
    losses = []
    try:
        for s in range(STEPS):
            loss = net(*batch(CFG, s, MB * world_size))
            (loss * scale).backward()
            for n, p in net.named_parameters():
                masters[n].grad, p.grad = p.grad.float() / scale, None
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(masters.values(), clip)
            opt.step()
            with torch.no_grad():
                for n, p in net.named_parameters():
                    p.copy_(masters[n])
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "params": {n: m.detach().clone() for n, m in masters.items()},
            "init": init}


def checkpoint_run(rank, path: str, layout: str) -> dict:
    """Rank task: bf16 compute, fp32 norms, SGD with momentum: two steps, saved, a third step;
    then a model built from other weights loads the checkpoint and takes the same third step."""
    policy = (torch.bfloat16, torch.float32)
    runs = []
    for seed, load in ((rank.rank, False), (rank.rank + 7, True)):
        comm = Comm(rank.tracer)
        net = shard(model(seed), comm, policy, layout)
        opt = fsdp.ShardedOptimizer(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
        if load:
            checkpoint.load(net, opt, path, comm=comm)
        else:
            for s in range(2):
                _step(net, opt, *batch(CFG, s, MB, rank.rank, rank.world_size), 1, None)
            checkpoint.save(net, opt, path, comm=comm, step=2)
        before = fsdp.full_parameters(net, dtype=torch.float32)
        whole = {n: p for n, p in net.named_parameters() if is_norm(n)}
        momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in whole.items()}
        loss = _step(net, opt, *batch(CFG, 2, MB, rank.rank, rank.world_size), 1, None)
        runs.append({"before": before, "momentum": momentum, "loss": loss,
                     "after": fsdp.full_parameters(net, dtype=torch.float32),
                     "dtypes": {n: p.dtype for n, p in whole.items()}})
    return {"rank": rank.rank, "runs": runs,
            "saved": {n: t["dtype"] for n, t in checkpoint.read_metadata(path)["tensors"].items()
                      if n.startswith("param/") and is_norm(n.removeprefix("param/"))}}
