"""minishard's strategy beside PyTorch's, event by event: the tables chapters 02 and 06 show.

Each function takes two traces — lists of events as ``minishard.core.trace.load`` returns them:
``mine`` (a minishard run) and ``theirs`` (a ``minishard.watch`` run of torch's own job) — and
returns plain data (lists of dict rows) that :func:`render` prints as a text table:

* :func:`compare_fsdp` — per unit, its lifecycle in one step; the order of the all-gathers
  (forward, backward with its prefetch); every collective's op, payload and dtype in order; and
  each ledger category's peak, per phase, on both sides.
* :func:`compare_ddp` — the gradient buckets' order and sizes, step by step.
* :func:`compare_zero1` — what minishard's ZeRO-1 and ``ZeroRedundancyOptimizer`` put on the
  wire per step, by op.

Names are mapped, not assumed equal: minishard's FSDP has a ``reduce_scattering`` state, FSDP2
has none (its reduce-scatter is a collective event of the unit, which both sides have), so the
lifecycle keeps the collective and drops that state. Both sides name the root unit ``root``.
Each known difference has a name here (:data:`DOCUMENTED`) and a row in docs/side-by-side.md.
"""
from __future__ import annotations

from minishard.core.trace import rank_events

CATEGORIES = ("params", "unsharded", "grads", "comm_buffers", "exp_avg", "exp_avg_sq",
              "activations")
PHASES = ("forward", "backward", "optimizer")
# minishard's FSDP under mixed precision enters its fp32 shards as ``master`` (they are the
# master weights); watch enters FSDP2's fp32 local shards as ``params``: the same bytes
MINE_TO_WATCH = {"master": "params"}

# differences the docs explain (docs/side-by-side.md), by the name the tables give them
DOCUMENTED = {
    "reshard_before_reduce_scatter": "FSDP2 frees a unit's gathered parameters before it "
                                     "reduce-scatters the gradients; minishard after",
    "deferred_all_gather_free": "FSDP2 keeps a forward all-gather's output until the next "
                                "unit's copy-out; minishard frees it at its own copy-out",
    "last_unsharded_grad_held": "FSDP2's foreach_reduce keeps the unit's last parameter's "
                                "unsharded gradient (its loop variable) through the "
                                "reduce-scatter; minishard drops every full gradient before",
    "first_step_bucket": "torch DDP's step 0 reduces every parameter in one bucket, whatever "
                         "its size, then rebuilds its buckets in gradient-ready order",
    "broadcast_from_owner": "ZeroRedundancyOptimizer all-reduces the gradients and broadcasts "
                            "each parameter from its owner; minishard reduce-scatters and "
                            "all-gathers buckets",
}


# ---------------------------------------------------------------------------- running both

def traces(ranks, mine: str, theirs: str, **knobs) -> tuple[list[dict], list[dict]]:
    """The same job under minishard's strategy ``mine`` and PyTorch's ``theirs`` (watched: that
    is how ``train`` runs PyTorch's strategies), one after the other on the same warm ranks
    (``minishard.core.launch.Ranks``), with the same ``TrainConfig`` knobs: both traces."""
    from minishard.training.loop import TrainConfig, train
    out = []
    for strategy in (mine, theirs):
        ranks.run(train, TrainConfig(strategy=strategy, **knobs))
        out.append(ranks.last_events)
    return out[0], out[1]


# ---------------------------------------------------------------------------- reading one side

def _in_order(events: list[dict], rank: int, step: int) -> list[dict]:
    """One rank's events of one step in the order things were *issued*: a collective at its
    start ``t`` (minishard records it when it completes, later in ``seq``), ties by ``seq``."""
    return sorted(rank_events(events, rank, step), key=lambda e: (e["t"], e["seq"]))


def lifecycle(events: list[dict], rank: int = 0, step: int = 1) -> dict[str, list[str]]:
    """Each unit's states and collectives in one step, in issue order: ``unsharding``,
    ``all_gather``, ``unsharded``, ``sharded``, ``reduce_scatter`` (minishard's
    ``reduce_scattering`` state is dropped: FSDP2 has no such state; see the module's doc)."""
    out: dict[str, list[str]] = {}
    for e in _in_order(events, rank, step):
        if e["kind"] == "unit" and e["state"] != "reduce_scattering":
            out.setdefault(e["name"], []).append(e["state"])
        elif e["kind"] == "collective" and e["op"] in ("all_gather", "reduce_scatter"):
            out.setdefault(e["tag"], []).append(e["op"])
    return out


