"""Property tests of the command line's input (hypothesis): generated flag combinations for
``minishard demo`` and generated Hugging Face configs for ``minishard ledger --config``.

``tests/test_cli_bad_input.py`` lists the wrong inputs a person thought of; these draw them —
every strategy of the registry with valid and invalid values of the sharding, memory and
training flags, on 1 to 4 ranks — and check what every input must satisfy: it is either run
(exit status 0) or refused with exit status 2 and exactly one line on stderr that names a flag
it was given, before any rank starts. A combination that fails inside a rank (status 1), or is
refused without naming its flag, or after the ranks started, is a wrong input the checks let
through. The configs are checked against the rules of a config.json written out below: a
config is read exactly when it breaks none, and a refusal names a field it broke.

Accepted runs are trained in this process on the session's warm ranks (``main(...,
pools=...)``), one step of the nano model each. Examples are drawn reproducibly
(``derandomize``, no example database) and bounded.
"""
from __future__ import annotations

import json
import re

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minishard import strategies  # noqa: E402
from minishard.cli import main  # noqa: E402


def bounded(n: int):
    """Reproducible (the same examples every run), bounded, no example database written."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def run(argv: list[str], capsys, pools=None) -> tuple[int, str, str]:
    """``minishard ARGV`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        status = main(argv, pools=pools)
    except SystemExit as e:                         # (argparse's refusals)
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


def names(line: str, flag: str) -> bool:
    """The line names ``flag`` itself (``--reshard-after-forward`` is not named by
    ``--no-reshard-after-forward``, nor ``--offload`` by ``--offload-dir``)."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", line) is not None


# ====================================================================== a. minishard demo

# each flag's values: (valid ones, wrong ones: a wrong number, another type, an unknown word);
# () is the flag alone
FLAGS = {
    "--steps": (["1", "2"], ["0", "-1", "abc", "1.5"]),
    "--micro-batch": (["1", "2"], ["0", "-3", "x"]),
    "--accum": (["1", "2"], ["0", "-2"]),
    "--accumulation": (["sync", "no_sync", "gathered"], ["later"]),
    "--prefetch": (["0", "1", "2"], ["-1"]),
    "--reshard-after-forward": ([(), "1", "2"], ["3", "0"]),     # (3: divides few world sizes)
    "--no-reshard-after-forward": ([()], []),
    "--shard-size": (["1", "2"], ["3", "0"]),
    "--quantized-weights": ([(), "8", "4"], ["3", "0"]),
    "--quantized-gradients": ([(), "4"], ["16"]),
    "--offload": (["host", "disk"], ["nvme"]),
    "--offload-dir": (["{tmp}"], []),
    "--bucket-cap-mb": (["25", "0.5"], ["0", "-1", "nan", "inf"]),
    "--precision": (["fp32", "bf16_mixed"], ["fp16"]),
    "--clip": (["1.0"], ["0", "-1", "inf"]),
}
STRATEGY_NAMES = [*strategies.STRATEGIES, "zero3", "zero4"]      # an alias, an unknown name


@st.composite
def demo_argv(draw) -> tuple[list[str], int]:
    """A ``demo`` command line (up to four flags, in a drawn order; a value wrong about one time
    in five) and its world size."""
    argv = ["--strategy", draw(st.sampled_from(STRATEGY_NAMES))]
    flags = draw(st.permutations(sorted(FLAGS)))[:draw(st.integers(0, 4))]
    for flag in flags:
        valid, wrong = FLAGS[flag]
        value = draw(st.sampled_from(wrong if wrong and draw(st.integers(0, 4)) == 4 else valid))
        argv += [flag] if value == () else [flag, value]
        if flag == "--offload" and value == "disk" and "--offload-dir" not in flags and draw(st.booleans()):
            argv += ["--offload-dir", "{tmp}"]
    return argv, draw(st.integers(1, 4))


@pytest.fixture(scope="module")
def offload_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("offload"))


@bounded(150)
@given(case=demo_argv())
@example(case=(["--strategy", "fsdp_flat", "--quantized-weights"], 2))    # (failed in a rank once)
@example(case=(["--strategy", "fsdp", "--accumulation", "no_sync"], 2))   # (ran, its flag read by nothing)
def test_every_demo_flag_combination_runs_or_is_refused_in_one_line(case, pools, capsys, offload_dir):
    drawn, world_size = case
    drawn = [a.format(tmp=offload_dir) for a in drawn]
    given_flags = {a for a in drawn if a.startswith("--")} | {"--world-size"}
    argv = ["demo", "--model", "nano", "--steps", "1", "--json", *drawn, "--world-size", str(world_size)]
    lent = []                                       # the world sizes the command asked ranks for

    def lend(n: int):
        lent.append(n)
        return pools(n)

    status, out, err = run(argv, capsys, lend)
    command = " ".join(argv)
    assert "Traceback" not in err + out, (command, err[-3000:])
    if status == 0:
        assert lent == [world_size] and not err.strip(), (command, err)
        result = json.loads(out)
        assert result["world_size"] == world_size and len(result["losses"]) >= 1, (command, out)
        return
    assert status == 2, f"{command}: exit status {status} (a run that failed, not refused):\n{err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, (command, err)
    assert lines[0].startswith("minishard"), (command, lines[0])
    assert any(names(lines[0], f) for f in given_flags), \
        f"{command}: the refusal names none of its flags {sorted(given_flags)}: {lines[0]}"
    assert not lent, f"{command}: refused after its ranks started: {lines[0]}"


# ====================================================================== b. minishard ledger --config

LLAMA_LIKE = ("llama", "mistral", "qwen2")
REQUIRED = {"llama": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                      "vocab_size"),
            "gpt2": ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions")}
OPTIONAL = {"llama": ("num_key_value_heads", "max_position_embeddings", "head_dim"),
            "gpt2": ("n_inner",)}
# what a damaged field may hold: a wrong size, another type, a valid size that may break a
# divisibility rule, null
ODD = [0, -4, 3, 7, 2.5, 8.0, True, "8", None]


def _family(kind) -> str:
    return "gpt2" if kind == "gpt2" else "llama"


@st.composite
def hf_config(draw) -> dict:
    """A config.json of a family minishard reads (or another model_type), valid as drawn, then
    with up to two fields dropped or given odd values."""
    kind = draw(st.sampled_from([*LLAMA_LIKE, "gpt2", "bert"]))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    width = heads * draw(st.sampled_from([2, 4, 8]))
    layers, vocab = draw(st.integers(1, 4)), draw(st.integers(1, 300))
    if kind == "gpt2":
        d = {"n_embd": width, "n_layer": layers, "n_head": heads, "vocab_size": vocab,
             "n_positions": draw(st.integers(1, 64))}
        if draw(st.booleans()):
            d["n_inner"] = draw(st.sampled_from([None, 4 * width, 3]))
    else:
        d = {"hidden_size": width, "num_hidden_layers": layers, "num_attention_heads": heads,
             "intermediate_size": draw(st.integers(1, 64)), "vocab_size": vocab}
        if draw(st.booleans()):
            divisors = [k for k in (1, 2, 4, 8) if heads % k == 0]
            d["num_key_value_heads"] = draw(st.sampled_from([None, *divisors]))
        if draw(st.booleans()):
            d["max_position_embeddings"] = draw(st.sampled_from([None, 64, 4096]))
        if draw(st.booleans()):
            d["head_dim"] = width // heads
        if draw(st.booleans()):
            d["tie_word_embeddings"] = draw(st.booleans())
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(sorted(d)))
        if draw(st.booleans()):
            del d[key]
        else:
            d[key] = draw(st.sampled_from(ODD + (["false"] if key == "tie_word_embeddings" else [])))
    return {"model_type": kind, **d}


def _size(value) -> bool:
    return type(value) is int and value >= 1


def broken(d: dict) -> set[str]:
    """The fields of ``d`` that break a rule of a config.json minishard builds; empty: it is read.
    (Written from the rules, not from hf_config.py.)"""
    kind = d.get("model_type")
    if kind not in (*LLAMA_LIKE, "gpt2"):
        return {"model_type"}
    family = _family(kind)
    missing = {f for f in REQUIRED[family] if f not in d}
    if missing:
        return missing
    bad = {f for f in REQUIRED[family] if not _size(d[f])}
    bad |= {f for f in OPTIONAL[family] if d.get(f) is not None and not _size(d[f])}
    if d.get("tie_word_embeddings") is not None and type(d["tie_word_embeddings"]) is not bool:
        bad.add("tie_word_embeddings")
    if bad:
        return bad
    width, heads = ("n_embd", "n_head") if family == "gpt2" else ("hidden_size", "num_attention_heads")
    if d[width] % d[heads]:
        return {width, heads}
    if d.get("num_key_value_heads") is not None and d[heads] % d["num_key_value_heads"]:
        return {"num_key_value_heads", heads}
    if d.get("head_dim") is not None and d["head_dim"] != d[width] // d[heads]:
        return {"head_dim"}
    return set()


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 96, "vocab_size": 128}
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 16}


@bounded(120)
@given(d=hf_config())
@example(d=dict(LLAMA, num_hidden_layers=-4))         # (once read as a model of a negative 4 blocks)
@example(d=dict(LLAMA, num_attention_heads=3))
@example(d=dict(LLAMA, num_key_value_heads=3))
@example(d=dict(LLAMA, head_dim=32))                  # (Mistral-Nemo's kind: wider than 64 / 4)
@example(d=dict(LLAMA, tie_word_embeddings="false"))
@example(d=dict(LLAMA, max_position_embeddings=0))
@example(d=dict(GPT2, n_inner=0))
@example(d=dict(GPT2, n_embd=30))
@example(d=dict(GPT2, n_inner=None))
def test_every_hf_config_is_read_or_refused_naming_its_field(d, capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    status, out, err = run(["ledger", "--config", str(path), "--json"], capsys)
    fields = broken(d)
    assert "Traceback" not in err + out, (d, err[-3000:])
    if not fields:
        assert status == 0 and not err, (d, err)
        assert json.loads(out)["n_params"] > 0, (d, out)
        return
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, (d, status, err)
    assert any(re.search(rf"\b{f}\b", lines[0]) for f in fields), \
        f"{d}: the refusal names none of {sorted(fields)}: {lines[0]}"
