"""minishard and DeepSpeed against PyTorch's own strategies: step time, interleaved, in one run.

    python benchmarks/bench.py                 # 2 and 4 ranks, tiny GPT (6.9 M params)
    python benchmarks/bench.py --world-sizes 2 --rounds 3 --steps 8
    python benchmarks/bench.py --all          # also naive DDP, ledger hooks on, ZeRO-1 all-reduce
    python benchmarks/bench.py --alone        # only the one-process step (seconds, no ranks)

For each world size one warm pool of ranks runs the contenders in turn, round after round
(interleaving cancels the drift of a shared machine), each for ``--steps`` optimizer steps of
which the first ``--warmup`` are dropped. Reported: median and p99 step time per contender, the
ratio to the PyTorch baseline (< 1.0 means minishard is faster), bytes sent per step as the OS
counted them, and the minor page faults a step took on rank 0 (a fresh buffer the allocator
mapped again: on a CPU, what a caching allocator saves a GPU). Same model, data, micro-batch,
optimizer and bucket size for everyone; one thread per rank, as in docs/reference-figures.md.

Two more columns need a reference without communication, measured in the same rounds:
* **comm share**: 1 - t_compute / t_step, where t_compute is the same training step run on every
  rank at once with no communication (``course.ch10.measure_compute``) — the part of the step that
  compute on these shared cores does not explain: communication, waiting, and the strategy's
  own bookkeeping.
* **scaling efficiency** (weak scaling, the micro-batch per rank fixed): t_1 / t_step, where t_1
  is one process training alone. With N ranks on C cores the ideal is C/N; the header prints
  it. (On a VM a lone busy process can run slower than each of two busy ones — see
  RESULTS.md — and then the figure reads higher than that ideal.)
"""
from __future__ import annotations

import argparse
import platform
import statistics
import os
import time

from minishard.course.ch10 import measure_compute
from minishard.core.launch import Ranks
from minishard.training.loop import TrainConfig, train

# (label, train kwargs, baseline label to compare against, run by default?)
CONTENDERS = [
    ("torch DDP", dict(strategy="torch_ddp", trace=False), None, True),
    ("minishard DDP", dict(strategy="ddp", track_activations=False), "torch DDP", True),
    ("minishard DDP (+activation ledger)", dict(strategy="ddp"), "torch DDP", False),
    ("minishard naive DDP", dict(strategy="ddp_naive", track_activations=False), "torch DDP", False),
    ("torch DDP + ZeroRedundancyOptimizer", dict(strategy="torch_zero1", trace=False), None, True),
    ("minishard ZeRO-1", dict(strategy="zero1", track_activations=False),
     "torch DDP + ZeroRedundancyOptimizer", True),
    ("minishard ZeRO-1 (all-reduce variant)", dict(strategy="zero1_allreduce", track_activations=False),
     "torch DDP + ZeroRedundancyOptimizer", False),
    ("minishard ZeRO-2", dict(strategy="zero2", track_activations=False),
     "torch DDP + ZeroRedundancyOptimizer", True),
    ("torch FSDP2 fully_shard (block + root)", dict(strategy="torch_fsdp", trace=False), None, True),
    ("minishard FSDP, per-parameter", dict(strategy="fsdp", track_activations=False),
     "torch FSDP2 fully_shard (block + root)", True),
    ("minishard FSDP, flat", dict(strategy="fsdp_flat", track_activations=False),
     "torch FSDP2 fully_shard (block + root)", True),
    ("minishard FSDP, per-parameter, prefetch 1", dict(strategy="fsdp", prefetch=1,
                                                       track_activations=False),
     "torch FSDP2 fully_shard (block + root)", True),
    # DeepSpeed's ZeRO, where the idea comes from (unwatched, as PyTorch's baselines), against the
    # same PyTorch baselines as minishard's stage of it: the two ratios side by side compare them
    ("DeepSpeed ZeRO-1", dict(strategy="deepspeed_zero1", trace=False),
     "torch DDP + ZeroRedundancyOptimizer", True),
    ("DeepSpeed ZeRO-2", dict(strategy="deepspeed_zero2", trace=False),
     "torch DDP + ZeroRedundancyOptimizer", True),
    # its defaults keep a model under 1e9 parameters gathered after the first step (live and
    # reuse-distance bounds of 1e9, parameters under 1e5 elements never sharded): in effect
    # ZeRO-2; bounded to 0, it gathers every submodule every time, as ZeRO-3 is told
    ("DeepSpeed ZeRO-3 (its defaults)", dict(strategy="deepspeed_zero3", trace=False),
     "torch FSDP2 fully_shard (block + root)", True),
    ("DeepSpeed ZeRO-3 (every gather: bounds 0)",
     dict(strategy="deepspeed_zero3", trace=False, max_live_parameters=0, param_persistence_threshold=0),
     "torch FSDP2 fully_shard (block + root)", True),
]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def selected(only: list[str] | None, everything: bool = False) -> list[tuple]:
    """The contenders asked for (default: the main ones; ``everything``: the variants too),
    with the baselines they are compared against, as (label, kwargs, baseline)."""
    if only:
        keep = {c[0] for c in CONTENDERS if any(o.lower() in c[0].lower() for o in only)}
    else:
        keep = {c[0] for c in CONTENDERS if everything or c[3]}
    keep |= {c[2] for c in CONTENDERS if c[0] in keep and c[2]}
    return [c[:3] for c in CONTENDERS if c[0] in keep]


