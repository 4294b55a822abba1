"""The doctor's findings beyond the collectives: what the ranks' facts (``minishard.instruments.health``, in
their flight dumps) and their ledgers (the traces' alloc/free events) say went wrong though every
collective matched.

    weights    ranks that started from different weights: their replicas' fingerprints differ at
               the start, or they built different weights and nothing broadcast rank 0's before
               each sharded its own (FSDP2's ``fully_shard`` broadcasts nothing)
    drift      replicas that drifted apart after the start, or optimizers told different things:
               the first recorded step at which a rank differs, and the likely cause — another
               hyperparameter, a step its optimizer did not take (``drift.py``)
    clip       ranks that clipped by different gradient norms at the same step: each computed the
               norm of its own shards, not of the whole gradient
    precision  the optimizer stepped weights that are not fp32 — no master copy — with the share
               of the elements it stepped that came out unchanged
    memory     what kept the peak up, from the ledger: one FSDP unit holding most parameters (no
               wrap policy: every rank gathers the whole model at once), unsharded gradients kept
               from one micro-batch to the next (accumulation without reduce-scatter)

Each is a :class:`Cause` in ``CAUSES`` (the end of this module): its kind, and the function that
reads the run (``doctor.Report``: the dumps, the traces) and decides, returning its findings with
their words — the title, the evidence, the fix. A new finding is one such function and one line in
``CAUSES``: the doctor runs it, reports it after the collectives' findings in the list's order,
and ``minishard doctor`` prints it and exits 1 (``tests/test_doctor_edges.py`` adds a toy one).
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from minishard.strategies.clipping import NORM_TAG
from . import drift as drift_
from .replicas import start_groups
from minishard.core import trace
from minishard.core.words import fmt_bytes

if TYPE_CHECKING:
    from .doctor import Report


@dataclass
class Finding:
    """What the doctor reports: a kind of fault (``doctor.kinds()``), the ranks it concerns, a
    one-line title, the evidence read from the dumps and traces, and the fix. ``details``: what
    only ``minishard doctor --verbose`` prints (an error's own words, as the library raised them:
    several lines, this machine's paths)."""
    kind: str
    ranks: list[int]
    title: str
    evidence: list[str]
    fix: str
    details: list[str] = field(default_factory=list)

NORM_AGREES = 1e-6        # relative: an all-reduced norm is the same number on every rank
MOST = 0.5                # one unit holding this share of the parameters or more
UNIT_FULL = (re.compile(r"(?P<unit>.+):full\d+$"), re.compile(r"unsharded:(?P<unit>.+)$"))
FULL_GRAD = re.compile(r"(?P<unit>.+):grad_full\d+$")
# reshard_after_forward=k: the part of a unit's gathered parameters it keeps from forward to backward
POST_FORWARD = re.compile(r"(?P<unit>.+):post_forward$")


def _ranks_word(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _facts(dumps: dict[int, dict]) -> dict[int, dict]:
    return {r: d.get("facts") or {} for r, d in dumps.items()}


def _differ_from_rank0(prints: dict[int, dict[str, str]]) -> dict[int, tuple[int, list[str]]]:
    """rank -> (the lowest rank, the parameters whose fingerprint differs from its)."""
    base_rank = min(prints)
    base = prints[base_rank]
    return {r: (base_rank, [n for n in base if p.get(n) != base[n]]) for r, p in prints.items()
            if r != base_rank and any(p.get(n) != base[n] for n in base)}


def _differ_within_groups(prints: dict[int, dict[str, str]], facts) -> dict[int, tuple[int, list[str]]]:
    """:func:`_differ_from_rank0` within each group of ranks that must start alike
    (``replicas.start_groups``: DDP's own group, where the job holds other weights elsewhere)."""
    out = {}
    for group in start_groups({r: facts[r] for r in prints}):
        if len(group) > 1:
            out |= _differ_from_rank0({r: prints[r] for r in group})
    return out


def weights(dumps: dict[int, dict]) -> list:
    facts = _facts(dumps)
    start = {r: f["weights_start"] for r, f in facts.items() if f.get("weights_start")}
    built = {r: f["weights_built"] for r, f in facts.items() if f.get("weights_built")}
    if len(start) > 1 and (odd := _differ_within_groups(start, facts)):
        return [_weights_finding(
            start, odd, facts, "started training from other weights than {base}: their "
            "replicas differ, and averaging gradients keeps them apart", "differ from", "at the first step",
            [], "make every rank start from one model: broadcast rank 0's weights before training (DDP "
            "does in its constructor; minishard's strategies do unless told not to), or build the "
            "model from the same seed on every rank")]
    sharded = [r for r in built if r not in start]
    synced = any(f.get("start_replicated") for f in facts.values())
    if len(built) > 1 and sharded and not synced and (odd := _differ_from_rank0(built)):
        return [_weights_finding(
            built, odd, facts, "built other weights than {base}, and each rank sharded its own: "
            "the model trained is made of each rank's shard of a different model",
            "built differently from", "", ["no broadcast of rank 0's weights was recorded before sharding"],
            "FSDP2's fully_shard does not broadcast: build the model from the same seed on every "
            "rank (or on the meta device and load one checkpoint), or broadcast rank 0's weights "
            "before fully_shard (minishard's fully_shard does)")]
    return []


def _weights_finding(prints: dict[int, dict[str, str]], odd: dict[int, tuple[int, list[str]]], facts,
                     title: str, verb: str, when: str, more: list[str], fix: str):
    """``odd``: rank -> (the rank it is compared with, the parameters that differ)."""
    bases = sorted({base for base, _ in odd.values()})
    said = f"rank {bases[0]}" if len(bases) == 1 else \
        f"the lowest rank of their replica group ({_ranks_word(bases)})"
    return Finding(
        "weights", sorted(odd), f"{_ranks_word(odd)} " + title.format(base=said),
        [f"rank {r}: {len(names)} of {len(prints[base])} parameters {verb} rank {base}'s"
         f"{' ' + when if when else ''} (first: {names[0]}, fingerprint {prints[r][names[0]]} against "
         f"{prints[base][names[0]]})" for r, (base, names) in sorted(odd.items())]
        + _sync_evidence(facts) + more,
        fix)


def _sync_evidence(facts: dict[int, dict]) -> list[str]:
    skipped = sorted(r for r, f in facts.items() if f.get("start_not_replicated"))
    run = next((f["run"] for f in facts.values() if f.get("run")), {})
    out = [f"the strategy was told not to broadcast rank 0's weights at the start on "
           f"{_ranks_word(skipped)} (fault {run.get('fault')})"] if skipped else []
    return out


def clip(dumps: dict[int, dict]) -> list:
    norms: dict[int, dict[int, float]] = defaultdict(dict)      # step -> rank -> norm
    for r, f in _facts(dumps).items():
        for note in f.get("steps", []):
            if note.get("grad_norm") is not None:
                norms[note["step"]][r] = note["grad_norm"]
    for step in sorted(norms):
        seen = norms[step]
        if len(seen) < 2:
            continue
        lo, hi = min(seen.values()), max(seen.values())
        if hi - lo > NORM_AGREES * max(abs(hi), 1e-12):
            base = min(seen)
            odd = [r for r in seen if abs(seen[r] - seen[base]) > NORM_AGREES * max(abs(hi), 1e-12)]
            return [Finding(
                "clip", sorted(seen),
                f"the ranks clipped by different gradient norms at step {step}: each computed the "
                f"norm of its own gradient shards, not of the whole gradient",
                [", ".join(f"rank {r}: {seen[r]:.6g}" for r in sorted(seen))]
                + [f"a global norm is one number on every rank ({_ranks_word(odd)} differ from rank "
                   f"{base}); no all-reduce of the squared norm was recorded in the optimizer phase"
                   if not _norm_reduced(dumps, step) else
                   f"{_ranks_word(odd)} differ from rank {base}"],
                "sum the squares of every rank's shards with one all-reduce before the square root, "
                "and scale every rank by the same factor (torch.nn.utils.clip_grad_norm_ on FSDP2's "
                "DTensors does; minishard's clip_grad_norm_ does)")]
    return []


def _norm_reduced(dumps: dict[int, dict], step: int) -> bool:
    return any(e.get("tag") == NORM_TAG and e.get("step") == step
               for d in dumps.values() for e in d["entries"])


def precision(dumps: dict[int, dict]) -> list:
    low: dict[int, list[dict]] = {}
    for r, f in _facts(dumps).items():
        notes = [n for n in f.get("steps", []) if set(n.get("param_dtypes", ())) - {"float32", "float64"}]
        if notes:
            low[r] = notes
    if not low:
        return []
    r0 = min(low)
    notes = low[r0]
    dtypes = sorted({d for n in notes for d in n["param_dtypes"]} - {"float32", "float64"})
    evidence = [f"rank {r0}, step {n['step']}: {n['unchanged']:,} of {n['low_precision_elements']:,} "
                f"{'/'.join(dtypes)} elements the optimizer stepped came out unchanged "
                f"({100 * n['unchanged'] / max(n['low_precision_elements'], 1):.1f} %)"
                for n in notes if "unchanged" in n]
    return [Finding(
        "precision", sorted(low),
        f"the optimizer steps {'/'.join(dtypes)} weights: no fp32 master copy, so an update smaller "
        f"than half the spacing of {'/'.join(dtypes)} numbers near a weight is rounded away",
        evidence,
        "keep an fp32 master of the weights and step it (minishard: precision bf16_mixed; FSDP2: "
        "fp32 parameters with MixedPrecisionPolicy(param_dtype=torch.bfloat16)); compute in bf16, "
        "never accumulate updates in it")]


# --------------------------------------------------------------------------- memory, from the traces

def _read(path: Path) -> list[dict]:
    """A rank's events as far as its trace goes: a rank that died cut it short."""
    return trace.read_events(path, damaged="stop")[0]


def _unit_of(tag: str, patterns) -> str | None:
    for p in patterns:
        if m := p.match(tag):
            return m.group("unit")
    return None


def _fold(events: list[dict]) -> dict:
    """One rank's ledger replayed as ``trace.LedgerTimeline`` does — each alloc adds its bytes to
    its category, each free takes its own away (a watched PyTorch job repeats tags) — with: the
    most each unit held unsharded, the peak and its categories, and the most full gradients live
    as a forward began (with their units)."""
    units: dict[str, int] = {}                         # unit -> the most it held unsharded
    gathered: dict[str, int] = defaultdict(int)        # unit -> unsharded now
    full: dict[str, int] = defaultdict(int)            # unit -> full gradients now
    kept_forward: dict[str, int] = defaultdict(int)    # unit -> its post-forward part now
    by_cat: dict[str, int] = defaultdict(int)
    # "last": as the last allocation left it — where a rank that ran out of memory stood (what
    # follows it in the trace is the exception unwinding: autograd freeing what it saved)
    out = {"units": units, "peak": 0, "at_peak": {}, "kept": 0, "kept_units": [], "last": {}}
    phase = None
    for ev in events:
        kind = ev.get("kind")
        if kind in ("alloc", "free") and ev.get("device", "device") == "device":
            sign = 1 if kind == "alloc" else -1
            nbytes, tag = sign * int(ev.get("bytes", 0)), str(ev.get("tag", ""))
            by_cat[ev.get("category")] += nbytes
            if ev.get("category") == "unsharded" and (u := _unit_of(tag, UNIT_FULL)):
                gathered[u] += nbytes
                units[u] = max(units.get(u, 0), gathered[u])
            elif ev.get("category") == "unsharded" and (m := POST_FORWARD.match(tag)):
                # gathered bytes too, held into backward: an out-of-memory split without them
                # left them out of every cause, and could advise the wrong fix first
                kept_forward[m.group("unit")] += nbytes
            if ev.get("category") == "grads" and (m := FULL_GRAD.match(tag)):
                full[m.group("unit")] += nbytes
            total = sum(by_cat.values())
            if kind == "alloc":
                if total > out["peak"]:
                    out["peak"], out["at_peak"] = total, {c: b for c, b in by_cat.items() if b}
                now = {u: gathered.get(u, 0) + kept_forward.get(u, 0)
                       for u in dict.fromkeys([*gathered, *kept_forward])}
                out["last"] = {"gathered": {u: b for u, b in now.items() if b > 0},
                               "full": sum(full.values()), "phase": phase, "total": total}
        if kind == "phase" and ev.get("edge") == "begin" and ev.get("name") != "step":
            phase = ev.get("name")
        if kind == "phase" and ev.get("name") == "forward" and ev.get("edge") == "begin":
            if sum(full.values()) > out["kept"]:
                out["kept"] = sum(full.values())
                out["kept_units"] = sorted(u for u, b in full.items() if b > 0)
    return out


def _one_unit(units: dict[str, int]) -> bool:
    """No wrap policy (a single unit), or a unit below the root holding most parameters. A root
    holding most beside wrapped blocks is the embedding of a large vocabulary: no wrap fixes it."""
    if not units:
        return False
    biggest = max(units, key=units.get)
    return len(units) == 1 or (biggest != "root" and units[biggest] >= MOST * sum(units.values()))


def memory(traces: dict[int, Path], dumps: dict[int, dict] | None = None) -> list:
    folds = {r: _fold(_read(path)) for r, path in sorted(traces.items())}
    found = out_of_memory(folds, dumps or {})
    one_unit = {r: f for r, f in folds.items() if _one_unit(f["units"])}
    if one_unit:
        r = min(one_unit)
        f = one_unit[r]
        unit = max(f["units"], key=f["units"].get)
        nbytes, whole, n = f["units"][unit], sum(f["units"].values()), len(f["units"])
        found.append(Finding(
            "memory", sorted(one_unit),
            f"FSDP unit {unit!r} holds {100 * nbytes / whole:.0f} % of the parameters: while it is "
            f"gathered every rank holds {fmt_bytes(nbytes)} unsharded, so sharding saves little",
            [f"rank {r}: {n} unit{'s' if n > 1 else ''} gathered; {unit!r} unsharded "
             f"{fmt_bytes(nbytes)} of {fmt_bytes(whole)} in all",
             f"rank {r}'s peak {fmt_bytes(f['peak'])}: " + _split(f["at_peak"])],
            "wrap smaller units: fully_shard each block (each layer) before the root (minishard: "
            "wrap 'block'; FSDP2: call fully_shard on every transformer block, then on the model), "
            "so that one block's parameters are gathered at a time"))
    kept = {r: f for r, f in folds.items() if f["kept"]}
    if kept:
        r = min(kept)
        f = kept[r]
        us = f["kept_units"]
        found.append(Finding(
            "memory", sorted(kept),
            f"unsharded gradients kept from one micro-batch to the next: {fmt_bytes(f['kept'])} of "
            f"full gradients of {len(us)} unit{'s' if len(us) > 1 else ''} held as a forward begins",
            [f"rank {r}: full gradients of {', '.join(us)} live when the next micro-batch's "
             f"forward began",
             f"rank {r}'s peak {fmt_bytes(f['peak'])}: " + _split(f["at_peak"])],
            "accumulation without synchronising (no_sync, set_requires_gradient_sync(False), "
            "accumulation=\"no_sync\") keeps every unit's full gradient until the last "
            "micro-batch: reduce-scatter every micro-batch instead (FSDP2's default; more bytes "
            "on the wire, only the shards held)"))
    return found


STATE = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "momentum")


def out_of_memory(folds: dict[int, dict], dumps: dict[int, dict]) -> list:
    """A rank that ran out of memory: what it held when the allocation failed (the ledger's own
    count, which its dump keeps; units and full gradients from its trace, as its last
    allocation left them), split into the causes one can change, the largest first."""
    ranks = sorted(r for r, d in dumps.items() if (d.get("facts") or {}).get("out_of_memory"))
    if not ranks:
        return []
    r = ranks[0]
    oom = dumps[r]["facts"]["out_of_memory"]
    held, last = oom["held"], folds.get(r, {}).get("last", {})
    full, gathered = last.get("full", 0), last.get("gathered", {})
    causes: list[tuple[int, str, str]] = []           # (bytes, what, what to change)
    act = held.get("activations", 0)
    causes.append((act, f"activations {fmt_bytes(act)}", "recompute them (activation "
                   "checkpointing), a smaller micro-batch with accumulation, the loss in chunks"))
    state = sum(held.get(c, 0) for c in STATE) - full
    causes.append((state, f"parameters' shards, gradients and optimizer state {fmt_bytes(state)}",
                   "shard more of it (the next ZeRO stage, more ranks) or offload it"))
    if gathered:
        units = ", ".join(f"{u} {fmt_bytes(b)}" for u, b in sorted(gathered.items(), key=lambda ub: -ub[1]))
        root = " (the root is kept gathered from forward to backward: FSDP2's default)" \
            if "root" in gathered and last.get("phase") != "forward" else ""
        causes.append((sum(gathered.values()),
                       f"{len(gathered)} unit{'s' if len(gathered) > 1 else ''} gathered at once: "
                       f"{units}{root}", "smaller units (wrap each block), a smaller prefetch depth"
                       + (", reshard the root after forward" if root else "")))
    if full:
        causes.append((full, f"full gradients {fmt_bytes(full)}", "reduce-scatter every micro-batch "
                       "instead of accumulating unsharded"))
    if held.get("comm_buffers"):
        causes.append((held["comm_buffers"], f"communication buffers {fmt_bytes(held['comm_buffers'])}",
                       "smaller buckets, fewer collectives in flight"))
    causes = sorted((c for c in causes if c[0]), key=lambda c: -c[0])
    return [Finding(
        "memory", ranks,
        f"{_ranks_word(ranks)} ran out of memory in {last.get('phase') or 'the run'}: rank {r} held "
        f"{fmt_bytes(sum(held.values()))}, allocating {fmt_bytes(oom['nbytes'])} of {oom['category']} "
        f"would pass its budget of {fmt_bytes(oom['budget'])}",
        [f"{what}: {fix}" for _, what, fix in causes],
        f"change the largest first: {causes[0][2]}" if causes else "a larger device, or less held")]


def _split(at_peak: dict[str, int]) -> str:
    return ", ".join(f"{c} {fmt_bytes(b)}" for c, b in sorted(at_peak.items(), key=lambda cb: -cb[1]) if b)


@dataclass(frozen=True)
class Cause:
    """One kind of finding beyond the collectives: the word it is reported under, and how it is
    found — ``find(report)``, the run's dumps and traces in, its findings out (none: nothing)."""
    kind: str
    find: Callable[["Report"], list[Finding]]


# the doctor's findings beyond the collectives, in the order it reports them
CAUSES: list[Cause] = [
    Cause("weights", lambda report: weights(report.dumps)),
    Cause("drift", lambda report: [Finding(**f) for f in drift_.find(report.dumps)]),
    Cause("clip", lambda report: clip(report.dumps)),
    Cause("precision", lambda report: precision(report.dumps)),
    Cause("memory", lambda report: memory(report.traces, report.dumps)),
]
