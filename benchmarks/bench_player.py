"""How long does ``Player.jump`` take on a long trace? (target: <= 50 ms per jump)

Builds a synthetic but realistic 4-rank DDP trace of about 10,000 events — parameters and
gradient buckets allocated up front, per step a forward that saves activations, a backward that
frees them while bucketed all-reduces run (each collective spans many events, so the ring view
animates), AdamW state allocated on the first optimizer step — then times random jumps.

    .venv/bin/python benchmarks/bench_player.py [--events 10000] [--ranks 4] [--jumps 200]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from minishard import trace
from minishard.viz import Player


def synthetic_ddp_trace(world_size: int = 4, target_events: int = 10_000, seed: int = 0,
                        n_params: int = 40, n_acts: int = 100, n_buckets: int = 4) -> list[dict]:
    """Events as ``minishard.train`` would record them for DDP, with jittered timings."""
    rng = random.Random(seed)
    per_step = 2 * n_acts + n_buckets + 8               # allocs, frees, collectives, phase edges
    steps = max(1, (target_events // world_size - 2 * n_params) // per_step)
    sizes = [rng.choice([256, 768, 16384, 49152, 65536]) for _ in range(n_params)]
    events = []
    for rank in range(world_size):
        seq, t = 0, 0.001 * rank

        def emit(kind, dt=2e-5, **fields):
            nonlocal seq, t
            t += dt * rng.uniform(0.5, 1.5)
            ev = {"v": trace.SCHEMA_VERSION, "rank": rank, "seq": seq, "t": round(t, 7), "kind": kind, **fields}
            seq += 1
            events.append(ev)
            return ev

        for j, size in enumerate(sizes):
            emit("alloc", category="params", bytes=size, tag=f"param:{j}", device="device")
            emit("collective", op="broadcast", payload=size, wire=size if rank == 0 else 0,
                 dtype="float32", group=world_size, tag=f"init:{j}", src=0, t_end=round(t + 1e-4, 7))
        emit("alloc", category="grads", bytes=sum(sizes), tag="buckets", device="device")
        bucket = sum(sizes) // n_buckets
        for step in range(steps):
            emit("phase", name="step", edge="begin", step=step)
            emit("phase", name="forward", edge="begin", step=step)
            acts = [rng.choice([256, 1024, 16384, 65536]) for _ in range(n_acts)]
            for a, size in enumerate(acts):
                emit("alloc", category="activations", bytes=size, tag=f"act{a}", device="device", step=step)
            emit("phase", name="forward", edge="end", step=step)
            emit("phase", name="backward", edge="begin", step=step)
            launch_at = {n_acts * (b + 1) // n_buckets - 1: b for b in range(n_buckets)}
            pending = []
            for a in reversed(range(n_acts)):
                emit("free", category="activations", bytes=acts[a], tag=f"act{a}", device="device", step=step)
                if (n_acts - 1 - a) in launch_at:               # a bucket is full: launch its all-reduce
                    pending.append((launch_at[n_acts - 1 - a], t))
            for b, t0 in pending:                                # recorded at wait(), stamped at launch
                emit("collective", op="all_reduce", payload=bucket, wire=2 * (world_size - 1) * bucket // world_size,
                     dtype="float32", group=world_size, tag=f"bucket{b}", step=step, t_end=round(t + 1e-4, 7))
                events[-1]["t"] = round(t0, 7)
            emit("phase", name="backward", edge="end", step=step)
            emit("phase", name="optimizer", edge="begin", step=step)
            if step == 0:
                for j, size in enumerate(sizes):
                    emit("alloc", category="exp_avg", bytes=size, tag=f"m:{j}", device="device", step=step)
                    emit("alloc", category="exp_avg_sq", bytes=size, tag=f"v:{j}", device="device", step=step)
            emit("phase", name="optimizer", edge="end", step=step)
            emit("phase", name="step", edge="end", step=step)
    return trace.merge(events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--jumps", type=int, default=200)
    args = ap.parse_args()

    events = synthetic_ddp_trace(args.ranks, args.events)
    t0 = time.perf_counter()
    p = Player(events)
    build_s = time.perf_counter() - t0
    rng = random.Random(1)
    for i in rng.sample(range(len(events)), 10):        # warm-up: first plotly validations
        p.jump(i)
    times = []
    for _ in range(args.jumps):
        i = rng.randrange(len(events))
        t0 = time.perf_counter()
        p.jump(i)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    n_coll = sum(e["kind"] == "collective" for e in events)
    print(f"trace: {len(events)} events, {args.ranks} ranks, {n_coll} collectives; Player() built in {build_s:.2f} s "
          "(including the first LiveFigure and the kernel's plotly.js library widget)")
    print(f"jump over {args.jumps} random events: median {statistics.median(times):.2f} ms, "
          f"p99 {p99:.2f} ms, max {times[-1]:.2f} ms")


if __name__ == "__main__":
    main()