def interleaving(events: list[dict], rank: int = 0, step: int = 1,
                 phase: str = "forward") -> list[str]:
    """Every unit's state changes in one phase, all units together, in issue order
    (``blocks.1 unsharding`` before ``blocks.0 sharded`` is a forward prefetch): what each
    unit's own lifecycle and the collectives' order cannot show, since in forward the
    all-gathers run in the same order with or without prefetch."""
    evs = _in_order(events, rank, step)
    return [f"{e['name']} {e['state']}" for e, ph in zip(evs, _phase_of(evs))
            if ph == phase and e["kind"] == "unit"]


def _phase_of(events: list[dict]) -> list[str | None]:
    """The top-level phase (forward / backward / optimizer) each event happened in, by ``t``."""
    spans = {}
    for e in events:
        if e["kind"] == "phase" and "unit" not in e and e["name"] in PHASES:
            spans.setdefault(e["name"], [None, None])[e["edge"] == "end"] = e["t"]
    def where(e):
        for name, (t0, t1) in spans.items():
            if t0 is not None and t0 <= e["t"] and (t1 is None or e["t"] <= t1):
                return name
        return None
    return [where(e) for e in events]


def collectives(events: list[dict], rank: int = 0, step: int = 1) -> list[dict]:
    """The step's collectives in issue order: op, tag (unit or bucket), payload, wire, dtype,
    phase."""
    evs = _in_order(events, rank, step)
    return [{"phase": ph, "op": e["op"], "tag": e["tag"], "payload": e["payload"],
             "wire": e["wire"], "dtype": e["dtype"]}
            for e, ph in zip(evs, _phase_of(evs)) if e["kind"] == "collective"]


def gather_order(events: list[dict], rank: int = 0, step: int = 1) -> dict[str, list[str]]:
    """The units in the order their all-gathers were issued, per phase (a prefetch counts
    under the unit it gathers)."""
    out: dict[str, list[str]] = {}
    for c in collectives(events, rank, step):
        if c["op"] == "all_gather":
            out.setdefault(c["phase"], []).append(c["tag"])
    return out


def peaks(events: list[dict], rank: int = 0, step: int | None = None) -> dict[tuple, int]:
    """The most bytes each category held on ``rank``: ``{(phase, category): bytes}``, with
    phase None for the whole trace; ``step``: phases of that step only (a phase's peak counts
    what it began with). Live bytes fold in the order the rank recorded them (``seq``), from the
    start of the trace; ``master`` is read as ``params`` (:data:`MINE_TO_WATCH`)."""
    evs = rank_events(events, rank)
    phases = _phase_of(evs)
    live: dict[str, int] = {}
    out: dict[tuple, int] = {}
    for e, ph in zip(evs, phases):
        if e["kind"] == "phase" and e["edge"] == "begin" and e["name"] in PHASES \
                and (step is None or e.get("step") == step):
            for c, b in live.items():              # what the phase starts with counts too
                out[(e["name"], c)] = max(out.get((e["name"], c), 0), b)
        if e["kind"] not in ("alloc", "free"):
            continue
        c = MINE_TO_WATCH.get(e["category"], e["category"])
        live[c] = live.get(c, 0) + (e["bytes"] if e["kind"] == "alloc" else -e["bytes"])
        out[(None, c)] = max(out.get((None, c), 0), live[c])
        if ph is not None and (step is None or e.get("step") == step):
            out[(ph, c)] = max(out.get((ph, c), 0), live[c])
    return out


def live_at(events: list[dict], rank: int, step: int, category: str,
            at) -> list[tuple[dict, dict[str, int]]]:
    """What ``category`` held, by tag, at each event of ``step`` for which ``at(event)`` is true
    (the event itself included): ``(event, {tag: bytes})`` per such event, in ``seq`` order.
    Tags entered more than once (the watch tags each unit's gradients alike) are summed."""
    live: dict[str, int] = {}
    out = []
    for e in rank_events(events, rank):
        if e["kind"] in ("alloc", "free") and MINE_TO_WATCH.get(e["category"], e["category"]) == category:
            sign = 1 if e["kind"] == "alloc" else -1
            live[e["tag"]] = live.get(e["tag"], 0) + sign * e["bytes"]
        if e.get("step") == step and at(e):
            out.append((e, {t: b for t, b in live.items() if b}))
    return out


# ---------------------------------------------------------------------------- the comparisons

def _swap_reshard_rs(seq: list[str]) -> list[str]:
    """A minishard lifecycle as FSDP2 orders it: ``sharded`` before the ``reduce_scatter``."""
    if seq[-2:] == ["reduce_scatter", "sharded"]:
        return seq[:-2] + ["sharded", "reduce_scatter"]
    return seq


