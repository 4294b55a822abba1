"""The end-of-run report of ``minishard demo``: what the checkpoint did, one row per rank, then
what the formula leaves out — each difference named once, for the ranks it holds on.

The formula is the library's (``train`` returns the analytic ledger of the run it made, every
knob included); this module only prints it next to what was measured.
"""
from __future__ import annotations

from pathlib import Path

MiB = 2**20
# what the analytic formula (state + activations) does not count, by how the strategy holds
# memory and by ledger category: only what that strategy really allocates is named
LEFT_OUT = {
    "replicas": {"comm_buffers": "collective buffers in flight"},
    "zero": {"comm_buffers": "collective buffers in flight",
             "grads": "gradient buckets filled by backward, before their reduce-scatter"},
    "fsdp": {"unsharded": "gathered units", "comm_buffers": "collective buffers in flight",
             "grads": "a unit's full gradients before their reduce-scatter"},
}
NOT_ALIVE = "not all alive at the peak"
NOT_MODELLED = "not in the formula"
TIER_NOTE = "the sharded state, offloaded"


def report(results: list[dict], args, exported: dict | None = None) -> str:
    r0 = results[0]
    first, steps = r0.get("first_step", 0), len(r0["losses"])
    span = f" (steps {first + 1}-{first + steps}: resumed at step {first})" if first else ""
    lines = [f"minishard demo: strategy={r0['strategy']} world_size={r0['world_size']} "
             f"model={args.model} params={r0['n_params']:,} steps={steps}{span}"]
    lines += checkpoint_lines(results, args, exported)
    lines += table(results, formula_words(results, args))
    lines.append(f"losses, the global batch's (the mean of the ranks' own), steps {first + 1}-{first + steps}: "
                 + " ".join(f"{x:.4f}" for x in mean_losses(results)))
    res = max((x for r in results for x in r.get("loss_resolution", ())), default=0.0)
    if res >= 5e-5:        # visible at four decimals: a 16-bit loss
        lines.append(f"  (each rank's loss is a bf16 number: near {r0['losses'][-1]:.1f} it moves in steps of "
                     f"{res:g}, so a smaller change does not show)")
    if args.trace:
        from minishard.viewers.perfetto import write_chrome
        from minishard.core.trace import load
        events = load(args.trace)
        write_chrome(events, Path(args.trace) / "trace.json")
        lines.append(f"trace: {args.trace}/rank*.jsonl ({len(events)} events); "
                     f"Perfetto: {args.trace}/trace.json")
    return "\n".join(lines)


def checkpoint_lines(results: list[dict], args, exported: dict | None = None) -> list[str]:
    """One line each for what ``--resume``, ``--save`` and ``--export`` did."""
    r0, out = results[0], []
    n = r0["world_size"]
    load = r0.get("checkpoint", {}).get("load")
    if load is not None:
        was_n, was = load.get("saved_world_size", n), load.get("saved_strategy", r0["strategy"])
        how = ("the same layout: nothing resharded" if (was_n, was) == (n, r0["strategy"]) else
               f"resharded {was_n} → {n} ranks, {was} → {r0['strategy']}")
        read = sum(r["checkpoint"]["load"]["bytes_read"] for r in results)
        out.append(f"resumed {args.resume} at step {load['step']}: {how} ({read:,} bytes read by {n} ranks)")
    save = r0.get("checkpoint", {}).get("save")
    if save is not None and args.save:
        written = sum(r["checkpoint"]["save"]["bytes_written"] for r in results)
        out.append(f"saved step {save['step']} to {args.save} ({n} ranks, {written:,} bytes)")
    if exported is not None:
        out.append(f"exported step {exported['step']} to {args.export}: {len(exported['files'])} weight "
                   f"files, {exported['total_size']:,} bytes of weights")
    return out


def mean_losses(results: list[dict]) -> list[float]:
    return [sum(r["losses"][s] for r in results) / len(results) for s in range(len(results[0]["losses"]))]


