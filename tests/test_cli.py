"""The command line reaches every chapter: the README's torchrun line for each chapter runs, on 2
ranks, and reports bytes and ledgers that agree with the formulas; a checkpoint saved on 2 ranks
resumes on 3 exactly where an uninterrupted run would be; ``ledger`` and ``plan`` read real model
configs; bad input stops with one line before any rank starts."""
import json
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from minishard import strategies, trace
from minishard.cli import main
from minishard.analytic import estimate, gpt_activation_bytes
from minishard.model import GPT, config

ROOT = Path(__file__).resolve().parents[1]
NANO = GPT("nano", device="meta")
PSI = NANO.num_params()
ROOT_PARAMS = sum(p.numel() for n, p in NANO.named_parameters() if not n.startswith("blocks."))


def readme_recipes() -> dict[str, list[str]]:
    """Chapter -> the demo's arguments, from the README's one-line-per-chapter block."""
    text = (ROOT / "README.md").read_text()
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


def demo(args: list[str], n: int, tmp: Path, **extra) -> dict:
    """Run ``minishard demo`` under torchrun on ``n`` ranks; the JSON summary rank 0 printed."""
    args = [str(tmp / a) if a.startswith(("traces/", "ckpt/", "release/")) else a for a in args]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "minishard", "demo", *args, "--model", "nano", "--json",
           *[x for k, v in extra.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


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


def test_every_chapters_readme_line_runs_and_agrees_with_the_formulas(tmp_path):
    recipes = readme_recipes()
    assert sorted(recipes) == [f"{c:02d}" for c in range(2, 11)]
    lines = {chapter: runs[0] for chapter, runs in recipes.items() if chapter != "09"}   # 09: next test
    assert all(len(recipes[c]) == 1 for c in lines)
    # three torchrun jobs at a time: a job's ranks spend most of their time starting up and
    # meeting, not computing, so three overlap on two cores in half the time of one by one
    with ThreadPoolExecutor(3) as pool:
        outs = dict(zip(lines, pool.map(lambda args: demo(args, 2, tmp_path, steps=2), lines.values())))
    for chapter, args in lines.items():
        out = outs[chapter]
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


def test_save_on_2_ranks_resume_on_3_continues_the_uninterrupted_run(tmp_path):
    """The same global batch (2 x 3 and 3 x 2 sequences): the steps after the checkpoint give the
    losses an uninterrupted run gives, within 1e-6."""
    (save, resume), = [readme_recipes()["09"]]
    with ThreadPoolExecutor(2) as pool:              # the uninterrupted run beside the saving one
        uninterrupted = pool.submit(demo, save[:save.index("--save")], 2, tmp_path, steps=4, micro_batch=3)
        demo(save, 2, tmp_path, steps=2, micro_batch=3)
        whole = uninterrupted.result()
    after = demo(resume, 3, tmp_path, steps=2, micro_batch=2)
    assert [r["checkpoint"]["load"]["step"] for r in after["ranks"]] == [2, 2, 2]
    for got, want in zip(after["losses"], whole["losses"][2:]):
        assert abs(got - want) <= 1e-6 * abs(want), (after["losses"], whole["losses"])
    release = tmp_path / resume[resume.index("--export") + 1]
    assert (release / "model.safetensors.index.json").exists()


def cli(*args: str, cwd: Path) -> str:
    """``python -m minishard ...`` in a fresh process, as a user runs it: the ranks it starts
    write to its stdout (in this test process, a rank pool started earlier would not)."""
    out = subprocess.run([sys.executable, "-m", "minishard", *args], capture_output=True, text=True,
                         timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_progress_line_and_the_tables(tmp_path):
    out = cli("demo", "--world-size", "2", "--strategy", "zero3", "--steps", "2", "--model", "nano",
              "--trace", str(tmp_path / "t"), cwd=tmp_path)
    assert re.search(r"^step   2/2  loss \d+\.\d{4} .* ms  peak .* MiB$", out, re.M)
    assert "minishard demo: strategy=fsdp world_size=2 model=nano params=217,664" in out
    assert "peak - formula" in out and "(gathered units)" in out
    assert (tmp_path / "t" / "trace.json").exists()
    quiet = cli("demo", "--world-size", "1", "--strategy", "single", "--steps", "1", "--model", "nano",
                "--quiet", cwd=tmp_path)
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
    from minishard.costmodel import DEVICES
    first = plan_out(capsys).splitlines()[0]
    gib = DEVICES["h100-80gb"].memory / 2**30
    assert f"({gib:.1f} GiB each" in first, first


@pytest.mark.parametrize("nodes", [1, 2])
def test_plan_names_the_link_between_nodes_only_when_there_are_nodes(nodes, capsys):
    from minishard.costmodel import LINKS
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


def test_two_torchrun_agents_as_two_nodes(tmp_path):
    """The multi-node launch a cluster uses, on one machine: two torchrun agents (--nnodes 2),
    c10d rendezvous on 127.0.0.1, hybrid sharding across the two "nodes"."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t",
           "-m", "minishard", "demo", "--strategy", "hsdp", "--steps", "2", "--model", "nano",
           "--trace", str(tmp_path)]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=240) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    printed = "".join(o for o, _ in outs)
    assert "strategy=hsdp world_size=4" in printed
