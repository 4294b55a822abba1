"""benchmarks/bench_watch.py runs: its smoke run (``--quick``'s sizes: nano GPT, 2 ranks, 1
round, on the warm pool) prints a ratio line for each torch job, and counts in each steady step
of the streamed trace at least the events one step must write. No timing is asserted: the ratios
are whatever this machine gives."""
import re
import sys
from pathlib import Path

import minishard

# the rank processes import the benchmark's task by its module's name: the pool starts after
# collection, with this path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_watch  # noqa: E402
JOBS = {"ddp": "torch DDP", "fsdp2": "torch FSDP2 fully_shard (block + root)"}
LINE = re.compile(r"ratio watched \(trace=DIR\) / unwatched, (?P<job>.+?), 2 ranks: CPU time "
                  r"(?P<cpu>\d+\.\d+) .*?wall (?P<wall>\d+\.\d+);.*trace (?P<bytes>[\d,]+) B and "
                  r"(?P<events>\d+) events per step per rank")


def least_events(job: str) -> int:
    """What one step of nano's job writes at the least: step, forward, backward and optimizer
    each begin and end; DDP all-reduces its gradients once (one bucket or more); FSDP2 gathers
    the root once and each block twice (forward, backward) and reduce-scatters every unit."""
    phases = 2 * 4
    blocks = minishard.model_config("nano").n_layer
    return phases + (1 if job == "torch DDP" else (1 + 2 * blocks) + (1 + blocks))


def test_the_smoke_run_prints_a_ratio_line_per_job(pools, tmp_path, capsys):
    res = bench_watch.bench(pools(2), list(bench_watch.JOBS), ["off", "file"], rounds=1, steps=3,
                            warmup=1, model="nano", micro_batch=2, bucket_cap_mb=25.0, root=tmp_path)
    bench_watch.report(2, res, cores=2)
    out = capsys.readouterr()          # .out: what the report printed
    lines = {m["job"]: m for m in map(LINE.search, out.out.splitlines()) if m}
    assert set(lines) == set(JOBS.values()), out.out
    for job, m in lines.items():
        assert float(m["cpu"]) > 0 and float(m["wall"]) > 0, m.group(0)
        events, nbytes = int(m["events"]), int(m["bytes"].replace(",", ""))
        assert events >= least_events(job), f"{job}: {events} events per step < {least_events(job)}"
        assert nbytes > events, f"{job}: {nbytes} B for {events} events (a JSON line each)"
