"""Rank tasks and trace readings for chapter 10 (choosing and debugging).

Nothing here is a strategy: every allocation, collective and timing comes from
:func:`minishard.training.loop.train` and the engine under it. The tasks run on real ranks and return
plain data; the readings are pure functions of results and events.

* :func:`under_budget` trains under a device memory budget and, instead of failing the pool,
  reports a :class:`~minishard.core.ledger.DeviceOutOfMemory` as data — the OOM checklist, live.
* :func:`straggler` makes one rank slow on some steps: synchronous training waits for the
  slowest rank, so the healthy ranks' step times get the same tail (p50 vs p99).
* :func:`phase_seconds` reads how long each forward or backward took from a trace.
* :func:`profile` reads the profiling checklist (step time, utilisation, communication share,
  peak memory, scaling efficiency) off a run's results and trace events.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from minishard.core.comm import Comm
from minishard.core.launch import RankContext
from minishard.core.ledger import DeviceOutOfMemory, LiveLedger
from minishard.strategies.tp import TensorParallelMLP
from minishard.core.trace import phase_spans


# ---------------------------------------------------------------------------- the OOM checklist


def under_budget(rank: RankContext, budget: int, *, peak_too: bool = True, **train_kw) -> dict[str, Any]:
    """``train`` with ``TrainConfig(**train_kw, device_budget=budget)``. Returns whether it fit, and either
    the measured peak (``peak``, ``peak_snapshot`` by category) or the out-of-memory report
    read as data (:func:`oom_report`: what failed to allocate, what the device held). With
    ``peak_too``, a run that does not fit is repeated without the budget, to add the peak it
    would have reached.

    Every rank runs the same shapes, so every rank reaches the allocation that crosses the
    budget at the same point of the program and raises there: no rank is left waiting in a
    collective, and the warm pool stays usable (a real CUDA OOM usually ends the job)."""
    from minishard.training.loop import TrainConfig, train
    try:
        out = train(rank, TrainConfig(device_budget=budget, **train_kw))
        report: dict[str, Any] = {"fits": True}
    except DeviceOutOfMemory as e:
        report = {"fits": False, "error": str(e), **oom_report(e)}
        if not peak_too:
            return report
        out = train(rank, TrainConfig(**train_kw))
    led = out["ledger"]
    return {**report, "peak": led["peak"], "peak_snapshot": led["peak_snapshot"],
            "calls": out["calls"][-1], "step_times": out["step_times"]}


def oom_report(error: DeviceOutOfMemory) -> dict[str, Any]:
    """A :class:`~minishard.core.ledger.DeviceOutOfMemory` as data, in MiB: the category and size of
    the allocation that failed (and its tag), the total it would have reached, the budget, and
    what the device held by category — what you read first in a real out-of-memory report."""
    mib = 2**20
    return {"allocating": error.category, "alloc_mib": error.nbytes / mib, "tag": error.tag,
            "would_be_mib": error.would_be / mib, "budget_mib": error.budget / mib,
            "held_mib": {c: b / mib for c, b in sorted(error.held.items())}}


# ---------------------------------------------------------------------------- tail jitter


def straggler(rank: RankContext, slow_rank: int = 1, every: int = 5, delay: float = 0.1,
              steps: int = 20, strategy: str = "ddp", model: str = "nano",
              micro_batch: int = 2) -> dict[str, list[float]]:
    """Train ``steps`` steps; rank ``slow_rank`` sleeps ``delay`` seconds before the forward of
    every ``every``-th step (a stand-in for a slow node, a GC pause, a noisy neighbour).
    Returns this rank's wall-clock step times, measured from a common barrier."""
    from minishard.core.model import GPT, batch, config
    from minishard.training.loop import TrainConfig, build, train_step

    cfg = config(model)
    comm = Comm()
    built = build(GPT(cfg).to(rank.device), TrainConfig(strategy, model=model), comm)
    times = []
    for step in range(steps + 1):                  # step 0 warms up (first-touch allocations)
        x, y = batch(cfg, step, micro_batch, rank.rank, rank.world_size)
        comm.barrier()
        t0 = time.perf_counter()
        if rank.rank == slow_rank and step % every == every - 1:
            time.sleep(delay)
        train_step(built, [(x, y)])
        comm.barrier()                             # the step ends when every rank is done
        if step:
            times.append(time.perf_counter() - t0)
    return {"step_times": times, "slow_steps": [s for s in range(steps) if s % every == every - 2]}


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation, as numpy's default."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---------------------------------------------------------------------------- profiling


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def phase_seconds(events: list[dict], rank: int, name: str) -> list[float]:
    """Seconds rank ``rank`` spent in each top-level phase ``name`` (forward, backward, ...),
    step by step, from the trace's phase spans."""
    return [p.t1 - p.t0 for p in phase_spans(events)
            if p.rank == rank and p.name == name and not p.unit]