def compare_fsdp(mine: list[dict], theirs: list[dict], rank: int = 0, step: int = 1) -> dict:
    """The FSDP tables: ``lifecycle`` (per unit), ``gathers`` (per phase), ``collectives`` (in
    order) and ``peaks`` (per category, per phase and overall). Each row says ``same`` or the
    name of the documented difference it shows (``difference``), or None: unexplained."""
    lm, lt = lifecycle(mine, rank, step), lifecycle(theirs, rank, step)
    life = []
    for unit in sorted(set(lm) | set(lt)):
        a, b = lm.get(unit, []), lt.get(unit, [])
        diff = ("same" if a == b else "reshard_before_reduce_scatter"
                if _swap_reshard_rs(a) == b else None)
        life.append({"unit": unit, "mine": a, "theirs": b, "difference": diff})
    gm, gt = gather_order(mine, rank, step), gather_order(theirs, rank, step)
    gathers = [{"phase": ph, "mine": gm.get(ph, []), "theirs": gt.get(ph, []),
                "difference": "same" if gm.get(ph) == gt.get(ph) else None}
               for ph in ("forward", "backward")]
    cm, ct = collectives(mine, rank, step), collectives(theirs, rank, step)
    colls = []
    for i in range(max(len(cm), len(ct))):
        a = cm[i] if i < len(cm) else {}
        b = ct[i] if i < len(ct) else {}
        same = all(a.get(k) == b.get(k) for k in ("op", "tag", "payload", "dtype"))
        colls.append({"i": i, "phase": a.get("phase"), "op": a.get("op"), "tag": a.get("tag"), "payload": a.get("payload"),
                      "dtype": a.get("dtype"), "their_op": b.get("op"), "their_tag": b.get("tag"),
                      "their_payload": b.get("payload"), "their_dtype": b.get("dtype"),
                      "difference": "same" if same else None})
    pm, pt = peaks(mine, rank, step), peaks(theirs, rank, step)
    rows = []
    for c in CATEGORIES:
        for ph in (None, *PHASES):
            a, b = pm.get((ph, c), 0), pt.get((ph, c), 0)
            rows.append({"category": c, "phase": ph or "all", "mine": a, "theirs": b,
                         "theirs_minus_mine": b - a})
    return {"lifecycle": life, "gathers": gathers, "collectives": colls, "peaks": rows}


def buckets(events: list[dict], rank: int = 0, step: int = 1) -> list[dict]:
    """A DDP step's bucket all-reduces in launch order: tag and bytes."""
    return [{"tag": c["tag"], "bytes": c["payload"], "dtype": c["dtype"]}
            for c in collectives(events, rank, step)
            if c["op"] == "all_reduce" and c["tag"].startswith("bucket")]


def compare_ddp(mine: list[dict], theirs: list[dict], rank: int = 0,
                steps: tuple[int, ...] = (0, 1)) -> list[dict]:
    """Per step, per bucket in launch order: minishard's bucket and torch's, their bytes.
    torch's step 0 is its one-bucket layout (``first_step_bucket``), compared as it is."""
    rows = []
    for s in steps:
        bm, bt = buckets(mine, rank, s), buckets(theirs, rank, s)
        for i in range(max(len(bm), len(bt))):
            a = bm[i] if i < len(bm) else {}
            b = bt[i] if i < len(bt) else {}
            rows.append({"step": s, "i": i, "mine": a.get("tag"), "bytes": a.get("bytes"),
                         "theirs": b.get("tag"), "their_bytes": b.get("bytes"),
                         "difference": "same" if a.get("bytes") == b.get("bytes") else None})
    return rows


def traffic(events: list[dict], rank: int = 0, step: int = 1) -> dict[str, dict[str, int]]:
    """A step's collectives summed by op: calls, payload and wire bytes (this rank's)."""
    out: dict[str, dict[str, int]] = {}
    for c in collectives(events, rank, step):
        o = out.setdefault(c["op"], {"calls": 0, "payload": 0, "wire": 0})
        o["calls"] += 1
        o["payload"] += c["payload"]
        o["wire"] += c["wire"]
    return out


def compare_zero1(mine: list[dict], theirs: list[dict], rank: int = 0,
                  steps: tuple[int, ...] = (0, 1)) -> list[dict]:
    """Per step and side, each op's calls, payload and wire bytes: minishard's ZeRO-1
    (reduce-scatter, all-gather of buckets) beside ``ZeroRedundancyOptimizer`` (DDP's
    all-reduce, one broadcast per parameter from its owner): ``broadcast_from_owner``."""
    rows = []
    for s in steps:
        for side, evs in (("mine", mine), ("theirs", theirs)):
            for op, t in sorted(traffic(evs, rank, s).items()):
                rows.append({"step": s, "side": side, "op": op, **t})
    return rows


# ---------------------------------------------------------------------------- text

def render(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain text table of ``rows`` (lists shown joined by spaces, numbers as they are)."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cell = lambda v: " ".join(map(str, v)) if isinstance(v, list) else "" if v is None else str(v)  # noqa: E731
    table = [columns] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
