"""``assert_parity``: the one oracle check behind every strategy's tests.

A strategy on N ranks must train exactly like one process on the same global batch: the mean
of the ranks' losses equals the single-process loss at every step, and the final parameters
agree (every rank holding the same replica, or — for sharded strategies — the gathered whole).
Tolerances are those PyTorch's own strategies reach on this machine (docs/reference-figures.md):
fp32 loss 1e-6 relative; AdamW parameters 2e-4 after 10 steps (Adam's normalisation amplifies
summation-order noise on near-zero gradients); SGD much tighter.
"""
import torch

from minishard.train import train

_reference_cache: dict = {}


def reference(world_size: int, micro_batch: int, **kw) -> dict:
    """Single-process training on the global batch (micro_batch x world_size), cached."""
    key = (world_size, micro_batch, tuple(sorted(kw.items())))
    if key not in _reference_cache:
        _reference_cache[key] = train(strategy="single", micro_batch=micro_batch * world_size,
                                      return_params=True, track_activations=False, **kw)
    return _reference_cache[key]


def rank_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """The model the ranks hold; for replicas, checks first that every rank holds the same."""
    p0 = results[0]["params"]
    for r in results[1:]:
        for name, t in r["params"].items():
            assert torch.equal(t, p0[name]), f"rank {r['rank']} replica differs from rank 0 in {name}"
    return p0


def assert_parity(results: list[dict], ref: dict, *, loss_rtol: float = 1e-6,
                  param_atol: float = 2e-4, bitwise: bool = False) -> None:
    losses = [sum(r["losses"][s] for r in results) / len(results) for s in range(len(ref["losses"]))]
    for s, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= loss_rtol * abs(want), f"step {s}: loss {got} vs reference {want}"
    params = rank_params(results)
    assert params.keys() == ref["params"].keys()
    for name, want in ref["params"].items():
        got = params[name]
        if bitwise:
            assert torch.equal(got, want), f"{name}: not bit-identical"
        else:
            err = (got - want).abs().max().item()
            assert err <= param_atol, f"{name}: max |diff| {err:.3g} > {param_atol}"
