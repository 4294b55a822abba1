"""The command line reaches every chapter: the README's torchrun line for each chapter runs, on 2
ranks, and reports bytes and ledgers that agree with the formulas; a checkpoint saved on 2 ranks
resumes on 3 where an uninterrupted run would be; the README's two-node example runs as two
torchrun agents; ``ledger`` and ``plan`` read real model configs; bad input stops with one line
before any rank starts."""
import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minishard import strategies
from minishard.core import trace
from minishard.cli import main
from minishard.planner.analytic import estimate, gpt_activation_bytes
from minishard.core.model import GPT, config

ROOT = Path(__file__).resolve().parents[1]
NANO = GPT("nano", device="meta")
PSI = NANO.num_params()
ROOT_PARAMS = sum(p.numel() for n, p in NANO.named_parameters() if not n.startswith("blocks."))


# what the comment above the README's chapter lines says these tests change, word for word
CHAPTERS_STAND_IN = ("run these lines on 2 ranks where it says 4, on 3 where it says 3, with "
                     "`--model nano --steps 2` (09: micro-batches of 3 and 2, the same global batch)")


def readme_recipes() -> dict[str, list[str]]:
    """Chapter -> the demo's arguments, from the README's one-line-per-chapter block."""
    text = (ROOT / "README.md").read_text()
    assert CHAPTERS_STAND_IN in text[:text.index("# 02 DDP")].splitlines()[-2]
    block = text[text.index("# 02 DDP"):]
    block = block[:block.index("```")]
    out, chapter = {}, None
    for line in block.splitlines():
        if line.startswith("# "):
            chapter = line[2:4]
        elif line.startswith("torchrun"):
            args = shlex.split(line)
            out.setdefault(chapter, []).append(args[args.index("demo") + 1:])
    return out