def comm_seconds(events: list[dict], rank: int, step: int) -> tuple[float, float]:
    """(seconds some collective of ``rank`` was in flight during ``step``, the step's duration),
    read from the trace: collective events carry ``t`` and ``t_end``, the step phase its edges."""
    mine = (e for e in events if e["rank"] == rank and e.get("step") == step)
    t0, t1 = next((p.t0, p.t1) for p in phase_spans(mine) if p.name == "step" and not p.unit)
    spans = [(max(e["t"], t0), min(e["t_end"], t1)) for e in events
             if e["kind"] == "collective" and e["rank"] == rank and e["t_end"] > t0 and e["t"] < t1]
    return _union(spans), t1 - t0


def profile(results: list[dict], events: list[dict], tokens_per_rank: int,
            single_tokens_per_s: float | None = None, skip: int = 1) -> dict[str, float]:
    """The profiling checklist for one run of :func:`~minishard.training.loop.train` on N ranks:

    * ``step_s``: median step time of the slowest rank (a synchronous step ends when it does),
      ``p99_s`` its 99th percentile;
    * ``tokens_per_s``: all ranks' tokens over the median step;
    * ``utilisation``: the share of the step a rank computes rather than waits for the network,
      1 - exposed communication / step time (FSDP reports the waits per step);
    * ``comm_share``: the share of the step some collective is in flight (from the trace; it
      can overlap compute);
    * ``peak_bytes``: the largest measured ledger peak over the ranks;
    * ``scaling_efficiency``: tokens/s over N times one process's (if given).

    ``skip`` first steps are left out (warm-up)."""
    N = len(results)
    steps = range(skip, len(results[0]["step_times"]))
    slowest = [max(r["step_times"][s] for r in results) for s in steps]
    step_s = statistics.median(slowest)
    exposed = statistics.median(results[0]["exposed_comm"][s] for s in steps)
    shares = []
    for s in steps:
        c, d = comm_seconds(events, 0, s)
        shares.append(c / d)
    out = {"world_size": N, "step_s": step_s, "p99_s": percentile(slowest, 99),
           "tokens_per_s": N * tokens_per_rank / step_s,
           "utilisation": 1 - exposed / statistics.median(results[0]["step_times"][s] for s in steps),
           "comm_share": statistics.median(shares),
           "peak_bytes": max(r["ledger"]["peak"] for r in results)}
    if single_tokens_per_s:
        out["scaling_efficiency"] = out["tokens_per_s"] / (N * single_tokens_per_s)
    return out


# --------------------------------------------------------------------------- §3: FSDP vs tensor parallelism