def steady(res: list[dict], warmup: int, steps: int) -> list[float]:
    """Per-step times after warm-up, each as slow as its slowest rank."""
    return [max(r["step_times"][s] for r in res) for s in range(warmup, steps)]


def bench(world_size: int, rounds: int, steps: int, warmup: int, model: str, micro_batch: int,
          bucket_cap_mb: float, contenders: list[tuple]) -> dict[str, dict]:
    times: dict[str, list[float]] = {label: [] for label, _, _ in contenders}
    sent: dict[str, list[int]] = {label: [] for label, _, _ in contenders}
    faults: dict[str, list[int]] = {label: [] for label, _, _ in contenders}
    compute, alone = [], []
    solo = dict(steps=steps, model=model, micro_batch=micro_batch)
    # the references without communication are measured in every round too, so that the
    # host's drift between rounds hits them and the contenders alike
    with Ranks(1) as one, Ranks(world_size, timeout=900) as ranks:
        for _ in range(rounds):
            alone += steady([{"step_times": t} for t in one.run(measure_compute, **solo)],
                            warmup, steps)
            compute += steady([{"step_times": t} for t in ranks.run(measure_compute, **solo)],
                              warmup, steps)
            for label, kw, _ in contenders:
                res = ranks.run(train, TrainConfig(steps=steps, model=model, micro_batch=micro_batch, bucket_cap_mb=bucket_cap_mb, **kw))
                times[label] += steady(res, warmup, steps)
                sent[label] += [res[0]["wchar"][s] for s in range(warmup, steps)]
                faults[label] += [res[0]["page_faults"][s] for s in range(warmup, steps)]
    t_compute, t_alone = statistics.median(compute), statistics.median(alone)
    out = {label: {"p50": statistics.median(times[label]), "p99": percentile(times[label], 0.99),
                   "sent": statistics.median(sent[label]),
                   "faults": statistics.median(faults[label])} for label in times}
    for r in out.values():
        r["comm_share"] = max(0.0, 1 - t_compute / r["p50"])
        r["scaling"] = t_alone / r["p50"]
    out["_reference"] = {"alone": t_alone, "compute": t_compute}
    return out


# the time make test may take, in minutes, on a machine whose one-process step is 0.43 s; a
# machine twice as fast gets half (DEVELOPERS' rule: 20 min x step / 0.43 s)
SUITE_MINUTES, SUITE_STEP_S = 20, 0.43


def alone(args) -> None:
    """The one-process step, as the full benchmark's "one process alone" measures it (one
    thread, the same model and micro-batch, warm-up dropped, the median), without starting
    ranks; with ``--suite-started``, the suite's wall time beside the budget that step sets."""
    import torch
    torch.set_num_threads(1)
    times = measure_compute(0, steps=args.steps, model=args.model, micro_batch=args.micro_batch)
    step = statistics.median(times[args.warmup:])
    print(f"one-process step: {step:.3f} s ({args.model}, micro_batch={args.micro_batch}, one "
          f"thread, median of {args.steps - args.warmup} steps)")
    if args.suite_started is not None:
        took, budget = time.time() - args.suite_started, SUITE_MINUTES * 60 * step / SUITE_STEP_S
        print(f"make test took {took:.0f} s; the budget at this step is {SUITE_MINUTES} min x "
              f"{step:.3f} / {SUITE_STEP_S} = {budget:.0f} s ({took / budget:.0%} of it)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="substrings of contender names to run")
    ap.add_argument("--all", action="store_true",
                    help="also the variants (naive DDP, ledger hooks on, ZeRO-1 all-reduce)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--alone", action="store_true",
                    help="only the one-process step, measured in this process (one thread)")
    ap.add_argument("--suite-started", type=float, metavar="EPOCH_S",
                    help="with --alone: also the seconds since then against make test's budget")
    args = ap.parse_args()
    if args.alone:
        return alone(args)
    started, cores = time.perf_counter(), os.cpu_count() or 1
    print(f"# minishard benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
          f"{platform.processor() or platform.machine()}, {cores} cores, model={args.model}, "
          f"micro_batch={args.micro_batch}/rank, bucket={args.bucket_cap_mb} MiB, "
          f"{args.rounds} rounds x {args.steps - args.warmup} timed steps")
    contenders = selected(args.only, args.all)
    for n in args.world_sizes:
        res = bench(n, args.rounds, args.steps, args.warmup, args.model, args.micro_batch,
                    args.bucket_cap_mb, contenders)
        ref = res.pop("_reference")
        print(f"\n{n} ranks: one process alone {ref['alone']:.3f} s/step; {n} ranks computing at "
              f"once without communication {ref['compute']:.3f} s/step (ideal scaling efficiency "
              f"with {n} ranks on {cores} cores: {min(1, cores / n):.0%})")
        print(f"{'contender':<44}{'p50 s':>7}{'p99 s':>7}{'ratio':>9}{'comm':>6}{'scaling':>8}"
              f"{'sent/step MB':>13}{'faults/step':>12}")
        for label, _, base in contenders:
            r = res[label]
            ratio = f"{r['p50'] / res[base]['p50']:.3f}" if base else "1 (base)"
            print(f"{label:<44}{r['p50']:>7.3f}{r['p99']:>7.3f}{ratio:>9}{r['comm_share']:>6.0%}"
                  f"{r['scaling']:>8.0%}{r['sent'] / 2**20:>13.2f}{r['faults']:>12,.0f}")
    print(f"\nbenchmark ran in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