def demo(args: list[str], n: int, tmp: Path, pools, capsys, **extra) -> dict:
    """Run ``minishard demo`` on ``n`` of the session's warm ranks (what ``torchrun
    --nproc-per-node n -m minishard demo`` runs, started once for the whole suite); the JSON
    summary it printed. Torchrun itself is under test in the two-node test below."""
    args = [str(tmp / a) if a.startswith(("traces/", "ckpt/", "release/")) else a for a in args]
    argv = ["demo", *args, "--model", "nano", "--json", "--world-size", str(n),
            *[x for k, v in extra.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
    capsys.readouterr()
    status = main(argv, pools=pools)
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def expected_wire(args: list[str], n: int) -> int:
    """Bytes one rank sends per step, from the ring formulas (fp32 unless bf16 gradients)."""
    s = args[args.index("--strategy") + 1]
    ring = (n - 1) * 4 * PSI // n                                 # one pass of fp32 parameters
    accum = int(args[args.index("--accum") + 1]) if "--accum" in args else 1
    norm = 2 * (n - 1) * 8 // n if "--clip" in args and s.startswith("zero") else 0   # ZeRO: one float64
    if s == "zero1" and "bf16_mixed" in args:
        return ring + norm                                        # bf16 gradients and parameters
    if s == "zero2":                      # a reduce-scatter per micro-batch, one all-gather
        return (accum + 1) * ring + norm
    if s in ("ddp", "zero1", "hsdp") or "--no-reshard-after-forward" in args:
        return 2 * ring + norm if s != "hsdp" else None
    if "--reshard-root" in args:
        return 3 * ring                                           # the textbook 1.5x
    return 3 * ring - (n - 1) * 4 * ROOT_PARAMS // n              # FSDP2 keeps the root gathered


def test_every_chapters_readme_line_runs_and_agrees_with_the_formulas(tmp_path, pools, capsys):
    recipes = readme_recipes()
    assert sorted(recipes) == [f"{c:02d}" for c in range(2, 11)]
    lines = {chapter: runs[0] for chapter, runs in recipes.items() if chapter != "09"}   # 09: next test
    assert all(len(recipes[c]) == 1 for c in lines)
    for chapter, args in lines.items():
        out = demo(args, 2, tmp_path, pools, capsys, steps=2)
        assert out["world_size"] == 2 and len(out["losses"]) == 2, chapter
        want = expected_wire(args, 2)
        for r in out["ranks"]:
            if want is not None:
                assert r["wire"] == [want, want], (chapter, r["wire"], want)
            assert 0 <= r["wchar"][-1] - r["wire"][-1] < 16384, chapter       # the OS agrees
            # the printed formula is the analytic ledger for this run
            prec = "bf16_mixed" if "bf16_mixed" in args else "fp32"
            strategy = strategies.get(args[args.index("--strategy") + 1])     # (hsdp: groups of 2)
            state = estimate(NANO, world_size=2, strategy=strategy.name,
                             precision=strategy.ledger_precision(prec)).state_bytes
            est = r["estimate"]
            assert sum(v for c, v in est.items() if c != "activations") == state, chapter
            assert est["activations"] == gpt_activation_bytes(config("nano"), 4,
                                                              dtype_bytes=2 if prec == "bf16_mixed" else 4,
                                                              recompute="--recompute" in args)
            if "--offload" in args:                                           # the state, off the device
                assert sum(r["formula"]["host"].values()) == state, chapter
            assert r["peak"] >= state, chapter
        if "--trace" in args:
            events = trace.load(tmp_path / args[args.index("--trace") + 1])
            assert {e["rank"] for e in events} == {0, 1}


def test_save_on_2_ranks_resume_on_3_continues_the_uninterrupted_run(tmp_path, pools, capsys):
    """The same global batch (2 x 3 and 3 x 2 sequences): the steps after the checkpoint give the
    losses an uninterrupted run gives, to float32 rounding."""
    (save, resume), = [readme_recipes()["09"]]
    whole = demo(save[:save.index("--save")], 2, tmp_path, pools, capsys, steps=4, micro_batch=3)
    demo(save, 2, tmp_path, pools, capsys, steps=2, micro_batch=3)
    after = demo(resume, 3, tmp_path, pools, capsys, steps=2, micro_batch=2)
    assert [r["checkpoint"]["load"]["step"] for r in after["ranks"]] == [2, 2, 2]
    # Not bit for bit: 3 ranks of 2 sequences sum the same numbers as 2 ranks of 3 in another
    # grouping (each rank's mean loss over its tokens, the gradients' all-reduce), and a float32
    # sum of n terms rounds by at most about n·eps of its magnitude. The longest sums in a loss
    # are the mean over a rank's 3 x seq_len tokens and each token's softmax over the vocabulary;
    # the second step starts from parameters that differ by that rounding times the learning
    # rate, far less. The bound is 7e-5 of the loss (measured: 4e-8); a resume from another
    # step's weights or batch moves a loss by a step's change, 9e-4 to 7e-3 of it here.
    nano = config("nano")
    rtol = torch.finfo(torch.float32).eps * (3 * nano.seq_len + nano.vocab_size)
    for got, want in zip(after["losses"], whole["losses"][2:]):
        assert abs(got - want) <= rtol * abs(want), (after["losses"], whole["losses"], rtol)
    release = tmp_path / resume[resume.index("--export") + 1]
    assert (release / "model.safetensors.index.json").exists()


def cli(pools, capsys, *args: str) -> str:
    """``python -m minishard ...`` as a user runs it, here on the session's warm ranks: what it
    printed (the progress lines too: the ranks report each step to the command, which prints it)."""
    capsys.readouterr()
    status = main(list(args), pools=pools)
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    return out


def test_the_progress_line_and_the_tables(pools, capsys, tmp_path):
    out = cli(pools, capsys, "demo", "--world-size", "2", "--strategy", "zero3", "--steps", "2",
              "--model", "nano", "--trace", str(tmp_path / "t"))
    assert re.search(r"^step   2/2  loss \d+\.\d{4} .* ms  peak .* MiB$", out, re.M)
    assert "minishard demo: strategy=fsdp world_size=2 model=nano params=217,664" in out
    assert "peak - formula" in out and "(gathered units)" in out
    assert (tmp_path / "t" / "trace.json").exists()
    quiet = cli(pools, capsys, "demo", "--world-size", "1", "--strategy", "single", "--steps", "1",
                "--model", "nano", "--quiet")
    assert "minishard demo:" in quiet and not re.search(r"^step ", quiet, re.M)


@pytest.mark.parametrize("config_file, n_params", [("llama3-8b.json", 8_030_261_248),
                                                   ("qwen2-7b.json", 7_615_616_512),
                                                   ("gpt2.json", 124_439_808)])
def test_real_configs_give_the_published_parameter_counts(config_file, n_params, capsys):
    path = str(ROOT / "configs" / config_file)
    assert main(["ledger", "--config", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_params"] == n_params
    assert main(["plan", "--config", path, "--json", "--seq-len", "1024"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans["n_params"] == n_params and set(plans["plans"]) == {"ddp", "zero1", "zero2", "fsdp"}
    assert main(["plan", "--config", path, "--seq-len", "1024"]) == 0
    assert "GiB/GPU" in capsys.readouterr().out


@pytest.mark.parametrize("strategy, nodes, inter", [("fsdp", 2, "ethernet-100g"), ("ddp", 1, "ib-ndr-400"),
                                                  ("zero1", 1, "ib-ndr-400")])
def test_plan_gives_the_widgets_advice(strategy, nodes, inter, capsys):
    """``minishard plan`` words the same advice as the chapter 10 widget, sentence for sentence."""
    pytest.importorskip("ipywidgets")
    from minishard.viz.planner import PlannerWidget
    pw = PlannerWidget(model="llama3-70b", strategy=strategy, nodes=nodes, inter=inter,
                       recompute=False, seq_len=4096)
    assert main(["plan", "--model", "llama3-70b", "--nodes", str(nodes), "--inter", inter,
                 "--no-recompute", "--seq-len", "4096", "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)["plans"][strategy]["advice"]
    assert advice == pw.hints and advice and all(advice)


def test_plan_offload_host_plans_the_state_in_host_memory(capsys):
    """``plan --offload host`` asks the planner what the widget's offload box asks: the same
    plan (the state off the device, its PCIe bytes counted) and the same advice."""
    pytest.importorskip("ipywidgets")
    from minishard.viz.planner import PlannerWidget
    argv = ["plan", "--model", "llama3-70b", "--seq-len", "4096", "--json"]
    plans = {}
    for extra in ([], ["--offload", "host"]):
        assert main([*argv, *extra]) == 0
        plans[bool(extra)] = json.loads(capsys.readouterr().out)["plans"]["fsdp"]
    on, off = plans[False], plans[True]
    assert on["transfer_bytes"] == 0 < off["transfer_bytes"]
    assert off["total_memory"] < on["total_memory"] and off["fits"] and not on["fits"]
    pw = PlannerWidget(model="llama3-70b", strategy="fsdp", seq_len=4096, offload="host")
    assert off["advice"] == pw.hints and off["total_memory"] == pw.plan.total_memory


QWEN2 = ROOT / "configs" / "qwen2-7b.json"


def plan_out(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_plan_states_the_sequence_length_and_takes_the_configs_only_when_asked(capsys):
    """Qwen2's config allows far more positions than a model is trained at: plan models the
    training length (and says so), and the config's maximum only on ``--seq-len config``."""
    from minishard.cli.plan import TRAINING_SEQ_LEN
    longest = json.loads(QWEN2.read_text())["max_position_embeddings"]
    assert longest > TRAINING_SEQ_LEN                      # the case the default is for
    default = json.loads(plan_out(capsys, "--config", str(QWEN2), "--json"))
    assert default["seq_len"] == TRAINING_SEQ_LEN
    assert all(p["tokens_per_rank"] == TRAINING_SEQ_LEN for p in default["plans"].values())
    assert any(p["fits"] for p in default["plans"].values())
    text = plan_out(capsys, "--config", str(QWEN2))
    assert f"sequence length {TRAINING_SEQ_LEN:,} tokens" in text and f"{longest:,}" in text
    assert f"sequences of {TRAINING_SEQ_LEN:,} tokens" in (ROOT / "README.md").read_text()   # documented
    asked = json.loads(plan_out(capsys, "--config", str(QWEN2), "--seq-len", "config", "--json"))
    assert asked["seq_len"] == longest
    assert f"sequence length {longest:,} tokens" in plan_out(capsys, "--config", str(QWEN2), "--seq-len", "config")
    # a learned position table (GPT-2's) keeps its size whatever the sequence: the count is exact
    gpt2 = ROOT / "configs" / "gpt2.json"
    positions = json.loads(gpt2.read_text())["n_positions"]
    counts = {json.loads(plan_out(capsys, "--config", str(gpt2), "--seq-len", str(n), "--json"))["n_params"]
              for n in (positions // 2, positions)}
    assert len(counts) == 1


@pytest.mark.parametrize("seq_len, message", [("0", "--seq-len takes a positive number"),
                                              ("long", "--seq-len takes a positive number"),
                                              ("2048", "learned positions")])
def test_plan_refuses_a_sequence_length_it_cannot_model(seq_len, message, capsys):
    assert main(["plan", "--config", str(ROOT / "configs" / "gpt2.json"), "--seq-len", seq_len]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_plan_table_columns_and_advice_printed_once(capsys):
    """Every heading is its own word (``activations`` and ``comm_buffers`` once ran together),
    each row has a figure under each heading, and a sentence that holds for several strategies
    is printed once; "faster" follows the two times the sentence compares."""
    for argv in (["--seq-len", "config"], ["--cluster", "h100-2nodes-ethernet"]):
        plans = json.loads(plan_out(capsys, "--config", str(QWEN2), *argv, "--json"))["plans"]
        text = plan_out(capsys, "--config", str(QWEN2), *argv).splitlines()
        cats = list(dict.fromkeys(c for p in plans.values() for c in p["memory"]))
        head = next(i for i, line in enumerate(text) if line.startswith("strategy"))
        assert text[head].split() == ["strategy", *cats, "GiB/GPU", "fits", "s/step", "tok/s/GPU", "waiting"]
        assert re.fullmatch(r"\S+(?: {2,}\S+)+", text[head].rstrip()), text[head]   # two spaces at least
        for name, line in zip(plans, text[head + 1:head + 1 + len(plans)]):
            assert line.split()[0] == name and len(line.split()) == len(text[head].split())
        advice = [line for line in text if line.startswith(" - ")]
        sentences = [line.split(": ", 1)[1] for line in advice]
        assert len(sentences) == len(set(sentences))
        assert set(sentences) == {h for p in plans.values() for h in p["advice"]}
        for line in advice:                      # each sentence names exactly the strategies it holds for
            who, sentence = line[3:].split(": ", 1)
            holds = {n for n, p in plans.items() if sentence in p["advice"]}
            assert (who == "every strategy") == (holds == set(plans)), line
            if who != "every strategy":
                assert set(who.split(", ")) == holds, line
        if argv[0] == "--seq-len":               # the long sequence: advice shared by strategies
            assert any(sum(s in p["advice"] for p in plans.values()) > 1 for s in sentences)
        for line in advice:
            m = re.search(r"is (faster|about as fast) \((\d+\.\d+) s a step against (\d+\.\d+) s\)", line)
            if m:
                assert (m.group(1) == "faster") == (float(m.group(2)) < float(m.group(3))), line


def test_plan_gives_the_devices_memory_in_gib(capsys):
    from minishard.planner.costmodel import DEVICES
    first = plan_out(capsys).splitlines()[0]
    gib = DEVICES["h100-80gb"].memory / 2**30
    assert f"({gib:.1f} GiB each" in first, first


def test_plan_device_memory_is_read_in_gib(capsys):
    """``--device-memory 40`` is 40 GiB (the unit its help names):
    40 * 2**30 bytes. Read as decimal GB it would plan a device 7% smaller than the one asked."""
    cluster = json.loads(plan_out(capsys, "--device-memory", "40", "--json"))["cluster"]
    assert cluster["device_memory"] == 40 * 2**30
    assert "(40.0 GiB each" in plan_out(capsys, "--device-memory", "40").splitlines()[0]

@pytest.mark.parametrize("nodes", [1, 2])
def test_plan_names_the_link_between_nodes_only_when_there_are_nodes(nodes, capsys):
    from minishard.planner.costmodel import LINKS
    inter = LINKS["ethernet-100g"].name
    text = plan_out(capsys, "--nodes", str(nodes), "--inter", "ethernet-100g")
    assert (inter in text.splitlines()[0]) == (nodes > 1)
    cluster = json.loads(plan_out(capsys, "--nodes", str(nodes), "--inter", "ethernet-100g", "--json"))["cluster"]
    assert cluster["inter"] == (inter if nodes > 1 else None)


def test_ledger_prints_binary_units_with_the_decimal_figure(capsys):
    est = estimate(GPT(config("llama3-8b"), device="meta"), world_size=8, strategy="zero3")
    assert main(["ledger", "--world-size", "8", "--strategy", "zero3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[2:]}
    for cat, nbytes in [*est.per_rank.items(), ("total", est.total)]:
        assert rows[cat].split()[1:5] == [f"{nbytes / 2**30:.3f}", "GiB", f"({nbytes / 1e9:.3f}", "GB)"], rows[cat]


@pytest.mark.parametrize("argv, message", [
    (["demo", "--strategy", "zero4"], "--strategy zero4: unknown strategy; expected one of"),
    (["demo", "--prefetch", "-1"], "--prefetch -1: must be an integer >= 0"),
    (["demo", "--strategy", "hsdp", "--world-size", "3"], "does not divide the world size 3"),
    (["demo", "--resume", "/nonexistent/ckpt"], "no such checkpoint directory"),
    (["demo", "--offload", "host", "--strategy", "ddp"], "--offload host applies to an FSDP strategy"),
    (["ledger", "--model", "gpt-9"], "--model gpt-9: no such built-in model"),
    (["ledger", "--config", "/nonexistent/config.json"], "no model config at"),
    (["plan", "--device-memory", "-3"], "--device-memory must be a positive"),
])
def test_bad_input_stops_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_freeze_a_prefix_some_parameters_share_trains_the_rest(tmp_path, pools, capsys):
    """``--freeze blocks.0.`` names the first block's parameters (not every parameter of the
    model): the demo must accept it and train without gradients or Adam moments for them, the
    rest at 4 bytes per parameter each."""
    frozen = sum(p.numel() for n, p in NANO.named_parameters() if n.startswith("blocks.0."))
    assert 0 < frozen < PSI
    got = demo(["--strategy", "single", "--steps", "1", "--freeze", "blocks.0."], 1, tmp_path, pools, capsys)
    held = got["ranks"][0]["by_device"]["device"]
    assert held["params"] == 4 * PSI
    assert held["grads"] == held["exp_avg"] == held["exp_avg_sq"] == 4 * (PSI - frozen), held

def test_a_checkpoint_of_another_model_is_refused_before_training(tmp_path, capsys):
    assert main(["demo", "--world-size", "1", "--strategy", "single", "--steps", "1", "--model", "nano",
                 "--quiet", "--save", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    assert main(["demo", "--world-size", "1", "--strategy", "single", "--model", "tiny",
                 "--resume", str(tmp_path / "ck")]) == 2
    assert "holds another model" in capsys.readouterr().err


def test_unknown_architectures_name_the_missing_fields(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["ledger", "--config", str(tmp_path)]) == 2
    assert "lacks num_hidden_layers, num_attention_heads, intermediate_size, vocab_size" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    assert main(["ledger", "--config", str(tmp_path)]) == 2
    assert "model_type 'mamba' is not one minishard builds exactly" in capsys.readouterr().err


def test_every_option_has_help():
    from minishard.cli import parser
    p = parser()
    for action in p._subparsers._group_actions[0].choices.values():
        for a in action._actions:
            assert a.help, f"{action.prog} {a.option_strings or a.dest} has no help"


def readme_two_nodes() -> tuple[list[list[str]], str]:
    """The README's two-node example: its torchrun commands (words) and the comment above it."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "--nnodes 2" in line)
    fence = max(i for i in range(start) if lines[i] == "```bash")
    end = lines.index("```", start)
    code = "\n".join(lines[fence + 1:end]).replace("\\\n", " ")       # continuation lines joined
    commands = [shlex.split(c, comments=True) for c in code.splitlines() if not c.startswith("#")]
    return commands, lines[fence - 1]


# what the comment above the README's example says this test changes, word for word
TWO_NODES_STAND_IN = ("runs these lines on 127.0.0.1 with 2 processes a node and --shard-size 2, "
                      "the resume on 3 processes, with `--model nano --steps 2`")


def test_two_torchrun_agents_as_two_nodes(tmp_path):
    """The README's multi-node example on one machine: two torchrun agents (--nnodes 2), c10d
    rendezvous on 127.0.0.1, hybrid sharding across the two "nodes", a checkpoint saved; then one
    agent resumes it on 3 processes, resharded on load. The one test here that starts torchrun:
    the others run the same command lines on warm ranks."""
    (save, resume), comment = readme_two_nodes()
    assert "tests/test_cli.py::test_two_torchrun_agents_as_two_nodes" in comment
    assert TWO_NODES_STAND_IN in comment
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def smallest(words: list[str], nproc: int) -> list[str]:
        words = [f"127.0.0.1:{port}" if w.startswith("HOST:") else w for w in words]
        words = [str(tmp_path / w.lstrip("/")) if w.startswith("/shared/") else w for w in words]
        words[words.index("--nproc-per-node") + 1] = str(nproc)
        if "--shard-size" in words:
            words[words.index("--shard-size") + 1] = "2"
        # torchrun is torch.distributed.run: the venv's, whatever is first on PATH
        return [sys.executable, "-m", "torch.distributed.run", *words[1:], "--model", "nano", "--steps", "2"]

    assert "--save" in save and "--resume" in resume and save[save.index("--nnodes") + 1] == "2"
    agents = [subprocess.Popen(smallest(save, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=240) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    printed = "".join(o for o, _ in outs)
    assert "strategy=hsdp world_size=4" in printed and "saved step 2 to" in printed and "(4 ranks" in printed
    one = subprocess.run(smallest(resume, 3), capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "world_size=3" in one.stdout and "at step 2:" in one.stdout and "read by 3 ranks" in one.stdout, one.stdout
