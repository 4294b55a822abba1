"""Core question 3: FSDP stores shards but computes each layer whole; tensor parallelism splits
the multiply itself, so no rank ever holds the full matrix — activations cross the wire instead."""
import pytest

from minishard.course.ch10 import compare_with_fsdp


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
