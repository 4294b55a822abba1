"""The course's side-by-side of ZeRO and FSDP (``minishard.course.zero_vs_fsdp``, chapters 03 §7,
04 §8, 05 §6 and 10 §7.1): minishard's stages, DeepSpeed's and PyTorch's FSDP2 trained on the same
warm ranks, model and global batch, each row read from its trace and checked against the
formulas the chapters quote — DeepSpeed's holdings term by term
(``planner.deepspeed_estimator.deepspeed_holdings``), the bytes of each collective, the units.

One run of every contender the relations need, on two ranks, three steps, the third read
(DeepSpeed's stage 3 follows its recorded module order from there). DeepSpeed's stage 3 runs
last: building it leaves DeepSpeed's ``zero3_linear_wrap`` as ``torch.nn.functional.linear`` in the
rank processes (the module's docstring)."""
import pytest

from minishard import GPT
from minishard.course.zero_vs_fsdp import (calls_by_tag, compare, deepspeed_terms, measured_terms,
                                           reduce_bucket_size, standing, state_table, table, wire_table)
from minishard.strategies.deepspeed_native import DS_DEFAULTS

pytest.importorskip("deepspeed")
BUCKET_MB = 0.15
NANO = GPT("nano", device="meta")
PSI = NANO.num_params()
NAMES = ["DDP (minishard)", "ZeRO-1 (minishard)", "ZeRO-1, all-reduce (minishard)", "ZeRO-1 (DeepSpeed)",
         "ZeRO-2 (minishard)", "ZeRO-2 (DeepSpeed)", "ZeRO-3 / FSDP (minishard)",
         "ZeRO-3 (DeepSpeed, its defaults)", "ZeRO-3 (DeepSpeed, threshold 0)", "ZeRO-3 (DeepSpeed, bounds 0)"]


@pytest.fixture(scope="module")
def rows(pools):
    got = compare(pools(2), NAMES, step=2, model="nano", micro_batch=2, steps=3, bucket_cap_mb=BUCKET_MB)
    return {r["name"]: r for r in got}


def test_deepspeeds_stages_1_and_2_hold_their_terms_and_send_one_and_a_half_times_ddp(rows):
    ddp = rows["DDP (minishard)"]["wire"]
    assert ddp == 4 * PSI                                        # 2(N-1)/N · 4Ψ on two ranks
    for stage in (1, 2):
        r = rows[f"ZeRO-{stage} (DeepSpeed)"]
        terms = deepspeed_terms(stage, world_size=2, bucket_cap_mb=BUCKET_MB)
        assert measured_terms(r, terms) == {t: b for t, (_, b) in terms.items()}
        assert r["state"] == standing(stage, terms)
        assert r["tag_peaks"]["reduce bucket"] == 4 * reduce_bucket_size(BUCKET_MB)
        assert abs(r["wire"] / ddp - 1.5) < 1e-3 and set(r["ops"]) == {"all_reduce", "all_gather"}
        assert calls_by_tag(r, "all_reduce")["get_grad_norm_direct"] == 1
        # §3's all-reduce version of stage 1, plus the 4 bytes of the gradient norm
        assert r["wire"] == rows["ZeRO-1, all-reduce (minishard)"]["wire"] + 4
    assert rows["ZeRO-1 (minishard)"]["wire"] == rows["ZeRO-2 (minishard)"]["wire"] == ddp
    assert rows["ZeRO-1 (DeepSpeed)"]["category_peaks"]["grads"] == 4 * PSI      # every full gradient
    # the same standing total as minishard's stage 2, in other terms: a copy of the partition, no gradient
    assert sum(rows["ZeRO-2 (DeepSpeed)"]["state"].values()) == sum(rows["ZeRO-2 (minishard)"]["state"].values())
    assert "grads" not in rows["ZeRO-2 (DeepSpeed)"]["state"] and "master" not in rows["ZeRO-2 (minishard)"]["state"]


def test_deepspeeds_stage_3_gathers_every_submodule_and_its_defaults_shard_nothing_of_a_small_model(rows):
    ddp, fsdp = rows["DDP (minishard)"]["wire"], rows["ZeRO-3 / FSDP (minishard)"]
    bounded, threshold0 = rows["ZeRO-3 (DeepSpeed, bounds 0)"], rows["ZeRO-3 (DeepSpeed, threshold 0)"]
    defaults = rows["ZeRO-3 (DeepSpeed, its defaults)"]
    terms = deepspeed_terms(3, world_size=2, bucket_cap_mb=BUCKET_MB)
    owners = sum(1 for m in NANO.modules() if any(True for _ in m.parameters(recurse=False)))
    assert measured_terms(bounded, terms) == {t: b for t, (_, b) in terms.items()}
    assert bounded["state"] == threshold0["state"] == standing(3, terms)
    assert sum(fsdp["state"].values()) == 16 * PSI // 2
    # textbook ZeRO-3: every submodule that owns parameters gathered in forward and in backward
    assert bounded["ops"]["all_gather"]["calls"] == 2 * owners and abs(bounded["wire"] / ddp - 1.5) < 1e-3
    assert bounded["calls"] > 4 * fsdp["calls"]
    # the live and reuse bounds of 1e9: the model gathered once a step and kept until backward used it
    assert abs(threshold0["wire"] / ddp - 1) < 1e-3 and threshold0["category_peaks"]["unsharded"] == 4 * PSI
    # every parameter under the persistence threshold: kept whole, all-gathered once after each step
    assert max(p.numel() for p in NANO.parameters()) <= DS_DEFAULTS["stage3_param_persistence_threshold"]
    assert defaults["state"] == {**standing(3, terms), "unsharded": 4 * PSI}
    assert defaults["ops"]["all_gather"]["calls"] == len(list(NANO.parameters()))
    assert abs(defaults["wire"] / ddp - 1) < 1e-3


def test_the_tables_print_exact_counts(rows):
    rs = list(rows.values())
    text = state_table(rs) + wire_table(rs, baseline="DDP (minishard)", label="× DDP") + table(
        rs, columns=("state", "wire", "calls"), baseline="DDP (minishard)")
    assert f"{4 * PSI:,}" in text and "1.500" in text and "—" in text
    assert " ms" not in text and "peak" not in text.lower()    # nothing of this machine's timing or peak
