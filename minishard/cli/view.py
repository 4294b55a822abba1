"""``minishard view TRACE_DIR``: any trace as one HTML file that steps through it with no kernel.

    torchrun --standalone --nproc-per-node 4 -m minishard demo --strategy fsdp --trace traces/fsdp
    python -m minishard view traces/fsdp                 # writes traces/fsdp/player.html
    python -m minishard view traces/fsdp -o fsdp.html

The file needs no kernel, no network and no install: open it in a browser. A trace that cannot
be read whole still gives a player: each problem — a line that is not JSON (a file cut short),
events of a newer schema version, a rank whose trace stops steps before the others' — is one
line naming the file and line; the player shows what could be read and says what was skipped.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from minishard.viewers import offline_player
from minishard.core import trace

DEFAULT_NAME = "player.html"
NEEDS = {"phase": ("name", "edge"), "collective": ("op", "payload", "wire", "t_end"),
         "alloc": ("category", "bytes"), "free": ("category", "bytes"), "unit": ("name", "state"),
         "transfer": ("bytes",)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace_dir", help="a directory with rank*.jsonl (demo --trace DIR), or one .jsonl file")
    p.add_argument("-o", "--out", default=None,
                   help=f"the HTML file to write (default: TRACE_DIR/{DEFAULT_NAME}; for a file "
                        f"x.jsonl, x.html beside it)")
    p.add_argument("--title", default=None, help="the line above the player (default: the trace's name and size)")


def trace_files(source: Path) -> list[Path]:
    if source.is_dir():
        files = sorted(source.glob("rank*.jsonl"))
        if not files:
            raise FileNotFoundError(f"{source}: no rank*.jsonl trace files in this directory")
        return files
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such trace directory or file")
    return [source]


def problem(path: Path, line: int, what: str) -> str:
    return f"{path}:{line}: {what}"


def read_file(path: Path) -> tuple[list[dict], list[str]]:
    """The events of one file that this minishard can read, and one line per kind of problem
    (the first line it happened on, how many lines it skipped)."""
    events, bad = trace.read_events(path, damaged="skip", also=_not_replayable)
    skipped = defaultdict(list)                    # reason -> line numbers
    for n, why in bad:
        skipped[why].append(n)
    out = []
    for reason, lines in skipped.items():
        more = f" ({len(lines)} lines skipped, the last at line {lines[-1]})" if len(lines) > 1 else " (skipped)"
        out.append(problem(path, lines[0], reason + more))
    return events, out


def _not_replayable(ev: dict) -> str | None:
    """Why an event cannot be replayed (what the player needs of its kind), or None."""
    if ev.get("kind") not in NEEDS:
        return f"unknown event kind {ev.get('kind')!r}"
    missing = [k for k in NEEDS[ev["kind"]] if k not in ev]
    return f"a {ev['kind']} event without {', '.join(missing)}" if missing else None


def uneven_steps(events_by_file: dict[Path, list[dict]], lines: dict[Path, int]) -> list[str]:
    """One line per rank whose trace reaches fewer steps than the others' (a rank that stopped,
    or a file cut short): the ranks did not run the same steps, so bars of different ranks at
    the end of the trace are not the same moment."""
    last = {path: -1 for path in events_by_file}       # -1: not one step recorded
    for path, events in events_by_file.items():
        for ev in events:
            if ev.get("step") is not None:
                last[path] = max(last[path], ev["step"])
    if len(set(last.values())) <= 1:
        return []
    most = max(last.values())
    ahead = sorted(p.name for p, s in last.items() if s == most)
    return [problem(path, lines[path], f"this rank's trace ends "
                                       f"{f'in step {s}' if s >= 0 else 'before its first step'}, "
                                       f"the others' ({', '.join(ahead)}) in step {most}: it stopped early "
                                       f"or its file was cut short; the player shows what it recorded")
            for path, s in sorted(last.items()) if s < most]


def read(source: Path) -> tuple[list[dict], list[str]]:
    """Every readable event of a trace directory or file, merged, and what could not be read."""
    by_file, problems, lines = {}, [], {}
    for path in trace_files(source):
        events, bad = read_file(path)
        by_file[path], lines[path] = events, sum(1 for _ in trace.numbered_lines(path))
        problems += bad
    problems += uneven_steps(by_file, lines)
    return trace.merge(ev for events in by_file.values() for ev in events), problems


def run(args) -> int:
    source = Path(args.trace_dir)
    events, problems = read(source)
    for line in problems:
        print(f"minishard view: warning: {line}", file=sys.stderr)
    if not events:
        raise ValueError(f"{source}: no event could be read, nothing to replay")
    out = Path(args.out) if args.out else (source / DEFAULT_NAME if source.is_dir() else source.with_suffix(".html"))
    ranks = sorted({e["rank"] for e in events})
    title = args.title or f"minishard trace {source.name}: {len(events):,} events on {len(ranks)} ranks"
    offline_player.write(out, offline_player.encode(events, title=title, problems=problems))
    skipped = f"; {len(problems)} problem(s) above, shown in the page too" if problems else ""
    print(f"wrote {out}: {len(events):,} events, {len(ranks)} ranks ({', '.join(map(str, ranks))}){skipped}; "
          "open it in a browser (no kernel, no network needed)")
    return 0
