"""Chapter 11 (when it breaks): the failures people hit, planted on real ranks, and the doctor's
word on each.

* :func:`broken` trains the course's GPT with one failure planted (``fault=NAME``: a
  :class:`minishard.instruments.faults.Fault` handed to ``train``) or one memory mistake configured, and leaves what every rank recorded —
  its flight dump and its trace — in a directory for :func:`minishard.instruments.doctor.diagnose`;
  :func:`outcome` does the same for a run that fails on some ranks (a hang that times out), each
  rank's error coming back as data.
* :func:`drifting` is a user's own job — PyTorch's DDP and AdamW under ``minishard.watch`` — where
  rank 1 may build its optimizer with another learning rate: replicas that drift apart though
  every collective matches.
* :func:`doctor_text` is the doctor's printed report, made the same on every machine (see
  :func:`stable`); :func:`summary` is one finding in a line, :func:`verdict` a run's in a line.

Nothing here plants a fault or reads a dump itself: the fault wraps the run's objects, the flight
recorder writes, the doctor reads.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from minishard.core.launch import RankContext

SMALL = dict(model="nano", steps=2, micro_batch=2)     # a run that breaks in about a second


def broken(rank: RankContext, directory: str, fault: str | None = None, fault_rank: int = 1,
           **knobs) -> dict[str, Any]:
    """``train`` with ``TrainConfig(flight_dir=directory, **SMALL, **knobs)`` and ``fault`` planted
    on ``fault_rank`` (``minishard.instruments.faults``); the rank's trace
    is written to ``directory/rank{r}.jsonl`` however the run ends (the doctor's memory findings
    read it). Returns the losses, the bytes sent per step, the ledger's peak and its categories
    (minishard's strategies), the parameters (``return_params=True``) and their count."""
    from minishard.instruments.faults import Fault
    from minishard.training.loop import TrainConfig, train
    try:
        out = train(rank, TrainConfig(flight_dir=directory, **SMALL | knobs),
                    hooks=None if fault is None else Fault(fault, fault_rank))
    finally:
        rank.tracer.write_jsonl(f"{directory}/rank{rank.rank}.jsonl")
    ledger = out.get("ledger") or {}
    return {"losses": out["losses"], "wire": out["wire"], "n_params": out["n_params"],
            "peak": ledger.get("peak"), "peak_snapshot": ledger.get("peak_snapshot"),
            "params": out.get("params")}


def outcome(rank: RankContext, directory: str, **knobs) -> dict[str, Any]:
    """:func:`broken`, for a run that fails on some ranks: a rank's error comes back as data
    (``{"finished": False, "error": "RuntimeError: ..."}``), after its flight dump was written,
    instead of failing the pool — so every rank reports, and no rank is stopped before it wrote
    its dump (``Ranks.run`` would raise the first error and terminate the others)."""
    try:
        return {"finished": True, **broken(rank, directory, **knobs)}
    except Exception as e:                     # a collective that timed out raises RuntimeError
        return {"finished": False, "error": f"{type(e).__name__}: {e}"}


def drifting(rank: RankContext, directory: str, odd_lr: float | None = None, lr: float = 1e-3) -> dict[str, Any]:
    """A user's script on every rank: the nano GPT in PyTorch's ``DistributedDataParallel``,
    ``torch.optim.AdamW(lr=lr)`` — on rank 1 ``lr=odd_lr`` if given — trained ``SMALL``'s steps
    under ``minishard.watch(trace=directory)``. Returns this rank's parameters after the run."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import minishard
    cfg = minishard.model_config(SMALL["model"])
    net = minishard.GPT(cfg, seed=0)
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=odd_lr if odd_lr is not None and rank.rank == 1 else lr)
    with minishard.watch(model, opt, trace=directory) as w:
        for step in range(SMALL["steps"]):
            x, y = minishard.batch(cfg, step, SMALL["micro_batch"], rank.rank, rank.world_size)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            w.step()
    return {"params": {n: p.detach().clone() for n, p in net.named_parameters()}}


# --------------------------------------------------------------------------- the doctor's words

# what differs from machine to machine, or commit to commit, though the diagnosis does not
LINE_NO = re.compile(r"(\.py):\d+ in ")                              # the engine's line numbers
OUTSIDE = re.compile(r", called from /[^;]*? in [\w.<>]+")           # an interpreter's own path
HASHES = re.compile(r"fingerprint [0-9a-f]{16} against [0-9a-f]{16}")
# how long ranks waited before they gave up, and whether their own wait timed out or a peer
# that gave up first closed the connection: timing decides both
WAITED = re.compile(r"(gave up(?: waiting in .*?)?) after \d+\.\d+(?: to \d+\.\d+)? s")
GAVE_UP_HOW = re.compile(r"(gave up waiting in .* s): (?:timed out|a peer went away|timed out or lost a peer)$")
LOST = re.compile(r"(rank \d+, step \d+: )[\d,]+( of [\d,]+ \w+ elements the optimizer stepped "
                  r"came out unchanged \()[\d.]+( %\))")
NORM = re.compile(r"(rank \d+): -?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?=,|$)")


def stable(line: str) -> str:
    """A line of the doctor's report without what changes with the machine, the float kernels,
    the timing or the engine's code: line numbers and an interpreter's path, the weights'
    hashes, how long ranks waited before they gave up and whether theirs or a peer's wait ran
    out first, and the values float kernels decide — the updates a bf16 step lost, the norms
    ranks clipped by — each shown as ``…``."""
    line = OUTSIDE.sub("", LINE_NO.sub(r"\1 in ", line))
    line = HASHES.sub("fingerprints differ", line)
    line = GAVE_UP_HOW.sub(r"\1: …", WAITED.sub(r"\1 after … s", line))
    line = LOST.sub(r"\1…\2…\3", line)
    return NORM.sub(r"\1: …", line) if line.lstrip().startswith("- rank ") else line


def doctor_text(directory: str | Path, name: str | None = None) -> list[str]:
    """``python -m minishard doctor DIR``'s lines for ``directory``, the directory shown as
    ``name``, each made :func:`stable`."""
    from minishard.instruments import doctor
    from minishard.cli.doctor import text
    shown = name or Path(directory).name
    return [stable(line.replace(str(directory), shown)) for line in text(doctor.diagnose(directory))]


def summary(finding) -> str:
    """``[kind] ranks 0, 2, 3: title`` — one finding in a line (the ranks once: a title that
    starts with them already names them)."""
    who = f"rank{'s' if len(finding.ranks) > 1 else ''} {', '.join(map(str, finding.ranks))}"
    said = finding.title if finding.title.startswith(who) else f"{who}: {finding.title}"
    return stable(f"[{finding.kind}] {said}")


def verdict(directory: str | Path, name: str | None = None) -> str:
    """``minishard doctor NAME: nothing found`` or the kinds it found, in a line."""
    from minishard.instruments import doctor
    found = doctor.diagnose(directory).findings
    said = "nothing found" if not found else ", ".join(f"[{f.kind}]" for f in found)
    return f"minishard doctor {name or Path(directory).name}: {said}"
