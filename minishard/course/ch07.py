"""Rank tasks and views of traces for the course's chapter 07 (prefetch).

Nothing here is a strategy: every gather and wait is made by :mod:`minishard.strategies.fsdp`. The tasks
run on real ranks and return plain data; the views read a trace's events only, through the
trace's fold (:mod:`minishard.core.trace`; plotly is imported lazily, so rank processes do not pay
for it).

* :func:`prefetch_race` trains one model per prefetch depth side by side on the same ranks,
  alternating step by step, and returns each depth's step times and *exposed* communication
  (seconds compute waited for an all-gather or reduce-scatter) — a fair comparison on a
  shared machine.
* :func:`gathered_peaks` folds a rank's trace into the peak of gathered parameters, of
  parameters still in flight in packed all-gather buffers, and of both together.
* :func:`who_is_gathered` lists, at the moment each unit starts computing, which other units
  hold their full parameters and which are still arriving — the prefetch schedule, read from
  the unit state events.
* :func:`gather_waits` and :func:`prefetch_timeline` put each all-gather next to the time
  compute spent waiting for it: the overlap that prefetch buys, as numbers and as a figure.
* :func:`stage3_train` is ``train`` with DeepSpeed's ZeRO-3 bounds (``fsdp.limits``) set on
  its units: a prefetch bucket, a cap on live parameters, a persistence threshold.
"""
from __future__ import annotations

import itertools
import time

from minishard.core.comm import Comm
from minishard.core.model import GPT, batch, config
from minishard.core.trace import phase_spans, rank_events, unit_spans

PASSES = ("forward", "backward")


# --------------------------------------------------------------------------- 07: DeepSpeed's bounds


def stage3_train(rank, config, prefetch_bucket_size: int | None = None,
                 max_live_parameters: int | None = None,
                 param_persistence_threshold: int | None = None) -> dict:
    """``train(rank, config)`` (an FSDP strategy) with DeepSpeed's three ZeRO-3 bounds, in
    elements (``TrainConfig``'s fields of the same names, ``fsdp.limits``). Adds ``gathered``
    (:func:`gathered_peaks` of this rank's trace)."""
    from minishard.training.loop import train
    out = train(rank, config.replace(prefetch_bucket_size=prefetch_bucket_size,
                                     max_live_parameters=max_live_parameters,
                                     param_persistence_threshold=param_persistence_threshold))
    out["gathered"] = gathered_peaks(rank.tracer.events, rank.rank)
    return out


# --------------------------------------------------------------------------- 07: a fair race


def prefetch_race(rank, depths=(0, 1, 2, 3), model: str = "tiny", steps: int = 5,
                  micro_batch: int = 4, strategy: str = "fsdp_flat", warmup: int = 1) -> dict:
    """One FSDP model per prefetch depth on the same ranks, trained side by side, alternating
    the order step by step (0, 1, 2, 3, then 3, 2, 1, 0, ...) so that load from other processes
    falls on every depth alike. Each step starts from a barrier.

    Returns ``{"step_s": {k: [...]}, "exposed_s": {k: [...]}, "cpu_s": {k: [...]}}`` for this
    rank: wall-clock seconds per step, seconds compute waited on communication per step (the
    sum over units of :attr:`FSDPUnit.exposed_s`), CPU seconds the rank process burned. The
    ``warmup`` first steps are dropped."""
    from minishard.training.loop import TrainConfig, build, train_step
    cfg = config(model)
    runs = {}
    for k in depths:
        comm = Comm()
        runs[k] = (comm, build(GPT(cfg).to(rank.device), TrainConfig(strategy, model=model, prefetch=k), comm))
    out = {"step_s": {k: [] for k in depths}, "exposed_s": {k: [] for k in depths},
           "cpu_s": {k: [] for k in depths}}
    for step in range(warmup + steps):
        x, y = batch(cfg, step, micro_batch, rank.rank, rank.world_size)
        for k in (depths if step % 2 == 0 else depths[::-1]):
            comm, built = runs[k]
            units = built.units
            comm.barrier()
            e0 = sum(u.exposed_s for u in units)
            t0, c0 = time.perf_counter(), time.process_time()
            train_step(built, [(x, y)])
            if step >= warmup:
                out["step_s"][k].append(time.perf_counter() - t0)
                out["cpu_s"][k].append(time.process_time() - c0)
                out["exposed_s"][k].append(sum(u.exposed_s for u in units) - e0)
    return out


