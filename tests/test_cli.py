"""The torchrun entry point: the same job as the notebooks, a ledger table, a replayable trace."""
import json
import subprocess
import sys

from minishard import trace
from minishard.cli import main


def test_torchrun_demo_prints_the_ledger_and_writes_a_replayable_trace(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "minishard", "demo", "--strategy", "ddp", "--steps", "2", "--model", "nano",
         "--trace", str(tmp_path)],
        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("minishard demo: strategy=ddp world_size=2 model=nano params=217,664")
    rows = [l.split() for l in lines if l.strip()[:1].isdigit() and len(l.split()) > 5]
    assert [r[0] for r in rows] == ["0", "1"]
    # measured peak (MB) equals the analytic formula (MB) on both ranks
    assert all(r[-3] == r[-2] for r in rows)
    events = trace.load(tmp_path)
    assert {e["rank"] for e in events} == {0, 1}
    assert any(e["kind"] == "collective" and e["op"] == "all_reduce" for e in events)
    chrome = json.loads((tmp_path / "trace.json").read_text())
    assert chrome["traceEvents"]


def test_demo_without_torchrun_and_the_ledger_command(tmp_path, capsys):
    assert main(["demo", "--world-size", "1", "--strategy", "single", "--steps", "1",
                 "--model", "nano"]) == 0
    assert "world_size=1" in capsys.readouterr().out
    assert main(["ledger", "--model", "llama3-8b", "--world-size", "8", "--strategy", "ddp"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248 parameters" in out and "16.00 bytes/param" in out


def test_bad_model_name_is_an_error_not_a_traceback(capsys):
    assert main(["ledger", "--model", "gpt-9"]) == 2
    assert "unknown model config 'gpt-9'" in capsys.readouterr().err


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
    assert {e["rank"] for e in trace.load(tmp_path)} == {0, 1, 2, 3}
