"""The cost of the flight recorder when nothing fails (issue 27: at most 2 % of a step), in
memory and on disk as it flies (issue 41: under twice the in-memory cost, under 0.5 % of a step).

    python benchmarks/bench_flight.py

Every collective minishard's ``Comm`` issues enters the recorder (``minishard/core/flight.py``): a
dict, a walk up the stack to the issuing and the calling line, a lock. This measures that cost
per collective (the same all-reduce of a 1,000-element tensor with and without the recorder's
two calls, from 20 frames deep, as a training step calls it), then multiplies it by each
strategy's collectives per step and divides by its step time on 2 ranks of the tiny GPT. On disk,
two ways are measured: the memory-mapped ring minishard keeps (``core/flight_file.py``: the entry
as JSON into its slot, then a 1-byte state change when it completes) and an append-only log (a
JSON line per issue and one per completion, ``os.write`` on an ``O_APPEND`` file: what the ring
would be without its fixed slots). The
doctor's facts (``minishard/instruments/health.py``) cost a few microseconds a step for fp32 weights and a
fingerprint of the weights once at the start: measured beside it. So is what a run pays every
``fingerprint_every`` steps (default 10) for the replicas' record (``instruments/replicas.py``: the
fingerprints of the parameters a rank holds as replicas, the optimizer's settings, the ring's
slot), on the ranks of each strategy, with XXH3 as recorded and with BLAKE2 in its place:

    python benchmarks/bench_flight.py               # all of it (about a minute)
    python benchmarks/bench_flight.py --replicas    # the replicas' record only
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from minishard.core.comm import Comm
from minishard.core.launch import Ranks
from minishard.training.loop import TrainConfig, train

CALLS = 20_000
STRATEGIES = ("ddp_naive", "ddp", "zero2", "fsdp")
sys.path.insert(0, str(Path(__file__).resolve().parent))     # the ranks import this file's task


VARIANTS = ("bare", "memory", "ring", "log")


def per_call() -> dict[str, float]:
    """Seconds per ``Comm.all_reduce`` on a world of one, from 20 frames deep, for each variant:
    no recorder, the recorder in memory, and also on disk as the ``ring`` or an append-only
    ``log`` — interleaved round by round (5 rounds of ``CALLS``), the median of each, so that a
    shared machine's drift falls on all of them alike."""
    t, comms = torch.zeros(1000), {}
    for variant in VARIANTS:
        comm = comms[variant] = Comm(alone=True)
        if variant == "bare":
            comm.flight.issued = lambda *a, **k: {}
            comm.flight.completed = lambda *a, **k: None
        elif variant == "ring":
            comm.flight.fly_to(tempfile.mkdtemp(prefix="bench-flight-"))
        elif variant == "log":
            _log_to(comm.flight, tempfile.mkdtemp(prefix="bench-flight-"))

    def deep(comm, n: int) -> float:
        if n:
            return deep(comm, n - 1)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            comm.all_reduce(t, tag="x")
        return (time.perf_counter() - t0) / CALLS
    rounds = [{v: deep(comms[v], 20) for v in VARIANTS} for _ in range(5)]
    return {v: statistics.median(r[v] for r in rounds) for v in VARIANTS}


