"""Each collective moves the dtype its policy says, read from the trace: FSDP gathers parameters
in ``param_dtype`` and reduce-scatters gradients in ``reduce_dtype`` (None: in ``param_dtype``, as
FSDP2); DDP and ZeRO under bf16 mixed precision reduce and gather bf16. And a bf16 reduction
changes the result as much as it should: at N = 2 it is the fp32 sum rounded to bf16, exactly."""
import pytest
import torch

from minishard.strategies import fsdp
from minishard.core.comm import Comm
from minishard.core.model import GPT, batch, config
from minishard.training.loop import TrainConfig, train

BF16, FP32 = torch.bfloat16, torch.float32
POLICIES = [(None, None), (BF16, FP32), (BF16, BF16), (BF16, None)]


def fsdp_wire(rank, layout: str) -> list[dict]:
    """Rank task: one step of the nano model under each policy; the dtype of every gather and
    reduce-scatter, and the reduced gradient shards."""
    cfg = config("nano")
    x, y = batch(cfg, 0, 2, rank.rank, rank.world_size)
    out = []
    for param_dtype, reduce_dtype in POLICIES:
        comm = Comm(rank.tracer)
        net = GPT(cfg, seed=0)
        kw = dict(comm=comm, layout=layout, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype, reduce_dtype))
        fsdp.apply_fsdp(net, **kw)
        first = len(rank.tracer.events)
        net(x, y).backward()
        evs = [e for e in rank.tracer.events[first:] if e["kind"] == "collective"]
        out.append({"dtypes": {(e["op"], e["dtype"]) for e in evs},
                    "grads": [p.grad.as_subclass(torch.Tensor).clone() for p in net.parameters()]})
    return out


@pytest.mark.parametrize("layout", ["per_param", "flat"])
def test_fsdp_gathers_and_reduces_in_the_policys_dtypes(pools, layout):
    res = pools(2).run(fsdp_wire, layout)
    for r in res:
        for (param_dtype, reduce_dtype), got in zip(POLICIES, r):
            gather = str(param_dtype or FP32).removeprefix("torch.")
            reduce = str(reduce_dtype or param_dtype or FP32).removeprefix("torch.")
            assert got["dtypes"] == {("all_gather", gather), ("reduce_scatter", reduce)}, \
                (layout, param_dtype, reduce_dtype, got["dtypes"])
        # bf16 compute: the same bf16 gradients, summed in fp32 or in bf16. At N = 2 the bf16 sum
        # is one rounding of the (exact) fp32 sum; the two differ where the rounding bites
        fp32_sum, bf16_sum = r[1]["grads"], r[2]["grads"]
        differ = 0
        for a, b in zip(fp32_sum, bf16_sum):
            assert torch.equal(a.to(BF16).float(), b), layout
            differ += int((a != b).sum())
        assert differ > 0.25 * sum(a.numel() for a in fp32_sum), (layout, differ)   # ~half


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_every_collective_of_a_run_moves_its_precisions_dtype(pools, strategy):
    pool = pools(2)
    for precision in ("fp32", "bf16_mixed"):
        pool.run(train, TrainConfig(strategy=strategy, model="nano", steps=1, micro_batch=2,
                                    precision=precision, track_activations=False))
        evs = [e for e in pool.last_events if e["kind"] == "collective" and e["tag"] != "replicate"]
        dtypes = {(e["op"], e["dtype"]) for e in evs}
        if precision == "fp32":
            assert {d for _, d in dtypes} == {"float32"}, (strategy, dtypes)
        elif strategy == "fsdp":                          # bf16 gathers, fp32 reduce-scatters
            assert dtypes == {("all_gather", "bfloat16"), ("reduce_scatter", "float32")}, dtypes
        else:                                             # bf16 replicas: bf16 gradients, bf16 gathers
            assert {d for _, d in dtypes} == {"bfloat16"}, (strategy, dtypes)
