"""Replicas that drifted apart after the start, and optimizers told different things: the doctor's
reading of the records ``replicas.py`` notes every few steps (``facts["replicas"]`` in each rank's
dump; the short form its ring keeps, for a rank that died without one).

At each recorded step, in order, three things are compared across the ranks:

    replicas   each set of parameters held as replicas, by its ranks: grouped by fingerprint
    settings   every rank's optimizer hyperparameters (its param groups without their parameters)
    steps      how many times each rank's optimizer stepped

The first step at which any of them differs is the finding (kind ``drift``), with what the
evidence shows of the cause: a hyperparameter that differs (named, with both values), a step
the rank's optimizer did not take (from its per-step notes, ``facts["steps"]``). Which ranks
differ: the ranks are grouped by what they hold, the largest group is the reference and the
others differ; when no group is the largest (two ranks, or a tie) the group holding the lowest
rank is the reference — so with two ranks, rank 1 is said to differ from rank 0.

This module words its findings as plain fields (``causes.py`` makes them ``Finding``s: it lists
this cause among the others) and what it compared, for the "nothing found" line
(``cli/doctor.py``).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from minishard.core.trace import TraceFormatError
from .replicas import digest, settings_digest, start_groups

SHOWN = 3              # parameters named in a line; the count says how many more
# the hyperparameters a title names first, when several differ
FIRST = ("lr", "weight_decay", "momentum", "betas", "eps", "dampening", "nesterov")


@dataclass
class Record:
    """One rank's record of one step, as the doctor compares it: each set's digest, and, from a
    dump (not from a ring), each set's fingerprints and the settings themselves."""
    step: int
    optimizer_steps: int | None
    settings: list | None
    settings_digest: str
    sets: dict[tuple[int, ...], str]
    prints: dict[tuple[int, ...], dict[str, str]] = field(default_factory=dict)


def records(dumps: dict[int, dict]) -> dict[int, dict[int, Record]]:
    """rank -> step -> its record (the ranks that noted none are left out). A record that cannot
    be read raises :class:`TraceFormatError`, naming the rank and the record."""
    out: dict[int, dict[int, Record]] = {}
    for r, body in sorted(dumps.items()):
        noted = (body.get("facts") or {}).get("replicas")
        if not noted:
            continue
        mine = out[r] = {}
        for i, raw in enumerate(noted):
            try:
                rec = _record(raw)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                where = "flight_rank{r}.ring" if body.get("reason") == "ring" else "flight_rank{r}.json"
                raise TraceFormatError(f"{where.format(r=r)}: replicas record {i} cannot be read "
                                       f"({type(e).__name__}: {e}): a damaged dump") from None
            mine[rec.step] = rec
    return out


def _record(raw: dict) -> Record:
    step, count, said = int(raw["step"]), raw.get("optimizer_steps"), raw.get("settings")
    sets, prints = {}, {}
    for s in raw["sets"]:
        if isinstance(s, dict):                        # a dump's: the fingerprints, or their digest
            key = tuple(int(x) for x in s["ranks"])
            if "prints" in s:
                prints[key] = dict(s["prints"])
                sets[key] = digest(prints[key])
            else:
                sets[key] = str(s["digest"])
        else:                                          # a ring's: [ranks, digest]
            ranks, d = s
            sets[tuple(int(x) for x in ranks)] = str(d)
    if isinstance(said, list):
        return Record(step, count, said, settings_digest(said), sets, prints)
    return Record(step, count, None, str(said), sets, prints)


# --------------------------------------------------------------------------- comparing

def sides(values: dict[int, object]) -> tuple[list[int], list[int]]:
    """(the reference ranks, the ranks that differ from them): grouped by value, the largest
    group is the reference; of groups equally large, the one holding the lowest rank."""
    groups: dict[object, list[int]] = defaultdict(list)
    for r in sorted(values):
        groups[values[r]].append(r)
    ordered = sorted(groups.values(), key=lambda rs: (-len(rs), rs[0]))
    return ordered[0], sorted(r for rs in ordered[1:] for r in rs)


