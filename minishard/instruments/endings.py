"""How each rank's run ended, in the doctor's words: a rank that raised (the error in a line, and
the line that raised it), ranks that gave up waiting (in which collective, for how long, timed
out or a peer gone), a rank that died leaving only its ring, ranks that ended their run while
others waited, a rank that left no record at all (and where its trace ends) — and how each
rank's record came to be. The doctor (``doctor.py``) puts them among the collectives' findings.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from .causes import Finding
from .entries import entry_line, op_of, ranks_word
from minishard.core.trace import numbered_lines, read_events
from minishard.core.words import fmt_bytes

if TYPE_CHECKING:
    from .records import Report

# what a rank raises when the collective it waits in never completes, or its peer went away
TIMED_OUT = re.compile(r"^TimeoutError\b|timed out waiting|timed out after|collective operation "
                       r"timeout|timeout caused pair closure|connection (closed|reset) by peer",
                       re.IGNORECASE)
# ... of which: the peer went away (it stopped, or gave up first and closed the connection)
PEER_GONE = re.compile(r"timeout caused pair closure|connection (closed|reset) by peer", re.IGNORECASE)
# gloo's own wait, in its words ("Timed out waiting 3000ms for recv operation to complete"): how
# long a rank waited when its dump has no clock
GLOO_WAITED = re.compile(r"timed out waiting (\d+) ?ms", re.IGNORECASE)
# where a C++ library's message says it was raised: "[/__w/pytorch/.../pair.cc:553] " — this
# machine's build paths, for --verbose only
CPP_SITE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\] ?")


def written(r: int, body: dict) -> str:
    """How rank r's record came to be, in words: why its dump was written, or what stands in
    for the dump it never wrote."""
    return {"end": f"rank {r}'s dump was written at the end of its run",
            "exception": f"rank {r}'s dump was written as it raised {short(body.get('error'))}",
            "sigterm": f"rank {r}'s dump was written when it was sent SIGTERM (torchrun stopping it "
                       f"after another rank failed)",
            "ring": f"rank {r} wrote no dump: it died, and its ring is read instead",
            "torch": f"rank {r}'s dump is PyTorch's own flight recorder's (it records no reason)",
            "trace": f"rank {r} left no flight record: the collectives it completed were read from its trace",
            }.get(body["reason"], f"rank {r}'s dump gives {body['reason']!r} as the reason it was written")


def short(error: str | None) -> str:
    """An error in one line: its first, without a C++ library's source path (``--verbose``
    prints it whole)."""
    lines = (error or "an exception").strip().splitlines() or ["an exception"]
    return CPP_SITE.sub("", lines[0]).strip()


def raised_site(body: dict) -> str:
    """The line that raised a rank's exception: the user's innermost (else the raise itself)."""
    raised = body.get("raised") or {}
    return raised.get("caller") or raised.get("at") or ""


def verbatim(dumps: dict[int, dict], ranks: list[int]) -> list[str]:
    """Each rank's error as it was raised, for ``--verbose`` (ranks with the same words: once)."""
    by_error: dict[str, list[int]] = defaultdict(list)
    for r in ranks:
        by_error[dumps[r].get("error") or ""].append(r)
    return [f"{ranks_word(rs)}'s error, as raised: {error}" for error, rs in by_error.items() if error]