# --------------------------------------------------------------------------- 07: views of a trace


def gathered_peaks(events: list[dict], rank: int = 0) -> dict[str, int]:
    """Peaks, over the whole trace, of the bytes of full parameters on ``rank``:

    * ``unsharded`` — gathered parameters a module can compute with (ledger category);
    * ``in_flight`` — packed all-gather buffers (``comm_buffers`` tagged ``<unit>:ag``): the
      per-parameter layout gathers into one, then copies out into the parameters;
    * ``both`` — the two together, at the same moment: every byte of full parameters held."""
    live = {"unsharded": 0, "in_flight": 0}
    peaks = {"unsharded": 0, "in_flight": 0, "both": 0}
    for e in rank_events(events, rank):
        if e["kind"] not in ("alloc", "free"):
            continue
        if e["category"] == "unsharded":
            key = "unsharded"
        elif e["category"] == "comm_buffers" and e.get("tag", "").endswith(":ag"):
            key = "in_flight"
        else:
            continue
        live[key] += e["bytes"] if e["kind"] == "alloc" else -e["bytes"]
        peaks[key] = max(peaks[key], live[key])
        peaks["both"] = max(peaks["both"], live["unsharded"] + live["in_flight"])
    return peaks


def who_is_gathered(events: list[dict], rank: int = 0, step: int = 1) -> list[dict]:
    """The prefetch schedule of one step, read from the trace.

    One row each time a unit starts computing: the pass, the unit, and the units whose
    all-gather is then in flight (``unsharding``) — the ones prefetched behind it, in the order
    their all-gathers were issued. A unit
    becomes ``unsharded`` when its own all-gather is done, then issues its prefetches; the row
    is read when compute begins, i.e. at the first event that is not gathering bookkeeping (an
    activation saved or freed, a gradient, another state change). Needs a trace recorded with
    activations tracked (``train``'s default)."""
    state: dict[str, str] = {}
    issued: dict[str, int] = {}                 # unit -> when its current all-gather was issued
    tick = itertools.count()
    rows, current, pending = [], "forward", None

    def bookkeeping(e) -> bool:
        return ((e["kind"] == "unit" and e["state"] == "unsharding")
                or (e["kind"] in ("alloc", "free") and e["category"] in ("unsharded", "comm_buffers"))
                or e["kind"] in ("collective", "transfer")
                or (e["kind"] == "phase" and e["name"].startswith("wait_")))

    for e in rank_events(events, rank, step):
        if pending is not None and not bookkeeping(e):
            pending["in_flight"] = sorted((u for u, s in state.items() if s == "unsharding"),
                                          key=issued.get)
            rows.append(pending)
            pending = None
        if e["kind"] == "phase" and e["name"] in PASSES and e["edge"] == "begin" and not e.get("unit"):
            current = e["name"]
        if e["kind"] != "unit":
            continue
        state[e["name"]] = e["state"]
        if e["state"] == "unsharding":
            issued[e["name"]] = next(tick)
        if e["state"] == "unsharded":
            pending = {"pass": current, "unit": e["name"]}
    return rows


def gather_waits(events: list[dict], rank: int = 0, step: int = 1) -> list[dict]:
    """Every all-gather of one step on ``rank``: its unit and pass, when it was issued and
    completed, and how long compute then waited for it (the ``wait_unshard`` phase). ``hidden``
    is the part of the all-gather's time that compute did not wait through."""
    evs = rank_events(events, rank, step)
    phases = phase_spans(evs)
    bounds = {p.name: (p.t0, p.t1) for p in phases if p.name in PASSES and not p.unit}   # each pass's last
    waits: dict[str, list[tuple[float, float]]] = {}
    for p in phases:
        if p.name == "wait_unshard":
            waits.setdefault(p.unit, []).append((p.t0, p.t1))

    def pass_of(t: float) -> str:
        return next((p for p in PASSES if p in bounds and bounds[p][0] <= t <= bounds[p][1]), "outside")

    rows = []
    for e in sorted((e for e in evs if e["kind"] == "collective" and e["op"] == "all_gather"),
                    key=lambda e: e["t"]):
        t0, t1 = e["t"], e["t_end"]
        # the unit's waits that overlap this gather's flight (a wait ends just after completion)
        waited = sum(max(0.0, min(b, t1 + 1e-3) - max(a, t0))
                     for a, b in waits.get(e["tag"], []) if a < t1 + 1e-3 and b > t0)
        where = pass_of(t0)
        dur = max(t1 - t0, 1e-9)
        rows.append({"unit": e["tag"], "pass": where, "t0": t0, "t1": t1, "seconds": t1 - t0,
                     "waited": min(waited, dur), "hidden": max(0.0, 1 - waited / dur)})
    return rows


