"""Replicas that drift apart after the start: what a rank notes for the doctor as it trains, every
``every``-th step (``step % every == 0``) and after its last step, so that ``drift.py`` can name
the first step at which one rank's replica differs and why.

A record, in ``facts["replicas"]`` of the rank's flight dump (the first and the ``KEPT - 1``
latest with each parameter's fingerprint, the others with one digest of each set's):

    step        the step that has just ended
    sets        each set of parameters this rank holds as a replica of other ranks': the ranks
                that must hold the same values, and each parameter's fingerprint. The ranks of a
                parameter held whole are the data-parallel group (DDP's replicas, ZeRO-1/2's
                whole parameters, the parameters an FSDP unit keeps whole); a shard's are its
                HSDP replica group (minishard's ``hsdp``; FSDP2's DTensors along their
                ``Replicate`` mesh dimensions); a shard with no replica is in no set
    optimizer   each param group's hyperparameters (``lr``, ``betas``, ``weight_decay`` ...: the
                group without its parameters) and how many times the optimizer has stepped

and into its ring (``core/flight_file.py``, for a rank that dies without a dump) the same record
cut to fit a slot: each set's ranks with one digest of its fingerprints, a digest of the
settings, the step count.

A fingerprint here is XXH3-64 of a tensor's dtype, shape and bytes, as the checkpoint's checksums
are: equal replicas give equal fingerprints, one flipped bit changes it. BLAKE2, which
``health.fingerprint`` uses once at the start, costs an order of magnitude more per byte: taken
every 10 steps it costs more than 1 % of a step of the tiny GPT on two ranks, XXH3 under 0.2 %
(``benchmarks/bench_flight.py --replicas``, ``benchmarks/RESULTS.md``). On an accelerator each
replica is copied to the host to be hashed: that cost is not measured here (CPU ranks only).
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
import xxhash

from .health import row_major

EVERY = 10             # the default cadence: steps 0, 10, 20, ... and the last
# records that keep each parameter's fingerprint — the first and the latest: the others keep one
# digest per set, so that a long run's dump stays small (the digests find the first step at
# which a rank differs; a record with the fingerprints names the parameters)
KEPT = 8


def check_every(every, name: str = "fingerprint_every") -> None:
    """``every`` is a cadence: an integer >= 1, or None (after the last step only)."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"{name}={every!r}: must be an integer >= 1 (fingerprint the replicas "
                         f"after every K-th step and the last), or None (after the last step only)")


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """name -> XXH3-64 (16 hex digits) of the tensor's dtype, shape and elements in row-major
    order (``health.row_major``: a layout is not a value)."""
    out = {}
    for name, t in named:
        h = xxhash.xxh3_64(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(row_major(name, t).numpy())
        out[name] = h.hexdigest()
    return out


def digest(prints: dict[str, str]) -> str:
    """One hash of a set's fingerprints, the same on every rank that holds the same values (by
    name, whatever order the rank keeps its parameters in): what the ring keeps of a set."""
    return xxhash.xxh3_64_hexdigest("".join(f"{n}={prints[n]};" for n in sorted(prints)).encode())


def settings_digest(settings: list[dict]) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(settings, sort_keys=True).encode())


# --------------------------------------------------------------------------- which replicas

def replicated_sets(model: torch.nn.Module) -> dict[tuple[int, ...], list[tuple[str, torch.Tensor]]]:
    """The ranks that must hold equal values -> the parameters this rank holds as such a replica
    (by name, without DDP's ``module.`` prefix). Sets of one rank are left out: nothing to
    compare."""
    from minishard.strategies.fsdp import units
    shards = {id(t): u for u in units(model) for t in u.layout.shard_tensors()}
    everyone = data_parallel_ranks(model)
    sets: dict[tuple[int, ...], list] = defaultdict(list)
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        if id(p) in shards:                              # minishard's shard: HSDP's replicas only
            group = shards[id(p)].replica_group
            ranks = () if group is None or group.world_size < 2 else tuple(
                group.members) if group.members is not None else everyone   # (None: the world)
        elif hasattr(p, "device_mesh") and hasattr(p, "to_local"):      # a DTensor (FSDP2)
            ranks, p = _dtensor_replicas(p), p.to_local()
        elif hasattr(p, "ds_tensor"):                    # DeepSpeed's stage 3: a partition
            ranks = ()
        else:                                            # held whole
            ranks = everyone
        if len(ranks) > 1:
            sets[tuple(sorted(ranks))].append((name, p))
    return dict(sets)