def exceptions(dumps: dict[int, dict]) -> list[Finding]:
    """The ranks whose dump was written on an exception, one finding per error, the earliest
    first: ranks that timed out waiting for one that raised raise after it."""
    by_error: dict[str, list[int]] = defaultdict(list)
    for r, body in sorted(dumps.items(), key=lambda rb: (rb[1].get("time") or 0, rb[0])):
        if body["reason"] == "exception":
            by_error[body.get("error") or "an exception"].append(r)
    out, timed_out = [], []
    for error, ranks in by_error.items():
        if TIMED_OUT.search(error):           # a consequence: what it waited for is the cause
            timed_out += ranks
            continue
        ranks = sorted(ranks)
        sites = {raised_site(dumps[r]) for r in ranks}
        at = f", at {next(iter(sites))}" if len(sites) == 1 and "" not in sites else ""
        out.append(Finding(
            "exception", ranks, f"{ranks_word(ranks)} raised {short(error)}{at}",
            [_raised_line(r, dumps[r]) for r in ranks if raised_site(dumps[r])] + _last(dumps, ranks),
            "the first error is the cause to fix: ranks that were waiting for this one hang or time "
            "out because of it" if not out else
            f"raised after {ranks_word(out[0].ranks)} did: fix that first, this may be its consequence",
            verbatim(dumps, ranks) if short(error) != error else []))
    if timed_out:
        out.append(gave_up(dumps, sorted(timed_out)))
    return out


def _raised_line(r: int, body: dict) -> str:
    raised = body.get("raised") or {}
    at, caller = raised.get("at") or "", raised.get("caller") or ""
    return f"rank {r} raised it at {at or caller}" + (f", called from {caller}" if caller and at and caller != at else "")


def gave_up(dumps: dict[int, dict], ranks: list[int]) -> Finding:
    """The ranks that gave up waiting, in one line: the collective each waited in (the last it
    issued and never completed), how long — the dump's clock against the collective's issue,
    else gloo's own count — and whether its wait timed out or its peer went away."""
    waits = {r: next((e for e in reversed(dumps[r]["entries"]) if e["state"] == "issued"), None) for r in ranks}
    held = [e for e in waits.values() if e is not None]
    if held and len(held) == len(ranks) and len({(e["group"], e["seq"], op_of(e)) for e in held}) == 1:
        what = f"{op_of(held[0])} (seq {held[0]['seq']} of group {held[0]['group']!r})"
    else:
        what = "a collective (each rank's below)" if held else "a collective no record holds"
    waited = {r: w for r in ranks if (w := _waited(dumps[r], waits[r])) is not None}
    lo, hi = (f"{min(waited.values()):.1f}", f"{max(waited.values()):.1f}") if waited else ("", "")
    after = "" if not waited else f" after {lo} s" if lo == hi else f" after {lo} to {hi} s"
    gone = {bool(PEER_GONE.search(dumps[r].get("error") or "")) for r in ranks}
    why = {frozenset([False]): "timed out", frozenset([True]): "a peer went away"}.get(
        frozenset(gone), "timed out or lost a peer")
    evidence = [entry_line(f"rank {r}, gave up" + (f" after {waited[r]:.1f} s" if r in waited else ""),
                           waits[r]) if waits[r] is not None else _last(dumps, [r])[0] for r in ranks]
    return Finding(
        "timeout", ranks, f"{ranks_word(ranks)} gave up waiting in {what}{after}: {why}", evidence,
        "a timeout is where a hang ends: the finding about the collective the other ranks never "
        "issued (or never completed) names the cause",
        verbatim(dumps, ranks))


def _waited(body: dict, e: dict | None) -> float | None:
    """Seconds rank's wait in ``e`` lasted, as far as its dump tells."""
    if e is not None and body.get("t") is not None and e.get("t_issued") is not None:
        return max(0.0, body["t"] - e["t_issued"])
    m = GLOO_WAITED.search(body.get("error") or "")
    return int(m.group(1)) / 1000 if m else None


def _last(dumps: dict[int, dict], ranks: list[int]) -> list[str]:
    return [entry_line(f"rank {r}, its last collective", dumps[r]["entries"][-1])
            if dumps[r]["entries"] else f"rank {r} had issued no collective" for r in ranks]


