"""ZeRO against FSDP, both for real: minishard's stages, DeepSpeed's and PyTorch's FSDP2 on one model
and one global batch — what chapters 03, 04, 05 and 10 put side by side.

:func:`compare` trains each contender on the same warm ranks (``Ranks``), one after the other,
with the same ``TrainConfig`` knobs (model, micro-batch, steps, bucket size), every one traced —
minishard's strategies record themselves, PyTorch's and DeepSpeed's are watched
(``minishard.watch``) — and reads from each trace, for one step after the first:

* **memory**: rank 0's peak, the categories it held at that moment, and each category's own peak;
* **bytes**: per collective op, how many were issued, their payload and what rank 0 sent (the
  ring model: ``wire``), and the total;
* **time**: the median step of every rank's slowest (a figure of this machine and its load:
  a notebook prints it, never compares it).

:func:`table` words the rows as the chapters print them. Every number is measured from the
trace; the formulas they are checked against are the engine's (``planner.analytic.estimate`` for
minishard's, ``planner.deepspeed_estimator.deepspeed_holdings`` for DeepSpeed's).
"""
from __future__ import annotations

import statistics

from minishard.core.trace import rank_events

# the contenders the chapters name, each as TrainConfig fields; DeepSpeed's stage 3 twice: as
# its defaults leave a small model (gathered once, then kept: live and reuse bounds of 1e9,
# parameters under 1e5 elements never partitioned), and bounded to 0 (every submodule gathered
# when it runs, released after, as ZeRO-3 is told)
CONTENDERS = {
    "DDP (minishard)": dict(strategy="ddp"),
    "ZeRO-1 (minishard)": dict(strategy="zero1"),
    "ZeRO-1 (DeepSpeed)": dict(strategy="deepspeed_zero1"),
    "ZeRO-2 (minishard)": dict(strategy="zero2"),
    "ZeRO-2 (DeepSpeed)": dict(strategy="deepspeed_zero2"),
    "ZeRO-3 / FSDP (minishard)": dict(strategy="fsdp"),
    "FSDP2 (PyTorch)": dict(strategy="torch_fsdp"),
    "ZeRO-3 (DeepSpeed, its defaults)": dict(strategy="deepspeed_zero3"),
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
        results = ranks.run(train, TrainConfig(**{**knobs, **CONTENDERS[name]}))
        rows.append(measured(name, ranks.last_events, results, step))
    return rows


def measured(name: str, events: list[dict], results: list[dict], step: int = 1) -> dict:
    """One contender's row from its trace (rank 0's events of ``step``) and ``train``'s results."""
    mine = rank_events(events, 0)
    held, peak, at_peak, category_peak = {}, 0, {}, {}
    for e in mine:
        if e["kind"] in ("alloc", "free") and e["device"] == "device":
            c = e["category"]
            held[c] = held.get(c, 0) + (e["bytes"] if e["kind"] == "alloc" else -e["bytes"])
            category_peak[c] = max(category_peak.get(c, 0), held[c])
            if (total := sum(held.values())) > peak:
                peak, at_peak = total, {k: v for k, v in held.items() if v}
    ops: dict[str, dict] = {}
    for e in mine:
        if e["kind"] == "collective" and e.get("step") == step:
            o = ops.setdefault(e["op"], {"calls": 0, "payload": 0, "wire": 0})
            o["calls"] += 1
            o["payload"] += e["payload"]
            o["wire"] += e["wire"]
    slowest = [max(r["step_times"][s] for r in results) for s in range(1, len(results[0]["step_times"]))]
    return {"name": name, "strategy": results[0]["strategy"], "losses": results[0]["losses"],
            "peak": peak, "at_peak": at_peak, "category_peaks": category_peak,
            "state": {c: held.get(c, 0) for c in STATE if held.get(c, 0)},
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
