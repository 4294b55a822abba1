"""How cost grows: step time and bytes per step against the model size and the world size,
minishard and PyTorch side by side, and checkpoint save/load throughput against the state size.

    python benchmarks/bench_scaling.py            # the full matrix, writes benchmarks/scaling.json
    python benchmarks/bench_scaling.py --quick    # a smoke run: small GPTs, 1 and 2 ranks, 1 round
    python benchmarks/bench_scaling.py --report benchmarks/scaling.json   # the tables again, no run

The matrix (about 15 minutes on 2 cores):

* **model size** — three GPTs (width and depth grow together, the largest >= 50 M parameters) on
  2 ranks, every contender;
* **world size** — the middle GPT on 1, 2, 4 and 8 ranks, every contender (weak scaling: the
  micro-batch per rank is fixed). With N ranks on C cores and N > C, the ranks share the cores:
  each computes at C/N of a core's speed, so step time grows about N/C before any byte is sent.
  The tables say so on every such row;
* **checkpoints** — ``minishard.checkpoint.save`` and ``load`` (the public API, integrity checks
  on) of each GPT's FSDP state — parameters and both AdamW moments — on 2 ranks.

The contenders are bench.py's (imported from it, not copied): PyTorch's DDP, DDP +
``ZeroRedundancyOptimizer`` and FSDP2 ``fully_shard`` (block + root), minishard's DDP, ZeRO-1,
ZeRO-2 and FSDP (per-parameter), each trained for ``--steps`` steps of which the first
``--warmup`` are dropped, interleaved round by round in one warm pool of ranks per world size.

Bytes per step are the kernel's count of what rank 0 wrote (``/proc/self/io`` wchar, bench.py's
"sent/step" column). They are deterministic, so every point is checked against its formula
(:func:`formula`) and the relation is printed. The fits (least squares, :func:`fits`):

* bytes/step = c * 4Ψ(N-1)/N through the origin: the fitted c beside the formula's;
* time/step = a Ψ + b on 2 ranks (slope, intercept, R²);
* time/step = a N + b over N >= 2 (all but N = 2 oversubscribe 2 cores), beside t(2)·N/2, the
  time that oversubscription alone would give;
* checkpoint seconds = S / B + t0 over the per-rank state S (B: MB/s per rank, t0: fixed cost).

Results go to a JSON file (``--out``; the committed run is ``benchmarks/scaling.json``, which
chapter 10 plots) and are printed as tables.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench.py, and for the ranks

from bench import percentile, selected, steady  # noqa: E402  (the contender machinery)

HERE = Path(__file__).resolve().parent
OUT = HERE / "scaling.json"
BYTES = 4                                        # fp32 everywhere in this matrix
REL_TOL, ABS_TOL = 1e-3, 16384                   # measured vs formula: gloo's headers, ZeRO's bucket padding

# width and depth grow together; the largest >= 50 M parameters
SIZES = {"S": dict(d_model=256, n_layer=6, n_head=4),      # the course's tiny GPT, 6.9 M
         "M": dict(d_model=512, n_layer=8, n_head=8),      # 21.1 M
         "L": dict(d_model=768, n_layer=12, n_head=12)}    # 53.7 M
QUICK_SIZES = {"S": dict(d_model=64, n_layer=2, n_head=4),
               "M": dict(d_model=128, n_layer=3, n_head=4),
               "L": dict(d_model=192, n_layer=4, n_head=4)}
STRATEGIES = ("torch_ddp", "ddp", "torch_zero1", "zero1", "zero2", "torch_fsdp", "fsdp")
FAMILY = {"torch_ddp": "DDP", "ddp": "DDP", "torch_zero1": "ZeRO", "zero1": "ZeRO",
          "zero2": "ZeRO", "torch_fsdp": "FSDP", "fsdp": "FSDP"}


def contenders() -> list[tuple[str, dict, str | None]]:
    """bench.py's default contenders, the first of each strategy this matrix measures (the
    main variant: per-parameter FSDP, not flat nor prefetch 1), as (label, kwargs, baseline)."""
    out, seen = [], set()
    for label, kw, base in selected(None):
        if kw["strategy"] in STRATEGIES and kw["strategy"] not in seen:
            seen.add(kw["strategy"])
            out.append((label, kw, base))
    return out


# ------------------------------------------------------------------ the formulas
def shapes(overrides: dict) -> dict:
    """The GPT's parameter shapes (model order), split into the root unit and the blocks."""
    from minishard.core.model import GPT, config
    net = GPT(config("tiny", **overrides), device="meta")
    blocks = [[tuple(p.shape) for p in b.parameters()] for b in net.blocks]
    in_blocks = {id(p) for b in net.blocks for p in b.parameters()}
    root = [tuple(p.shape) for p in net.parameters() if id(p) not in in_blocks]
    return {"all": [tuple(p.shape) for p in net.parameters()], "root": root, "blocks": blocks}


