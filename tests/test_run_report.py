"""The run report of ``minishard demo`` explains itself: its formula models every knob the run
used (hybrid shard groups, recomputation, offload with its host bytes and transfers, the
layout's padding), each peak - formula difference is named in the strategy's words and said
once, a column that was not measured says so, and ``--save`` / ``--resume`` / ``--export`` each
say what they did, the resumed run counting on from its step."""
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minishard.cli.report import LEFT_OUT, NOT_MODELLED, explain, report
from minishard.training.config import TrainConfig
from minishard.core.ledger import STATE_CATEGORIES
from minishard.training.loop import train
from test_cli import cli                        # python -m minishard in a fresh process

NANO = dict(model="nano", steps=2)


def args_for(config: TrainConfig, **more) -> SimpleNamespace:
    """What the command line would have parsed for this config."""
    return SimpleNamespace(model=config.model, precision=config.precision, optimizer=config.optimizer,
                           offload=config.offload, recompute=config.recompute,
                           loss_chunk_tokens=config.loss_chunk_tokens, trace=None, resume=None,
                           save=None, export=None, **more)


def state(ledger_bytes: dict) -> dict:
    return {c: b for c, b in ledger_bytes.items() if c in STATE_CATEGORIES}


def assert_named(results: list[dict], family: str) -> None:
    """Every category where the device peak differs from the formula is above it by what the
    strategy really allocates, in its words, or below it (not all alive at the peak)."""
    for r in results:
        led = r["ledger"]
        for c in set(led["peak_snapshot"]) | set(led["formula"]["device"]):
            extra = led["peak_snapshot"].get(c, 0) - led["formula"]["device"].get(c, 0)
            assert extra <= 0 or c in LEFT_OUT[family], (r["strategy"], c, extra)
        assert NOT_MODELLED not in " ".join(explain(r))


def test_hybrid_shards_and_recomputation_are_in_the_formula(pools):
    config = TrainConfig(strategy="hsdp", shard_size=2, recompute=True, **NANO)
    results = pools(4).run(train, config)
    for r in results:
        led = r["ledger"]
        assert led["shard_group"] == config.shard_size
        # the state the ranks hold after the run is the formula's, category by category
        assert state(led["by_device"]["device"]) == state(led["formula"]["device"])
        # recomputation: what autograd ever held in forward is what the formula says it keeps
        assert led["category_peaks"]["activations"] == led["formula"]["device"]["activations"]
        assert any("while backward recomputes them" in note for note in explain(r))
    assert_named(results, "fsdp")
    text = report(results, args_for(config))
    assert "state sharded over 2 ranks (--shard-size 2; replicated across 2 groups)" in text
    assert "--recompute" in text


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offload_puts_the_state_beside_the_device_and_counts_its_transfers(pools, tier, tmp_path):
    where = dict(offload_dir=str(tmp_path)) if tier == "disk" else {}
    config = TrainConfig(strategy="fsdp", offload=tier, accum=2, **where, **NANO)
    results = pools(3).run(train, config)
    for r in results:
        led = r["ledger"]
        assert not state(led["formula"]["device"]) and not state(led["by_device"].get("device", {}))
        assert set(led["by_device"]) <= {"device", tier}        # the state is where the run said
        assert led["formula"][tier] == led["by_device"][tier]
        assert led["transfer_formula"] == {k: r["transfer"][-1][k] for k in ("h2d_bytes", "d2h_bytes")}
    assert_named(results, "fsdp")
    text = report(results, args_for(config))
    assert re.search(rf"^rank .* peak MiB formula MiB  {tier} MiB formula MiB", text, re.M)
    assert f"{tier} = formula" in text and "transfers per step = formula" in text


def test_zero_padding_is_in_the_formula_and_each_note_is_said_once(pools):
    config = TrainConfig(strategy="zero1", **NANO)
    results = pools(3).run(train, config)
    padding = [b[2] * 3 - b[1] for b in results[0]["layout"]["buckets"]]
    assert any(padding), "nano on 3 ranks pads a bucket: the case this test is about"
    for r in results:
        assert r["ledger"]["peak"] == sum(r["ledger"]["formula"]["device"].values())
    text = report(results, args_for(config))
    assert text.count("device: peak = formula") == 1 and "ranks 0-2: device: peak = formula" in text
    assert "reduce-scatter" not in text.split("why:")[1]           # FSDP's words are not ZeRO's
    # DDP and ZeRO do not time their waits: the column says so instead of 0.0
    rows = [line for line in text.splitlines() if re.match(r"^\s+\d ", line)]
    assert len(rows) == 3 and all(row.split()[-1] == "n/a" for row in rows)
    assert "waited ms: n/a, not measured" in text


