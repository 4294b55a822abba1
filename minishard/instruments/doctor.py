"""The doctor: what went wrong in a run, read from the files it left behind.

``python -m minishard doctor TRACE_DIR`` reads every rank's flight-recorder dump
(``flight_rank{r}.json``, :mod:`minishard.core.flight`) and notes the traces (``rank{r}.jsonl``) beside
them. Each problem is one :class:`Finding`: its kind, the ranks involved, a one-line title, the
evidence (which rank issued which collective, with which shapes and dtypes, at which ``seq`` of
which group, from which line of code, in which state) and the fix in words. Findings come most
important first — the cause before its consequences:

    desync        at some ``seq`` of a group the ranks issued different collectives (op, shapes
                  or dtypes): they issued collectives in different orders, or one rank skipped
                  one and the next paired with it. Everything after it in that group is noise.
    exception     a rank's dump was written on an exception: its error, quoted in one line, and
                  the line that raised it (the user's innermost, else the ``raise`` itself).
    died          a rank left only its ring (``flight_rank{r}.ring``, written as it flew): it
                  died without reaching Python again (killed, the OOM killer, ``os.abort()``, a
                  crash inside C++ such as gloo aborting on a size mismatch); where it stopped.
    missing_dump  a rank left neither dump nor ring while others did: it never started, or its
                  files were not kept.
    hang          a ``seq`` some ranks issued and another never reached (name that rank, its
                  last collective, and the one the others wait in), or one every rank issued
                  and that never completed.
    timeout       ranks that gave up waiting — a hang's end, not its cause: in one line, the
                  collective each waited in, how long, and whether it timed out or its peer went
                  away (the library's own message, C++ paths and all, only for ``--verbose``:
                  a finding's ``details``).

The k-th collective of a group must be the same collective on every rank, so the dumps are
aligned by ``seq``. A ring buffer drops its oldest entries, and ranks may have dropped different
ones: only the seqs every rank still holds are compared. A run that left only traces is read from
them (:func:`from_traces`): its completed collectives are compared for a desync, nothing more.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from . import causes, cut_short
from .causes import Finding
from .endings import (TIMED_OUT, died, exceptions, left_early, missing_dumps, trace_end,  # noqa: F401
                      written)
from .entries import describe, entry_line, op_of, ranks_word, site, state   # noqa: F401 (the words)
from .records import DUMP, RING, TRACE, Report, read_dir, read_dump   # noqa: F401 (the doctor's reading)

# the collectives' findings, most important first: the cause before its consequences (a timeout
# is what a hang raises); then the causes.CAUSES, in their order (kinds())
COLLECTIVE_KINDS = ("desync", "exception", "died", "missing_dump", "hang", "timeout")
def signature(e: dict) -> tuple:
    """What must agree across ranks at one seq: the collective, and what it moves (the unit or
    bucket it is tagged with, the step it belongs to: two units of one size swapped pair up
    without an error, and the model is silently wrong)."""
    return (e["op"], tuple(map(tuple, e["shapes"])), tuple(e["dtypes"]), e.get("tag") or "",
            e.get("step"), e.get("src"))


def sizes_agree(a: dict, b: dict) -> bool:
    return signature(a)[:3] == signature(b)[:3]


def sizes_agree_and_tag(a: dict, b: dict) -> bool:
    return signature(a) == signature(b)


# --------------------------------------------------------------------------- findings

def by_group(dumps: dict[int, dict]) -> dict[str, dict[int, dict[int, dict]]]:
    """group -> rank -> seq -> entry."""
    out: dict[str, dict[int, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r, body in dumps.items():
        for e in body["entries"]:
            out[e["group"]][r][e["seq"]] = e
    return out


NAMED = re.compile(r".*\[(\d+(?:, \d+)*)\]$")     # "shard[0, 1]": a group named by its members


def members(group: str, held: dict[int, dict[int, dict]], dumps: dict[int, dict], world: int) -> list[int]:
    """The ranks with dumps that should hold this group's collectives: every rank when the group
    spans the world, its members when its name lists them (a rank holding none of it never
    issued one), else those that hold some."""
    if all(e["group_size"] == world for seqs in held.values() for e in seqs.values()):
        return sorted(dumps)
    if m := NAMED.fullmatch(group):
        return sorted(r for r in map(int, m.group(1).split(", ")) if r in dumps)
    return sorted(held)


def absent(group: str, ranks: list[int], missing: list[int], dumps: dict[int, dict]) -> list[int]:
    """The group's members that left no dump: those its name lists (a shard or replicate group
    whose waiting member is the only one left with a dump waits for the one without), else every
    rank without a dump when the group spans every rank with one."""
    if m := NAMED.fullmatch(group):
        return [r for r in map(int, m.group(1).split(", ")) if r in missing]
    return missing if len(ranks) == len(dumps) else []


def reached(held: dict[int, dict], r: int, dumps: dict[int, dict]) -> int:
    """The last seq rank r issued in a group; one before the first when it holds none (PyTorch's
    recorder numbers each group's collectives from 1, minishard's from 0)."""
    return max(held.get(r, {}), default=dumps[r].get("first_seq", 0) - 1)


def bystanders(groups: dict[str, tuple], gone: dict[str, list[int]], dumps: dict[int, dict]) -> set[int]:
    """The ranks that wait in a collective for a rank that stopped (one that waits in none, or
    left no dump), directly or through a chain of waiting ranks: behind in another group only
    because they wait here, they are not that group's cause. Ranks waiting for each other in a
    cycle (collectives of two groups issued in opposite orders) wait for no stopped rank: each is
    the cause in the group it never reached — else such a deadlock would be reported as nothing."""
    waits = {r: [(e["group"], e["seq"]) for e in body["entries"] if e["state"] == "issued"]
             for r, body in dumps.items()}

    def blockers(group: str, seq: int) -> list[int]:
        held, ranks = groups[group]
        return [r for r in ranks if reached(held, r, dumps) < seq] + gone[group]
    out: set[int] = set()
    grew = True
    while grew:
        grew = False
        for r in sorted(set(waits) - out):
            if any(not waits.get(b) or b in out for g, s in waits[r] for b in blockers(g, s)):
                out.add(r)
                grew = True
    return out


def desync(group: str, held: dict[int, dict[int, dict]], ranks: list[int]) -> Finding | None:
    """The first seq every rank holds where they issued different collectives."""
    common = set.intersection(*(set(held.get(r, {})) for r in ranks)) if ranks else set()
    for seq in sorted(common):
        sides: dict[tuple, list[int]] = defaultdict(list)
        for r in ranks:
            sides[signature(held[r][seq])].append(r)
        if len(sides) == 1:
            continue
        parts = sorted(sides.values(), key=lambda rs: (-len(rs), rs))
        odd = [r for rs in parts[1:] for r in rs] if len(parts[0]) > len(parts[1]) else ranks
        said = "; ".join(f"{ranks_word(rs)} {describe(held[rs[0]][seq])}{apart}"
                         for rs, apart in zip(parts, differences([held[rs[0]][seq] for rs in parts])))
        silent = all(sizes_agree(held[ranks[0]][seq], held[r][seq]) for r in ranks)
        return Finding(
            "desync", odd,
            f"ranks issued collectives in different orders: at seq {seq} of group {group!r}, {said}",
            [entry_line(f"rank {r}", held[r][seq]) for r in ranks]
            + ([f"the collectives before it agree on every rank (seqs {min(common)}..{seq - 1} "
                f"compared)"] if seq > min(common) else [])
            + (["their ops, shapes and dtypes agree, so nothing failed: the collectives paired up "
                "across what they move, and every rank computed with the wrong tensors"] if silent else []),
            "every rank must issue the same collectives in the same order, with the same shapes and "
            "dtypes: find the branch between the call sites above that differs by rank (a condition "
            "on the rank, the data, or on parameters that have no gradient here; buckets or units "
            "built from parameters in a different order; another precision on one rank) and make it "
            "the same everywhere")
    return None


def differences(sides: list[dict]) -> list[str]:
    """What tells the sides of a desync apart beyond what :func:`describe` says — the step, the
    broadcast's source, and, where they read the same otherwise, the line that issued each —
    one phrase per side (``, step 2, at train.py:108 in main``); "" where nothing more differs."""
    said = [""] * len(sides)
    same = len({describe(e) for e in sides}) == 1
    for key, word in (("step", "step {}"), ("src", "from rank {}"), ("where", "at {}")):
        values = [e.get(key) for e in sides]
        if len(set(map(str, values))) > 1 and (key != "where" or same):
            said = [f"{s}, {word.format(v)}" if v not in (None, "") else f"{s}, no {key}"
                    for s, v in zip(said, values)]
    return said


def never_issued(group: str, held: dict[int, dict[int, dict]], ranks: list[int],
                 dumps: dict[int, dict], victims: set[int] = frozenset()) -> Finding | None:
    """A rank that stopped short of a collective the others issued."""
    last = {r: reached(held, r, dumps) for r in ranks}
    top = max(last.values(), default=-1)
    # a rank stuck in another group's collective for a rank that stopped is that hang's victim,
    # not this one's cause
    behind = sorted((r for r in ranks if last[r] < top
                     and not (r in victims and _waiting_elsewhere(dumps[r], group))),
                    key=lambda r: (last[r], r))
    if not behind:
        return None
    first = last[behind[0]] + 1
    # the rings of ranks far ahead may have dropped it: then their oldest later one stands in
    shown = min(s for r in ranks for s in held.get(r, {}) if s >= first)
    ahead = [r for r in ranks if shown in held.get(r, {})]
    waiting = [r for r in ahead if held[r][shown]["state"] != "completed"]
    e = held[ahead[0]][shown]
    evidence = [entry_line(ranks_word(ahead), e)] if _alike(held, ahead, shown) else \
        [entry_line(f"rank {r}", held[r][shown]) for r in ahead]
    if shown != first:
        evidence.insert(0, f"seq {first} is no longer in any ring that went past it; the oldest "
                           f"later one is seq {shown}")
    for r in behind:
        mine = held.get(r, {})
        evidence.append(entry_line(f"rank {r}, its last collective", mine[last[r]]) if mine else
                        f"rank {r}: holds no collective of group {group!r}")
        evidence.append(written(r, dumps[r]))
    wait = (f"; {ranks_word(waiting)} wait{'s' if len(waiting) == 1 else ''} in "
            f"{'it' if shown == first else f'seq {shown}'}") if waiting else ""
    # the ranks that never issued it; others behind issued it and stopped later (each said so)
    never = [r for r in behind if last[r] < first]
    later = "".join(f"; rank {r} stopped after seq {last[r]}" for r in behind if r not in never)
    # a group the ranks behind never used at all, whose first collective the ranks ahead issued
    # instead of the next one of a stream they shared with them (where the others wait now): one
    # collective more on the ranks ahead (a line only they ran) — or one fewer on the others; both
    # are named, and the evidence's call sites tell which
    unused = first == min(held[ahead[0]]) and all(not held.get(r) for r in never) and \
        _left_a_stream(dumps, group, ahead, never)
    either = (f", the first of that group {ranks_word(ahead)} issued: one collective more on "
              f"{ranks_word(ahead)}, or one fewer on {ranks_word(never)}") if unused else ""
    return Finding(
        "hang", sorted(set(behind + ahead)) if unused else behind,
        f"{ranks_word(never)} never issued seq {first} of group {group!r}"
        f"{f' ({op_of(e)})' if shown == first else ''}{either}{later}{wait}",
        evidence,
        f"the collective at seq {first} must run on every rank, even one with nothing to send: "
        f"make {ranks_word(never)} issue it too (all-reduce zeros for parameters without a "
        f"gradient there, e.g. frozen or LoRA-only ones; no rank-dependent early exit before it). "
        f"If the rank raised or was killed, the finding about it says why")


def never_completed(group: str, held: dict[int, dict[int, dict]], ranks: list[int],
                    missing: list[int], dumps: dict[int, dict]) -> Finding | None:
    """The first seq every rank issued that never completed on some."""
    common = set.intersection(*(set(held.get(r, {})) for r in ranks)) if ranks else set()
    for seq in sorted(common):
        stuck = [r for r in ranks if held[r][seq]["state"] not in ("completed", "retired")]
        if not stuck or (not missing and all(dumps[r]["reason"] == "exception" for r in stuck)):
            continue             # (what a rank that raised left in flight, it abandoned)
        e = held[stuck[0]][seq]
        gone = f"; {ranks_word(missing)} left no dump" if missing else ""
        dead = [r for r in stuck if dumps[r]["reason"] == "ring"]
        alive = [r for r in stuck if r not in dead]
        what = (f"{ranks_word(dead)} died inside {e['op']} seq {seq} of group {group!r}"
                + (f"; {ranks_word(alive)} wait{'s' if len(alive) == 1 else ''} in it" if alive else "")
                if dead else f"{ranks_word(stuck)} wait{'s' if len(stuck) == 1 else ''} in {e['op']} "
                f"seq {seq} of group {group!r}")
        return Finding(
            "hang", missing or dead or stuck, what + gone,
            [entry_line(ranks_word(ranks), e)] if _alike(held, ranks, seq) else
            [entry_line(f"rank {r}", held[r][seq]) for r in ranks],
            (f"the ranks with a dump all issued it, so the one that did not is among those "
             f"without: {ranks_word(missing)} (the finding about the missing dumps)") if missing else
            "every rank issued it and it did not complete: a peer process stopped inside it "
            "(killed, or stuck in another group's collective), or, issued with async_op=True, "
            "it was never waited for")
    return None


def _left_a_stream(dumps: dict[int, dict], group: str, ahead: list[int], behind: list[int]) -> bool:
    """Each rank behind waits in another group's collective whose seq the ranks ahead had come
    up to — they hold the one before it, not it: they left that stream for ``group``. (Ranks
    that each began with another group, with nothing shared before, waited in a cycle of orders
    instead.)"""
    waits = [e for r in behind for e in dumps[r]["entries"] if e["group"] != group and e["state"] == "issued"]
    if not waits:
        return False
    for e in waits:
        for a in ahead:
            seqs = {x["seq"] for x in dumps[a]["entries"] if x["group"] == e["group"]}
            if e["seq"] in seqs or e["seq"] - 1 not in seqs:
                return False
    return True


def _waiting_elsewhere(dump: dict, group: str) -> bool:
    return any(e["group"] != group and e["state"] == "issued" for e in dump["entries"])


def _alike(held, ranks, seq) -> bool:
    return len({(signature(held[r][seq]), held[r][seq]["state"], held[r][seq].get("where"))
                for r in ranks}) == 1


def diagnose(directory: str | Path) -> Report:
    """Every finding of a run's directory, most important first."""
    report = read_dir(directory)
    if report.only_traces:
        return from_traces(report)
    found: list[Finding] = exceptions(report.dumps)
    if (dead := died(report.dumps)) is not None:
        found.append(dead)
    if (gone := missing_dumps(report)) is not None:
        found.append(gone)
    missing = gone.ranks if gone else []
    groups = {g: (held, members(g, held, report.dumps, report.world_size))
              for g, held in sorted(by_group(report.dumps).items())}
    lost = {g: absent(g, ranks, missing, report.dumps) for g, (_, ranks) in groups.items()}
    victims = bystanders(groups, lost, report.dumps)
    for group, (held, ranks) in groups.items():
        f = desync(group, held, ranks)
        if f is None:          # after a desync, what a group did next is its consequence
            f = never_issued(group, held, ranks, report.dumps, victims) or never_completed(
                group, held, ranks, lost[group], report.dumps)
        if f is not None:
            found.append(f)
    if not any(f.kind == "hang" for f in found) and (early := left_early(report.dumps)) is not None:
        found.append(early)
    return ranked(report, found)


def from_traces(report: Report) -> Report:
    """A run that left only traces: the order of the collectives each rank completed is compared
    (a desync among them shows); hangs and deaths cannot be seen, so they are not looked for."""
    found = []
    for group, held in sorted(by_group(report.dumps).items()):
        ranks = members(group, held, report.dumps, report.world_size)
        # a trace a death cut short lacks what its rank had not completed: lined up, not a desync
        if f := desync(group, cut_short.lined_up(held, ranks, sizes_agree_and_tag), ranks):
            found.append(f)
    return ranked(report, found)


def ranked(report: Report, found: list[Finding]) -> Report:
    """The report with the collectives' findings and every cause's, most important first."""
    for cause in causes.CAUSES:
        found += cause.find(report)
    order = kinds()
    report.findings = sorted(found, key=lambda f: order.index(f.kind))
    return report


def kinds() -> tuple[str, ...]:
    """Every kind of finding, in the order the doctor reports them."""
    return COLLECTIVE_KINDS + tuple(c.kind for c in causes.CAUSES)
