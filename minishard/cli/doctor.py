"""``minishard doctor TRACE_DIR``: what went wrong in a run, from the files its ranks left.

    torchrun --standalone --nproc-per-node 4 -m minishard demo --strategy fsdp --trace traces/fsdp
    python -m minishard doctor traces/fsdp            # findings, most important first
    python -m minishard doctor traces/fsdp --json     # the same, for tools
    python -m minishard doctor traces/fsdp --verbose  # and each error as the library raised it

It reads each rank's flight-recorder dump (``flight_rank{r}.json``) — or, for a rank that died
without writing one, the ring it wrote as it flew (``flight_rank{r}.ring``) — and notes the
traces beside them (``minishard/instruments/doctor.py`` says what it looks for). Exit status:

    0   nothing found: every collective matched and completed, and nothing else was wrong
    1   a finding (a rank that died is always one)
    2   the input cannot be read (the file, and the line, named), or is not one run's: files
        of different runs (each file named under the run id it carries), files that disagree
        on the world size, a ring most of whose records cannot be read. Nothing is diagnosed:
        a diagnosis of files from two runs describes a run that never happened. Files written
        before run ids carry none: they are read as before, and the report names them as not
        checked to be one run's (``instruments/one_run.py``)
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
# how each rank's record came to be (its dump's reason), in the order a run's end meets them
WRITTEN = {"end": "written at the end", "exception": "on an exception", "sigterm": "on SIGTERM",
           "ring": "rings of ranks that died", "torch": "PyTorch's own",
           "trace": "read from its trace"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace_dir", help="a directory with flight_rank*.json (TrainConfig(flight_dir=DIR), "
                                     "demo --trace DIR) and rank*.jsonl traces")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.add_argument("--verbose", action="store_true",
                   help="also print each error as the library raised it (gloo's C++ message, with "
                        "its source paths), which the findings otherwise say in one line")


def run(args) -> int:
    report = doctor.diagnose(args.trace_dir)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print("\n".join(text(report, verbose=args.verbose)))
    if report.findings:
        return FOUND
    return CANNOT_CHECK if report.only_traces or not report.dumps else 0


def text(report: doctor.Report, verbose: bool = False) -> list[str]:
    """The report in words; the files that carry no run id are named last (``not_checked``)."""
    lines = findings_text(report, verbose)
    if report.unchecked:
        lines += [""] * bool(report.findings) + [not_checked(report)]
    return lines


def findings_text(report: doctor.Report, verbose: bool = False) -> list[str]:
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
        if verbose:                          # (an error's own lines, indented under its own)
            lines += ["   - " + "\n     ".join(d.splitlines()) for d in f.details]
        lines.append(f"   fix: {f.fix}")
    return lines


def not_checked(report: doctor.Report) -> str:
    """The files read without a run id, which nothing tells apart from another run's."""
    why = "(written before minishard wrote run ids, or written back without one)"
    if report.run is None:
        return f"not checked to be one run's files: none of them carries a run id {why}"
    many = len(report.unchecked) > 1
    return (f"not checked to be run {report.run}'s: {', '.join(report.unchecked)} "
            f"carr{'y' if many else 'ies'} no run id {why}")


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
    for body in sorted(report.dumps.values(), key=lambda b: list(WRITTEN).index(b["reason"])
                       if b["reason"] in WRITTEN else len(WRITTEN)):
        said = WRITTEN.get(body["reason"], f"reason {body['reason']!r}")
        reasons[said] = reasons.get(said, 0) + 1
    dumps = (f"{len(report.dumps)} flight dump{'s' if len(report.dumps) != 1 else ''} of a world of "
             f"{report.world_size} (" + ", ".join(f"{k}: {v}" for k, v in reasons.items())
             + ")") if report.dumps else "no flight dumps"
    return f"{dumps}, {len(report.traces)} trace{'s' if len(report.traces) != 1 else ''}"