def _numel(shape: tuple) -> int:
    return math.prod(shape)


def _padded(shape: tuple, n: int) -> int:
    """Elements of a parameter sharded along dim 0 on n ranks, rows padded to a multiple of n
    (FSDP2's layout and minishard's per-parameter layout)."""
    return math.ceil(shape[0] / n) * n * _numel(shape[1:])


def zero_partition(all_shapes: list[tuple], n: int) -> list[int]:
    """Elements each rank owns under ``ZeroRedundancyOptimizer``'s partition (largest first,
    each to the rank with the fewest so far, the first such rank on a tie)."""
    sizes = [0] * n
    for numel in sorted((_numel(s) for s in all_shapes), reverse=True):
        sizes[sizes.index(min(sizes))] += numel
    return sizes


def formula(strategy: str, overrides: dict, n: int, rank: int = 0) -> tuple[int, str]:
    """Bytes rank ``rank`` sends per fp32 step under ``strategy`` on ``n`` gloo ranks, and the
    formula in words. Ring collectives (minishard.core.comm.ring_wire_bytes): all-reduce 2(N-1)/N·S,
    all-gather and reduce-scatter (N-1)/N·S; broadcast a binomial tree."""
    from minishard.core.comm import ring_wire_bytes as wire
    sh = shapes(overrides)
    psi = sum(_numel(s) for s in sh["all"])
    if strategy in ("ddp", "torch_ddp"):
        return wire("all_reduce", BYTES * psi, n), "all-reduce of the gradients: 2(N-1)/N·4Ψ"
    if strategy in ("zero1", "zero2"):
        return (2 * wire("all_gather", BYTES * psi, n),
                "reduce-scatter of the gradients + all-gather of the parameters: 2(N-1)/N·4Ψ")
    if strategy == "torch_zero1":
        casts = sum(wire("broadcast", BYTES * owned, n, rank=rank, src=r)
                    for r, owned in enumerate(zero_partition(sh["all"], n)))
        return (wire("all_reduce", BYTES * psi, n) + casts,
                "all-reduce 2(N-1)/N·4Ψ + every rank's updated parameters broadcast (binomial tree)")
    if strategy in ("fsdp", "torch_fsdp"):
        units = [sh["root"]] + sh["blocks"]
        total = sum(BYTES * _padded(s, n) for u in units for s in u)
        blocks = sum(BYTES * _padded(s, n) for u in sh["blocks"] for s in u)
        gathers = wire("all_gather", total, n) + wire("all_gather", blocks, n)
        if strategy == "fsdp":                    # minishard on gloo: all_to_all + a local sum
            return (gathers + wire("reduce_scatter", total, n),
                    "all-gather every unit + the blocks again in backward (the root stays gathered) "
                    "+ reduce-scatter: (N-1)/N·4·(3Ψ - Ψ_root)")
        return (gathers + wire("all_reduce", total, n),   # gloo's reduce_scatter is an all-reduce
                "all-gather every unit + the blocks again in backward + gloo's reduce-scatter "
                "(a full all-reduce): (N-1)/N·4·(4Ψ - Ψ_root)")
    raise ValueError(f"no byte formula for strategy {strategy!r}")


def formula_constant(strategy: str, overrides: dict) -> float:
    """c in bytes/step ≈ c·4Ψ(N-1)/N: 2 for DDP and ZeRO, 3 for DDP + ZeroRedundancyOptimizer
    (its broadcasts add 1), 3 - Ψ_root/Ψ for minishard's FSDP, 4 - Ψ_root/Ψ for FSDP2 on gloo."""
    sh = shapes(overrides)
    root = sum(_numel(s) for s in sh["root"]) / sum(_numel(s) for s in sh["all"])
    return {"ddp": 2, "torch_ddp": 2, "zero1": 2, "zero2": 2, "torch_zero1": 3,
            "fsdp": 3 - root, "torch_fsdp": 4 - root}[strategy]