COLORS = {"gathering": "#B7DDE0", "gathered": "#72B7B2", "reduce_scatter": "#B279A2",
          "waiting": "#E45756"}
LABELS = {"gathering": "all-gather in flight", "gathered": "gathered (computing)",
          "reduce_scatter": "reduce-scatter", "waiting": "compute waits"}
WIDTHS = {"gathering": 0.75, "gathered": 0.45, "reduce_scatter": 0.75, "waiting": 0.25}


def _unit_spans(evs: list[dict]) -> tuple[list[str], dict[str, list[tuple]], list[tuple]]:
    """Units in order of appearance, spans ``(unit, t0, t1)`` by kind, and the passes. A unit
    is *gathered* from the end of its all-gather until it is freed (through its reduce-scatter
    in backward: its full parameters are still held)."""
    order = list(dict.fromkeys(e["name"] for e in evs if e["kind"] == "unit"))
    bars = {k: [] for k in COLORS}
    into_rs: dict[str, float] = {}              # unit -> when it was gathered, now reduce-scattering
    for s in unit_spans(evs):
        if s.state == "unsharded" and s.until == "reduce_scattering":
            into_rs[s.unit] = s.t0
        elif s.state == "unsharded" or (s.state == "reduce_scattering" and s.unit in into_rs):
            bars["gathered"].append((s.unit, into_rs.pop(s.unit, s.t0), s.t1))
    for e in evs:
        if e["kind"] == "collective" and e["op"] in ("all_gather", "reduce_scatter") \
                and e["tag"] != "replicate":
            key = "gathering" if e["op"] == "all_gather" else "reduce_scatter"
            bars[key].append((e["tag"], e["t"], e["t_end"]))
    phases = phase_spans(evs)
    bars["waiting"] = [(p.unit, p.t0, p.t1) for p in phases
                       if p.name in ("wait_unshard", "wait_reduce_scatter")]
    passes = [(p.name, p.t0, p.t1) for p in phases if p.name in PASSES and not p.unit]
    return order, bars, passes


def prefetch_timeline(runs: dict[str, list[dict]], rank: int = 0, step: int = 1, title: str = ""):
    """One panel per run (``{label: events}``), one row per unit, time in ms since the step
    began: the all-gather in flight (launch to completion), the unit gathered (from the end of
    its wait until it is freed: it computes in there), its reduce-scatter, and in red the time
    compute *waited* for the unit's communication. Forward and backward are shaded behind.
    Without prefetch a red bar covers each all-gather; with prefetch the all-gather of the next
    unit runs under this unit's compute and the red shrinks."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=len(runs), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=list(runs))
    n_units = 1
    for row, (label, events) in enumerate(runs.items(), start=1):
        evs = rank_events(events, rank, step)
        t0 = min(e["t"] for e in evs)
        order, bars, passes = _unit_spans(evs)
        n_units = max(n_units, len(order))
        for name in ("gathering", "reduce_scatter", "gathered", "waiting"):
            bs = bars[name]
            fig.add_trace(go.Bar(name=LABELS[name], legendgroup=name, showlegend=row == 1,
                                 orientation="h", y=[b[0] for b in bs],
                                 base=[(b[1] - t0) * 1e3 for b in bs],
                                 x=[max(b[2] - b[1], 0) * 1e3 for b in bs], width=WIDTHS[name],
                                 marker_color=COLORS[name],
                                 hovertext=[f"{b[0]}: {LABELS[name]} {(b[2] - b[1]) * 1e3:.1f} ms"
                                            for b in bs], hoverinfo="text"), row=row, col=1)
        for name, a, b in passes:
            fig.add_vrect(x0=(a - t0) * 1e3, x1=(b - t0) * 1e3, opacity=0.08, line_width=0,
                          fillcolor="#4C78A8" if name == "forward" else "#F58518",
                          annotation_text=name, annotation_position="top left", row=row, col=1)
        fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], row=row, col=1)
    fig.update_xaxes(title_text="ms since the step began", row=len(runs), col=1)
    fig.update_layout(barmode="overlay", title=title, width=950,
                      height=120 + len(runs) * (60 + 26 * n_units),
                      margin=dict(l=80, r=10, t=70, b=40))
    return fig
