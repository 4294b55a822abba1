"""Calibrate the planner on this machine, then predict runs it has not seen.

    python benchmarks/bench_planner.py

1. Calibrate: one rank's step time (no communication) gives the CPU's achieved FLOP/s per core;
   timed all-reduces of a few sizes on 2 ranks give loopback's alpha (latency per ring step)
   and bandwidth.
2. Predict with ``costmodel.plan`` — DDP and ZeRO-3 (per-block units, prefetch 1) on 2 and 4
   ranks, and a different model width — and print predicted vs measured median step time.
   With as many ranks as cores or more, ranks share cores: compute slows by ranks/cores and
   gloo's communication threads find no idle core, so nothing overlaps.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from minishard.costmodel import (Cluster, Device, Link, measure_all_reduce, plan,
                                  train_flops_per_token)
from minishard.launch import Ranks
from minishard.model import config
from minishard.train import train

CORES = os.cpu_count() or 1


def main() -> None:
    model, mb = "tiny", 4
    cfg = config(model)
    torch.set_num_threads(1)
    single = train(strategy="single", model=model, micro_batch=mb, steps=6, track_activations=False)
    t_compute = statistics.median(single["step_times"][2:])
    flops = train_flops_per_token(cfg, cfg.seq_len, False) * mb * cfg.seq_len / t_compute
    sizes = [2**10, 2**16, 2**20, 2**22]
    with Ranks(2) as ranks:
        t = ranks.run(measure_all_reduce, sizes)[0]
        # ring all-reduce on 2 ranks: 2 steps, S bytes sent: t = 2 alpha + S / bw
        bw = (4 * sizes[-1] - 4 * sizes[-2]) / (t[-1] - t[-2])
        alpha = max(1e-6, (t[0] - 4 * sizes[0] / bw) / 2)
    link = Link("loopback (gloo, calibrated)", bw, alpha)
    print(f"calibrated: {flops / 1e9:.2f} GFLOP/s per core, loopback {bw / 1e9:.2f} GB/s, "
          f"alpha {alpha * 1e6:.0f} us")
    print(f"{'run':<34}{'predicted s':>12}{'measured s':>12}{'ratio':>8}")
    for N in (2, 4):
        share = max(1.0, N / CORES)
        device = Device("CPU core (calibrated)", 24 * 2**30, flops / share)
        cluster = Cluster(device, gpus_per_node=N, intra=link)
        with Ranks(N) as ranks:
            for label, strategy, ours, kw in (("DDP", "ddp", "ddp", {}),
                                              ("ZeRO-3, prefetch 1", "zero3", "fsdp", {"prefetch": 1}),
                                              ("ZeRO-3, d_model 384", "zero3", "fsdp",
                                               {"prefetch": 1, "model_overrides": {"d_model": 384, "n_head": 6}})):
                res = ranks.run(train, strategy=ours, model=model, micro_batch=mb, steps=6,
                                track_activations=False, **kw)
                measured = statistics.median(max(r["step_times"][s] for r in res) for s in range(2, 6))
                c = config(model, **kw.get("model_overrides", {}))
                p = plan(c, cluster, strategy, micro_batch=mb, precision="fp32",
                         prefetch=kw.get("prefetch", 0), flash_attention=False, mfu=1.0,
                         overlap=N < CORES)
                print(f"{label + f', {N} ranks':<34}{p.step_s:>12.3f}{measured:>12.3f}"
                      f"{p.step_s / measured:>8.2f}")


if __name__ == "__main__":
    main()
