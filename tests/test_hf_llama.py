"""A Hugging Face model as a user's own job: a ``transformers`` Llama built from a small config
(``tests/hf_tasks.py``; nothing downloaded) under PyTorch's DDP, FSDP2 (``fully_shard`` per
decoder layer, then the root) and DeepSpeed ZeRO-3, each watched on 2 warm ranks into a trace
directory.

The units carry HF's module names — FSDP2's the modules ``fully_shard`` was called on
(``model.layers.0``, ``model.layers.1``, ``root``), ZeRO-3's the submodules whose parameters it
gathers (``model.layers.0.self_attn.q_proj``, …) — each collective is recorded with the bytes the
model's parameters make, ``minishard view`` replays each trace, and the doctor finds nothing on
the healthy runs. A rank SIGKILLed mid-backward (ZeRO-3 and FSDP2, each in a pool of its own) is
named by the doctor: the rank, its last collective (by unit name) and the user's line.

The three healthy jobs run in one pool task (``hf_tasks.healthy``), shared by every test here.
"""
import json
import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from minishard.cli import main
from minishard.core.launch import RankError, Ranks
from minishard.core.trace import read_events
from minishard.instruments import doctor

import hf_tasks
from hf_tasks import DYING, JOBS, STEP, STEPS

TIMEOUT_S = 5          # the collective timeout of the dying runs' own pools
LAYERS = ("model.layers.0", "model.layers.1")
# each decoder layer's parameters by submodule (hidden 64, MLP 128, 2 KV heads of 16), in elements
LAYER = {"self_attn.q_proj": 64 * 64, "self_attn.k_proj": 64 * 32, "self_attn.v_proj": 64 * 32,
         "self_attn.o_proj": 64 * 64, "mlp.gate_proj": 64 * 128, "mlp.up_proj": 64 * 128,
         "mlp.down_proj": 128 * 64, "input_layernorm": 64, "post_attention_layernorm": 64}
SIZES = {"model.embed_tokens": hf_tasks.VOCAB * 64, "model.norm": 64, "lm_head": hf_tasks.VOCAB * 64,
         **{f"{layer}.{m}": n for layer in LAYERS for m, n in LAYER.items()}}
# the modules that own parameters, by HF's names: ZeRO-3's units
OWNERS = set(SIZES)


def _param_bytes(prefix: str = "") -> int:
    """fp32 bytes of the parameters of the modules under ``prefix`` (all of them: "")."""
    return 4 * sum(n for name, n in SIZES.items() if name.startswith(prefix + ".") or name == prefix or not prefix)


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory):
    """The three healthy jobs, one pool task: ({job: trace directory}, {job: [losses per rank]})."""
    base = tmp_path_factory.mktemp("hf_llama")
    outs = {job: str(base / job) for job in JOBS}
    results = pools(2).run(hf_tasks.healthy, outs)
    return {job: Path(d) for job, d in outs.items()}, {job: [r[job] for r in results] for job in JOBS}


def _events(out: Path, rank: int = 0) -> list[dict]:
    return read_events(out / f"rank{rank}.jsonl")[0]


def _collectives(out: Path, rank: int = 0) -> list[dict]:
    return [e for e in _events(out, rank) if e["kind"] == "collective"]


def test_the_three_jobs_train_the_same_llama(runs):
    """Same weights, same batches, same AdamW: the losses agree across DDP, FSDP2 and ZeRO-3
    (the watch changes nothing); ranks draw different batches."""
    _, losses = runs
    for job in JOBS:
        for rank in (0, 1):
            assert losses[job][rank] == pytest.approx(losses["ddp"][rank], abs=1e-5), (job, losses)
        assert len(losses[job][0]) == STEPS and losses[job][0] != losses[job][1]


def test_ddp_buckets_reduce_every_parameter_byte(runs):
    outs, _ = runs
    for rank in (0, 1):
        calls = _collectives(outs["ddp"], rank)
        assert {(c["op"], c["tag"][:6]) for c in calls} == {("all_reduce", "bucket")}, calls
        for step in range(STEPS):
            assert sum(c["payload"] for c in calls if c["step"] == step) == _param_bytes()


def test_fsdp2_units_are_the_decoder_layers_and_the_root_by_hf_names(runs):
    """One unit per ``fully_shard`` call, named as HF names the module; each layer gathered in
    forward and again in backward, the root once; every unit's gradients reduce-scattered; the
    payloads are each unit's parameter bytes (the root: the embeddings, the final norm and
    lm_head)."""
    outs, _ = runs
    events = _events(outs["fsdp2"])
    units = {e["name"] for e in events if e["kind"] == "unit"}
    assert units == {*LAYERS, "root"}, units
    calls = Counter((c["step"], c["op"], c["tag"], c["payload"]) for c in _collectives(outs["fsdp2"]))
    root = _param_bytes() - 2 * _param_bytes("model.layers.0")
    want = Counter()
    for step in range(STEPS):
        for layer in LAYERS:
            want[(step, "all_gather", layer, _param_bytes(layer))] = 2
            want[(step, "reduce_scatter", layer, _param_bytes(layer))] = 1
        want[(step, "all_gather", "root", root)] = 1
        want[(step, "reduce_scatter", "root", root)] = 1
    assert calls == want
    last = {}
    for e in events:
        if e["kind"] == "unit":
            last[e["name"]] = e["state"]
    assert last == {u: "sharded" for u in units}


