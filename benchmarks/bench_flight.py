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
fingerprint of the weights once at the start: measured beside it.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

from minishard.core.comm import Comm
from minishard.core.launch import Ranks
from minishard.training.loop import TrainConfig, train

CALLS = 20_000


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


def main() -> None:
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
        for strategy in ("ddp_naive", "ddp", "zero2", "fsdp"):
            res = ranks.run(train, TrainConfig(strategy=strategy, model="tiny", steps=4, micro_batch=2,
                                               track_activations=False))
            step = statistics.median(res[0]["step_times"][1:])
            calls = statistics.median(res[0]["calls"][1:])
            print(f"{strategy:<10} {calls:>4.0f} collectives a step, step {step * 1e3:7.1f} ms: the "
                  f"recorder, ring included, costs {calls * cost * 1e3:.3f} ms = {100 * calls * cost / step:.3f} % of a step")


if __name__ == "__main__":
    main()
