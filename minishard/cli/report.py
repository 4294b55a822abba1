"""The end-of-run table of ``minishard demo``: one row per rank, then what the formula leaves out."""
from __future__ import annotations

from pathlib import Path

MiB = 2**20
# what the analytic formula (model state + activations) does not count, by ledger category
LEFT_OUT = {"unsharded": "gathered units", "comm_buffers": "collective buffers in flight",
            "grads": "a unit's full gradients before their reduce-scatter",
            "activations": "a recomputed block's activations"}


def report(results: list[dict], args) -> str:
    r0 = results[0]
    lines = [f"minishard demo: strategy={r0['strategy']} world_size={r0['world_size']} "
             f"model={args.model} params={r0['n_params']:,} steps={len(r0['losses'])}"]
    lines += table(results)
    lines.append("losses (the global batch's, the mean over ranks): " +
                 " ".join(f"{x:.4f}" for x in mean_losses(results)))
    if args.trace:
        from ..trace import load, write_chrome
        events = load(args.trace)
        write_chrome(events, Path(args.trace) / "trace.json")
        lines.append(f"trace: {args.trace}/rank*.jsonl ({len(events)} events); "
                     f"Perfetto: {args.trace}/trace.json")
    return "\n".join(lines)


def mean_losses(results: list[dict]) -> list[float]:
    return [sum(r["losses"][s] for r in results) / len(results) for s in range(len(results[0]["losses"]))]


def summary(results: list[dict]) -> dict:
    """What ``demo --json`` prints: per step the global loss, per rank what it measured."""
    return {"strategy": results[0]["strategy"], "world_size": results[0]["world_size"],
            "n_params": results[0]["n_params"], "losses": mean_losses(results),
            "ranks": [{"rank": r["rank"], "wire": r["wire"], "wchar": r["wchar"], "calls": r["calls"],
                       "step_times": r["step_times"], "exposed_comm": r["exposed_comm"],
                       "by_op": r["by_op"],
                       **({"peak": r["ledger"]["peak"], "peak_snapshot": r["ledger"]["peak_snapshot"],
                           "estimate": r["ledger"]["estimate"]} if "ledger" in r else {}),
                       **({"checkpoint": {k: {kk: vv for kk, vv in v.items() if kk in ("step", "bytes_read", "bytes_written")}
                                          for k, v in r["checkpoint"].items()}} if "checkpoint" in r else {})}
                      for r in results]}


def table(results: list[dict]) -> list[str]:
    """Per rank: the ledger by category at the peak (MiB), the peak, the formula, bytes sent per
    step (the last step), seconds compute waited on communication per step; then, per rank whose
    peak is above the formula, which categories make the difference."""
    cats = list(dict.fromkeys(c for r in results for c in r.get("ledger", {}).get("peak_snapshot", {})))
    head = (f"{'rank':>4} " + " ".join(f"{c:>12}" for c in cats) +
            f" {'peak MiB':>9} {'formula MiB':>11} {'sent/step B':>13} {'waited ms':>9}")
    lines, notes = [head], []
    for r in results:
        led = r.get("ledger")
        if led is None:
            lines.append(f"{r['rank']:>4}  (PyTorch's own strategy: not instrumented)  "
                         f"sent/step {r['wire'][-1]:,} B")
            continue
        snap, est = led["peak_snapshot"], led["estimate"]
        formula = sum(est.values())
        lines.append(f"{r['rank']:>4} " + " ".join(f"{snap.get(c, 0) / MiB:>12.2f}" for c in cats) +
                     f" {led['peak'] / MiB:>9.2f} {formula / MiB:>11.2f} {r['wire'][-1]:>13,}"
                     f" {r['exposed_comm'][-1] * 1e3:>9.1f}")
        diff = {c: snap.get(c, 0) - est.get(c, 0) for c in {**est, **snap}}
        if led["peak"] != formula:
            notes.append(f"rank {r['rank']}: peak - formula = {led['peak'] - formula:+,} B = " + ", ".join(
                f"{c} {b:+,}" + (f" ({LEFT_OUT[c]})" if b > 0 and c in LEFT_OUT else
                                 " (not all alive at the peak)" if b < 0 else "")
                for c, b in diff.items() if b))
    return lines + (["what the formula (state + activations) leaves out:"] + notes if notes else
                    ["peak = formula on every rank"])
