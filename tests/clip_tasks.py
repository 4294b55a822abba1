"""Rank tasks of the clipping tests: what each rank's gradient norm is, and what a clip does."""
import torch

from minishard.core.comm import Comm
from minishard.core.model import GPT, batch, config
from minishard.training.loop import TrainConfig, build

MB = 2


def norms(rank, strategies: list, max_norm: float) -> dict:
    """For each strategy, after one backward on step 0's batch: the sum of squares of the
    gradient this rank holds (its own share), and the norm the strategy's clip reports."""
    out = {}
    for s, built in _after_backward(rank, strategies):
        out[s] = {"local": _own_share(built), "total": built.clip_grad_norm(max_norm).item()}
    return out


def _after_backward(rank, strategies: list):
    """(strategy, the nano model built under it after one backward on step 0's batch)."""
    cfg = config("nano")
    x, y = batch(cfg, 0, MB, rank.rank, rank.world_size)
    for s in strategies:
        built = build(GPT(cfg, seed=0), TrainConfig(s, model="nano", optimizer="sgd"), Comm(rank.tracer))
        built.model(x, y).backward()
        yield s, built


def _own_share(built) -> float:
    """The squares of the gradient elements this rank is responsible for (ZeRO: its shards)."""
    if hasattr(built.optimizer, "grad_shards"):
        return sum(float(g.double().pow(2).sum()) for g in built.optimizer.grad_shards)
    return sum(float(p.grad.as_subclass(torch.Tensor).double().pow(2).sum())
               for p in built.model.parameters() if p.grad is not None)


def torch_clip(rank, strategies: list) -> dict:
    """``torch.nn.utils.clip_grad_norm_(model.parameters())`` after a backward under each
    strategy: the norm it returns, or the error it raises."""
    out = {}
    for s, built in _after_backward(rank, strategies):
        try:
            out[s] = torch.nn.utils.clip_grad_norm_(built.model.parameters(), 1.0).item()
        except RuntimeError as e:
            out[s] = str(e)
    return out


def fsdp_with_whole_norms(rank, max_norm: float) -> float:
    """``fsdp.clip_grad_norm_`` on a nano GPT whose LayerNorms every rank keeps whole
    (``replicate_params``): the norm it reports after one backward on step 0's batch."""
    from minishard.strategies import fsdp
    cfg = config("nano")
    comm = Comm(rank.tracer)
    net = GPT(cfg, seed=0)
    fsdp.apply_fsdp(net, comm=comm, blocks=dict(replicate_params=("ln1", "ln2")),
                    root=dict(replicate_params=("ln_f",)))
    x, y = batch(cfg, 0, MB, rank.rank, rank.world_size)
    net(x, y).backward()
    return fsdp.clip_grad_norm_(net, max_norm).item()
