"""Chapter 08 (offload): what crossed between device and host, read from a trace, and what a
disk tier leaves on disk."""
from __future__ import annotations

from minishard.core.comm import Comm
from minishard.core.model import GPT, batch, config
from minishard.core.trace import rank_events


def transfer_table(events: list[dict], rank: int = 0, step: int | None = None) -> dict:
    """``transfer`` events of ``rank`` (in ``step``) summed: ``{(direction, unit): [count,
    bytes, seconds]}``."""
    out: dict[tuple, list] = {}
    for e in rank_events(events, rank, step):
        if e["kind"] == "transfer":
            row = out.setdefault((e["direction"], e["tag"]), [0, 0, 0.0])
            row[0] += 1
            row[1] += e["bytes"]
            row[2] += e["seconds"]
    return out


def disk_tier_files(rank, directory: str, model: str = "tiny", micro_batch: int = 2) -> dict:
    """Build FSDP (flat layout) with the sharded state in memory-mapped files under
    ``directory``, train one step, and list what the tier holds on disk before cleaning up:
    ``{"files": n, "bytes": total, "sizes": sorted sizes, "units": folders (one per unit)}``
    for this rank."""
    import os

    from minishard.training.loop import TrainConfig, build
    cfg = config(model)
    comm = Comm()
    built = build(GPT(cfg).to(rank.device), TrainConfig("fsdp_flat", model=model, offload="disk",
                                                        offload_dir=directory), comm)
    x, y = batch(cfg, 0, micro_batch, rank.rank, rank.world_size)
    built.model(x, y).backward()
    built.optimizer.step()
    folders = [u.tier.directory for u in built.units]        # one per unit
    sizes = sorted(os.path.getsize(d / f) for d in folders for f in os.listdir(d))
    for u in built.units:
        u.release_tier()
    return {"files": len(sizes), "bytes": sum(sizes), "sizes": sizes, "units": len(folders),
            "left_behind": any(os.path.exists(d) for d in folders)}


WHAT = ("nothing", "optimizer", "everything")


def offload_compare(rank, what: str, model: str = "tiny", micro_batch: int = 2, steps: int = 2,
                    lr: float = 1e-3, return_params: bool = False) -> dict:
    """Train ``steps`` AdamW steps of FSDP (flat layout, a unit per block plus the root, no
    prefetch: as §1's runs) with ``what`` in host memory: ``"nothing"``, ``"optimizer"`` —
    ZeRO-Offload's choice, ``ShardedOptimizer(..., offload_policy=CPUOffloadPolicy())`` — or
    ``"everything"``, ``fully_shard(..., offload_policy=CPUOffloadPolicy())``. Returns this
    rank's losses, its ledger by device at the end, the device peak, the bytes each step moved
    each way (the units' and the optimizer's transfer logs together) and, with
    ``return_params``, the final full parameters."""
    from minishard.core.ledger import LiveLedger, track_optimizer_state
    from minishard.strategies import fsdp
    from minishard.strategies.registry import optimizer_spec
    from minishard.strategies.offload import CPUOffloadPolicy, OffloadPolicy
    if what not in WHAT:
        raise ValueError(f"offload_compare: what={what!r}; expected one of {WHAT}")
    cfg = config(model)
    ledger = LiveLedger(rank.tracer)
    comm = Comm(rank.tracer, ledger=ledger)
    host = CPUOffloadPolicy()
    net = fsdp.apply_fsdp(GPT(cfg, seed=0).to(rank.device), comm=comm, ledger=ledger, layout="flat",
                          offload_policy=host if what == "everything" else OffloadPolicy())
    fsdp.set_prefetch(net, 0, 0)
    opt_class, opt_kwargs = optimizer_spec("adamw", lr)          # as a run's: AdamW, decay 0.01
    opt = fsdp.ShardedOptimizer(net, opt_class(net.parameters(), **opt_kwargs),
                                offload_policy=host if what == "optimizer" else OffloadPolicy())
    if opt.offload is not None:
        opt.offload.account(ledger)
    logs = [u.transfers for u in fsdp.units(net)] + ([opt.offload.transfers] if opt.offload else [])
    moved = lambda d: sum(log.bytes[d] for log in logs)                       # noqa: E731
    losses, per_step = [], []
    for step in range(steps):
        before = {d: moved(d) for d in ("h2d", "d2h")}
        x, y = batch(cfg, step, micro_batch, rank.rank, rank.world_size)
        with ledger.activations():
            loss = net(x, y)
        loss.backward()
        opt.step()
        track_optimizer_state(ledger, opt.optimizer, net, device=None if what == "nothing" else "host")
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
        per_step.append({d: moved(d) - before[d] for d in before})
    out = {"losses": losses, "by_device": ledger.by_device(), "peak": ledger.peak, "moved": per_step}
    if return_params:
        out["params"] = fsdp.full_parameters(net)
    return out
