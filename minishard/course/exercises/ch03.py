"""Chapter 03 exercise: the ZeRO-1 update of one shard.

Every rank holds the same flat parameter buffer (padded to N equal chunks) and its own, not yet
averaged, flat gradient. Rank r owns chunk r: an fp32 ``shard`` of the parameters and an
optimizer over that shard alone. Write one step: get the *averaged* gradient of your chunk
(reduce-scatter), update your shard, and all-gather the updated chunks so every rank has the
whole model again.

The check runs your step for three steps of SGD with momentum on 2 and 4 real ranks, next to
minishard's ``ZeroOptimizer(stage=1)`` training an identical model on the same data, and compares
the parameters — and the bytes you sent, which should be DDP's 2(N−1)/N·Ψ, not 3(N−1)/N·Ψ.
(SGD, not AdamW: Adam divides by the gradient's own scale, so it would not notice a gradient
summed over the ranks instead of averaged — the mistake this exercise is most often failed by.)
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from . import at_world_sizes, attempt, expect, portable, run_on_rank

STEPS = 3


def zero1_step(comm, flat_param: torch.Tensor, flat_grad: torch.Tensor, shard: torch.nn.Parameter,
               optimizer: torch.optim.Optimizer) -> None:
    """One ZeRO-1 step on this rank (``comm``: a ``minishard.Comm``; ``comm.rank``, ``comm.world_size``).

    * ``flat_param`` — all parameters, ``N * chunk`` elements, identical on every rank; update it
      in place (the model's parameters are read back from it);
    * ``flat_grad`` — this rank's local gradient, same layout, *not* averaged over ranks;
    * ``shard`` — the optimizer's copy of chunk ``comm.rank`` of the parameters;
    * ``optimizer`` — an optimizer over ``[shard]`` only.

    Collectives: ``comm.reduce_scatter(out, inp)`` (``out``: 1/N of ``inp``, the *sum* over ranks
    of chunk ``rank``), ``comm.all_gather(out, inp)`` (``out``: every rank's ``inp``, in rank order;
    pass a copy, not a view of ``out``), ``comm.all_reduce(t)``.
    """
    raise NotImplementedError("zero1_step: your code here")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 3))   # 122 parameters


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 13, generator=torch.Generator().manual_seed(1000 * step + rank))


def _task(ctx, spec: dict) -> dict:
    """On each rank: the learner's step and minishard's ZeroOptimizer, side by side."""
    from minishard.core.comm import Comm
    from minishard.strategies.zero import ZeroOptimizer

    N, r = ctx.world_size, ctx.rank
    model = _model()
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    chunk = math.ceil(numel / N)
    flat_param = torch.zeros(N * chunk)
    torch.cat([p.detach().reshape(-1) for p in params], out=flat_param[:numel])
    shard = nn.Parameter(flat_param[r * chunk:(r + 1) * chunk].clone())
    opt = torch.optim.SGD([shard], lr=0.1, momentum=0.9)
    comm = Comm(None)
    start = flat_param[:numel].clone()
    first = None
    for step in range(STEPS):
        with torch.no_grad():                          # the model reads the flat buffer
            off = 0
            for p in params:
                p.copy_(flat_param[off:off + p.numel()].view_as(p))
                off += p.numel()
        loss = model(_batch(step, r)).pow(2).mean()
        grads = torch.autograd.grad(loss, params)
        flat_grad = torch.zeros(N * chunk)
        torch.cat([g.reshape(-1) for g in grads], out=flat_grad[:numel])
        run_on_rank(spec, comm, flat_param, flat_grad, shard, opt)
        if first is None:
            first = (flat_param[:numel] - start).norm().item()
    zcomm = Comm(None)
    zopt = ZeroOptimizer(ref.parameters(), torch.optim.SGD, stage=1, comm=zcomm, lr=0.1, momentum=0.9)
    zcomm.reset_counters()                               # (ZeroOptimizer broadcasts rank 0's model first)
    ref_first = None
    for step in range(STEPS):
        zopt.zero_grad()
        ref(_batch(step, r)).pow(2).mean().backward()
        zopt.step()
        if ref_first is None:
            ref_first = (torch.cat([p.detach().reshape(-1) for p in ref.parameters()]) - start).norm().item()
    theirs = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    return {"rank": r, "mine": flat_param[:numel].clone(), "theirs": theirs,
            "wire": comm.totals["wire"], "by_op": dict(comm.by_op),
            "zero_wire": zcomm.totals["wire"], "numel": numel,
            "step_ratio": first / ref_first if ref_first else 1.0}


@attempt
def check_zero1_step(fn=None, ranks=None) -> None:
    spec = portable(fn or zero1_step)
    for n, out in at_world_sizes(_task, spec, ranks, (1, 2, 4)):
        for o in out:
            gap = (o["mine"] - o["theirs"]).abs().max().item()
            print(f"N={n} rank {o['rank']}: after {STEPS} steps your parameters are within "
                  f"{gap:.1e} of ZeroOptimizer's; you sent {o['wire']:,} bytes "
                  f"({', '.join(o['by_op'])}), ZeroOptimizer {o['zero_wire']:,}")
            expect(torch.equal(o["mine"], out[0]["mine"]),
                   f"N={n}: rank {o['rank']}'s parameters differ from rank 0's — did every "
                   f"rank all-gather the updated chunks into flat_param?")
            ratio = o["step_ratio"]
            if abs(ratio - 1) > 1e-3:
                hint = (f"; your first update was {ratio:.2g}x its size: average the gradient — "
                        f"the reduce-scatter sums it over the {n} ranks, divide by N")
            else:
                hint = (". Average the gradient (the reduce-scatter sums it), update only your "
                        "shard, and gather every rank's updated chunk.")
            expect(gap <= 1e-5, f"N={n} rank {o['rank']}: your parameters are {gap:.2e} away "
                   f"from ZeroOptimizer's{hint}")
            psi = 4 * n * math.ceil(o["numel"] / n)          # fp32 bytes, padded
            ddp_volume = 2 * (n - 1) * psi // n
            expect(o["wire"] <= ddp_volume * STEPS + 8 * n * STEPS,
                   f"N={n}: right numbers, but you sent {o['wire'] / STEPS:,.0f} bytes per step "
                   f"where DDP sends {ddp_volume:,}: an all-reduce of the gradient gives every "
                   f"rank the whole sum; a reduce-scatter gives it only the shard it updates.")