def bytes_match(measured: float, expected: int) -> bool:
    """The relation every point must satisfy: the kernel's count equals the formula within
    gloo's protocol headers and ZeRO's bucket padding (0.1% or 16 KiB per step)."""
    return abs(measured - expected) <= REL_TOL * expected + ABS_TOL


def relation(point: dict) -> str:
    m, f = point["sent"], point["formula"]
    ratio = f"{m / f:.4f}" if f else "-"
    return (f"measured {m:,.0f} B/step vs formula {f:,} B ({ratio}): "
            f"{'equal within 0.1%' if bytes_match(m, f) else 'DIFFERENT'}")


# ------------------------------------------------------------------ the fits
def linfit(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = slope·x + intercept, with R²."""
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    return {"slope": slope, "intercept": intercept, "r2": _r2(xs, ys, slope, intercept), "n": n}


def propfit(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = c·x (through the origin), with R² about the mean."""
    c = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return {"c": c, "r2": _r2(xs, ys, c, 0.0), "n": len(xs)}


def _r2(xs, ys, slope, intercept) -> float:
    my = statistics.fmean(ys)
    tot = sum((y - my) ** 2 for y in ys)
    res = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys))
    return 1 - res / tot if tot else 1.0


def fits(data: dict) -> dict:
    """Every fitted growth law of a result (see the module docstring), per contender."""
    mid, cores = data["middle"], data["cores"]
    out = {"bytes": {}, "time_vs_params": {}, "time_vs_ranks": {}, "checkpoint": {}}
    for c in data["contenders"]:
        pts = [p for p in data["points"] if p["contender"] == c["label"]]
        sent = [p for p in pts if p["world_size"] > 1]
        law = propfit([BYTES * p["params"] * (p["world_size"] - 1) / p["world_size"] for p in sent],
                      [p["sent"] for p in sent])
        # the formula's own c at each point (FSDP's depends on the root's share of Ψ, the
        # broadcasts of ZeroRedundancyOptimizer on how evenly its partition splits Ψ)
        law["formula_c"] = [p["formula"] / (BYTES * p["params"] * (p["world_size"] - 1) / p["world_size"])
                            for p in sent]
        law["vs_formula"] = propfit([p["formula"] for p in sent], [p["sent"] for p in sent])["c"]
        law["all_match"] = all(bytes_match(p["sent"], p["formula"]) for p in pts)
        out["bytes"][c["label"]] = law
        two = sorted((p for p in pts if p["world_size"] == 2), key=lambda p: p["params"])
        out["time_vs_params"][c["label"]] = linfit([p["params"] for p in two], [p["p50"] for p in two])
        ranks = sorted((p for p in pts if p["model"] == mid and p["world_size"] >= 2),
                       key=lambda p: p["world_size"])
        if len(ranks) >= 2:
            f = linfit([p["world_size"] for p in ranks], [p["p50"] for p in ranks])
            t2 = ranks[0]["p50"]
            f["oversubscribed_only"] = {p["world_size"]: t2 * max(1, p["world_size"] / cores)
                                        / max(1, 2 / cores) for p in ranks}
            out["time_vs_ranks"][c["label"]] = f
    for kind in ("save", "load"):
        rows = data.get("checkpoint", [])
        if len(rows) >= 2:
            f = linfit([r["bytes_per_rank"] / 1e6 for r in rows], [r[f"{kind}_s"] for r in rows])
            f["mb_per_s_per_rank"] = 1 / f["slope"] if f["slope"] > 0 else float("inf")
            out["checkpoint"][kind] = f
    return out


