"""How long does ``Player.jump`` take on a long trace? (target: <= 50 ms per jump)

Builds a synthetic but realistic 4-rank DDP trace of about 10,000 events — parameters and
gradient buckets allocated up front, per step a forward that saves activations, a backward that
frees them while bucketed all-reduces run (each collective spans many events, so the ring view
animates), AdamW state allocated on the first optimizer step — then times random jumps.

``--offline`` times the player without a kernel instead (``minishard view``'s HTML file) in
headless Chromium (Debian's ``/usr/bin/chromium`` through Playwright, as the browser tests):
writing the file, opening it, a jump to a random event (the script's work with style and layout,
and until the next frame is painted; target <= 30 ms), and playing (events drawn per second at
each speed, one event per frame at most; target >= 30 events/s).

    .venv/bin/python benchmarks/bench_player.py [--events 10000] [--ranks 4] [--jumps 200]
    .venv/bin/python benchmarks/bench_player.py --offline [--events 10000] [--trace DIR]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from minishard.core import trace
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


# In the page: random jumps, each timed to the end of its style and layout (forced), then until
# the frame that shows it is painted (a message posted from that frame's animation callback
# runs after its paint; the wait for the display's next frame, up to 16.7 ms, is included).
JUMPS_JS = """async ([count, seed]) => {
    const p = MinishardReplay.players[0], root = p.root;
    let x = seed; const rand = () => (x = (x * 48271) % 2147483647) / 2147483647;
    const frame = () => new Promise(r => requestAnimationFrame(() => {
        const c = new MessageChannel(); c.port1.onmessage = r; c.port2.postMessage(0); }));
    const sync = [], painted = [];
    for (let k = 0; k < count; k++) {
        const i = Math.floor(rand() * p.n), t0 = performance.now();
        p.show(i); root.getBoundingClientRect();
        sync.push(performance.now() - t0);
        await frame();
        painted.push(performance.now() - t0);
    }
    return {sync, painted};
}"""
# Play for ``seconds`` at ``speed`` events/s: how many distinct events were drawn per second.
PLAY_JS = """async ([speed, seconds]) => {
    const p = MinishardReplay.players[0];
    p.stop(); p.show(0); p.speed = speed;
    let drawn = 0; const show = p.show.bind(p);
    p.show = i => { drawn++; show(i); };
    const t0 = performance.now(); p.play();
    await new Promise(r => setTimeout(r, seconds * 1000));
    p.stop(); p.show = show;
    const s = (performance.now() - t0) / 1000;
    return {drawn: drawn / s, advanced: p.index / s};
}"""


def stats(ms: list[float]) -> str:
    ms = sorted(ms)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return f"median {statistics.median(ms):.2f} ms, p99 {p99:.2f} ms, max {ms[-1]:.2f} ms"


def offline(events: list[dict], jumps: int) -> None:
    """The offline player in headless Chromium (network off)."""
    import sys
    import tempfile
    from pathlib import Path

    from minishard.viewers import offline_player
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from headless import chromium, missing

    if missing():
        raise SystemExit(f"bench_player --offline: {missing()}")
    t0 = time.perf_counter()
    data = offline_player.encode(events, title="bench")
    with tempfile.TemporaryDirectory() as tmp:
        path = offline_player.write(Path(tmp) / "player.html", data)
        write_s, size = time.perf_counter() - t0, path.stat().st_size
        with chromium(offline=True) as ctx:
            page = ctx.new_page()
            t0 = time.perf_counter()
            page.goto(path.as_uri())
            page.wait_for_function("() => (window.MinishardReplay || {players: []}).players.length === 1")
            open_s = time.perf_counter() - t0
            page.evaluate(JUMPS_JS, [20, 7])                        # warm-up
            got = page.evaluate(JUMPS_JS, [jumps, 12345])
            plays = {speed: page.evaluate(PLAY_JS, [speed, 4]) for speed in (30, 60, 1000)}
            engine = page.evaluate("navigator.userAgent")
    print(f"offline player: {len(events):,} events, {len(data['ranks'])} ranks; encoded and written in "
          f"{write_s:.2f} s, {size / 1e3:.0f} kB; opened (inflated, keyframes, first draw) in {open_s:.2f} s")
    print(f"  jump to a random event ({jumps}): script + style + layout {stats(got['sync'])}")
    print(f"  jump to a random event, until the frame showing it is painted: {stats(got['painted'])}")
    for speed, r in plays.items():
        print(f"  play at {speed}/s: {r['drawn']:.1f} events drawn per second, "
              f"{r['advanced']:.1f} events advanced per second")
    print(f"  ({engine.split(') ')[-1]}, headless, {os.cpu_count()} CPUs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--jumps", type=int, default=200)
    ap.add_argument("--offline", action="store_true", help="time minishard view's HTML player in headless Chromium")
    ap.add_argument("--trace", default=None, help="a recorded trace directory instead of the synthetic trace")
    args = ap.parse_args()

    events = trace.load(args.trace) if args.trace else synthetic_ddp_trace(args.ranks, args.events)
    if args.offline:
        offline(events, args.jumps)
        return
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
