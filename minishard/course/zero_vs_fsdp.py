"""ZeRO against FSDP, both for real: minishard's stages, DeepSpeed's and PyTorch's FSDP2 on one model
and one global batch — what chapters 03, 04, 05 and 10 put side by side.

:func:`compare` trains each contender on the same warm ranks (``Ranks``), one after the other,
with the same ``TrainConfig`` knobs (model, micro-batch, steps, bucket size), every one traced —
minishard's strategies record themselves, PyTorch's and DeepSpeed's are watched
(``minishard.watch``) — and reads from each trace, for one step after the first:

* **memory**: rank 0's peak, the categories it held at that moment, each category's own peak
  (over the run, and within the measured step), each tag's (what ``deepspeed_holdings`` calls a
  term), and what it holds once the run is over (``state``: what stands between steps);
* **bytes**: per collective op, how many were issued, their payload and what rank 0 sent (the
  ring model: ``wire``), and the total; each collective with its tag (``collectives``);
* **time**: the median step of every rank's slowest (a figure of this machine and its load:
  a notebook prints it, never compares it).

:func:`table`, :func:`state_table`, :func:`wire_table` and :func:`terms_table` word the rows as
the chapters print them (exact counts only: a notebook may compare their text). Every number is
measured from the trace; the formulas they are checked against are the engine's
(``planner.analytic.estimate`` for minishard's, ``planner.deepspeed_estimator.deepspeed_holdings``
for DeepSpeed's: :func:`deepspeed_terms`, :func:`standing`).

Run DeepSpeed's stage 3 last on a pool whose ranks serve other work: building it replaces
``torch.nn.functional.linear`` with DeepSpeed's ``zero3_linear_wrap`` in the rank processes, for
good (``deepspeed/runtime/zero/partition_parameters.py``, ``_enable_mem_efficient_linear``), and
a later run there computes its Linears through it — the same values, not the same bits.
"""
from __future__ import annotations

import statistics

from minishard.core.trace import rank_events

# the contenders the chapters name, each as TrainConfig fields; minishard's stage 1 in both of
# chapter 03's versions; DeepSpeed's stage 3 three times: as its defaults leave a small model
# (parameters of at most 1e5 elements are never partitioned: gathered whole and kept), with the
# persistence threshold at 0 (every parameter partitioned, but the live and reuse bounds of 1e9
# keep what forward gathered until backward has used it), and bounded to 0 (every submodule
# gathered when it runs, released after, in forward and again in backward: ZeRO-3 as told)
CONTENDERS = {
    "DDP (minishard)": dict(strategy="ddp"),
    "ZeRO-1 (minishard)": dict(strategy="zero1"),
    "ZeRO-1, all-reduce (minishard)": dict(strategy="zero1_allreduce"),
    "ZeRO-1 (DeepSpeed)": dict(strategy="deepspeed_zero1"),
    "ZeRO-2 (minishard)": dict(strategy="zero2"),
    "ZeRO-2 (DeepSpeed)": dict(strategy="deepspeed_zero2"),
    "ZeRO-3 / FSDP (minishard)": dict(strategy="fsdp"),
    "FSDP2 (PyTorch)": dict(strategy="torch_fsdp"),
    "ZeRO-3 (DeepSpeed, its defaults)": dict(strategy="deepspeed_zero3"),
    "ZeRO-3 (DeepSpeed, threshold 0)": dict(strategy="deepspeed_zero3", param_persistence_threshold=0),
    "ZeRO-3 (DeepSpeed, bounds 0)": dict(strategy="deepspeed_zero3", max_live_parameters=0,
                                         param_persistence_threshold=0),
}
STATE = ("params", "master", "grads", "exp_avg", "exp_avg_sq", "unsharded", "comm_buffers")


def compare(ranks, names: list[str], *, step: int = 1, **knobs) -> list[dict]:
    """Each contender of ``names`` (keys of :data:`CONTENDERS`) trained on ``ranks`` with the
    same ``knobs``; one row each (see the module's docstring), in the order given."""
    from minishard.training.loop import TrainConfig, train
    rows = []
    for name in names:
        config = TrainConfig(**{**knobs, **CONTENDERS[name]})
        task = quietly if config.strategy.startswith("deepspeed") else train
        results = ranks.run(task, config)
        rows.append(measured(name, ranks.last_events, results, step))
    return rows