def how_picked(reference: list[int], others: list[int], values: dict[int, object]) -> str:
    """How the reference was chosen, in words."""
    groups = Counter(values[r] for r in values)
    if groups[values[reference[0]]] > max(c for v, c in groups.items() if v != values[reference[0]]):
        return f"{_ranks(reference)} agree{'s' if len(reference) == 1 else ''}: the majority, the reference"
    if len(values) == 2:
        return (f"of two ranks neither is a majority: rank {reference[0]}, the lower, is the "
                f"reference, and rank {others[0]} is said to differ")
    return (f"no majority: the group with the lowest rank ({_ranks(reference)}) is the reference")


@dataclass
class Compared:
    """What differed at the first step where anything did (each list empty: it agreed)."""
    step: int
    replicas: list[tuple[tuple[int, ...], list[int], list[int]]]   # (set, reference, differ)
    settings: tuple[list[int], list[int]] | None                     # (reference, differ)
    steps: tuple[list[int], list[int]] | None


def first_difference(recs: dict[int, dict[int, Record]], compare: bool = True) -> Compared | None:
    """The first recorded step at which the ranks differ (``compare`` False: in their optimizers
    only, not in their replicas)."""
    for step in sorted(set().union(*map(set, recs.values()))):
        here = {r: mine[step] for r, mine in recs.items() if step in mine}
        if len(here) < 2:
            continue
        replicas = []
        for key in sorted(set().union(*(set(rec.sets) for rec in here.values()))) if compare else ():
            held = {r: rec.sets[key] for r, rec in here.items() if key in rec.sets}
            if len(held) > 1 and len(set(held.values())) > 1:
                replicas.append((key, *sides(held)))
        said = {r: rec.settings_digest for r, rec in here.items()}
        counts = {r: rec.optimizer_steps for r, rec in here.items() if rec.optimizer_steps is not None}
        settings = sides(said) if len(set(said.values())) > 1 else None
        steps = sides(counts) if len(set(counts.values())) > 1 else None
        if replicas or settings or steps:
            return Compared(step, replicas, settings, steps)
    return None


# --------------------------------------------------------------------------- words

def find(dumps: dict[int, dict]) -> list[dict]:
    """The ``drift`` finding's fields (kind, ranks, title, evidence, fix), or none."""
    recs = records(dumps)
    # replicas that started apart differ for that reason (the weights finding): not compared
    c = first_difference(recs, not started_apart(dumps)) if len(recs) > 1 else None
    phase = skipped_phase(dumps)
    if c is None:
        return [_phase_finding(phase)] if phase else []
    here = {r: mine[c.step] for r, mine in recs.items() if c.step in mine}
    odd = sorted({r for _, _, rs in c.replicas for r in rs}
                 | set(c.settings[1] if c.settings else ()) | set(c.steps[1] if c.steps else ()))
    ref = (c.replicas[0][1] if c.replicas else c.settings[0] if c.settings else c.steps[0])[0]
    changed = _settings_changed(here, c.settings)
    skipped = _skipped(dumps, c.step, c.steps)
    if phase and phase[0] <= c.step:               # what the collectives showed, where notes did not
        for r in phase[2]:
            less, more = skipped.setdefault(r, ([], []))
            if phase[0] not in less:
                less.insert(0, phase[0])
    cause, fix = _cause(odd, ref, changed, skipped, here, c)
    whose = _whose(odd)
    if c.replicas:
        title = (f"{whose} replica{'s' if len(odd) > 1 else ''} differ{'' if len(odd) > 1 else 's'} "
                 f"from rank {ref}'s after step {c.step}, the first step recorded at which they "
                 f"differ" + (f": {'their' if len(odd) > 1 else 'its'} {cause}" if cause else
                              ": every collective matched"))
    else:
        title = (f"{whose} {cause or f'optimizer differs from rank {ref}'}" + f" (found at step "
                 f"{c.step}, the first step recorded at which the ranks differ)")
    evidence = (_replica_lines(c, here, recs) + _settings_lines(changed, ref)
                + _step_lines(c, here, skipped, ref) + _unseen(c, here, odd))
    if phase and phase[0] <= c.step:
        evidence.append(_phase_line(phase))
    evidence.append(_recorded(recs, dumps))
    return [{"kind": "drift", "ranks": odd, "title": title, "evidence": evidence, "fix": fix}]