def compare_with_fsdp(rank: RankContext, micro_batch: int = 2, model: str = "tiny") -> dict:
    """One MLP forward+backward, tensor-parallel and FSDP-sharded, on real ranks: what each
    rank stores at its peak, what crosses the wire, and whether the results are the single-
    process ones. (A rank task; core question 3 of the course.)"""
    from minishard.strategies import fsdp
    from minishard.core.model import GPT, config

    cfg = config(model)
    full = GPT(cfg, seed=0).blocks[0].mlp                   # the same weights on every rank
    x = torch.randn(micro_batch, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(1))
    ref_x = x.clone().requires_grad_(True)
    ref = full(ref_x)
    ref.sum().backward()
    out = {}

    tracer = rank.tracer
    ledger = LiveLedger(tracer)
    comm = Comm(tracer, ledger=ledger)
    tp = TensorParallelMLP(full, comm, ledger)
    tx = x.clone().requires_grad_(True)
    y = tp(tx)
    y.sum().backward()
    # this rank's shards of the unsharded MLP's weight gradients (proj.bias: whole on every rank)
    N, F_ = comm.world_size, full.fc.out_features
    part = slice(rank.rank * F_ // N, (rank.rank + 1) * F_ // N)
    want = {"fc_w": full.fc.weight.grad[part], "fc_b": full.fc.bias.grad[part],
            "proj_w": full.proj.weight.grad[:, part], "proj_b": full.proj.bias.grad}
    out["tp"] = {"output_matches": torch.allclose(y, ref, atol=1e-5),
                 "grad_x_matches": torch.allclose(tx.grad, ref_x.grad, atol=1e-5),
                 "grad_w_gap": {n: (getattr(tp, n).grad - g).abs().max().item() for n, g in want.items()},
                 "grad_w_scale": {n: g.abs().max().item() for n, g in want.items()},
                 "peak_weight_bytes": ledger.category_peaks.get(("params", "device"), 0),
                 "wire": comm.totals["wire"], "calls": comm.totals["calls"]}

    ledger2 = LiveLedger(tracer)
    comm2 = Comm(tracer, ledger=ledger2)
    sharded = GPT(cfg, seed=0).blocks[0].mlp
    fsdp.fully_shard(sharded, comm=comm2, ledger=ledger2, reshard_after_forward=True, name="mlp")
    comm2.reset_counters()
    fx = x.clone().requires_grad_(True)
    y2 = sharded(fx)
    y2.sum().backward()
    peaks = {c: b for (c, d), b in ledger2.category_peaks.items()}
    out["fsdp"] = {"output_matches": torch.allclose(y2, ref, atol=1e-5),
                   "peak_weight_bytes": peaks.get("params", 0) + peaks.get("unsharded", 0),
                   "gathered_full_weights": peaks.get("unsharded", 0),
                   "wire": comm2.totals["wire"], "calls": comm2.totals["calls"]}
    out["full_weight_bytes"] = sum(p.numel() * 4 for p in full.parameters())
    out["activation_bytes"] = x.numel() * 4
    return out


# --------------------------------------------------------------------------- the planner's calibration on this machine


def measure_compute(rank, **train_kw) -> list[float]:
    """A rank task: step times of single-process training on every rank at once, with no
    communication — what one "device" computes when all the ranks share this machine's cores
    (see benchmarks/bench_planner.py)."""
    from minishard.training.loop import TrainConfig, train
    return train(None, TrainConfig(strategy="single", track_activations=False, **train_kw))["step_times"]


def measure_all_reduce(rank, sizes: list[int], repeats: int = 5) -> list[float]:
    """A rank task: median seconds of an fp32 all-reduce of each size (elements), to calibrate
    the loopback link (see benchmarks/bench_planner.py)."""
    comm = Comm()
    out = []
    for n in sizes:
        x = torch.ones(n)
        times = []
        for _ in range(repeats):
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(x)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


# ---------------------------------------------------------------------------- reshard_after_forward=k

def held_after_forward(events: list[dict], rank: int = 0, step: int = 0) -> int:
    """Bytes of gathered parameters (the ledger's ``unsharded``, the parts kept by
    ``reshard_after_forward=k`` included) on ``rank`` when forward ends in ``step``: what a unit
    keeps for its backward."""
    from minishard.core.trace import rank_events
    live = 0
    for e in rank_events(events, rank, step):
        if e["kind"] in ("alloc", "free") and e["category"] == "unsharded":
            live += e["bytes"] if e["kind"] == "alloc" else -e["bytes"]
        elif e["kind"] == "phase" and e["name"] == "forward" and e["edge"] == "end" and "unit" not in e:
            return live
    raise ValueError(f"rank {rank} has no forward in step {step}")
