"""Checkpoint throughput: save and load MB/s per rank, against a plain copy of the same bytes.

    python benchmarks/bench_checkpoint.py                       # tiny GPT, FSDP, 2 and 4 ranks
    python benchmarks/bench_checkpoint.py --world-sizes 4 --repeats 5 --dir /mnt/nvme/scratch

For each world size one warm pool of ranks trains a step and saves (warm-up, not timed), then
``--repeats`` times resumes from that checkpoint, trains one step and saves it again
(``train(None, TrainConfig(resume_from=..., save_to=...))``), which times one load and one save per round.

* save MB/s: bytes the rank wrote / seconds of its whole ``checkpoint.save`` — describing,
  hashing, writing, fsync, the ranks' agreement, rank 0's metadata and the renames;
* write MB/s: the same bytes / seconds spent on the rank's own file (hash + write + fsync);
* load MB/s: bytes the rank read / seconds of its whole ``checkpoint.load`` — plan, read,
  verify, agree, copy into the live tensors;
* copy MB/s: the same rank files copied with ``shutil.copyfile`` + fsync, on the same disk, all
  files at once (one thread each, as the ranks write at once) and one at a time.

Medians over the rounds. Loads read files the save has just written, so they come from the page
cache, as a restart on the same machine would; copies likewise.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from minishard.launch import Ranks
from minishard.train import TrainConfig, train


def copy_rate(src: Path, dst: Path) -> float:
    """MB/s of one plain copy of ``src`` (fsync'd, like the checkpoint's files)."""
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    return src.stat().st_size / (time.perf_counter() - t0) / 1e6


def copies(ck: Path, scratch: Path) -> tuple[list[float], list[float]]:
    """Per-file MB/s copying every rank file at once, then one at a time."""
    files = sorted(ck.glob("rank*.safetensors"))
    scratch.mkdir(exist_ok=True)
    with ThreadPoolExecutor(len(files)) as pool:
        together = list(pool.map(lambda f: copy_rate(f, scratch / f"par-{f.name}"), files))
    alone = [copy_rate(f, scratch / f"seq-{f.name}") for f in files]
    shutil.rmtree(scratch)
    return together, alone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; model {args.model}, "
          f"strategy {args.strategy}; files in {root}")
    kw = dict(strategy=args.strategy, model=args.model, micro_batch=2, track_activations=False,
              trace=False)
    try:
        for N in args.world_sizes:
            ck = root / f"n{N}"
            rows = {k: [[] for _ in range(N)] for k in ("save", "write", "load", "par", "seq")}
            with Ranks(N) as ranks:
                ranks.run(train, TrainConfig(steps=1, save_to=str(ck), **kw))           # warm-up
                for _ in range(args.repeats):
                    out = ranks.run(train, TrainConfig(steps=1, resume_from=str(ck), save_to=str(ck), **kw))
                    together, alone = copies(ck, root / "copy")
                    for r, o in enumerate(out):
                        s, ld = o["checkpoint"]["save"], o["checkpoint"]["load"]
                        rows["save"][r].append(s["bytes_written"] / s["seconds"] / 1e6)
                        rows["write"][r].append(s["bytes_written"] / s["write_seconds"] / 1e6)
                        rows["load"][r].append(ld["bytes_read"] / ld["seconds"] / 1e6)
                        rows["par"][r].append(together[r])
                        rows["seq"][r].append(alone[r])
            mb = out[0]["checkpoint"]["save"]["bytes_written"] / 1e6
            print(f"\n{N} ranks, {mb:.1f} MB per rank file (median MB/s per rank over {args.repeats} rounds)")
            print(f"{'rank':>4}{'save':>9}{'write':>9}{'load':>9}{'copy, all at once':>19}{'copy, alone':>13}")
            for r in range(N):
                m = {k: statistics.median(v[r]) for k, v in rows.items()}
                print(f"{r:>4}{m['save']:>9.0f}{m['write']:>9.0f}{m['load']:>9.0f}{m['par']:>19.0f}{m['seq']:>13.0f}")
            med = {k: statistics.median(x for v in rows[k] for x in v) for k in rows}
            print(f"{'all':>4}{med['save']:>9.0f}{med['write']:>9.0f}{med['load']:>9.0f}{med['par']:>19.0f}"
                  f"{med['seq']:>13.0f}   save/copy {med['save'] / med['par']:.2f}, "
                  f"load/copy {med['load'] / med['par']:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