@pytest.mark.parametrize("accum", [1, 2])
def test_a_bf16_loss_says_its_resolution(pools, accum):
    """With accumulation each micro-batch's loss / accum is what bf16 rounds: the step's loss is a
    sum of numbers half as large, whose spacing is half as large too."""
    config = TrainConfig(strategy="zero1", precision="bf16_mixed", accum=accum, **NANO)
    results = pools(3).run(train, config)
    for r in results:
        for loss, step in zip(r["losses"], r["loss_resolution"]):
            # a bf16 loss is a whole number of its resolution, and half a step more is no bf16 number
            half = loss + step / 2
            assert (loss / step).is_integer() and torch.tensor(half, dtype=torch.bfloat16).item() != half
    text = report(results, args_for(config))
    assert f"moves in steps of {max(max(r['loss_resolution']) for r in results):g}" in text


def test_save_resume_export_say_what_they_did_and_steps_count_on(pools, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = cli(pools, capsys, "demo", "--world-size", "2", "--strategy", "fsdp", "--model", "nano",
                "--steps", "2", "--save", "ckpt")
    on_disk = sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("rank*.safetensors"))
    assert f"saved step 2 to ckpt (2 ranks, {on_disk:,} bytes)" in saved
    out = cli(pools, capsys, "demo", "--world-size", "3", "--strategy", "zero1", "--model", "nano",
              "--steps", "2", "--resume", "ckpt", "--export", "release")
    assert "resumed ckpt at step 2: resharded 2 → 3 ranks, fsdp → zero1" in out
    assert re.search(r"^step   3/4  loss", out, re.M) and re.search(r"^step   4/4  loss", out, re.M)
    assert not re.search(r"^step   1/", out, re.M)
    weights = list((tmp_path / "release").glob("*.safetensors"))
    index = json.loads((tmp_path / "release" / "model.safetensors.index.json").read_text())
    assert (f"exported step 4 to release: {len(weights)} weight files, "
            f"{index['metadata']['total_size']:,} bytes of weights") in out
    assert "(steps 3-4: resumed at step 2)" in out
    # the per-step lines are rank 0's own, said once; the summary's losses are the global mean
    assert out.count("rank 0's steps") == 1 and "losses, the global batch's" in out


# ------------------------------------------------------------ the words, on made-up ledgers
# (an outsider's planted bugs that the runs above could not tell apart)

def made_up(strategy: str, peak_snapshot: dict, estimate: dict, **extra) -> dict:
    return {"strategy": strategy, "ledger": {"peak": sum(peak_snapshot.values()),
                                             "peak_snapshot": peak_snapshot, "estimate": estimate, **extra}}


@pytest.mark.parametrize("strategy,family", [("ddp", "replicas"), ("zero1", "zero"), ("zero2", "zero"),
                                             ("fsdp", "fsdp"), ("hsdp", "fsdp"), ("fsdp_flat", "fsdp")])
def test_each_strategy_is_explained_in_its_own_words(strategy, family):
    from minishard.cli.report import family as family_of
    assert family_of(strategy) == family
    line = explain(made_up(strategy, {"params": 10, "grads": 30}, {"params": 10, "grads": 10}))[0]
    words = LEFT_OUT[family].get("grads", NOT_MODELLED)
    assert f"grads +20 ({words})" in line
    if family == "zero":
        assert "unit" not in line                          # FSDP's words are FSDP's


