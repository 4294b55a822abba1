"""ZeRO++'s quantized collectives (``minishard/quantized.py``) in minishard's FSDP: what crosses
the wire, counted from the trace against the formula — 4·⌈n/block⌉ scale bytes and n int8 bytes
(to whole 4 bytes) per rank's part of n elements, about a quarter of fp32 — and what the rounding costs,
against the unquantized run over a few dozen steps: the loss curve, and how far each run's
model drifts from the other relative to how far training moved it (``minishard.parity.drift``).
"""
import math

import pytest
import torch

from minishard import quantized
from minishard.config import ConfigError, TrainConfig
from minishard.model import GPT
from minishard.parity import drift, params_of
from minishard.train import train

STEPS = 20
KW = dict(strategy="fsdp", model="nano", micro_batch=2, steps=STEPS, return_params=True)
MODES = {"qwZ": dict(quantized_weights=True), "qgZ": dict(quantized_gradients=True),
         "qwZ+qgZ": dict(quantized_weights=True, quantized_gradients=True)}


def test_a_block_round_trips_within_half_its_scale():
    g = torch.Generator().manual_seed(0)
    for n in (1, 255, 256, 1000):
        x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
        buf = torch.empty(quantized.packed_bytes(n, 256), dtype=torch.uint8)
        quantized.pack(x, 256, buf)
        y = torch.empty(n)
        quantized.unpack(buf, n, 256, y)
        for lo in range(0, n, 256):
            block = slice(lo, min(lo + 256, n))
            scale = x[block].abs().max() / 127
            assert (x[block] - y[block]).abs().max() <= scale / 2 * (1 + 1e-6)
    zeros = torch.zeros(300)
    buf = torch.empty(quantized.packed_bytes(300, 256), dtype=torch.uint8)
    quantized.pack(zeros, 256, buf)
    quantized.unpack(buf, 300, 256, y := torch.empty(300))
    assert torch.equal(y, zeros)


@pytest.mark.parametrize("N", [2, 3])
def test_the_int8_bytes_on_the_wire_are_the_formula(pools, N):
    pool = pools(N)
    plain = pool.run(train, TrainConfig(**dict(KW, steps=1)))
    fp32 = {(e["op"], e["tag"]): e["payload"] for e in pool.last_events
            if e["kind"] == "collective" and e.get("step") == 0 and e["rank"] == 0}
    both = pool.run(train, TrainConfig(**dict(KW, steps=1), **MODES["qwZ+qgZ"]))
    seen = {(e["op"], e["tag"]): (e["payload"], e["dtype"], e["wire"]) for e in pool.last_events
            if e["kind"] == "collective" and e.get("step") == 0 and e["rank"] == 0}
    for (op, unit), nbytes in fp32.items():
        n = nbytes // 4 // N                              # this rank's part, in elements
        want = N * quantized.packed_bytes(n, quantized.BLOCK)
        got = seen[("all_gather" if op == "all_gather" else "all_to_all", unit)]
        assert got == (want, "uint8", (N - 1) * want // N), (op, unit)
        assert want < nbytes / 3.9                        # a quarter of fp32, and the scales
    assert both[0]["wire"][0] < plain[0]["wire"][0] / 3.9
    for r in both:                     # the kernel's count of what each rank process wrote agrees
        assert 0 <= r["wchar"][0] - r["wire"][0] < 16384, (r["rank"], r["wchar"], r["wire"])


@pytest.mark.parametrize("N", [2, 3])
def test_what_the_rounding_costs_over_twenty_steps(pools, N):
    """Measured on 2 and 3 ranks, nano, AdamW: the loss stays within 0.5 % of the unquantized
    run at every step, and the model within a quarter of how far training moved it (overall)."""
    pool = pools(N)
    base = pool.run(train, TrainConfig(**KW))
    init = params_of(GPT("nano", seed=0))
    for name, kw in MODES.items():
        out = pool.run(train, TrainConfig(**KW, **kw))
        for s, (got, want) in enumerate(zip(out[0]["losses"], base[0]["losses"])):
            assert abs(got - want) <= 5e-3 * want, (name, s, got, want)
        d = drift(out[0]["params"], base[0]["params"], init)
        assert d.overall <= 0.25, (name, d.overall, d.worst_tensor)
        assert d.overall > 1e-3, name                     # it did quantize


def test_quantized_collectives_are_refused_where_nothing_is_gathered():
    with pytest.raises(ConfigError, match="quantized_weights"):
        TrainConfig(strategy="ddp", quantized_weights=True)
    assert quantized.packed_bytes(1001, 256) == 4 * math.ceil(1001 / 256) + 1004


@pytest.mark.parametrize("N", [2, 3])
def test_every_rank_computes_with_the_same_dequantized_weights(pools, N):
    """Its own part included: a rank that kept its own shard exact would compute with other
    weights than its peers, and their replicas of the gradient would not be one model's."""
    import zeropp_tasks
    assert len(set(pools(N).run(zeropp_tasks.gathered_weights_digest))) == 1