def data_parallel_ranks(model) -> tuple[int, ...]:
    """The ranks that hold the same whole parameters as this one: the wrapper's process group
    (PyTorch's DDP on a group of its own, beside tensor or pipeline parallelism across the
    groups), else the world; () without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    group = getattr(model, "process_group", None)        # torch's DDP keeps its own
    if isinstance(group, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(group))
    return tuple(range(dist.get_world_size()))


def _dtensor_replicas(p) -> tuple[int, ...]:
    """The ranks holding the same local tensor as this one: those at this rank's coordinates on
    the mesh dimensions the parameter is sharded along, any coordinate on those it is
    replicated along (HSDP's ``(Replicate(), Shard(0))``)."""
    mesh, placements = p.device_mesh, p.placements
    here = mesh.get_coordinate()
    if here is None or not any(pl.is_replicate() for pl in placements):
        return ()
    at = tuple(slice(None) if pl.is_replicate() else c for pl, c in zip(placements, here))
    return tuple(sorted(int(r) for r in mesh.mesh[at].flatten().tolist()))


def start_groups(facts: dict[int, dict]) -> list[list[int]]:
    """The ranks whose ``weights_start`` must agree, grouped by the data-parallel group each rank
    noted beside it (``weights_start_ranks``, where that group is not the world: the pairs of a
    job that holds other weights on each pair differ by design); the ranks that noted none, or
    the world, are one group."""
    everyone = sorted(facts)
    groups: dict[tuple[int, ...] | None, list[int]] = defaultdict(list)
    for r in everyone:
        said = facts[r].get("weights_start_ranks")
        key = tuple(sorted(int(x) for x in said)) if said else None
        groups[None if key is not None and set(everyone) <= set(key) else key].append(r)
    return [rs for _, rs in sorted(groups.items(), key=lambda kv: kv[1][0])]


# --------------------------------------------------------------------------- the optimizer

def settings(optimizer) -> list[dict]:
    """Each param group's hyperparameters, as JSON values (a tensor ``lr`` as its number; what is
    not a number, a string, a bool or a list of them — a callable — is left out)."""
    out = []
    for group in optimizer.param_groups:
        kept = {}
        for k, v in sorted(group.items()):
            if k != "params" and (plain := _plain(v)) is not _LEFT_OUT:
                kept[k] = plain
        out.append(kept)
    return out


_LEFT_OUT = object()


def _plain(v):
    if torch.is_tensor(v):
        v = v.item() if v.numel() == 1 else _LEFT_OUT
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)          # (JSON has no inf or nan)
    if isinstance(v, (tuple, list)):
        items = [_plain(x) for x in v]
        return _LEFT_OUT if any(x is _LEFT_OUT for x in items) else items
    return _LEFT_OUT


# --------------------------------------------------------------------------- the notes

class ReplicaNotes:
    """Takes the records of one rank's run into ``recorder`` (its flight recorder): call
    :meth:`ended` after each step, :meth:`finished` after the last. ``optimizer``: the torch
    optimizer that steps (its settings; its step hook counts the steps)."""

    def __init__(self, model: torch.nn.Module, optimizer, recorder, every: int | None = EVERY):
        check_every(every)
        self.model, self.optimizer, self.recorder, self.every = model, optimizer, recorder, every
        self.steps = 0                           # optimizer steps taken since these notes began
        self._last: int | None = None            # the step noted last
        self._ended: int | None = None           # the step that ended last
        self._whole: list[dict] = []             # the records that keep every fingerprint
        recorder.facts["fingerprint_every"] = every
        self._hooks = [] if optimizer is None else [optimizer.register_step_post_hook(self._stepped)]

    def _stepped(self, optimizer, args, kwargs) -> None:
        self.steps += 1

    def ended(self, step: int) -> None:
        """Step ``step`` is over: noted if the cadence says so."""
        self._ended = step
        if self.every is not None and step % self.every == 0:
            self.note(step)

    def finished(self, step: int | None = None) -> None:
        """The run is over, ``step`` its last step (by default the one that ended last): noted
        unless it was already."""
        step = self._ended if step is None else step
        if step is not None and step >= 0 and step != self._last:
            self.note(step)

    def note(self, step: int) -> None:
        sets = replicated_sets(self.model)
        said = settings(self.optimizer) if self.optimizer is not None else []
        kept = []
        for ranks, named in sorted(sets.items()):
            prints = fingerprint(named)
            kept.append({"ranks": list(ranks), "digest": digest(prints), "prints": prints})
        record = {"step": step, "optimizer_steps": self.steps, "settings": said, "sets": kept}
        ring = {"step": step, "optimizer_steps": self.steps, "settings": settings_digest(said),
                "sets": [[s["ranks"], s["digest"]] for s in kept]}
        self.recorder.note("replicas", record, ring)
        self._last = step
        self._whole.append(record)
        if len(self._whole) > KEPT:              # the second oldest gives up its fingerprints
            for s in self._whole.pop(1)["sets"]:
                s.pop("prints", None)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