def test_a_category_the_formula_does_not_know_is_said_so_and_a_missing_tier_byte_too():
    line = explain(made_up("fsdp", {"params": 10, "mystery": 7}, {"params": 10}))[0]
    assert f"mystery +7 ({NOT_MODELLED})" in line
    r = made_up("fsdp", {"params": 10}, {"params": 10},
                formula={"device": {"params": 10}, "host": {"exp_avg": 8, "exp_avg_sq": 8}},
                by_device={"host": {"exp_avg": 9, "exp_avg_sq": 7}})
    host = explain(r)[1]
    assert f"exp_avg +1 ({NOT_MODELLED})" in host and "exp_avg_sq -1 (not allocated)" in host


def test_the_formula_says_how_many_replica_groups():
    from minishard.cli.report import formula_words
    results = [{"strategy": "hsdp", "world_size": 6, "ledger": {"shard_group": 2}}]
    words = formula_words(results, SimpleNamespace(precision="fp32", optimizer="adamw"))
    assert "sharded over 2 ranks (--shard-size 2; replicated across 3 groups)" in words


def test_every_knob_is_accepted_by_every_strategy_that_reads_it():
    from minishard import strategies
    from minishard.training.config import KNOBS
    values = {"bucket_cap_mb": 4.0, "wrap": "linear", "reshard_after_forward": False, "reshard_root": True,
              "prefetch": 1, "accumulation": "no_sync", "shard_size": 1, "offload": "host",
              "prefetch_bucket_size": 10**6, "max_live_parameters": 10**6, "param_persistence_threshold": 100,
              "quantized_weights": True, "quantized_gradients": True}
    assert set(values) == set(KNOBS)
    accepted = 0
    for name, (reads, _) in KNOBS.items():
        for s in strategies.STRATEGIES.values():
            if reads(s):
                assert TrainConfig(strategy=s.name, **{name: values[name]}).unused() == [], (name, s.name)
                accepted += 1
    assert accepted >= len(KNOBS)


def test_the_knobs_only_fsdp_and_deepspeeds_zero_read_are_refused_or_named_for_every_other_strategy():
    """Written out by hand, not read from ``KNOBS`` (a test reading the table could never
    disagree with it): under any other strategy, PyTorch's FSDP2 included, each of these knobs
    is refused or listed as unused — never silently ignored. (DeepSpeed's ZeRO reads two of
    them as its own settings: offload as offload_optimizer, the ZeRO-3 bounds at its stage 3.)"""
    from minishard import strategies
    from minishard.training.config import ConfigError
    ours = {"fsdp", "fsdp_flat", "hsdp"}
    deepspeed = {"deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"}
    knobs = {"reshard_root": (True, ours), "quantized_weights": (True, ours),
             "quantized_gradients": (True, ours), "offload": ("host", ours | deepspeed),
             "prefetch_bucket_size": (10**6, ours | {"deepspeed_zero3"}),
             "max_live_parameters": (10**6, ours | {"deepspeed_zero3"}),
             "param_persistence_threshold": (100, ours | {"deepspeed_zero3"})}
    for name, (value, readers) in knobs.items():
        for s in strategies.STRATEGIES:
            try:
                unused = TrainConfig(strategy=s, **{name: value}).unused()
            except ConfigError as e:
                assert s not in readers and name in str(e), (name, s, str(e))
                continue
            assert (unused == []) == (s in readers), (name, s, unused)


def test_the_resume_line_says_a_change_of_strategy_on_as_many_ranks():
    from minishard.cli.report import checkpoint_lines
    results = [{"world_size": 2, "strategy": "zero1",
                "checkpoint": {"load": {"step": 3, "saved_world_size": 2, "saved_strategy": "fsdp",
                                        "bytes_read": 10}}} for _ in range(2)]
    line = checkpoint_lines(results, SimpleNamespace(resume="ck", save=None))[0]
    assert line == "resumed ck at step 3: resharded 2 → 2 ranks, fsdp → zero1 (20 bytes read by 2 ranks)"
    results[0]["checkpoint"]["load"]["saved_strategy"] = "zero1"
    assert "nothing resharded" in checkpoint_lines(results, SimpleNamespace(resume="ck", save=None))[0]