def summary(results: list[dict], exported: dict | None = None) -> dict:
    """What ``demo --json`` prints: per step the global loss, per rank what it measured (a
    quantity that was not measured is null)."""
    def checkpoint(r):
        return {k: {kk: vv for kk, vv in v.items()
                    if kk in ("step", "bytes_read", "bytes_written", "saved_world_size", "saved_strategy")}
                for k, v in r["checkpoint"].items()}
    return {"strategy": results[0]["strategy"], "world_size": results[0]["world_size"],
            "n_params": results[0]["n_params"], "first_step": results[0].get("first_step", 0),
            "losses": mean_losses(results),
            **({"export": {"files": len(exported["files"]), "bytes": exported["total_size"]}}
               if exported is not None else {}),
            "ranks": [{"rank": r["rank"], "losses": r["losses"], "wire": r["wire"], "wchar": r["wchar"],
                       "calls": r["calls"], "step_times": r["step_times"],
                       "exposed_comm": r["exposed_comm"] if waited_measured(r) else None,
                       "by_op": r["by_op"],
                       **({"peak": r["ledger"]["peak"], "peak_snapshot": r["ledger"]["peak_snapshot"],
                           "estimate": r["ledger"]["estimate"], "formula": r["ledger"].get("formula"),
                           "by_device": r["ledger"].get("by_device")} if "ledger" in r else {}),
                       **({"transfer": r["transfer"], "transfer_formula": r["ledger"]["transfer_formula"]}
                          if "transfer_formula" in r.get("ledger", {}) else {}),
                       **({"checkpoint": checkpoint(r)} if "checkpoint" in r else {})}
                      for r in results]}


def waited_measured(r: dict) -> bool:
    return r.get("exposed_comm_measured", True)


def family(strategy: str) -> str:
    from minishard import strategies
    stage = strategies.get(strategy).stage
    return "replicas" if stage == 0 else "zero" if stage < 3 else "fsdp"


def device_formula(led: dict) -> dict[str, int]:
    """The formula's bytes on the device (with offload, the state is elsewhere)."""
    return led.get("formula", {}).get("device", led["estimate"])


def tiers(led: dict) -> list[str]:
    return [d for d in led.get("formula", {}) if d != "device"]


def formula_words(results: list[dict], args) -> str:
    """What the formula column models, in the command line's words."""
    r0 = results[0]
    led = r0.get("ledger")
    if led is None:
        return ""
    from minishard import strategies
    strategy, n = strategies.get(r0["strategy"]), r0["world_size"]
    group = led.get("shard_group") or n
    # (the precision the run trained in: a planted no-master fault trains bf16 under an fp32 flag)
    words = [f"{led.get('precision') or getattr(args, 'precision', 'fp32')} {getattr(args, 'optimizer', 'adamw')}"]
    if strategy.stage and group > 1:
        what = ("optimizer state", "optimizer state and gradients", "state")[min(strategy.stage, 3) - 1]
        words.append(f"{what} sharded over {group} ranks" +
                     (f" (--shard-size {group}; replicated across {n // group} groups)" if group != n else ""))
    if getattr(args, "offload", None):
        where = "in host memory" if args.offload == "host" else "on disk"
        words.append(f"--offload {args.offload}: the sharded state {where}")
    if getattr(args, "recompute", False):
        words.append("--recompute: each block saves its input only")
    if getattr(args, "loss_chunk_tokens", None):
        words.append(f"--loss-chunk-tokens {args.loss_chunk_tokens}: no logits kept")
    return "; ".join(words)