# ------------------------------------------------------------------ measuring
def sweep(ranks, models: list[str], sizes: dict, conts: list, rounds: int, steps: int,
          warmup: int, micro_batch: int, bucket_cap_mb: float) -> list[dict]:
    """Every contender on every model of ``models`` in one pool, interleaved round by round."""
    from minishard.training.loop import TrainConfig, train
    acc = {(label, m): {"times": [], "sent": [], "wire": []} for m in models for label, _, _ in conts}
    for _ in range(rounds):
        for m in models:
            for label, kw, _ in conts:
                res = ranks.run(train, TrainConfig(steps=steps, model="tiny", model_overrides=sizes[m],
                                                   micro_batch=micro_batch, bucket_cap_mb=bucket_cap_mb, **kw))
                a = acc[(label, m)]
                a["times"] += steady(res, warmup, steps)
                a["sent"] += [res[0]["wchar"][s] for s in range(warmup, steps)]
                a["wire"] += [res[0]["wire"][s] for s in range(warmup, steps)]
                a["params"] = res[0]["n_params"]
    points = []
    for (label, m), a in acc.items():
        strategy = next(kw["strategy"] for lb, kw, _ in conts if lb == label)
        f, text = formula(strategy, sizes[m], ranks.world_size)
        points.append({"contender": label, "strategy": strategy, "model": m, "params": a["params"],
                       "world_size": ranks.world_size, "times": a["times"],
                       "p50": statistics.median(a["times"]), "p99": percentile(a["times"], 0.99),
                       "sent_steps": a["sent"], "sent": statistics.median(a["sent"]),
                       "comm_wire": statistics.median(a["wire"]), "formula": f, "formula_text": text})
    return points


def checkpoint_rounds(rank, overrides: dict, path: str, rounds: int) -> dict:
    """A rank task: build a GPT under minishard's FSDP with AdamW state, then ``rounds`` times
    save it with ``minishard.checkpoint.save`` and load it back with ``load``, each timed from
    an agreed start to its return; the bytes are what the checkpoint holds on disk."""
    from minishard import checkpoint
    from minishard.core.comm import Comm
    from minishard.core.model import GPT, config
    from minishard.training.loop import TrainConfig, build
    rank.tracer.enabled = False
    comm = Comm(rank.tracer)
    built = build(GPT(config("tiny", **overrides), seed=0),
                  TrainConfig(strategy="fsdp", model="tiny", model_overrides=overrides), comm)
    save_s, load_s = [], []
    for _ in range(rounds):
        comm.barrier()
        t0 = time.perf_counter()
        checkpoint.save(built.model, built.optimizer, path, comm=comm, step=0)
        save_s.append(time.perf_counter() - t0)
        comm.barrier()
        t0 = time.perf_counter()
        checkpoint.load(built.model, built.optimizer, path, comm=comm)
        load_s.append(time.perf_counter() - t0)
    disk = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    return {"save_s": save_s, "load_s": load_s, "disk_bytes": disk}


def checkpoints(ranks, sizes: dict, rounds: int, root: Path) -> list[dict]:
    rows = []
    for m, overrides in sizes.items():
        res = ranks.run("bench_scaling:checkpoint_rounds", overrides, str(root / m), rounds)
        # a collective save ends when its slowest rank does
        save = [max(r["save_s"][k] for r in res) for k in range(rounds)]
        load = [max(r["load_s"][k] for r in res) for k in range(rounds)]
        disk = res[0]["disk_bytes"]
        rows.append({"model": m, "world_size": ranks.world_size, "disk_bytes": disk,
                     "bytes_per_rank": disk / ranks.world_size, "save_rounds": save,
                     "load_rounds": load, "save_s": statistics.median(save),
                     "load_s": statistics.median(load)})
        shutil.rmtree(root / m, ignore_errors=True)
    return rows


# ------------------------------------------------------------------ printing
def oversubscription(n: int, cores: int) -> str:
    return f"{n} ranks on {cores} cores, {n / cores:g}x oversubscribed" if n > cores else ""