def test_deepspeed_zero3_units_are_hfs_submodule_names(runs):
    """ZeRO-3 gathers each submodule's own parameters before it runs: every module of the Llama
    that owns parameters is a unit, by HF's name, gathered in forward and again in backward with
    exactly its parameters' bytes (no prefetch: one gather, one unit); the gradients are
    reduce-scattered, all of them, in one bucket."""
    outs, _ = runs
    for rank in (0, 1):
        calls = _collectives(outs["zero3"], rank)
        gathers = Counter((c["step"], c["tag"], c["payload"]) for c in calls if c["op"] == "all_gather")
        assert gathers == Counter({(step, owner, _param_bytes(owner)): 2
                                   for step in range(STEPS) for owner in OWNERS})
        for step in range(STEPS):
            scattered = [c for c in calls if c["step"] == step and c["op"] == "reduce_scatter"]
            assert sum(c["payload"] for c in scattered) == _param_bytes(), scattered
        gathered = [e for e in _events(outs["zero3"], rank) if e["kind"] == "unit" and e["state"] == "unsharded"]
        assert OWNERS <= {e["name"] for e in gathered}


def test_deepspeed_zero3_units_are_the_parameters_owners_and_end_each_step_sharded(runs):
    """The units ZeRO-3 draws are the modules whose parameters it gathers, and none is left
    gathered when the step ends (DeepSpeed has released them all: every parameter NOT_AVAILABLE)."""
    outs, _ = runs
    for rank in (0, 1):
        state = {}
        for e in _events(outs["zero3"], rank):
            if e["kind"] == "unit":
                state[e["name"]] = e["state"]
            elif e["kind"] == "phase" and e["name"] == "step" and e["edge"] == "end":
                assert state == {u: "sharded" for u in OWNERS}, state


def test_deepspeed_collectives_are_placed_at_the_deepspeed_line_that_issued_them(runs):
    """The flight recorder's ``where`` of a DeepSpeed collective is DeepSpeed's own line (the
    doctor prints it beside the user's line); a decorator's wrapper says nothing."""
    outs, _ = runs
    entries = json.loads((outs["zero3"] / "flight_rank0.json").read_text())["entries"]
    wheres = Counter(e["where"].rsplit("site-packages/", 1)[-1] for e in entries)
    assert all(w.startswith("deepspeed/") and "wrapped_fn" not in w for w in wheres), wheres


@pytest.mark.parametrize("job", JOBS)
def test_each_trace_replays_and_the_doctor_finds_nothing(runs, job, capsys):
    outs, _ = runs
    out = outs[job]
    assert sorted(p.name for p in out.iterdir()) == [
        "flight_rank0.json", "flight_rank0.ring", "flight_rank1.json", "flight_rank1.ring",
        "rank0.jsonl", "rank1.jsonl"]
    assert main(["view", str(out)]) == 0
    assert (out / "player.html").stat().st_size > 0
    assert doctor.diagnose(out).findings == []
    assert main(["doctor", str(out)]) == 0
    assert "nothing found" in capsys.readouterr().out


def _line(text: str) -> int:
    """The line of ``tests/hf_tasks.py`` that says ``text``."""
    lines = Path(hf_tasks.__file__).read_text().splitlines()
    (n,) = [i + 1 for i, line in enumerate(lines) if line.strip() == text]
    return n


@pytest.mark.parametrize("job", ["zero3", "fsdp2"])
def test_a_rank_killed_mid_backward_is_named_with_its_last_collective(tmp_path, job, capsys):
    """Rank 1 SIGKILLed when the gradient reaches the first decoder layer: its ring says it last
    recorded the second layer's backward (ZeRO-3: a gather of one of ``model.layers.1``'s
    submodules; FSDP2: ``model.layers.1``'s reduce-scatter) and never issued the first layer's,
    in which rank 0 waits; the line is the user's backward."""
    out = tmp_path / "run"
    with Ranks(2, timeout=120, collective_timeout=TIMEOUT_S) as own:
        with pytest.raises(RankError):
            own.run(hf_tasks.train, job, str(out), "sigkill")
    found = {f.kind: f for f in doctor.diagnose(out).findings}
    text = "\n".join(f"{f.kind}: {f.title} | " + " | ".join(f.evidence) for f in found.values())
    died = found["died"]
    assert died.ranks == [DYING], text
    op, unit = ("all_gather", r"model\.layers\.1\.\S+") if job == "zero3" else ("reduce_scatter", r"model\.layers\.1")
    assert re.match(rf"rank {DYING}, the last collective it recorded: seq \d+ {op} of {unit} .*"
                    rf"step {STEP}, phase backward", died.evidence[0]), text
    backward = _line("model.backward(loss)" if job == "zero3" else "loss.backward()")
    assert f"called from tests/hf_tasks.py:{backward} in train" in died.evidence[0], text
    waits = "all_gather of model.layers.0.mlp.down_proj" if job == "zero3" else "reduce_scatter of model.layers.0"
    assert re.fullmatch(rf"rank {DYING} never issued seq \d+ of group 'world' \({re.escape(waits)}\); "
                        rf"rank 0 waits in it", found["hang"].title), text
    assert main(["doctor", str(out)]) == 1
    capsys.readouterr()