def table(results: list[dict], modelled: str = "") -> list[str]:
    """Per rank: the device's ledger by category at the peak (MiB), the peak, the formula, the
    offload tier's bytes next to its formula, bytes sent per step (the last step), milliseconds
    compute waited on communication per step; then what peak - formula is, said once for all
    the ranks it holds on."""
    cats = list(dict.fromkeys(c for r in results for c in r.get("ledger", {}).get("peak_snapshot", {})))
    tier = next((t for r in results if "ledger" in r for t in tiers(r["ledger"])), None)
    head = (f"{'rank':>4} " + " ".join(f"{c:>12}" for c in cats) +
            f" {'peak MiB':>9} {'formula MiB':>11}" +
            (f" {tier + ' MiB':>9} {'formula MiB':>11}" if tier else "") +
            f" {'sent/step B':>13} {'waited ms':>9}")
    lines, notes = [f"MiB on the device at each rank's peak, by ledger category; formula: this run's analytic "
                    f"ledger, state + activations{' (' + modelled + ')' if modelled else ''}", head], {}
    for r in results:
        led = r.get("ledger")
        if led is None and "watched" in r:      # PyTorch's own strategy, under minishard.watch
            w = r["watched"]
            lines.append(f"{r['rank']:>4}  (PyTorch's own strategy, watched: peak {w['peak'] / MiB:.2f} MiB = "
                         + ", ".join(f"{c} {b / MiB:.2f}" for c, b in w["peak_snapshot"].items())
                         + f"; sent/step {w['wire'][-1]:,} B by the ring model; no formula)")
            continue
        if led is None:
            lines.append(f"{r['rank']:>4}  (PyTorch's own strategy: not instrumented)  "
                         f"sent/step {r['wire'][-1]:,} B")
            continue
        snap, est = led["peak_snapshot"], device_formula(led)
        formula = sum(est.values())
        row = (f"{r['rank']:>4} " + " ".join(f"{snap.get(c, 0) / MiB:>12.2f}" for c in cats) +
               f" {led['peak'] / MiB:>9.2f} {formula / MiB:>11.2f}")
        if tier:
            held = led.get("by_device", {}).get(tier, {})
            row += f" {sum(held.values()) / MiB:>9.2f} {sum(led['formula'].get(tier, {}).values()) / MiB:>11.2f}"
        waited = f"{r['exposed_comm'][-1] * 1e3:>9.1f}" if waited_measured(r) else f"{'n/a':>9}"
        lines.append(row + f" {r['wire'][-1]:>13,} {waited}")
        for note in explain(r):
            notes.setdefault(note, []).append(r["rank"])
    if notes:
        lines.append("peak - formula (bytes), by ledger category, and why:")
        lines += [f"  {ranks_of(rs, len(results))}: {note}" for note, rs in notes.items()]
    if any("ledger" in r and not waited_measured(r) for r in results):
        lines.append("  waited ms: n/a, not measured: DDP and ZeRO wait for their buckets' collectives "
                     "inside backward and the step, untimed (FSDP's units time each wait)")
    return lines


def explain(r: dict) -> list[str]:
    """What this rank's peak - formula is, category by category, in the strategy's words; with
    offload, the tier's bytes against their formula and the transfers against theirs."""
    led = r["ledger"]
    snap, est = led["peak_snapshot"], device_formula(led)
    gap = led["peak"] - sum(est.values())
    names = LEFT_OUT[family(r["strategy"])]
    diff = {c: snap.get(c, 0) - est.get(c, 0) for c in {**est, **snap}}
    out = [f"device {gap:+,} = " + ", ".join(
        f"{c} {b:+,} ({names.get(c, NOT_MODELLED) if b > 0 else NOT_ALIVE})"
        for c, b in sorted(diff.items(), key=lambda kv: -kv[1]) if b) if gap or any(diff.values())
        else "device: peak = formula"]
    for tier in tiers(led):
        held, want = led.get("by_device", {}).get(tier, {}), led["formula"][tier]
        off = {c: held.get(c, 0) - want.get(c, 0) for c in {**want, **held}}
        out.append(f"{tier} = formula ({', '.join(want)}: {TIER_NOTE})" if not any(off.values()) else
                   f"{tier} {sum(off.values()):+,} = " + ", ".join(
                       f"{c} {b:+,} ({NOT_MODELLED if b > 0 else 'not allocated'})" for c, b in off.items() if b))
    for what, nbytes in led.get("unseen", {}).items():
        out.append(f"not in the ledger (made outside its hooks; a real device holds it too): {what}, "
                   f"{nbytes:,} B by the formula")
    if "transfer_formula" in led:
        got, want = r["transfer"][-1], led["transfer_formula"]
        say = {d: f"{got[f'{d}_bytes']:,} B" + ("" if got[f"{d}_bytes"] == want[f"{d}_bytes"] else
                                                f" (formula {want[f'{d}_bytes']:,} B)") for d in ("h2d", "d2h")}
        same = all(got[f"{d}_bytes"] == want[f"{d}_bytes"] for d in ("h2d", "d2h"))
        out.append(f"transfers per step{' = formula' if same else ''}: {say['h2d']} to the device (each "
                   f"unit's shard, once per gather), {say['d2h']} to the {tiers(led)[0]} (each reduced "
                   f"gradient shard)")
    return out


def ranks_of(ranks: list[int], world_size: int) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