def started_apart(dumps: dict[int, dict]) -> bool:
    """The replicas of some group differed as training started (``weights_start``, compared
    within each group of ranks that must start alike: ``replicas.start_groups``)."""
    facts = {r: b.get("facts") or {} for r, b in dumps.items()}
    start = {r: f["weights_start"] for r, f in facts.items() if isinstance(f.get("weights_start"), dict)
             and f["weights_start"]}
    return any(len({tuple(sorted(start[r].items())) for r in group}) > 1
               for group in start_groups({r: facts[r] for r in start}))


def skipped_phase(dumps: dict[int, dict]) -> tuple[int, list[int], list[int], int] | None:
    """The first step whose optimizer phase some ranks issued collectives in (ZeRO's broadcasts
    or all-gathers of the stepped parameters) while others issued none there and went on to a
    later step: (the step, the ranks that issued them, those that skipped it, how many the
    first of them issued). A rank whose ring no longer holds that step, or that is still in it
    (stopped before its optimizer phase: a hang's), is not judged."""
    held = {r: [e for e in b["entries"] if isinstance(e.get("step"), int)] for r, b in dumps.items()}
    stepped = {r: {e["step"] for e in es if e.get("phase") == "optimizer"} for r, es in held.items()}
    for step in sorted(set().union(*stepped.values())):
        issued = sorted(r for r in held if step in stepped[r])
        past = sorted(r for r, es in held.items() if r not in issued and es
                      and min(e["step"] for e in es) <= step < max(e["step"] for e in es))
        if past:
            n = sum(1 for e in held[issued[0]] if e["step"] == step and e.get("phase") == "optimizer")
            return step, issued, past, n
    return None


def _phase_line(phase) -> str:
    step, issued, past, n = phase
    return (f"{_ranks(past)} issued no collective in step {step}'s optimizer phase and went on to "
            f"the next step; rank {issued[0]} issued {n} there (the collectives of the step the "
            f"optimizer takes: sending each rank's stepped part to the others)")


def _phase_finding(phase) -> dict:
    step, issued, past, n = phase
    return {"kind": "drift", "ranks": past,
            "title": f"{_whose(past)} optimizer did not step at step {step}: {_ranks(issued)} did",
            "evidence": [_phase_line(phase), "what the other ranks then waited in is the "
                         "consequence (a hang, a timeout, or collectives paired across steps)"],
            "fix": SKIP_FIX}


SKIP_FIX = ("every rank must step its optimizer at every step: a decision to skip one (a NaN or inf "
            "check on this rank's own loss or gradients, a counter of its own, a try/except around "
            "the step) must be taken by all ranks together — all-reduce the flag first, as "
            "GradScaler's inf check does — or the rank that skips falls behind for good")


def _unseen(c: Compared, here: dict[int, Record], odd: list[int]) -> list[str]:
    """Why differing settings or step counts did not show in the replicas: there are none, or
    each rank steps its own part of them and sends it to the others."""
    if c.replicas or not (c.settings or c.steps):
        return []
    if any(rec.sets for rec in here.values()):
        return [f"the replicas agree after step {c.step}: each rank steps its own part of the "
                f"parameters and sends it to the others (ZeRO), so every replica carries the part "
                f"{_ranks(odd)} stepped with {'their' if len(odd) > 1 else 'its'} own optimizer"]
    return ["no rank holds a parameter as a replica of another's (every one is sharded): each "
            "rank steps its shards with its own optimizer, so the model trained is a patchwork of "
            "shards stepped differently"]


def _whose(ranks: list[int]) -> str:
    return f"rank {ranks[0]}'s" if len(ranks) == 1 else f"{_ranks(ranks)}'"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _settings_changed(here: dict[int, Record], settings) -> dict[int, list[str] | None]:
    """rank -> what differs in its settings from the reference's, as ``(group, name, its value,
    the reference's)`` tuples (None: its ring kept only their digest)."""
    if settings is None:
        return {}
    ref = here[settings[0][0]]
    out = {}
    for r in settings[1]:
        mine = here[r].settings
        if mine is None or ref.settings is None:
            out[r] = None
            continue
        diffs = []
        if len(mine) != len(ref.settings):
            diffs.append((None, "param groups", len(mine), len(ref.settings)))
        for i, (a, b) in enumerate(zip(mine, ref.settings)):
            for k in sorted(set(a) | set(b), key=lambda k: (FIRST.index(k) if k in FIRST else len(FIRST), k)):
                if a.get(k, "(none)") != b.get(k, "(none)"):
                    diffs.append((i, k, a.get(k, "(none)"), b.get(k, "(none)")))
        out[r] = diffs
    return out


