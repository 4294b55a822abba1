"""``assert_parity``: the one oracle check behind every strategy's tests.

A strategy on N ranks must train exactly like one process on the same global batch: the mean
of the ranks' losses equals the single-process loss at every step, and the final parameters
agree (every rank holding the same replica, or — for sharded strategies — the gathered whole).

Parameters are compared per tensor *relative to how far the reference moved them* from the
initial weights (``minishard.training.parity.drift``): summation-order noise scores about 1e-4, a model
that did not train (or trained at the wrong scale under SGD) scores about 1. An element-wise
bound cannot do both: Adam turns noise on near-zero gradients into updates of a learning rate
(docs/testing.md). AdamW is blind to a constant gradient scale, so every strategy is also run
with plain SGD, whose update is linear in the gradient (``test_parity.py``).
"""
import torch

from minishard.core.model import GPT
from minishard.training.parity import Drift, bitwise_equal, drift, params_of
from minishard.training.loop import TrainConfig, train

_reference_cache: dict = {}
_init_cache: dict = {}


def initial(model: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights every run of ``model`` starts from (``train`` builds ``GPT(model, seed)``)."""
    if (model, seed) not in _init_cache:
        _init_cache[model, seed] = params_of(GPT(model, seed=seed))
    return _init_cache[model, seed]


def reference(world_size: int, micro_batch: int, **kw) -> dict:
    """Single-process training on the global batch (micro_batch x world_size), cached, with the
    initial weights it started from (``"init"``)."""
    key = (world_size, micro_batch, tuple(sorted(kw.items())))
    if key not in _reference_cache:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)               # one thread, like each rank: the same kernels
        try:
            ref = train(None, TrainConfig(strategy="single", micro_batch=micro_batch * world_size, return_params=True, track_activations=False, **kw))
        finally:
            torch.set_num_threads(threads)
        ref["init"] = initial(kw.get("model", "tiny"), kw.get("seed", 0))
        _reference_cache[key] = ref
    return _reference_cache[key]


def as_reference(results: list[dict], init: dict) -> dict:
    """Another implementation's run (e.g. PyTorch's DDP) as the reference to compare with."""
    steps = len(results[0]["losses"])
    return {"losses": [sum(r["losses"][s] for r in results) / len(results) for s in range(steps)],
            "params": rank_params(results), "init": init}


def rank_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """The model the ranks hold; for replicas, checks first that every rank holds the same."""
    p0 = results[0]["params"]
    for r in results[1:]:
        for name, t in r["params"].items():
            assert torch.equal(t, p0[name]), f"rank {r['rank']} replica differs from rank 0 in {name}"
    return p0


def assert_parity(results: list[dict], ref: dict, *, loss_rtol: float = 1e-6,
                  rtol: float = 2e-3, overall: float | None = None,
                  bitwise: bool = False, what: str = "") -> Drift | None:
    """Losses within ``loss_rtol`` (relative) at every step; every parameter tensor within
    ``rtol`` of how far the reference moved it — or, with ``overall`` (bf16, whose rounding
    makes barely-moving tensors noisy), the whole model within ``overall`` of its movement — or
    bit-identical. ``what`` names the run in failure messages. Returns the drift."""
    what = f"{what}: " if what else ""
    losses = [sum(r["losses"][s] for r in results) / len(results) for s in range(len(ref["losses"]))]
    for s, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= loss_rtol * abs(want), f"{what}step {s}: loss {got} vs reference {want}"
    params = rank_params(results)
    assert params.keys() == ref["params"].keys()
    if bitwise:
        assert bitwise_equal(params, ref["params"]), f"{what}not bit-identical"
        return None
    d = drift(params, ref["params"], ref["init"])
    if overall is not None:
        assert d.overall <= overall, (f"{what}the model is off by {d.overall:.2e} of how far the reference "
                                      f"moved it (allowed {overall:g}); worst tensor {d.worst_tensor}")
    else:
        assert d.within(rtol), (f"{what}{d.worst_tensor}: off by {d.worst:.2e} of how far the reference "
                                f"moved it (allowed {rtol:g}); largest element gap {d.max_abs:.2e}")
    return d
