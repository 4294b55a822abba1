"""Chapter 05 (ZeRO-3): a fair race between strategies, and views of a trace's unit states.

* :func:`race` times strategies (or FSDP wrappings) on the same ranks, alternating step by
  step, wall-clock and CPU seconds — fair timing on a machine other jobs share.
* :func:`unsharded_series` and :func:`unit_states_at` read a trace's ``unit`` events into the
  chapter's tables (both are lookups into the trace's fold, :mod:`minishard.core.trace`).
"""
from __future__ import annotations

from minishard.core.comm import Comm
from minishard.core.model import GPT, batch, config
from minishard.core.trace import LedgerTimeline, Replay


def race(rank, variants: dict[str, dict] | None = None, model: str = "tiny", steps: int = 6,
         micro_batch: int = 4, warmup: int = 1) -> dict[str, list[float]]:
    """Train one model per variant side by side on the same ranks, *alternating step by step*
    (A, B, B, A, A, B, ...), so that load from other processes on a shared machine falls on all
    alike. ``variants`` maps a label to :class:`minishard.TrainConfig` fields (default: ``ddp``
    and ``fsdp``). Every step starts from a barrier. Returns this rank's wall-clock step times per
    label, and (key ``"cpu:<label>"``) the CPU seconds the rank process burned in each step, all
    threads included — a figure other processes' load hardly changes. The ``warmup`` first steps
    of each are dropped."""
    import time

    from minishard.training.loop import TrainConfig, build, train_step
    variants = variants or {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"}}
    cfg = config(model)
    runs = {}
    for label, opts in variants.items():
        comm = Comm()
        runs[label] = (comm, build(GPT(cfg).to(rank.device), TrainConfig(model=model, **opts), comm))
    labels = list(variants)
    times = {k: [] for s in labels for k in (s, f"cpu:{s}")}
    for step in range(warmup + steps):
        x, y = batch(cfg, step, micro_batch, rank.rank, rank.world_size)
        for s in (labels if step % 2 == 0 else labels[::-1]):
            comm, built = runs[s]
            comm.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            train_step(built, [(x, y)])
            if step >= warmup:
                times[s].append(time.perf_counter() - t0)
                times[f"cpu:{s}"].append(time.process_time() - c0)
    return times


# --------------------------------------------------------------------------- views of a trace


def unsharded_series(events: list[dict], rank: int = 0, step: int | None = None) -> list[tuple]:
    """``(t, unsharded bytes, "unit → state")`` at every unit state change of ``rank`` (in
    ``step``, or all), read from the ledger fold of the trace."""
    tl = LedgerTimeline.build(events)
    if "unsharded" not in tl.categories:
        return []
    r, c = tl.ranks.index(rank), tl.categories.index("unsharded")
    return [(e["t"], int(tl.bytes[i, r, c]), f"{e['name']} → {e['state']}")
            for i, e in enumerate(events)
            if e["kind"] == "unit" and e["rank"] == rank and (step is None or e.get("step") == step)]


def unit_states_at(events: list[dict], i: int) -> dict[int, dict[str, str]]:
    """``{rank: {unit: state}}`` after event ``i``: every unit starts sharded (the trace's fold,
    :meth:`minishard.core.trace.Replay.unit_states`)."""
    return Replay(events).unit_states(i)


def with_unit_states(player):
    """The player's widget, and the panel in it that shows every unit's state on every rank at
    the event on its slider (``Player.units_panel``; kept for the chapters that unpack both)."""
    return player.widget, player.units_panel