def test_json_says_null_for_a_wait_that_was_not_measured():
    from minishard.cli.report import summary
    rank = {"rank": 0, "losses": [1.0], "wire": [8], "wchar": [8], "calls": [1], "step_times": [0.1],
            "exposed_comm": [0.0], "by_op": {}, "strategy": "ddp", "world_size": 1, "n_params": 2}
    assert summary([{**rank, "exposed_comm_measured": False}])["ranks"][0]["exposed_comm"] is None
    assert summary([{**rank, "exposed_comm_measured": True}])["ranks"][0]["exposed_comm"] == [0.0]


def test_a_watched_pytorch_run_reports_what_the_watch_measured():
    """PyTorch's own strategies have no ledger; under the watch (``trace`` on) the report shows
    its peak by category and the bytes sent, and says there is no formula; unwatched, it says so."""
    from minishard.cli.report import table
    MiB = 2 ** 20
    watched = {"rank": 0, "strategy": "torch_fsdp", "wire": [0, 0],
               "watched": {"peak": 3 * MiB, "peak_snapshot": {"params": MiB, "activations": 2 * MiB},
                           "wire": [5, 1_170_560]}}
    line = "\n".join(table([watched]))
    assert ("watched: peak 3.00 MiB = params 1.00, activations 2.00; sent/step 1,170,560 B by the "
            "ring model; no formula") in line
    assert "peak - formula" not in line                      # nothing to explain without a formula
    plain = {k: v for k, v in watched.items() if k != "watched"}
    assert "not instrumented" in "\n".join(table([plain]))


def test_the_waited_column_is_the_last_steps_wait_in_milliseconds():
    """The meter measures waits in seconds; the column is headed "waited ms". A last step that
    waited 12.5 ms (0.0125 s; the first step's 0.1 s is not the one shown) must read 12.5 there,
    not 12500.0."""
    from minishard.cli.report import table
    r = {"rank": 0, "strategy": "fsdp", "wire": [64, 128], "exposed_comm": [0.1, 0.0125],
         **made_up("fsdp", {"params": 2 ** 20}, {"params": 2 ** 20})}
    head, row = table([r])[1:3]
    assert head.split()[-2:] == ["waited", "ms"]
    assert row.split()[-2:] == ["128", "12.5"], row


def test_frozen_parameters_are_left_out_of_the_formula_as_they_are_out_of_the_ledger():
    """A frozen parameter has no gradient and no optimizer state: the formula the run is set
    beside counts the trainable parameters' only, and agrees with the ledger byte for byte."""
    kw = dict(strategy="single", track_activations=False, **NANO)
    frozen = train(None, TrainConfig(freeze=("blocks.0",), **kw))["ledger"]
    whole = train(None, TrainConfig(**kw))["ledger"]
    assert state(frozen["final"]) == state(frozen["estimate"])
    assert frozen["estimate"]["grads"] < whole["estimate"]["grads"]          # blocks.0 has none
    assert frozen["estimate"]["params"] == whole["estimate"]["params"]       # but its weights


def test_a_loss_chunk_longer_than_the_micro_batch_is_said_at_the_micro_batchs_tokens():
    """What backward recomputes of a chunked loss is one chunk's log-probabilities (fp32, one per
    vocabulary entry and token); a chunk cannot hold more tokens than the micro-batch has."""
    from minishard.core.model import config as model_config
    cfg = model_config("nano")
    for chunk, tokens in ((cfg.seq_len // 2, cfg.seq_len // 2), (10 * cfg.seq_len, cfg.seq_len)):
        led = train(None, TrainConfig(strategy="single", model="nano", steps=1, micro_batch=1,
                                      loss_chunk_tokens=chunk))["ledger"]
        assert led["unseen"] == {"one loss chunk's log-probabilities, while backward recomputes them":
                                 tokens * cfg.vocab_size * 4}, chunk


def test_a_diverged_loss_states_no_resolution_instead_of_raising():
    """A loss that went to infinity (or NaN) has no spacing to state: the progress line, which
    asks after every step, must not crash the run that is diverging."""
    from minishard.training.report import loss_resolution
    bf16 = TrainConfig(precision="bf16_mixed")
    assert loss_resolution(float("inf"), bf16) == 0.0
    assert loss_resolution(float("-inf"), bf16) == 0.0
    assert loss_resolution(float("nan"), bf16) == 0.0
    assert loss_resolution(8.0, bf16) == 2 ** -7 * 8       # bf16: 8 significant bits