def _skipped(dumps: dict[int, dict], step: int, steps) -> dict[int, tuple[list[int], list[int]]]:
    """rank -> (the steps at which its optimizer stepped fewer times than the reference's, those
    at which more), up to ``step``, from the per-step notes (empty lists: no notes to tell)."""
    if steps is None:
        return {}
    ref_notes = _stepped_at(dumps[steps[0][0]], step)
    out = {}
    for r in steps[1]:
        mine = _stepped_at(dumps[r], step)
        out[r] = (sorted(s for s in ref_notes if mine[s] < ref_notes[s]),
                  sorted(s for s in mine if mine[s] > ref_notes[s]))
    return out


def _stepped_at(dump: dict, step: int) -> Counter:
    notes = (dump.get("facts") or {}).get("steps") or []
    return Counter(n["step"] for n in notes if isinstance(n, dict) and isinstance(n.get("step"), int)
                   and n["step"] <= step)


def _value(v) -> str:
    return "(none)" if v is None else str(v)


def _cause(odd: list[int], ref: int, changed: dict, skipped: dict, here: dict[int, Record],
           c: Compared) -> tuple[str, str]:
    """The likely cause, as what the rank's optimizer did ("optimizer has another lr ..."; ""
    where the evidence shows none), and the fix."""
    r = odd[0]
    diffs = changed.get(r)
    if diffs:
        group, k, mine, theirs = diffs[0]
        what = (f"optimizer has {mine} param groups, rank {ref}'s {theirs}" if group is None else
                f"optimizer has another {k} ({_value(mine)} against rank {ref}'s {_value(theirs)})")
        return what, ("build every rank's optimizer from the same settings: a hyperparameter that "
                      "depends on the rank (a learning rate scaled by a rank-dependent factor, a "
                      "config read on each rank, a scheduler stepped on some ranks only) makes each "
                      "rank take another step from the same averaged gradient, and replicas drift "
                      "apart for good (sharded, each rank steps its shard by other settings)")
    if r in changed:
        return ("optimizer's settings differ (its ring keeps only their digest)",
                "build every rank's optimizer from the same settings")
    less, more = skipped.get(r, ([], []))
    if less or more:
        return (f"optimizer did not step at step {less[0]}" if less else
                f"optimizer stepped more than once at step {more[0]}"), SKIP_FIX
    if c.steps is not None and r in c.steps[1]:
        return (f"optimizer had stepped {here[r].optimizer_steps} times, rank {ref}'s "
                f"{here[ref].optimizer_steps}"), SKIP_FIX
    return "", ("the weights changed differently on some ranks though every collective matched: look "
                "between the step recorded before and this one for an update that depends on the "
                "rank — a parameter outside the wrapper (its gradient never all-reduced), weights "
                "edited or loaded on one rank only, a random draw per rank; record every step "
                "(fingerprint_every=1) to find the step")


def _named(recs, key, r: int, ref: int, step: int) -> tuple[int, dict, dict] | None:
    """The first record from ``step`` on where both ranks kept every fingerprint of the set and
    they differ: (its step, rank r's fingerprints, the reference's)."""
    for s in sorted(recs[r]):
        if s >= step and s in recs[ref]:
            mine, theirs = recs[r][s].prints.get(key), recs[ref][s].prints.get(key)
            if mine is not None and theirs is not None and mine != theirs:
                return s, mine, theirs
    return None


