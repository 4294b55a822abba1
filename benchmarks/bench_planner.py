"""Calibrate the planner on this machine, then predict runs it has not seen.

    python benchmarks/bench_planner.py

1. Calibrate the "device": the tiny GPT's training step on every rank at once with no
   communication (``course.ch10.measure_compute``) gives the FLOP/s one rank achieves while N
   ranks share this machine's cores — the CPU's counterpart of a GPU's datasheet FLOP/s.
2. Calibrate the network: timed all-reduces of several sizes on 2 ranks give loopback's alpha
   (latency per ring step) and bandwidth, by a least-squares line.
3. Predict with ``costmodel.plan`` — DDP and ZeRO-3 (per-block units, prefetch 1) on 2 and 4
   ranks, and ZeRO-3 for a model of another width (d_model 384, never calibrated) — and print
   predicted vs measured step time. The 4-rank network is predicted from the 2-rank link.
   With as many ranks as cores or more, gloo's communication threads find no idle core, so the
   planner is told that nothing overlaps (``overlap=False``).

The host's speed drifts by tens of percent over minutes (a shared machine), so calibration and
measured runs are interleaved in rounds and every figure is the median over the rounds.
"""
from __future__ import annotations

import os
import statistics

from minishard.planner.costmodel import Cluster, Device, Link, plan, train_flops_per_token
from minishard.course.ch10 import measure_all_reduce, measure_compute
from minishard.core.launch import Ranks
from minishard.core.model import config
from minishard.training.loop import TrainConfig, train

CORES = os.cpu_count() or 1
STEPS, WARMUP = 10, 3      # CPU step times settle only after a few steps
MODEL, MB = "tiny", 4
RUNS = (("DDP", "ddp", "ddp", {}),
        ("ZeRO-3, prefetch 1", "zero3", "fsdp", {"prefetch": 1}),
        ("ZeRO-3, d_model 384", "zero3", "fsdp",
         {"prefetch": 1, "model_overrides": {"d_model": 384, "n_head": 6}}))


def steady(res: list[dict]) -> float:
    """Median step time after warm-up, each step as slow as its slowest rank."""
    return statistics.median(max(r["step_times"][s] for r in res) for s in range(WARMUP, STEPS))


def calibrate_compute(ranks: Ranks) -> float:
    """Achieved FLOP/s of one rank while all of ``ranks`` compute at once (no communication)."""
    cfg = config(MODEL)
    t = steady([{"step_times": ts} for ts in
                ranks.run(measure_compute, model=MODEL, micro_batch=MB, steps=STEPS)])
    return train_flops_per_token(cfg, cfg.seq_len, False) * MB * cfg.seq_len / t


def calibrate_link() -> Link:
    """Loopback alpha and bandwidth from timed all-reduces of several sizes on 2 ranks."""
    sizes = [2**10, 2**14, 2**18, 2**20, 2**21, 2**22]
    with Ranks(2) as ranks:
        t = ranks.run(measure_all_reduce, sizes)[0]
    # ring all-reduce on 2 ranks: 2 steps and S bytes sent per rank, t = 2 alpha + S / bw;
    # a least-squares line through every size, so no single noisy timing sets alpha or bw
    S = [4 * n for n in sizes]
    mean_s, mean_t = statistics.fmean(S), statistics.fmean(t)
    slope = sum((s - mean_s) * (y - mean_t) for s, y in zip(S, t)) / sum((s - mean_s) ** 2 for s in S)
    return Link("loopback (gloo, calibrated)", 1 / slope, max(1e-6, (mean_t - slope * mean_s) / 2))


def main(rounds: int = 3) -> None:
    flops, links, measured = {}, [], {}
    for _ in range(rounds):
        links.append(calibrate_link())
        for N in (2, 4):
            with Ranks(N) as ranks:
                flops.setdefault(N, []).append(calibrate_compute(ranks))
                for label, _, ours, kw in RUNS:
                    res = ranks.run(train, TrainConfig(strategy=ours, model=MODEL, micro_batch=MB, steps=STEPS, track_activations=False, **kw))
                    measured.setdefault((label, N), []).append(steady(res))
    link = Link("loopback (gloo, calibrated)", statistics.median(x.bandwidth for x in links),
                statistics.median(x.latency for x in links))
    print(f"calibrated ({rounds} rounds): loopback {link.bandwidth / 1e9:.2f} GB/s, "
          f"alpha {link.latency * 1e6:.0f} us; per rank " + ", ".join(
              f"{statistics.median(f) / 1e9:.1f} GFLOP/s with {N} ranks" for N, f in flops.items()))
    print(f"{'run':<34}{'predicted s':>12}{'measured s':>12}{'ratio':>8}")
    ratios = []
    for N in (2, 4):
        device = Device("CPU share (calibrated)", 24 * 2**30, statistics.median(flops[N]))
        cluster = Cluster(device, gpus_per_node=N, intra=link)
        for label, strategy, _, kw in RUNS:
            c = config(MODEL, **kw.get("model_overrides", {}))
            p = plan(c, cluster, strategy, micro_batch=MB, precision="fp32",
                     prefetch=kw.get("prefetch", 0), flash_attention=False, mfu=1.0,
                     overlap=N < CORES)
            m = statistics.median(measured[label, N])
            ratios.append(p.step_s / m)
            print(f"{label + f', {N} ranks':<34}{p.step_s:>12.3f}{m:>12.3f}{ratios[-1]:>8.2f}")
    worst = max(abs(r - 1) for r in ratios)
    print(f"worst prediction error: {worst:.0%} ({'within' if worst <= 0.25 else 'OUTSIDE'} "
          f"the 25% target)")


if __name__ == "__main__":
    main()