def print_points(data: dict, points: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'contender':<40}{'model':>6}{'Ψ M':>7}{'N':>3}{'p50 s':>8}{'p99 s':>8}{'vs PyTorch':>11}"
          f"{'sent MB':>9}{'formula MB':>11}{'ratio':>8}  bytes = formula")
    base = {c["label"]: c["baseline"] for c in data["contenders"]}
    for p in points:
        b = next((q for q in data["points"] if q["contender"] == base[p["contender"]]
                  and q["model"] == p["model"] and q["world_size"] == p["world_size"]), None)
        vs = f"{p['p50'] / b['p50']:.3f}" if b else "(base)"
        ratio = f"{p['sent'] / p['formula']:.4f}" if p["formula"] else "-"
        print(f"{p['contender']:<40}{p['model']:>6}{p['params'] / 1e6:>7.1f}{p['world_size']:>3}"
              f"{p['p50']:>8.3f}{p['p99']:>8.3f}{vs:>11}{p['sent'] / 2**20:>9.2f}"
              f"{p['formula'] / 2**20:>11.2f}{ratio:>8}  {bytes_match(p['sent'], p['formula'])}")


def print_fits(data: dict) -> None:
    f, mid = data["fits"], data["middle"]
    print("\nfitted growth (least squares)")
    print(f"{'bytes/step = c·4Ψ(N-1)/N':<40}{'c fitted':>9}{'c formula':>16}{'vs formula':>11}"
          f"{'R²':>8}  every point = formula")
    for label, b in f["bytes"].items():
        lo, hi = min(b["formula_c"]), max(b["formula_c"])
        fc = f"{lo:.3f}" if hi - lo < 1e-9 else f"{lo:.3f}–{hi:.3f}"
        print(f"{label:<40}{b['c']:>9.3f}{fc:>16}{b['vs_formula']:>11.4f}{b['r2']:>8.4f}  {b['all_match']}")
    print(f"\n{'time/step = a·Ψ + b, 2 ranks':<40}{'a ms/M':>9}{'b ms':>9}{'R²':>7}")
    for label, t in f["time_vs_params"].items():
        print(f"{label:<40}{t['slope'] * 1e9:>9.1f}{t['intercept'] * 1e3:>9.0f}{t['r2']:>7.3f}")
    if f["time_vs_ranks"]:
        print(f"\n{'time/step = a·N + b, model ' + mid + ', N >= 2':<40}{'a s/rank':>9}{'b s':>8}{'R²':>7}"
              f"   t(N) measured / oversubscription alone (N/{data['cores']} cores)")
        for label, t in f["time_vs_ranks"].items():
            meas = {p["world_size"]: p["p50"] for p in data["points"]
                    if p["contender"] == label and p["model"] == mid}
            rel = ", ".join(f"N={n}: {meas[int(n)]:.2f}/{v:.2f} s" for n, v in t["oversubscribed_only"].items())
            print(f"{label:<40}{t['slope']:>9.3f}{t['intercept']:>8.3f}{t['r2']:>7.3f}   {rel}")
    for kind, c in f["checkpoint"].items():
        rate = f"{c['mb_per_s_per_rank']:.0f} MB/s per rank" if c["slope"] > 0 else "no growth measured"
        print(f"checkpoint {kind}: seconds = S/B + t0 with B = {rate}, t0 = {c['intercept']:.2f} s, "
              f"R² = {c['r2']:.3f}")


def print_checkpoints(rows: list[dict]) -> None:
    print(f"\ncheckpoint (minishard FSDP state: params + two AdamW moments), {rows[0]['world_size']} ranks")
    print(f"{'model':>6}{'MB/rank':>9}{'save s':>8}{'save MB/s/rank':>16}{'load s':>8}{'load MB/s/rank':>16}")
    for r in rows:
        mb = r["bytes_per_rank"] / 1e6
        print(f"{r['model']:>6}{mb:>9.1f}{r['save_s']:>8.2f}{mb / r['save_s']:>16.0f}{r['load_s']:>8.2f}"
              f"{mb / r['load_s']:>16.0f}")