def quietly(rank, config):
    """``train(rank, config)`` with the rank's stdout and stderr sent to /dev/null: DeepSpeed's
    start-up lines (the accelerator it picked, the JIT op it loaded) and torch's deprecation
    warnings about DeepSpeed's calls would otherwise land in the notebook's cell. (A failure still
    reaches the caller: ``Ranks`` sends a rank's traceback back with its result.)"""
    import os
    import sys
    from minishard.training.loop import train
    sys.stdout.flush()
    sys.stderr.flush()
    saved, null = (os.dup(1), os.dup(2)), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        return train(rank, config)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def measured(name: str, events: list[dict], results: list[dict], step: int = 1) -> dict:
    """One contender's row from its trace (rank 0's events of ``step``) and ``train``'s results."""
    mine = rank_events(events, 0)
    held, peak, at_peak, category_peak, step_peak = {}, 0, {}, {}, {}
    for e in mine:
        if e["kind"] in ("alloc", "free") and e["device"] == "device":
            c = e["category"]
            held[c] = held.get(c, 0) + (e["bytes"] if e["kind"] == "alloc" else -e["bytes"])
            category_peak[c] = max(category_peak.get(c, 0), held[c])
            if e.get("step") == step:
                step_peak[c] = max(step_peak.get(c, 0), held[c])
            if (total := sum(held.values())) > peak:
                peak, at_peak = total, {k: v for k, v in held.items() if v}
    by_tag: dict[str, int] = {}
    tag_peaks: dict[str, int] = {}
    for e in mine:
        if e["kind"] in ("alloc", "free") and e["device"] == "device":
            t = e["tag"]
            by_tag[t] = by_tag.get(t, 0) + (e["bytes"] if e["kind"] == "alloc" else -e["bytes"])
            tag_peaks[t] = max(tag_peaks.get(t, 0), by_tag[t])
    ops: dict[str, dict] = {}
    issued = []
    for e in mine:
        if e["kind"] == "collective" and e.get("step") == step:
            o = ops.setdefault(e["op"], {"calls": 0, "payload": 0, "wire": 0})
            o["calls"] += 1
            o["payload"] += e["payload"]
            o["wire"] += e["wire"]
            issued.append((e["op"], e["tag"], e["payload"], e["wire"]))
    slowest = [max(r["step_times"][s] for r in results) for s in range(1, len(results[0]["step_times"]))]
    return {"name": name, "strategy": results[0]["strategy"], "losses": results[0]["losses"],
            "peak": peak, "at_peak": at_peak, "category_peaks": category_peak, "step_peaks": step_peak,
            "state": {c: held.get(c, 0) for c in STATE if held.get(c, 0)},
            "tag_peaks": tag_peaks, "collectives": issued,
            "ops": ops, "wire": sum(o["wire"] for o in ops.values()),
            "calls": sum(o["calls"] for o in ops.values()),
            "step_s": statistics.median(slowest) if slowest else None}


def table(rows: list[dict], columns: tuple[str, ...] = ("peak", "state", "wire", "calls"),
          baseline: str | None = None) -> str:
    """The rows as a text table: peak and standing state in bytes, what rank 0 sent in one step and
    in how many collectives; ``baseline`` (a row's name): each row's sent bytes as a multiple of
    its. Exact counts only: a notebook may compare this text."""
    base = next((r for r in rows if r["name"] == baseline), None)
    head = {"peak": "peak B", "state": "standing state B", "wire": "sent/step B", "calls": "collectives"}
    width = max(len(r["name"]) for r in rows) + 2
    lines = [f"{'':<{width}}" + "".join(f"{head[c]:>18}" for c in columns)
             + (f"{'× ' + baseline:>{len(baseline) + 4}}" if base else "")]
    for r in rows:
        cells = {"peak": f"{r['peak']:,}", "state": f"{sum(r['state'].values()):,}",
                 "wire": f"{r['wire']:,}", "calls": f"{r['calls']:,}"}
        line = f"{r['name']:<{width}}" + "".join(f"{cells[c]:>18}" for c in columns)
        if base:
            line += f"{r['wire'] / base['wire']:>{len(baseline) + 4}.3f}" if base["wire"] else ""
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- DeepSpeed's terms
# the terms of deepspeed_holdings that stand between steps (what a rank holds once a step is
# over); the others live from backward to the step: stage 1's full gradients, the gradient
# partition, the fp32 partition's gradient, and stages 1-2's reduce bucket
STANDING = {1: ("flat parameters (padded to 2N)", "fp32 partition", "exp_avg", "exp_avg_sq"),
            3: ("partitions", "fp32 partitions", "gradient partitions", "exp_avg", "exp_avg_sq",
                "reduce bucket")}
STANDING[2] = STANDING[1]


def deepspeed_terms(stage: int, *, model: str = "nano", world_size: int = 2, rank: int = 0,
                    bucket_cap_mb: float = 25.0) -> dict[str, tuple[str, int]]:
    """``deepspeed_holdings`` for the run :func:`compare` makes with these knobs: the model's
    parameters in model order, the reduce bucket DeepSpeed's config gets from ``bucket_cap_mb``."""
    from minishard.core.model import GPT
    from minishard.planner.deepspeed_estimator import deepspeed_holdings
    numels = [p.numel() for p in GPT(model, device="meta").parameters()]
    return deepspeed_holdings(stage, numels, world_size, rank, reduce_bucket_size(bucket_cap_mb))


