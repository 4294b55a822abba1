"""minishard against PyTorch's own strategies: step time, interleaved, in one run.

    python benchmarks/bench.py                 # 2 and 4 ranks, tiny GPT (6.9 M params)
    python benchmarks/bench.py --world-sizes 2 --rounds 3 --steps 8

For each world size one warm pool of ranks runs the contenders in turn, round after round
(interleaving cancels the drift of a shared machine), each for ``--steps`` optimizer steps of
which the first ``--warmup`` are dropped. Reported: median and p99 step time per contender, the
ratio to the PyTorch baseline (< 1.0 means minishard is faster), bytes sent per step as the OS
counted them. Same model, data, micro-batch, optimizer and bucket size for everyone; one thread
per rank, as in REFERENCE_FIGURES.md.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

from minishard.launch import Ranks
from minishard.train import train

# (label, train kwargs, baseline label to compare against)
CONTENDERS = [
    ("torch DDP", dict(strategy="torch_ddp"), None),
    ("minishard DDP", dict(strategy="ddp", track_activations=False), "torch DDP"),
    ("minishard DDP (+activation ledger)", dict(strategy="ddp"), "torch DDP"),
    ("minishard naive DDP", dict(strategy="ddp_naive", track_activations=False), "torch DDP"),
    ("torch DDP + ZeroRedundancyOptimizer", dict(strategy="torch_zero1"), None),
    ("minishard ZeRO-1", dict(strategy="zero1", track_activations=False),
     "torch DDP + ZeroRedundancyOptimizer"),
    ("minishard ZeRO-1 (all-reduce variant)", dict(strategy="zero1_allreduce", track_activations=False),
     "torch DDP + ZeroRedundancyOptimizer"),
    ("minishard ZeRO-2", dict(strategy="zero2", track_activations=False),
     "torch DDP + ZeroRedundancyOptimizer"),
    ("torch FSDP2 fully_shard (block + root)", dict(strategy="torch_fsdp"), None),
    ("minishard FSDP, per-parameter", dict(strategy="fsdp", track_activations=False),
     "torch FSDP2 fully_shard (block + root)"),
    ("minishard FSDP, flat", dict(strategy="fsdp_flat", track_activations=False),
     "torch FSDP2 fully_shard (block + root)"),
    ("minishard FSDP, per-parameter, prefetch 1", dict(strategy="fsdp", prefetch=1,
                                                       track_activations=False),
     "torch FSDP2 fully_shard (block + root)"),
]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def selected(only: list[str] | None) -> list[tuple]:
    """The contenders asked for, with the baselines they are compared against."""
    if not only:
        return CONTENDERS
    keep = {c[0] for c in CONTENDERS if any(o.lower() in c[0].lower() for o in only)}
    keep |= {c[2] for c in CONTENDERS if c[0] in keep and c[2]}
    return [c for c in CONTENDERS if c[0] in keep]


def bench(world_size: int, rounds: int, steps: int, warmup: int, model: str, micro_batch: int,
          bucket_cap_mb: float, only: list[str] | None = None) -> dict[str, dict]:
    contenders = selected(only)
    times: dict[str, list[float]] = {label: [] for label, _, _ in contenders}
    sent: dict[str, list[int]] = {label: [] for label, _, _ in contenders}
    with Ranks(world_size, timeout=900) as ranks:
        for _ in range(rounds):
            for label, kw, _ in contenders:
                res = ranks.run(train, steps=steps, model=model, micro_batch=micro_batch,
                                bucket_cap_mb=bucket_cap_mb, **kw)
                # a step is as slow as its slowest rank
                per_step = [max(r["step_times"][s] for r in res) for s in range(warmup, steps)]
                times[label] += per_step
                sent[label] += [res[0]["wchar"][s] for s in range(warmup, steps)]
    return {label: {"p50": statistics.median(times[label]), "p99": percentile(times[label], 0.99),
                    "sent": statistics.median(sent[label])} for label in times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="substrings of contender names to run (default: all)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = ap.parse_args()
    print(f"# minishard benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
          f"{platform.processor() or platform.machine()}, model={args.model}, "
          f"micro_batch={args.micro_batch}/rank, bucket={args.bucket_cap_mb} MiB, "
          f"{args.rounds} rounds x {args.steps - args.warmup} timed steps")
    for n in args.world_sizes:
        res = bench(n, args.rounds, args.steps, args.warmup, args.model, args.micro_batch,
                    args.bucket_cap_mb, args.only)
        print(f"\n{n} ranks")
        print(f"{'contender':<38}{'p50 s':>8}{'p99 s':>8}{'ratio':>9}{'sent/step MB':>14}")
        for label, _, base in selected(args.only):
            r = res[label]
            ratio = f"{r['p50'] / res[base]['p50']:.3f}" if base else "1 (base)"
            print(f"{label:<38}{r['p50']:>8.3f}{r['p99']:>8.3f}{ratio:>9}{r['sent'] / 2**20:>14.2f}")


if __name__ == "__main__":
    main()