# ------------------------------------------------------------------ the run
def run(args) -> dict:
    from minishard.core.launch import Ranks
    from minishard.core.model import GPT, config
    import torch
    sizes = QUICK_SIZES if args.quick else SIZES
    conts = contenders()
    cores = os.cpu_count() or 1
    data = {"started": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.node(),
            "cpu": platform.processor() or platform.machine(), "cores": cores,
            "load_before": os.getloadavg()[0], "torch": torch.__version__, "quick": args.quick,
            "micro_batch": args.micro_batch, "bucket_cap_mb": args.bucket_cap_mb,
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "middle": "M", "sweep_world_size": 2,
            "models": {m: {"overrides": o, "params": GPT(config("tiny", **o), device="meta").num_params()}
                       for m, o in sizes.items()},
            "contenders": [{"label": lb, "strategy": kw["strategy"], "family": FAMILY[kw["strategy"]],
                            "side": "PyTorch" if kw["strategy"].startswith("torch") else "minishard",
                            "baseline": base} for lb, kw, base in conts],
            "points": [], "checkpoint": []}
    started = time.perf_counter()
    common = dict(conts=conts, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                  micro_batch=args.micro_batch, bucket_cap_mb=args.bucket_cap_mb)
    root = Path(tempfile.mkdtemp(prefix="bench-scaling-", dir=args.dir))
    try:
        for n in args.world_sizes:
            models = list(sizes) if n == 2 else ["M"]
            t0 = time.perf_counter()
            with Ranks(n, timeout=1800) as ranks:
                data["points"] += sweep(ranks, models, sizes, **common)
                if n == 2 and args.checkpoint_rounds:
                    data["checkpoint"] = checkpoints(ranks, sizes, args.checkpoint_rounds, root)
            print(f"[{n} ranks: {time.perf_counter() - t0:.0f} s]", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    data["seconds"] = time.perf_counter() - started
    data["load_after"] = os.getloadavg()[0]
    data["fits"] = fits(data)
    return data


def report(data: dict) -> bool:
    """Print a result's tables, fits and byte relations; True if every byte count matched."""
    cores = data["cores"]
    print(f"# how cost grows, {data['started']}, {data['machine']}, {data['cpu']}, {cores} cores, "
          f"torch {data['torch']}; micro-batch {data['micro_batch']}/rank, fp32 AdamW, "
          f"{data['rounds']} rounds x {data['steps'] - data['warmup']} timed steps; load average "
          f"{data['load_before']:.1f} before, {data['load_after']:.1f} after")
    order = {c["label"]: i for i, c in enumerate(data["contenders"])}
    by_size = sorted((p for p in data["points"] if p["world_size"] == data["sweep_world_size"]),
                     key=lambda p: (p["params"], order[p["contender"]]))
    print_points(data, by_size, f"model size, {data['sweep_world_size']} ranks")
    by_n = sorted((p for p in data["points"] if p["model"] == data["middle"]),
                  key=lambda p: (p["world_size"], order[p["contender"]]))
    over = [oversubscription(n, cores) for n in sorted({p["world_size"] for p in by_n}) if n > cores]
    print_points(data, by_n, f"world size, model {data['middle']} "
                 f"({data['models'][data['middle']]['params'] / 1e6:.1f} M)" + "".join(f"; {o}" for o in over))
    if data["checkpoint"]:
        print_checkpoints(data["checkpoint"])
    print_fits(data)
    print("\nbytes per step against the formula:")
    for p in data["points"]:
        print(f"  {p['contender']}, {p['model']} ({p['params']:,} params), N={p['world_size']}: {relation(p)}")
    ok = all(bytes_match(p["sent"], p["formula"]) for p in data["points"])
    print(f"every bytes/step equals its formula within 0.1%: {ok}")
    print(f"\nbenchmark ran in {data['seconds']:.0f} s")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small GPTs, 1 and 2 ranks, 1 round")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--checkpoint-rounds", type=int, default=None)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="print the tables and fits of an earlier run's results; run nothing")
    ap.add_argument("--out", default=None, help=f"the JSON results (default {OUT.relative_to(HERE.parent)}; "
                                                "--quick: a temporary file)")
    args = ap.parse_args()
    if args.report:
        sys.exit(0 if report(json.loads(Path(args.report).read_text())) else 1)
    args.world_sizes = args.world_sizes or ([1, 2] if args.quick else [1, 2, 4, 8])
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.checkpoint_rounds = args.checkpoint_rounds if args.checkpoint_rounds is not None else \
        (1 if args.quick else 3)
    if 2 not in args.world_sizes:
        ap.error("the model-size sweep runs on 2 ranks: --world-sizes must include 2")
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "scaling-quick.json"
                                            if args.quick else OUT)
    data = run(args)
    ok = report(data)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"results written to {out}")
    sys.exit(0 if ok else 1)              # a byte count off its formula is a bug, not noise


if __name__ == "__main__":
    main()