def _log_to(recorder, folder: str) -> None:
    """The alternative to the ring: every issue and every completion appended as a JSON line."""
    fd = os.open(os.path.join(folder, "flight.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    encode = json.JSONEncoder(separators=(",", ":")).encode
    issued, completed = recorder.issued, recorder.completed

    def log_issued(*a, **k):
        entry = issued(*a, **k)
        os.write(fd, (encode(entry) + "\n").encode())
        return entry

    def log_completed(entry, t):
        completed(entry, t)
        os.write(fd, (encode({"seq": entry["seq"], "group": entry["group"], "t": t}) + "\n").encode())
    recorder.issued, recorder.completed = log_issued, log_completed


def facts_cost() -> tuple[float, float]:
    """The doctor's facts (``minishard/instruments/health.py``): seconds per step for the notes around an
    fp32 optimizer step (which dtypes it steps; no copy), and once at the start for the
    fingerprints of the tiny GPT's weights."""
    from minishard.instruments import health
    from minishard.core.model import GPT
    net = GPT("tiny")
    opt = torch.optim.AdamW(net.parameters())
    t0 = time.perf_counter()
    for _ in range(200):
        with health.StepNotes(opt):
            pass
    per_step = (time.perf_counter() - t0) / 200
    t0 = time.perf_counter()
    health.fingerprint(net.named_parameters())
    return per_step, time.perf_counter() - t0


def record_cost(rank, strategy: str, repeats: int = 7, model: str = "tiny") -> dict[str, float]:
    """A rank task: seconds for one replicas' record of ``model`` under ``strategy`` (the
    median of ``repeats``), as a run takes it — the sets, their XXH3 fingerprints, the settings,
    the ring's slot — and the same fingerprints with BLAKE2 instead, for comparison."""
    from minishard.core.comm import Comm
    from minishard.core.model import GPT
    from minishard.instruments import health, replicas
    from minishard.strategies.registry import build
    rank.tracer.enabled = False
    config = TrainConfig(strategy=strategy, model=model, track_activations=False)
    comm = Comm(rank.tracer)
    built = build(GPT(model), config, comm, None)
    comm.flight.fly_to(tempfile.mkdtemp(prefix="bench-replicas-"))
    notes = replicas.ReplicaNotes(built.model, getattr(built.optimizer, "optimizer", built.optimizer),
                                  comm.flight)
    xxh, blake = [], []
    for step in range(repeats):
        t0 = time.perf_counter()
        notes.note(step)
        xxh.append(time.perf_counter() - t0)
        named = [t for ts in replicas.replicated_sets(built.model).values() for t in ts]
        t0 = time.perf_counter()
        health.fingerprint(named)
        blake.append(time.perf_counter() - t0)
    held = sum(t.numel() * t.element_size() for ts in replicas.replicated_sets(built.model).values()
               for _, t in ts)
    return {"xxh3": statistics.median(xxh), "blake2": statistics.median(blake), "bytes": held}


def replicas_cost(ranks) -> None:
    """Each strategy's step on 2 ranks of the tiny GPT, and a replicas' record's cost over the
    default cadence's steps: the share of a step a run pays."""
    from minishard.instruments.replicas import EVERY
    for strategy in STRATEGIES:
        res = ranks.run(train, TrainConfig(strategy=strategy, model="tiny", steps=4, micro_batch=2,
                                           track_activations=False))
        step = statistics.median(res[0]["step_times"][1:])
        task = importlib.import_module("bench_flight").record_cost      # (by its module's name)
        cost = max(ranks.run(task, strategy), key=lambda c: c["xxh3"])    # the slower rank
        print(f"{strategy:<10} step {step * 1e3:7.1f} ms; a replicas' record ({cost['bytes']:,} B held as "
              f"replicas) {cost['xxh3'] * 1e3:.2f} ms, every {EVERY} steps = {100 * cost['xxh3'] / EVERY / step:.3f} "
              f"% of a step (with BLAKE2: {cost['blake2'] * 1e3:.2f} ms, {100 * cost['blake2'] / EVERY / step:.3f} %)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", action="store_true", help="only the replicas' record's cost")
    args = p.parse_args()
    if args.replicas:
        with Ranks(2) as ranks:
            replicas_cost(ranks)
        return
    times = per_call()
    cost = times["memory"] - times["bare"]
    print(f"the recorder in memory: +{cost * 1e6:.1f} us per collective (median of 5 interleaved "
          f"rounds x {CALLS:,} calls)")
    disk = {how: times[how] - times["bare"] for how in ("ring", "log")}
    for how, c in disk.items():
        print(f"  and on disk as it flies, {how:<4}: +{c * 1e6:.1f} us per collective "
              f"({c / cost:.2f}x the recorder in memory)")
    cost = disk["ring"]                                  # what a run with a flight_dir pays
    per_step, once = facts_cost()
    print(f"the facts: {per_step * 1e6:.1f} us per step (fp32: no copy), {once * 1e3:.1f} ms once at the "
          f"start (fingerprints of the tiny GPT's weights, twice for replicas)")
    with Ranks(2) as ranks:
        replicas_cost(ranks)
        for strategy in STRATEGIES:
            res = ranks.run(train, TrainConfig(strategy=strategy, model="tiny", steps=4, micro_batch=2,
                                               track_activations=False))
            step = statistics.median(res[0]["step_times"][1:])
            calls = statistics.median(res[0]["calls"][1:])
            print(f"{strategy:<10} {calls:>4.0f} collectives a step, step {step * 1e3:7.1f} ms: the "
                  f"recorder, ring included, costs {calls * cost * 1e3:.3f} ms = {100 * calls * cost / step:.3f} % of a step")


if __name__ == "__main__":
    main()