def reduce_bucket_size(bucket_cap_mb: float) -> int:
    """The ``reduce_bucket_size`` (elements) DeepSpeed is configured with for ``bucket_cap_mb``."""
    from minishard.strategies.deepspeed_native import deepspeed_config
    from minishard.training.config import TrainConfig
    config = TrainConfig(strategy="deepspeed_zero2", bucket_cap_mb=bucket_cap_mb)
    return deepspeed_config(config, 2)["zero_optimization"]["reduce_bucket_size"]


def standing(stage: int, terms: dict[str, tuple[str, int]]) -> dict[str, int]:
    """What DeepSpeed's terms leave standing between steps, by category (a row's ``state``)."""
    out: dict[str, int] = {}
    for term in STANDING[stage]:
        category, nbytes = terms[term]
        out[category] = out.get(category, 0) + nbytes
    return out


def measured_terms(row: dict, terms: dict[str, tuple[str, int]]) -> dict[str, int]:
    """Each term's bytes as the watch measured them (rank 0): the most its tag held at once — the
    moments under the optimizer's tags, stage 1's full gradients as the sum of every gradient's."""
    peaks = row["tag_peaks"]
    out = {}
    for term in terms:
        if term.startswith("exp_avg"):
            out[term] = peaks.get(f"opt:{term}:0", 0)
        elif term.startswith("every full gradient"):
            out[term] = sum(v for k, v in peaks.items() if k.startswith("grad:"))
        else:
            out[term] = peaks.get(term, 0)
    return out


def terms_table(terms: dict[str, tuple[str, int]], measured: dict[str, int]) -> str:
    """DeepSpeed's terms beside what the watch measured: term, category, formula, measured."""
    width = max(len(t) for t in terms) + 2
    lines = [f"{'term (DeepSpeed 0.19, rank 0)':<{width}}{'category':<14}{'formula B':>12}{'measured B':>12}"]
    for term, (category, nbytes) in terms.items():
        lines.append(f"{term:<{width}}{category:<14}{nbytes:>12,}{measured[term]:>12,}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the chapters' tables
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def state_table(rows: list[dict]) -> str:
    """Each row's standing state by category — what rank 0 holds once the run is over, in bytes —
    and its total; a dash where a row holds none of a category. Exact counts only."""
    cats = [c for c in STATE if any(c in r["state"] for r in rows)]
    width = max(len(r["name"]) for r in rows) + 2
    short = {"comm_buffers": "buffers", "exp_avg_sq": "exp_avg_sq"}
    lines = [f"{'':<{width}}" + "".join(f"{short.get(c, c):>11}" for c in cats) + f"{'total B':>12}"]
    for r in rows:
        lines.append(f"{r['name']:<{width}}" + "".join(
            f"{r['state'][c]:>11,}" if c in r["state"] else f"{'—':>11}" for c in cats)
            + f"{sum(r['state'].values()):>12,}")
    return "\n".join(lines)


def wire_table(rows: list[dict], baseline: str | None = None, label: str | None = None) -> str:
    """Per row, each collective op of the measured step — ``calls × → bytes``: how many, and the
    bytes rank 0 sent (the ring model) — then the total and, with ``baseline`` (a row's name), its
    multiple of that row's, headed ``label`` (default ``× baseline``). Exact counts only."""
    ops = [o for o in OPS if any(o in r["ops"] for r in rows)]
    base = next((r for r in rows if r["name"] == baseline), None)
    label = label or f"× {baseline}"
    width = max(len(r["name"]) for r in rows) + 2
    lines = [f"{'':<{width}}" + "".join(f"{o:>20}" for o in ops) + f"{'sent B':>12}{'calls':>7}"
             + (f"{label:>{len(label) + 3}}" if base else "")]
    for r in rows:
        cells = [f"{r['ops'][o]['calls']} × → {r['ops'][o]['wire']:,}" if o in r["ops"] else "—" for o in ops]
        line = f"{r['name']:<{width}}" + "".join(f"{c:>20}" for c in cells) + f"{r['wire']:>12,}{r['calls']:>7}"
        if base and base["wire"]:
            line += f"{r['wire'] / base['wire']:>{len(label) + 3}.3f}"
        lines.append(line)
    return "\n".join(lines)


def calls_by_tag(row: dict, op: str) -> dict[str, int]:
    """How many ``op`` collectives of the measured step each tag issued (a DeepSpeed collective's
    tag is the DeepSpeed function that issued it, or for stage 3's gathers the unit)."""
    out: dict[str, int] = {}
    for o, tag, _, _ in row["collectives"]:
        if o == op:
            out[tag] = out.get(tag, 0) + 1
    return out
