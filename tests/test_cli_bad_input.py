"""Every bad input is one line: the table of wrong inputs a new user types (issues 25's and
38's, and every flag with a wrong value), each asserting the exit status (2: bad input, 1: a run
that failed, 0: a trace read with warnings), that the first line printed names the problem (the
flag, or a word only this problem has) and that no Python traceback is printed. Most run in this
process (``main([...])``, the same path as the command line); a representative few run as a user
runs them, through ``python -m minishard`` and under ``torchrun``, where the line must also be the
root cause of torchrun's failure summary. Generated inputs: tests/test_input_properties.py."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minishard import strategies
from minishard.cli import main
from minishard.training.config import TrainConfig
from minishard.training.loop import train

MISSING = "/nonexistent/minishard"


def _event(rank: int, seq: int, step, **kw) -> dict:
    return dict(v=1, rank=rank, seq=seq, t=0.1 * seq, step=step, **kw)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Every damaged thing the table names: checkpoints, configs, traces, files in the way."""
    tmp = tmp_path_factory.mktemp("bad")
    ck = tmp / "ck"                                   # a whole checkpoint: nano, AdamW, one rank
    train(None, TrainConfig(strategy="single", model="nano", steps=1, micro_batch=1, save_to=str(ck),
                            track_activations=False, trace=False))
    shard = sorted(p.name for p in ck.glob("*.safetensors"))[0]
    damaged = {}
    for name in ("corrupt_meta", "flipped", "missing_shard", "cut_shard"):
        damaged[name] = tmp / name
        shutil.copytree(ck, damaged[name])
    meta = damaged["corrupt_meta"] / "metadata.json"
    meta.write_text(meta.read_text()[: len(meta.read_text()) // 2])
    data = bytearray((damaged["flipped"] / shard).read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):   # (in the tensors, past the header)
        data[i] ^= 0xFF
    (damaged["flipped"] / shard).write_bytes(bytes(data))
    (damaged["missing_shard"] / shard).unlink()
    whole = (damaged["cut_shard"] / shard).read_bytes()
    (damaged["cut_shard"] / shard).write_bytes(whole[: len(whole) - 100])
    (tmp / "not_ckpt").mkdir()
    (tmp / "not_ckpt" / "notes.txt").write_text("not a checkpoint")
    (tmp / "empty").mkdir()
    (tmp / "a_file").write_text("in the way")
    (tmp / "list.json").write_text(json.dumps([{"model_type": "llama"}]))
    (tmp / "partial.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp / "broken.json").write_text('{"model_type": "llama", ')
    # a trace whose rank 0 ends in a line cut inside a string, and a rank cut before its first step
    cut, early = tmp / "cut", tmp / "early"
    steps = [_event(0, i, i // 2, kind="phase", name="forward", edge="begin" if i % 2 == 0 else "end")
             for i in range(4)]
    line = json.dumps(steps[0])
    for d in (cut, early):
        d.mkdir()
        (d / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in steps))
    with open(cut / "rank0.jsonl", "a") as f:
        f.write(line[:line.index('"phase"') + 3] + "\n")
    (early / "rank1.jsonl").write_text(json.dumps(_event(1, 0, None, kind="alloc", category="params",
                                                         bytes=1024)) + "\n")
    # a trace whose second line holds a byte no UTF-8 text has (in a string: \xff), one whose
    # line is a JSON list, and a flight dump of Latin-1 text
    latin, listed, dump = tmp / "latin", tmp / "listed", tmp / "dump"
    for d in (latin, listed, dump):
        d.mkdir()
    first = json.dumps(steps[0]) + "\n"
    (latin / "rank0.jsonl").write_bytes(first.encode() + json.dumps(steps[1]).replace("forward", "f\xf6rward")
                                        .encode("latin-1") + b"\n")
    (listed / "rank0.jsonl").write_text(first + "[1, 2]\n")
    (dump / "flight_rank0.json").write_bytes('{"v": 1, "rank": 0, "reason": "f\xe9rt"}'.encode("latin-1"))
    llama = json.loads((Path(__file__).resolve().parents[1] / "configs" / "llama3-8b.json").read_text())
    for name, change in (("negative", {"num_hidden_layers": -4}), ("heads", {"num_attention_heads": 7}),
                         ("kv_heads", {"num_key_value_heads": 5}), ("head_dim", {"head_dim": 96}),
                         ("float_size", {"hidden_size": 4096.0})):
        (tmp / f"{name}.json").write_text(json.dumps({**llama, **change}))
    return {"tmp": str(tmp), "ck": str(ck), **{k: str(v) for k, v in damaged.items()},
            **{k: str(tmp / k) for k in ("not_ckpt", "empty", "a_file", "cut", "early", "latin",
                                         "listed", "dump")},
            "list": str(tmp / "list.json"), "partial": str(tmp / "partial.json"),
            "broken": str(tmp / "broken.json"),
            **{k: str(tmp / f"{k}.json") for k in ("negative", "heads", "kv_heads", "head_dim", "float_size")}}


NANO = ["--model", "nano", "--steps", "1", "--micro-batch", "1", "--quiet"]
# (argv, exit status, words the first line holds). {name}: a path from the ``files`` fixture
CASES = [
    # what to train
    (["demo", "--strategy", "zero4"], 2, ["--strategy zero4", "unknown strategy"]),
    (["demo", "--model", "gpt9"], 2, ["--model gpt9"]),
    (["demo", "--steps", "0"], 2, ["--steps 0"]),
    (["demo", "--steps", "abc"], 2, ["--steps", "'abc'"]),
    (["demo", "--steps", "1.5"], 2, ["--steps", "'1.5'"]),
    (["demo", "--micro-batch", "0"], 2, ["--micro-batch 0"]),
    (["demo", "--accum", "0"], 2, ["--accum 0"]),
    (["demo", "--optimizer", "adam"], 2, ["--optimizer adam", "adamw"]),
    (["demo", "--lr", "0"], 2, ["--lr"]),
    (["demo", "--lr", "inf"], 2, ["--lr inf", "finite"]),
    (["demo", "--precision", "fp16"], 2, ["--precision fp16", "bf16_mixed"]),
    (["demo", "--clip", "-1"], 2, ["--clip"]),
    (["demo", "--freeze", "nope"], 2, ["--freeze nope", "matches no parameter"]),
    (["demo", "--world-size", "0"], 2, ["--world-size 0"]),
    (["demo", "--world-size", "-2"], 2, ["--world-size -2"]),
    (["demo", "--strategy", "single", "--world-size", "2"], 2, ["--strategy single", "--world-size 1"]),
    # ranks are numbered 0 to N-1: rank N is one past the last (it would plant the fault nowhere)
    (["demo", *NANO, "--fault", "skip-collective", "--world-size", "2", "--fault-rank", "2"], 2,
     ["--fault-rank 2", "no such rank", "ranks 0 to 1"]),
    # sharding knobs: a wrong value, and a knob the strategy never reads
    (["demo", "--bucket-cap-mb", "0"], 2, ["--bucket-cap-mb"]),
    (["demo", "--bucket-cap-mb", "inf"], 2, ["--bucket-cap-mb inf"]),
    (["demo", "--wrap", "layer"], 2, ["--wrap layer"]),
    (["demo", "--strategy", "fsdp", "--prefetch", "-1"], 2, ["--prefetch -1"]),
    (["demo", "--strategy", "hsdp", "--shard-size", "0"], 2, ["--shard-size 0"]),
    (["demo", "--strategy", "hsdp", "--world-size", "3"], 2, ["--shard-size 2", "--world-size 3"]),
    (["demo", "--strategy", "ddp", "--prefetch", "2"], 2, ["--prefetch 2", "--strategy ddp"]),
    (["demo", "--strategy", "ddp", "--wrap", "linear"], 2, ["--wrap linear", "--strategy ddp"]),
    (["demo", "--strategy", "zero1", "--reshard-root"], 2, ["--reshard-root", "--strategy zero1"]),
    (["demo", "--strategy", "ddp", "--no-reshard-after-forward"], 2, ["--no-reshard-after-forward"]),
    (["demo", "--strategy", "fsdp", "--reshard-after-forward", "0"], 2, ["--reshard-after-forward 0"]),
    (["demo", "--strategy", "fsdp", "--accumulation", "later"], 2, ["--accumulation later", "no_sync"]),
    (["demo", "--strategy", "zero2", "--accumulation", "gathered"], 2, ["--accumulation gathered", "ZeRO-2"]),
    (["demo", "--strategy", "ddp", "--accumulation", "no_sync"], 2, ["--accumulation no_sync", "--strategy ddp"]),
    (["demo", "--strategy", "fsdp", "--accumulation", "no_sync"], 2,
     ["--accumulation no_sync", "--accum 1", "--accum 2 or more"]),
    (["demo", "--strategy", "zero2", "--accumulation", "sync", "--accum", "1"], 2, ["--accumulation sync", "--accum 1"]),
    (["demo", "--strategy", "zero2", "--quantized-weights"], 2, ["--quantized-weights", "--strategy zero2"]),
    (["demo", "--strategy", "fsdp", "--quantized-gradients", "5"], 2, ["--quantized-gradients 5", "8 or 4"]),
    (["demo", "--strategy", "fsdp", "--quantized-weights", "3"], 2,
     ["--quantized-weights 3: ZeRO++ quantizes to 8 or 4 bits an element; give --quantized-weights (int8), "
      "--quantized-weights 8 or --quantized-weights 4"]),
    (["demo", "--strategy", "fsdp", "--world-size", "4", "--reshard-after-forward", "3"], 2,
     ["--reshard-after-forward 3", "[1, 2, 4]"]),
    (["demo", "--strategy", "hsdp", "--world-size", "4", "--reshard-after-forward", "4"], 2,
     ["--reshard-after-forward 4", "2 ranks"]),
    (["demo", "--strategy", "ddp", "--reshard-after-forward", "2"], 2, ["--reshard-after-forward 2", "--strategy ddp"]),
    (["demo", "--strategy", "fsdp", "--bucket-cap-mb", "4"], 2, ["--bucket-cap-mb 4", "--strategy fsdp"]),
    (["demo", "--strategy", "zero2", "--shard-size", "4"], 2, ["--shard-size 4", "--strategy zero2"]),
    (["demo", "--strategy", "torch_ddp", "--prefetch", "1"], 2, ["--prefetch 1", "--strategy torch_ddp"]),
    # memory
    (["demo", "--strategy", "ddp", "--offload", "host"], 2, ["--offload host", "--strategy ddp"]),
    (["demo", "--strategy", "fsdp", "--offload", "nvme"], 2, ["--offload", "'nvme'"]),
    (["demo", "--strategy", "fsdp", "--offload", "disk"], 2, ["--offload disk", "--offload-dir"]),
    (["demo", "--offload-dir", "{tmp}/off"], 2, ["--offload-dir"]),
    (["demo", "--strategy", "fsdp", "--offload", "host", "--offload-dir", "{tmp}/off"], 2,
     ["--offload-dir", "--offload host"]),
    (["demo", "--strategy", "fsdp", "--offload", "disk", "--offload-dir", "{a_file}"], 2, ["--offload-dir"]),
    (["demo", "--loss-chunk-tokens", "0"], 2, ["--loss-chunk-tokens 0"]),
    (["demo", "--device-budget", "0"], 2, ["--device-budget"]),
    (["demo", "--device-budget", "inf"], 2, ["--device-budget inf", "finite"]),
    (["demo", "--device-budget", "nan"], 2, ["--device-budget nan"]),
    (["demo", "--timeout", "inf"], 2, ["--timeout inf", "finite"]),
    (["demo", "--world-size", "1", "--device-budget", "40"], 1,
     ["rank 0", "out of device memory", "budget of 40.0 MiB", "--device-budget"]),
    # checkpoints and outputs
    (["demo", "--resume", MISSING], 2, ["--resume", "no such checkpoint directory"]),
    (["demo", "--resume", "{not_ckpt}"], 2, ["--resume", "not a checkpoint"]),
    (["demo", *NANO, "--resume", "{corrupt_meta}"], 2, ["--resume", "metadata.json", "JSON"]),
    (["demo", *NANO, "--resume", "{missing_shard}"], 2, ["--resume", "is missing"]),
    (["demo", *NANO, "--resume", "{cut_shard}"], 2, ["--resume", "cut short"]),
    (["demo", *NANO, "--strategy", "single", "--optimizer", "sgd", "--resume", "{ck}"], 2,
     ["--optimizer sgd", "--optimizer adamw"]),
    (["demo", "--model", "tiny", "--resume", "{ck}"], 2, ["--resume", "another model"]),
    (["demo", *NANO, "--world-size", "1", "--strategy", "single", "--resume", "{flipped}"], 2,
     ["checkpoint", "checksum mismatch"]),
    (["demo", "--save", "{a_file}"], 2, ["--save", "not a directory"]),
    (["demo", "--save", "{not_ckpt}"], 2, ["--save", "not a checkpoint"]),
    (["demo", "--export", "{a_file}"], 2, ["--export"]),
    (["demo", "--trace", "{a_file}"], 2, ["--trace"]),
    # ledger and plan
    (["ledger", "--config", "{list}"], 2, ["JSON list", "not a model config"]),
    (["ledger", "--config", "{partial}"], 2, ["lacks num_hidden_layers"]),
    (["ledger", "--config", "{broken}"], 2, ["not JSON"]),
    (["ledger", "--config", f"{MISSING}/config.json"], 2, ["no model config"]),
    (["ledger", "--config", "{negative}"], 2, ["num_hidden_layers: -4 must be an integer >= 1"]),
    (["ledger", "--config", "{float_size}"], 2, ["hidden_size: 4096.0 must be an integer >= 1"]),
    (["ledger", "--config", "{heads}"], 2, ["hidden_size: 4096", "num_attention_heads (7)"]),
    (["plan", "--config", "{kv_heads}"], 2, ["num_key_value_heads: 5", "num_attention_heads (32)"]),
    (["ledger", "--config", "{head_dim}"], 2, ["head_dim: 96", "(128)"]),
    (["ledger", "--model", "gpt-9"], 2, ["--model gpt-9"]),
    (["ledger", "--world-size", "0"], 2, ["--world-size 0"]),
    (["ledger", "--precision", "fp8"], 2, ["--precision fp8"]),
    (["plan", "--precision", "fp8"], 2, ["--precision fp8"]),
    (["plan", "--prefetch", "-1"], 2, ["--prefetch -1"]),
    (["plan", "--seq-len", "0"], 2, ["--seq-len"]),
    (["plan", "--micro-batch", "0"], 2, ["--micro-batch"]),
    (["plan", "--mfu", "1.5"], 2, ["--mfu"]),
    (["plan", "--offload", "disk"], 2, ["--offload disk", "host memory over PCIe only"]),
    (["ledger", "--strategy", "zero9"], 2, ["unknown strategy 'zero9'"]),
    (["plan", "--device-memory", "-3"], 2, ["--device-memory"]),
    (["plan", "--nodes", "0"], 2, ["--nodes"]),
    (["plan", "--device", "tpu"], 2, ["--device", "'tpu'"]),
    # traces
    (["perfetto", MISSING, "{tmp}/out.json"], 2, [MISSING, "no such trace directory"]),
    (["perfetto", "{empty}", "{tmp}/out.json"], 2, ["no rank*.jsonl"]),
    (["perfetto", "{cut}", "{tmp}/out.json"], 2, ["rank0.jsonl:5", "not JSON"]),
    (["perfetto", "{early}", f"{MISSING}/out.json"], 2, [f"{MISSING}/out.json", "No such file"]),
    (["perfetto", "{latin}", "{tmp}/out.json"], 2, ["rank0.jsonl:2", "not UTF-8", "byte 0xf6 at column"]),
    (["perfetto", "{listed}", "{tmp}/out.json"], 2, ["rank0.jsonl:2", "JSON list", "not a trace event"]),
    (["view", "{latin}", "-o", "{tmp}/latin.html"], 0, ["warning", "rank0.jsonl:2", "not UTF-8", "byte 0xf6"]),
    (["doctor", "{dump}"], 2, ["flight_rank0.json:1", "not UTF-8", "byte 0xe9 at column"]),
    (["view", MISSING], 2, ["no such trace directory"]),
    (["view", "{empty}"], 2, ["no rank*.jsonl"]),
    (["view", "{cut}", "-o", "{tmp}/cut.html"], 0, ["warning", "rank0.jsonl:5",
                                                  "Unterminated string starting at column"]),
    (["view", "{early}", "-o", "{tmp}/early.html"], 0, ["warning", "rank1.jsonl", "before its first step"]),
    (["bogus"], 2, ["invalid choice: 'bogus'"]),
]


def _argv(argv: list[str], files: dict) -> list[str]:
    return [a.format(**files) for a in argv]


def _check(status: int, out: str, err: str, want_status: int, words: list[str]) -> str:
    text = err + out
    assert "Traceback" not in text and "[Errno" not in text, text[-3000:]
    first = (err or out).strip().splitlines()[0]
    assert status == want_status, (status, text[-3000:])
    assert first.startswith("minishard") and all(w in first for w in words), (words, first)
    return first


@pytest.mark.parametrize("argv, status, words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_in_process(argv, status, words, files, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        got = main(_argv(argv, files))
    except SystemExit as e:                         # (argparse's refusals)
        got = e.code
    out = capsys.readouterr()
    first = _check(got, out.out, out.err, status, words)
    if status == 2:
        assert len(out.err.strip().splitlines()) == 1, out.err


def test_the_lines_name_each_thing_once(files, capsys):
    """An unknown strategy lists each strategy once, by the name the help uses (no alias
    list); a config's missing keys are listed once; a checkpoint's optimizer is advised in
    flags, not in Python arguments."""
    assert main(["demo", "--strategy", "zero4"]) == 2
    line = capsys.readouterr().err
    for name in strategies.STRATEGIES:
        assert line.count(f" {name},") + line.count(f" {name} ") + line.count(f" {name}\n") == 1, name
    assert "fsdp-flat" not in line and "zero-1" not in line
    assert main(["ledger", "--config", files["partial"]]) == 2
    line = capsys.readouterr().err
    for key in ("num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        assert line.count(key) == 1, line
    assert main(["demo", *NANO, "--strategy", "single", "--optimizer", "sgd", "--resume", files["ck"]]) == 2
    assert "optimizer=None" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--save", "--export", "--trace", "--offload-dir"])
def test_an_output_folder_that_cannot_be_made_is_refused_before_any_rank_starts(flag, files, capsys, monkeypatch):
    """A folder under a file, or where the file system makes none (/proc), is refused with the
    path and why before a rank starts — not after the ranks trained (--save wrote last)."""
    from minishard.core import launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks started before the output folder was checked")
    monkeypatch.setattr(launch, "Ranks", no_ranks)
    extra = ["--strategy", "fsdp", "--offload", "disk"] if flag == "--offload-dir" else []
    for target, why in ((f"{files['a_file']}/run/ckpt", f"{files['a_file']} is a file, not a directory"),
                        ("/proc/minishard/ckpt", "/proc refuses new files")):
        assert main(["demo", *NANO, *extra, "--world-size", "1", flag, target]) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"minishard demo: error: {flag} {target} cannot be written: {why}"), line
        assert len(line.splitlines()) == 1, line


def test_every_trace_reader_names_the_file_line_and_byte_it_could_not_decode(tmp_path):
    """A byte no UTF-8 text has (Latin-1's ö, 0xf6, on line 2, column 3) — named by file, line
    and byte by every reader of traces and flight dumps: refused by the strict ones, skipped
    with a warning by the player, quoted by the doctor where a rank's trace ends."""
    from minishard.instruments import doctor, torch_flight
    from minishard.core import trace
    from minishard.cli import view
    first = json.dumps(_event(0, 0, 0, kind="phase", name="forward", edge="begin"))
    text = (first + '\n{"\xf6": 2}\n').encode("latin-1")
    for name in ("rank0.jsonl", "flight_rank0.json", "nccl_trace_rank_0.json"):
        (tmp_path / name).write_bytes(text)
    where = "(byte 0xf6 at column 3)"
    for read, name in ((trace.read_jsonl, "rank0.jsonl"), (doctor.read_dump, "flight_rank0.json"),
                       (lambda p: torch_flight.read(p, 0, 1), "nccl_trace_rank_0.json")):
        with pytest.raises(trace.TraceFormatError) as e:
            read(tmp_path / name)
        assert str(e.value).startswith(f"{tmp_path / name}:2: not UTF-8 text {where}"), str(e.value)
    events, problems = view.read_file(tmp_path / "rank0.jsonl")
    assert problems == [f"{tmp_path / 'rank0.jsonl'}:2: not UTF-8 text {where}: a damaged trace, or not "
                        f"a trace (skipped)"], problems
    assert "stops at line 2 (not UTF-8 text (byte 0xf6 at column 3)" in doctor.trace_end(tmp_path / "rank0.jsonl")


def test_debug_adds_the_traceback_of_the_rank_that_failed(files, capsys):
    """--debug: the same first line, then the traceback — for a rank's failure, that rank's own."""
    argv = ["demo", *NANO, "--world-size", "1", "--strategy", "single", "--resume", files["flipped"]]
    assert main(argv) == 2
    plain = capsys.readouterr().err
    assert main([*argv, "--debug"]) == 2
    debug = capsys.readouterr().err
    assert debug.splitlines()[0] == plain.splitlines()[0] and "Traceback" not in plain
    assert "Traceback" in debug and "minishard/checkpoint/" in debug and "training/loop.py" in debug


def test_the_help_speaks_the_readmes_words():
    from minishard.cli import parser
    text = parser().format_help()
    assert "``" not in text and "python -m minishard" in text
    demo_help = parser()._subparsers._group_actions[0].choices["demo"].format_help()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name in ("fsdp_flat", "hsdp", "zero1"):
        assert name in demo_help and f"--strategy {name}" in readme
    assert "fsdp-flat" not in readme and "))" not in demo_help


# ----------------------------------------------------------------- as a user runs them

ENV = dict(os.environ, OMP_NUM_THREADS="1")          # (torchrun's banner otherwise comes first)
# One case of each command's refusal, and a failure inside a rank: every process imports torch
# (seconds of CPU each), and the table above runs every refusal through the same code in-process.
SUBPROCESS = [      # python -m minishard
    (["demo", "--strategy", "zero4"], 2, ["--strategy zero4"]),
    (["ledger", "--config", "{list}"], 2, ["JSON list"]),
    (["perfetto", MISSING, "out.json"], 2, ["no such trace directory"]),
    (["demo", "--world-size", "2", "--device-budget", "40"], 1, ["rank", "out of device memory", "40.0 MiB"]),
]
TORCHRUN = [        # torchrun --standalone --nproc-per-node 2 -m minishard
    (["demo", "--strategy", "ddp", "--prefetch", "2"], 2, ["--prefetch 2", "--strategy ddp"]),
    (["demo", "--device-budget", "40"], 1, ["rank", "out of device memory", "40.0 MiB"]),
    (["demo", *NANO, "--strategy", "zero1", "--resume", "{flipped}"], 2, ["checkpoint", "checksum mismatch"]),
]


@pytest.fixture(scope="module")
def launched(files):
    """Every subprocess case started at once (most of their time is importing torch and
    waiting), each in its own directory; their (exit status, stdout, stderr) by case."""
    procs = {}
    for kind, cases in (("python", SUBPROCESS), ("torchrun", TORCHRUN)):
        for i, (argv, _, _) in enumerate(cases):
            cmd = [sys.executable, "-m", "minishard"] if kind == "python" else \
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "-m", "minishard"]
            cwd = Path(files["tmp"]) / f"{kind}{i}"
            cwd.mkdir(exist_ok=True)
            procs[kind, i] = subprocess.Popen(cmd + _argv(argv, files), cwd=cwd, env=ENV, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = {k: (p.communicate(timeout=240), p.returncode) for k, p in procs.items()}
    return {k: (code, o, e) for k, ((o, e), code) in out.items()}


@pytest.mark.parametrize("i", range(len(SUBPROCESS)), ids=[" ".join(c[0]) for c in SUBPROCESS])
def test_bad_input_through_python_m(i, launched):
    argv, status, words = SUBPROCESS[i]
    code, out, err = launched["python", i]
    _check(code, out, err, status, words)


@pytest.mark.parametrize("i", range(len(TORCHRUN)), ids=[" ".join(c[0]) for c in TORCHRUN])
def test_bad_input_under_torchrun(i, launched):
    """The line is the first thing printed and the root cause torchrun's summary shows; the
    only traceback is torchrun's own (its ChildFailedError), none from minishard."""
    argv, status, words = TORCHRUN[i]
    code, out, err = launched["torchrun", i]
    text = err + out
    assert code != 0
    first = err.strip().splitlines()[0]
    assert first.startswith("minishard") and all(w in first for w in words), (words, err[-3000:])
    assert text.count("Traceback (most recent call last)") <= text.count("ChildFailedError:"), text[-3000:]
    assert "/minishard/" not in "".join(line for line in text.splitlines() if line.strip().startswith('File "'))
    assert "Fatal Python error" not in text, text[-3000:]
    root = text[text.index("Root Cause"):]
    assert f"exitcode  : {status}" in root, root
    assert f"traceback : {first}" in root, root


def test_a_rank_that_fails_alone_says_so_whatever_its_rank(monkeypatch, capsys, tmp_path):
    """Under torchrun each rank runs the command line; a failure only one rank saw (not rank 0)
    must still be printed, by that rank, naming it, and be the error file's line."""
    import minishard.cli as cli
    from minishard.core.launch import RankError
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    def fails(args, pools=None):
        raise RankError(1, "DeviceOutOfMemory('allocating 1 B of grads')", "tb")
    monkeypatch.setattr(cli, "_dispatch", fails)
    assert main(["demo", "--model", "nano"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[0].startswith("minishard demo: error: rank 1 ran out of device memory"), err
    assert "rank 1 ran out of device memory" in (tmp_path / "error.json").read_text()
