"""Core question 3: FSDP stores shards but computes each layer whole; tensor parallelism splits
the multiply itself, so no rank ever holds the full matrix — activations cross the wire instead."""
import pytest
import torch

from minishard.core.comm import Comm
from minishard.core.model import GPT, config
from minishard.course.ch10 import compare_with_fsdp
from minishard.strategies.tp import TensorParallelMLP


@pytest.mark.parametrize("N", [2, 4])
def test_tensor_parallel_never_holds_the_full_matrix_fsdp_gathers_it(pools, N):
    for r in pools(N).run(compare_with_fsdp):
        full, acts = r["full_weight_bytes"], r["activation_bytes"]
        tp, fs = r["tp"], r["fsdp"]
        assert tp["output_matches"] and tp["grad_x_matches"] and fs["output_matches"]
        # each rank's weight gradients are its slices of the unsharded MLP's (fc rows, proj
        # columns, the whole proj bias), to float rounding
        assert tp["grad_w_gap"].keys() == {"fc_w", "fc_b", "proj_w", "proj_b"}
        for name, gap in tp["grad_w_gap"].items():
            assert gap <= 1e-5 * tp["grad_w_scale"][name] + 1e-7, (name, gap)
        # TP: 1/N of both matrices (plus the replicated output bias) — at every moment
        assert tp["peak_weight_bytes"] < full / N + 4 * 256 + 4096
        # FSDP: its shard, plus the whole matrix while the layer computes
        assert fs["gathered_full_weights"] == full
        # what crosses the wire: activations for TP (y forward, dL/dx backward: 2 all-reduces),
        # weights for FSDP (gather forward, gather backward, reduce-scatter)
        assert tp["calls"] == 2 and tp["wire"] == 2 * (2 * (N - 1) * acts // N)
        assert fs["wire"] >= 3 * (N - 1) * full // N


def biased_mlp_run(rank) -> dict:
    """Rank task: the nano MLP with an output bias that is not zero (a fresh GPT's is), through
    ``TensorParallelMLP`` and whole, on the same input."""
    cfg = config("nano")
    full = GPT(cfg, seed=0).blocks[0].mlp
    with torch.no_grad():
        full.proj.bias.copy_(torch.linspace(0.5, 1.5, cfg.d_model))
    x = torch.randn(2, 4, cfg.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return {"tp": TensorParallelMLP(full, Comm(rank.tracer))(x), "whole": full(x)}


def test_the_output_bias_is_added_once_not_once_per_rank(pools):
    """Each rank's row-parallel multiply gives a partial sum that the all-reduce adds up; the
    output bias belongs to the whole sum. Added to each partial before the all-reduce, it would
    arrive N times over: every output off by (N-1) x bias, which a fresh GPT (bias 0) never shows."""
    for r in pools(2).run(biased_mlp_run):
        assert r["tp"].shape == r["whole"].shape
        assert torch.allclose(r["tp"], r["whole"], atol=1e-5), (r["tp"] - r["whole"]).abs().max()