def died(dumps: dict[int, dict]) -> Finding | None:
    """The ranks that left only their ring: where each stopped, and what it was writing."""
    dead = sorted(r for r, b in dumps.items() if b["reason"] == "ring")
    if not dead:
        return None
    evidence = []
    for r in dead:
        entries = dumps[r]["entries"]
        evidence.append(entry_line(f"rank {r}, the last collective it recorded", entries[-1])
                        if entries else f"rank {r} had issued no collective")
        evidence += [f"rank {r}'s ring: {t}" for t in dumps[r].get("torn", [])]
    inside = [r for r in dead if dumps[r]["entries"] and dumps[r]["entries"][-1]["state"] == "issued"]
    last = "each inside the collective it issued last" if len(inside) > 1 else "inside the collective it issued last"
    return Finding(
        "died", dead,
        f"{ranks_word(dead)} died without writing {'their dumps' if len(dead) > 1 else 'its dump'}"
        + (f", {last}" if inside == dead else f"; {ranks_word(inside)} {last}" if inside else ""),
        evidence,
        "a process that dies outright cannot write on its way out; its ring, written as every "
        "collective was issued, says where it was. The cause is outside Python: gloo aborts the "
        "process when a collective's sizes disagree on two ranks (a desync finding then names "
        "both), the kernel's OOM killer (dmesg), SIGKILL, os.abort(), a crash in an extension. "
        "The rank's own output, or torchrun's failure summary, has the message")


def left_early(dumps: dict[int, dict]) -> Finding | None:
    """Ranks that ended their run while others timed out waiting, in a collective no record
    holds (one PyTorch issued from C++, e.g. DDP's buffer broadcast in forward)."""
    waited = [r for r, b in dumps.items() if b["reason"] == "exception" and TIMED_OUT.search(b.get("error") or "")]
    ended = sorted(r for r, b in dumps.items() if b["reason"] == "end")
    if not waited or not ended:
        return None
    return Finding(
        "hang", ended,
        f"{ranks_word(ended)} ended {'their runs' if len(ended) > 1 else 'its run'} while "
        f"{ranks_word(waited)} still waited in a collective",
        _last(dumps, ended) + [f"rank {r}'s dump was written at the end of its run" for r in ended]
        + _last(dumps, sorted(waited)),
        f"every rank must run the same steps: {ranks_word(ended)} left before the others (a "
        f"rank-dependent number of steps or batches, an early return or break). What the others "
        f"waited in is a collective no record holds: one PyTorch issues itself (DDP's buffer "
        f"broadcast at the start of forward, a barrier)")


def missing_dumps(report: Report) -> Finding | None:
    missing = [r for r in range(report.world_size or 0) if r not in report.dumps]
    if not missing:
        return None
    evidence = [f"rank {r}: no flight_rank{r}.json or .ring; " + trace_end(report.traces[r])
                if r in report.traces else f"rank {r}: no flight_rank{r}.json, no .ring and no "
                f"rank{r}.jsonl" for r in missing]
    return Finding(
        "missing_dump", missing,
        f"{ranks_word(missing)} left no flight record while {ranks_word(report.dumps)} did: "
        f"{'they' if len(missing) > 1 else 'it'} died before writing",
        evidence,
        "a rank writes its dump at the end, on an exception and on SIGTERM; none means it was "
        "killed outright (SIGKILL, the kernel's OOM killer: see dmesg), crashed inside C++ (gloo "
        "aborts the process when collectives' sizes disagree) or never started. Its log, or "
        "torchrun's failure summary, has the cause")


def trace_end(path: Path) -> str:
    """Where a rank's trace stops (read as far as it goes: a rank that died cuts it short)."""
    events, bad = read_events(path, damaged="stop")
    collectives = [ev for ev in events if ev["kind"] == "collective"]
    last = collectives[-1] if collectives else None
    step = next((ev["step"] for ev in reversed(events) if "step" in ev), None)
    if bad:
        n, why = bad[0]
        return f"its trace {path.name} stops at line {n} ({why})" + _after(last, step)
    return f"its trace {path.name} ends at line {_lines(path)}" + _after(last, step)


def _lines(path: Path) -> int:
    return sum(1 for _ in numbered_lines(path))


def _after(last: dict | None, step) -> str:
    at = f" in step {step}" if step is not None else ""
    return at + (f", its last completed collective {last.get('op')} ({last.get('dtype')}, "
                 f"{fmt_bytes(last.get('payload', 0))})" if last else ", with no collective")