def _replica_lines(c: Compared, here: dict[int, Record], recs) -> list[str]:
    out = []
    for key, ref_ranks, odd in c.replicas:
        ref = ref_ranks[0]
        for r in odd:
            named = _named(recs, key, r, ref, c.step)
            if named is None:
                out.append(f"rank {r}: the digest of the parameters held as replicas by {_ranks(key)} "
                           f"differs from rank {ref}'s after step {c.step} (no record of both keeps "
                           f"a fingerprint per parameter: a ring's does not)")
                continue
            at, mine, theirs = named
            names = [n for n in theirs if mine.get(n) != theirs[n]] + [n for n in mine if n not in theirs]
            first = names[0]
            shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
            later = "" if at == c.step else (f" (step {c.step}'s record keeps one digest per set: "
                                             f"the parameters are named from step {at}'s, the first "
                                             f"after it that keeps every fingerprint)")
            out.append(f"rank {r}: {len(names)} of the {len(theirs)} parameters held as replicas by "
                       f"{_ranks(key)} differ from rank {ref}'s after step {at} ({shown}; {first}: "
                       f"fingerprint {mine.get(first, '(none)')} against {theirs.get(first, '(none)')})"
                       + later)
        out.append(how_picked(ref_ranks, odd, {r: here[r].sets[key] for r in here if key in here[r].sets}))
        before = [s for s in sorted(recs[ref]) if s < c.step and all(
            key in recs[r].get(s, Record(s, None, None, "", {})).sets for r in [ref, *odd])]
        if before:
            out.append(f"they were equal after step {before[-1]}, the record before")
        else:
            out.append(f"step {c.step} is the first step recorded: they differed from the first step on")
    return out


def _settings_lines(changed: dict, ref: int) -> list[str]:
    out = []
    for r, diffs in sorted(changed.items()):
        if diffs is None:
            out.append(f"rank {r}'s optimizer settings differ from rank {ref}'s (the digest its ring keeps)")
            continue
        for group, k, mine, theirs in diffs:
            where = "" if group is None else f", param group {group}"
            out.append(f"rank {r}'s optimizer{where}: {k} {_value(mine)}, rank {ref}'s {_value(theirs)}")
    return out


def _step_lines(c: Compared, here: dict[int, Record], skipped: dict, ref: int) -> list[str]:
    if c.steps is None:
        return []
    out = []
    for r in c.steps[1]:
        line = (f"rank {r}'s optimizer had stepped {here[r].optimizer_steps} times after step "
                f"{c.step}, rank {ref}'s {here[ref].optimizer_steps} times")
        less, more = skipped.get(r, ([], []))
        if less:
            line += f"; it took no step at step{'s' if len(less) > 1 else ''} {', '.join(map(str, less))}"
        if more:
            line += f"; it stepped more than once at step{'s' if len(more) > 1 else ''} {', '.join(map(str, more))}"
        out.append(line)
    return out


def _recorded(recs: dict[int, dict[int, Record]], dumps: dict[int, dict]) -> str:
    steps = sorted(set().union(*map(set, recs.values())))
    every = {(b.get("facts") or {}).get("fingerprint_every") for b in dumps.values()} - {None}
    cadence = (f" (every {next(iter(every))} steps and the last)" if len(every) == 1 else
               " (after the last step only)" if not every else "")
    return f"recorded after step{'s' if len(steps) > 1 else ''} {steps_word(steps)}{cadence}"


def steps_word(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else \
        f"{', '.join(map(str, steps[:3]))}, …, {', '.join(map(str, steps[-2:]))} ({len(steps)} records)"


def checked(dumps: dict[int, dict]) -> str:
    """What was compared, for the "nothing found" line: the replicas at the steps recorded, or,
    in words, what was not."""
    recs = records(dumps)
    if not recs:
        return ("Not compared: the weights after the start and the optimizers' settings — no "
                "fingerprints were recorded during the run (minishard.watch and "
                "TrainConfig(flight_dir=) record them every fingerprint_every steps).")
    steps = steps_word(sorted(set().union(*map(set, recs.values()))))
    sets: dict[tuple[int, ...], int] = {}
    for rec in (rec for mine in recs.values() for rec in mine.values()):
        for key in rec.sets:
            sets[key] = max(sets.get(key, 0), len(rec.prints.get(key, ())))
    if not sets:
        return (f"The optimizers' settings and step counts agreed at every step recorded (steps {steps}). "
                f"Not compared: the weights after the start — no rank holds a parameter as a "
                f"replica of another's (every one is sharded, none is kept whole).")
    held = "; ".join(f"{n} parameters held by {_ranks(key)}" if n else f"those held by {_ranks(key)}"
                     for key, n in sorted(sets.items()))
    return (f"The replicas agreed at every step recorded (steps {steps}; {held}), and so did the "
            f"optimizers' settings and step counts.")
