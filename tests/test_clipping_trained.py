"""The clip's global norm with parameters kept whole (``replicate_params``) under FSDP, on a
*trained* state (issue 39, B). At initialisation the norms' gradients are ~0.02% of the squared
norm: a clip that got their share wrong by a factor moved the norm by less than the old 1e-4
tolerance. Here the model trains a few clipped SGD steps, the ranks see different data (their
shares of the norm differ), the whole parameters are the norms *and* the attention projections,
and their gradients are scaled up so that they carry a large share of the squared norm.

The reference is the norm of the full gradients gathered from every rank's shards (each element
from exactly one rank) and the whole gradients (identical on every rank), summed here in fp64;
and after the clip every element, of shards and whole gradients alike, must be its value before
times the factor that norm gives.
"""
from __future__ import annotations

import pytest
import torch

from minishard.strategies import fsdp
from minishard.core.comm import Comm
from minishard.core.model import GPT, batch, config

MB, STEPS, LR, MAX_NORM = 2, 3, 0.5, 0.3
WHOLE = ("ln1", "ln2", "attn.proj")      # kept whole in every block; ln_f at the root
SCALE = 4.0                              # the whole gradients' share of the squared norm: ~1/2

# Tolerances, derived from fp32 (the gradients' and the returned norm's dtype). The clip and the
# reference both square fp32 values in fp64 (exact: 24-bit mantissas, 48-bit products) and sum
# n ~ 2e5 terms in fp64, in different orders: each sum is within n * u64 ~ 2e-11 relative of the
# exact one. sqrt halves a relative error; the clip then rounds its norm to fp32 (<= u32 = eps32/2
# relative). So |clip / reference - 1| <= u32 + n * u64 < eps32: NORM_RTOL = 2 * eps32 leaves
# a factor of two. A clipped element is g * coef rounded once (u32), with coef = max_norm / (norm
# + 1e-6) from either norm (differing by <= NORM_RTOL, plus one rounding of the division each):
# within NORM_RTOL + 3 * u32 < 4 * eps32 of the reference's g * coef.
EPS32 = torch.finfo(torch.float32).eps
NORM_RTOL, CLIP_RTOL = 2 * EPS32, 4 * EPS32


def _grads(net, units) -> dict:
    """This rank's part of the gradient: ``{name: (first element, values)}`` for each sharded
    parameter (the elements its layout keeps), ``{name: whole gradient}`` for those kept whole."""
    prefix = {id(m): n for n, m in net.named_modules()}
    fqn = lambda s: ".".join(x for x in (prefix[id(s.module)], s.name) if x)     # noqa: E731
    shards, whole = {}, {}
    for u in units:
        for i, s in enumerate(u.layout.slots):
            t, start, n, first = u.layout.shard_of(i)
            g = t.grad.as_subclass(torch.Tensor).reshape(-1)[first:first + n]
            shards[fqn(s)] = (start, g.clone())
        for s, p in zip(u.replicated_slots, u.replicated):
            whole[fqn(s)] = p.grad.clone()
    return {"shards": shards, "whole": whole}


def trained_clip_run(rank, layout: str) -> dict:
    """Rank task: ``STEPS`` clipped SGD steps, then one backward on this rank's own batch, the
    whole gradients scaled by ``SCALE``; the gradient before and after ``fsdp.clip_grad_norm_``
    and the norm it returned."""
    cfg = config("nano")
    comm = Comm(rank.tracer)
    net = GPT(cfg, seed=0)
    fsdp.apply_fsdp(net, comm=comm, layout=layout, blocks=dict(replicate_params=WHOLE),
                    root=dict(replicate_params=("ln_f",)))
    opt = fsdp.ShardedOptimizer(net, torch.optim.SGD(net.parameters(), lr=LR))
    units = fsdp.units(net)
    for step in range(STEPS + 1):
        opt.zero_grad(set_to_none=False)
        net(*batch(cfg, step, MB, rank.rank, rank.world_size)).backward()
        if step == STEPS:
            break
        fsdp.clip_grad_norm_(net, MAX_NORM)
        opt.step()
    with torch.no_grad():
        for u in units:
            for p in u.replicated:
                p.grad.mul_(SCALE)              # the same on every rank: they hold it whole
    before = _grads(net, units)
    total = fsdp.clip_grad_norm_(net, MAX_NORM)
    return {"before": before, "after": _grads(net, units), "total": total,
            "numel": {n: p.numel() for n, p in GPT(cfg, seed=0).named_parameters()}}


def _assemble(res: list, when: str) -> dict[str, torch.Tensor]:
    """The full gradients: each sharded element from the one rank that holds it, the whole
    gradients from rank 0 (checked identical on every rank)."""
    numel = res[0]["numel"]
    full = {n: torch.zeros(k) for n, k in numel.items()}
    seen = {n: torch.zeros(k, dtype=torch.int64) for n, k in numel.items()}
    for r in res:
        for name, (start, g) in r[when]["shards"].items():
            full[name][start:start + g.numel()] = g
            seen[name][start:start + g.numel()] += 1
        for name, g in r[when]["whole"].items():
            assert torch.equal(g, res[0][when]["whole"][name]), (name, "whole gradients differ")
            if r is res[0]:
                full[name] = g.reshape(-1).clone()
                seen[name] += 1
    assert all((c == 1).all() for c in seen.values()), {n: c.tolist()[:8] for n, c in seen.items()
                                                        if not (c == 1).all()}
    return full


@pytest.mark.parametrize("layout", ["per_param", "flat"])
@pytest.mark.parametrize("N", [2, 3])
def test_clip_with_whole_parameters_on_a_trained_state(pools, N, layout):
    res = pools(N).run(trained_clip_run, layout)
    before, after = _assemble(res, "before"), _assemble(res, "after")
    whole_names = res[0]["before"]["whole"].keys()
    sq = {n: float(g.double().pow(2).sum()) for n, g in before.items()}
    norm = sum(sq.values()) ** 0.5
    whole_share = sum(sq[n] for n in whole_names) / norm ** 2
    # the scenario: the clip binds, the whole parameters weigh, the ranks' shares differ
    assert norm > 2 * MAX_NORM, norm
    assert 0.2 < whole_share < 0.8, whole_share
    shares = [sum(float(g.double().pow(2).sum()) for _, g in r["before"]["shards"].values()) for r in res]
    assert len({round(s, 9) for s in shares}) == N, shares
    # the norm every rank returns: the same bits, the norm of the gathered gradient
    totals = [r["total"] for r in res]
    assert all(torch.equal(t, totals[0]) for t in totals) and totals[0].dtype == torch.float32, totals
    assert abs(totals[0].item() / norm - 1) <= NORM_RTOL, (totals[0].item(), norm, NORM_RTOL)
    # every element, shard and whole, scaled by the one factor that norm gives
    coef = torch.clamp(MAX_NORM / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
    for name, g in before.items():
        torch.testing.assert_close(after[name], g * coef, rtol=CLIP_RTOL, atol=0, msg=lambda m: f"{name}: {m}")
