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
