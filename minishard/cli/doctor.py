"""``minishard doctor TRACE_DIR``: what went wrong in a run, from the files its ranks left.

    torchrun --standalone --nproc-per-node 4 -m minishard demo --strategy fsdp --trace traces/fsdp
    python -m minishard doctor traces/fsdp            # findings, most important first
    python -m minishard doctor traces/fsdp --json     # the same, for tools

It reads each rank's flight-recorder dump (``flight_rank{r}.json``) — or, for a rank that died
without writing one, the ring it wrote as it flew (``flight_rank{r}.ring``) — and notes the
traces beside them (``minishard/instruments/doctor.py`` says what it looks for). Exit status:

    0   nothing found: every collective matched and completed, and nothing else was wrong
    1   a finding (a rank that died is always one)
    2   the input cannot be read (the file, and the line, named)
    3   nothing found, but not everything could be checked: no dump and no ring, only traces.
        A trace holds the collectives a rank *completed*, so their order is compared (a desync
        among them is a finding, exit 1), but a collective issued and never completed — a hang,
        a death — leaves no sign in it: "nothing found" would be a guess
"""
from __future__ import annotations

import argparse
import json

from minishard.instruments import doctor, drift

FOUND, CANNOT_CHECK = 1, 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace_dir", help="a directory with flight_rank*.json (TrainConfig(flight_dir=DIR), "
                                     "demo --trace DIR) and rank*.jsonl traces")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")


def run(args) -> int:
    report = doctor.diagnose(args.trace_dir)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print("\n".join(text(report)))
    if report.findings:
        return FOUND
    return CANNOT_CHECK if report.only_traces or not report.dumps else 0


def text(report: doctor.Report) -> list[str]:
    lines = [f"minishard doctor {report.directory}: {what_was_read(report)}"]
    if report.only_traces or not report.dumps:
        lines.append(("no flight_rank*.json or .ring: the order of the collectives each trace holds "
                      "(those that completed) was compared; hangs and deaths cannot be checked"
                      if report.only_traces else "no flight_rank*.json or .ring: hangs, desyncs and "
                      "deaths cannot be checked") + " (exit status 3 when nothing is found); record "
                     "the run with TrainConfig(flight_dir=DIR), demo --trace DIR or "
                     "minishard.watch(model, optimizer, trace=DIR)")
    if not report.findings:
        if report.dumps and not report.only_traces:
            lines.append("nothing found: every rank issued the same collectives in the same order, "
                         "and every one completed; " + checked(report))
        return lines
    n = len(report.findings)
    lines.append(f"{n} finding{'s' if n > 1 else ''}, most important first:")
    for i, f in enumerate(report.findings, 1):
        lines += ["", f"{i}. [{f.kind}] {f.title}"]
        lines += [f"   - {e}" for e in f.evidence]
        lines.append(f"   fix: {f.fix}")
    return lines


def checked(report: doctor.Report) -> str:
    """What else was compared, as far as the files allowed."""
    facts = [b.get("facts") or {} for b in report.dumps.values()]
    said = []
    if any(f.get("weights_built") for f in facts):
        said.append("the ranks started from the same weights")
    if any(n.get("grad_norm") is not None for f in facts for n in f.get("steps", [])):
        said.append("clipped by one gradient norm")
    if any(f.get("steps") for f in facts):
        said.append("stepped fp32 weights")
    if report.traces:
        said.append("no FSDP unit held most parameters and no full gradient outlived its micro-batch")
    blind = any((f.get("run") or {}).get("watched") == "fsdp2" for f in facts) and not any(
        f.get("weights_built") for f in facts)
    return ((", ".join(said) if said else "no facts or traces to check more (the dumps of "
             "minishard.train hold them)") + ". " + drift.checked(report.dumps)
            + (" Not compared: the weights each FSDP2 rank built — its shards differ by design; "
               "take built = minishard.fingerprint(model) before fully_shard and pass "
               "watch(..., built=built)." if blind else ""))


def what_was_read(report: doctor.Report) -> str:
    if report.only_traces:
        n = len(report.traces)
        return (f"no flight dumps, {n} trace{'s' if n != 1 else ''} of a world of {report.world_size} "
                f"(their completed collectives read in the dumps' place)")
    reasons: dict[str, int] = {}
    for body in report.dumps.values():
        said = {"torch": "PyTorch's own", "trace": "read from its trace"}.get(body["reason"], body["reason"])
        reasons[said] = reasons.get(said, 0) + 1
    dumps = (f"{len(report.dumps)} flight dump{'s' if len(report.dumps) != 1 else ''} of a world of "
             f"{report.world_size} (written on " + ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items()))
             + ")") if report.dumps else "no flight dumps"
    return f"{dumps}, {len(report.traces)} trace{'s' if len(report.traces) != 1 else ''}"
