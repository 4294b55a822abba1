"""Checkpoint throughput: minishard against PyTorch DCP and a plain copy of the same bytes.

    python benchmarks/bench_checkpoint.py                       # small + large state, 2 and 4 ranks
    python benchmarks/bench_checkpoint.py --states small --rounds 5 --dir /mnt/nvme/scratch
    python benchmarks/bench_checkpoint.py --what stall          # sync vs background vs DCP async_save

For each state — ``small``, the tiny GPT (6.9 M parameters: 82 MB of fp32 parameters + AdamW
moments), and ``large``, the tiny GPT widened to d_model 768 and deepened to 10 blocks (45.8 M
parameters, 549 MB) — and each world size, one warm pool of ranks builds the model twice: under
minishard's FSDP (per-parameter) and under PyTorch's FSDP2 ``fully_shard`` (a unit per block +
the root, as benchmarks/bench.py builds it), each with its AdamW state, then runs interleaved
rounds (the order rotates every round) of:

* minishard save: ``checkpoint.save`` — describe, hash (XXH3-64 per 64 KiB block), write, fsync,
  agree, metadata, renames ("its own file": the same bytes / the seconds of the rank's own file:
  hash, write, fsync);
* minishard load: ``checkpoint.load`` of that checkpoint — plan, read, verify every block, agree,
  copy into the live tensors;
* minishard load N→M: the same, of the checkpoint saved by the other world size (resharding);
* DCP save: ``get_state_dict`` + ``torch.distributed.checkpoint.save`` (FileSystemWriter
  defaults: one file per rank, fsync'd) of the same model + optimizer state;
* DCP load: ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``; and N→M, as above;
* copy: every rank copies its minishard rank file (``shutil.copyfile`` + fsync) to a new file,
  all ranks at once — the disk's speed for the same bytes.

Every operation is timed from a barrier to a barrier: from a common start until the last rank
has finished (a checkpoint, like a parallel copy, is done when its last file is). MB/s per rank
= the rank's share of the state (12Ψ/N bytes, the same figure for every contender, so MB/s
ratios are time ratios) / those seconds; "its own file" is the exception, each rank's own
seconds. Each round's figure is the median over the ranks; the table gives
the median over the rounds and the min–max, and each ratio is the median of the per-round
ratios. Checksums are on for minishard (always: a save computes them, a load verifies them);
DCP and the copy verify nothing. Every save writes a fresh directory (as a run saving each step
does); loads read files just written, so from the page cache, as a restart on the same machine
would, and so does the copy.

``--what stall`` measures instead what a save costs the training (issue 28, item 4), on the same
two models: the **stall** — from the call until it returns, so until the step can go on — of

* minishard sync: ``checkpoint.save`` (the whole save: the step waits for the write);
* minishard background: ``checkpoint.save(..., background=True)`` (describe + the copy to host
  memory; the write, exchange and commit run in a thread, in their own process group);
* DCP save: ``get_state_dict`` + ``dcp.save``;
* DCP async_save: ``get_state_dict`` + ``dcp.async_save`` (its default stager copies the state to
  CPU memory, a thread writes it), given a gloo group of its own as minishard's is.

After the call returns, each rank computes — fixed bursts of matmuls standing in for the next
steps — until the save is written, then waits for it: the bursts that ran beside the write took
longer than alone (2 cores: the writer thread takes CPU from them), and that extra time is
training-visible too. **Visible** = stall + that slowdown; **written** = call → on disk. Each
figure is the slowest rank's (the next collective waits for it), the median over rounds; the
ratios are medians of per-round ratios.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

STATES = {"small": {}, "large": {"d_model": 768, "n_layer": 10}}
OPS = ("minishard save", "  its own file", "minishard load", "minishard load N→M",
       "DCP save", "DCP load", "DCP load N→M", "copy")
OWN_FILE = OPS[1]
SAVES = ("minishard sync", "minishard background", "DCP save", "DCP async_save")
_HELD: dict = {}            # in each rank process: the built models, kept across rounds


def _timed(fn) -> float:
    """Seconds from a common start until every rank has finished: a checkpoint (or a parallel
    copy) is done when its last file is."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def setup(rank, root: str, state: str, refs: bool = True) -> int:
    """Build both models with their AdamW state, save both reference checkpoints (the other
    world size loads them: N→M), warm every path once. Returns this rank's state bytes.
    ``refs=False``: the models only.

    No training step: the optimizer state is made as the first step would make it (minishard's
    ``ensure_optimizer_state``, which ``describe`` calls; DCP's ``get_state_dict``, which steps
    once with zero gradients) — the bytes are the same, and no all-gather runs."""
    from minishard import checkpoint
    from minishard.core.comm import Comm
    from minishard.core.model import GPT, config
    from minishard.training.loop import TrainConfig, build
    _HELD.clear()
    cfg = config("tiny", **STATES[state])
    comm = Comm(rank.tracer)
    held = {"comm": comm}
    for kind in ("fsdp", "torch_fsdp"):
        config_ = TrainConfig(kind, model="tiny", model_overrides=STATES[state])
        held[kind] = build(GPT(cfg, seed=0), config_, comm)
    _HELD.update(held)
    N = rank.world_size
    if not refs:
        return 12 * GPT(cfg, device="meta").num_params() // N
    ref = Path(root) / f"ref-n{N}"
    ms, dcp = ref / "minishard", ref / "dcp"
    checkpoint.save(held["fsdp"].model, held["fsdp"].optimizer, ms, comm=comm, step=1)
    checkpoint.load(held["fsdp"].model, held["fsdp"].optimizer, ms, comm=comm)
    _dcp_save(held["torch_fsdp"], dcp)
    _dcp_load(held["torch_fsdp"], dcp)
    return 12 * GPT(cfg, device="meta").num_params() // N


def _dcp_save(built, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(built.model, built.optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def _dcp_load(built, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(built.model, built.optimizer)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(built.model, built.optimizer, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"])


def _copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def one_round(rank, root: str, k: int, other: int | None) -> dict[str, float]:
    """One interleaved round on this rank: seconds per operation (the order rotates with k)."""
    import torch.distributed as dist
    from minishard import checkpoint
    ms, tf, comm = _HELD["fsdp"], _HELD["torch_fsdp"], _HELD["comm"]
    N, here = rank.world_size, Path(root) / f"round{k}-n{rank.world_size}"
    mine = Path(root) / f"ref-n{N}" / "minishard" / f"rank{rank.rank}.safetensors"
    t: dict[str, float] = {}

    def save():
        t[OWN_FILE] = checkpoint.save(ms.model, ms.optimizer, here / "minishard", comm=comm,
                                      step=1)["write_seconds"]

    def load(path: Path):
        return lambda: checkpoint.load(ms.model, ms.optimizer, path, comm=comm)

    units = [[("minishard save", save), ("minishard load", load(here / "minishard"))],
             [("DCP save", lambda: _dcp_save(tf, here / "dcp")),
              ("DCP load", lambda: _dcp_load(tf, here / "dcp"))],
             [("copy", lambda: _copy(mine, here / f"copy-rank{rank.rank}"))]]
    if other is not None:
        src = Path(root) / f"ref-n{other}"
        units += [[("minishard load N→M", load(src / "minishard"))],
                  [("DCP load N→M", lambda: _dcp_load(tf, src / "dcp"))]]
    if rank.rank == 0:
        here.mkdir(parents=True)
    dist.barrier()
    for unit in units[k % len(units):] + units[:k % len(units)]:
        for name, fn in unit:
            t[name] = _timed(fn)
    dist.barrier()
    if rank.rank == 0:
        shutil.rmtree(here)
    return t


def _row(name: str, rates: list[float], ratios: dict[str, list[float]]) -> str:
    cells = [f"{statistics.median(rates):>7.0f}", f"{min(rates):>6.0f}–{max(rates):<6.0f}"]
    cells += [f"{statistics.median(v):>9.2f}" if v else f"{'':>9}" for v in ratios.values()]
    return f"{name:<22}" + "".join(cells)


def report(state: str, N: int, other: int | None, nbytes: int, rounds: list[list[dict]]) -> dict:
    """Print one table; return the medians of the ratios the goal is about."""
    # per round: the median over ranks of each operation's MB/s
    per = [{op: statistics.median(nbytes / r[op] / 1e6 for r in ranks) for op in ranks[0]}
           for ranks in rounds]
    print(f"\n{state} state, {N} ranks ({nbytes / 1e6:.1f} MB per rank, {len(rounds)} rounds"
          f"{f'; N→M: from {other} ranks' if other else ''})")
    print(f"{'':<22}{'MB/s':>7}{'min–max':>13}{'vs copy':>9}{'vs DCP':>9}")
    goal = {}
    for op in [o for o in OPS if o in per[0]]:
        base = ("DCP " + op.split(" ", 1)[1] if op.startswith("minishard") else
                "DCP save" if op == OWN_FILE else None)         # the DCP operation it faces
        ratios = {"copy": [p[op] / p["copy"] for p in per] if op != "copy" else [],
                  "dcp": [p[op] / p[base] for p in per] if base in per[0] else []}
        print(_row(op, [p[op] for p in per], ratios))
        if op.startswith("minishard"):
            goal[op] = {k: statistics.median(v) for k, v in ratios.items() if v}
    return goal


# ====================================================================== --what stall

def setup_stall(rank, root: str, state: str) -> int:
    """The two models (``setup``), a gloo group for DCP's thread — async_save runs its
    collectives in a thread, which must not share the group of the caller's barriers and
    training, as minishard's own background saves do not — and one unrecorded round (the first
    background save creates minishard's group, the first async_save imports its executor)."""
    import torch
    import torch.distributed as dist
    nbytes = setup(rank, root, state, refs=False)
    _HELD["dcp_group"] = dist.new_group(backend="gloo")
    _HELD["burst"] = (torch.randn(384, 384), torch.empty(384, 384))
    stall_round(rank, root, -1)
    return nbytes


def _burst() -> None:
    """A fixed piece of compute (~20 ms of one core here), standing in for training."""
    import torch
    x, out = _HELD["burst"]
    for _ in range(12):
        torch.mm(x, x, out=out)


def _save_calls(here: Path) -> dict:
    """Each contender's call: what the training's step waits for."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from minishard import checkpoint
    ms, tf, comm = _HELD["fsdp"], _HELD["torch_fsdp"], _HELD["comm"]

    def state():
        msd, osd = get_state_dict(tf.model, tf.optimizer)
        return {"model": msd, "optim": osd}

    return {"minishard sync": lambda: checkpoint.save(ms.model, ms.optimizer, here / "sync", comm=comm, step=1),
            "minishard background": lambda: checkpoint.save(ms.model, ms.optimizer, here / "background",
                                                            comm=comm, step=1, background=True),
            "DCP save": lambda: dcp.save(state(), checkpoint_id=str(here / "dcp")),
            "DCP async_save": lambda: dcp.async_save(state(), checkpoint_id=str(here / "dcp_async"),
                                                     process_group=_HELD["dcp_group"])}


def stall_round(rank, root: str, k: int) -> dict[str, dict[str, float]]:
    """One round on this rank: each contender's stall, the slowdown of the bursts that ran
    beside its write, and the seconds until it was written (the order rotates with k) — timed
    by the course's ``time_saves``, so chapter 09 and this benchmark measure alike."""
    import torch.distributed as dist
    from minishard.course.ch09 import time_saves
    here = Path(root) / f"stall{k}-n{rank.world_size}"
    if rank.rank == 0:
        here.mkdir(parents=True)
    dist.barrier()
    order = SAVES[k % len(SAVES):] + SAVES[:k % len(SAVES)]
    out = time_saves(_save_calls(here), order, _burst)
    dist.barrier()
    if rank.rank == 0:
        shutil.rmtree(here)
    return out


STALL_RATIOS = {"background / sync": ("minishard background", "minishard sync"),
                "async_save / DCP save": ("DCP async_save", "DCP save"),
                "background / async_save": ("minishard background", "DCP async_save")}


def stall_report(state: str, N: int, nbytes: int, rounds: list[list[dict]]) -> dict:
    """One table (ms, the slowest rank, medians over rounds) and the ratios; returns them."""
    per = [{name: {m: max(r[name][m] for r in ranks) for m in ranks[0][name]} for name in SAVES}
           for ranks in rounds]
    print(f"\n{state} state, {N} ranks ({nbytes / 1e6:.1f} MB per rank, {len(rounds)} rounds): ms, "
          f"the slowest rank, median (min–max) over rounds")
    print(f"{'':<22}" + "".join(f"{m:>18}" for m in ("stall", "+ slowed", "= visible", "written")))
    for name in SAVES:
        cells = []
        for m in ("stall", "slowed", "visible", "written"):
            v = [p[name][m] * 1e3 for p in per]
            cells.append(f"{statistics.median(v):>7.0f} ({min(v):>4.0f}–{max(v):<4.0f})")
        print(f"{name:<22}" + "".join(f"{c:>18}" for c in cells))
    ratios = {f"{label}, {m}": statistics.median(p[a][m] / p[b][m] for p in per)
              for label, (a, b) in STALL_RATIOS.items() for m in ("stall", "visible")}
    print("  " + "; ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return ratios


def run_stall(args, root: Path, me, Ranks) -> None:
    for state in args.states:
        rounds = args.rounds if state == "small" else args.large_rounds
        pools = {N: Ranks(N) for N in args.world_sizes}
        try:
            nbytes = {N: pools[N].run(me.setup_stall, str(root), state)[0] for N in pools}
            done: dict[int, list] = {N: [] for N in pools}
            for k in range(rounds):
                for N in pools:                         # the world sizes interleaved too
                    done[N].append(pools[N].run(me.stall_round, str(root), k))
        finally:
            for p in pools.values():
                p.close()
        for N in pools:
            r = stall_report(state, N, nbytes[N], done[N])
            ok = r["background / sync, stall"] < 1
            print(f"  goal: a background save stalls a step less than a sync one: {'met' if ok else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--states", nargs="+", default=list(STATES), choices=list(STATES))
    ap.add_argument("--rounds", type=int, default=7, help="rounds for the small state")
    ap.add_argument("--large-rounds", type=int, default=5, help="rounds for the large state")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--what", nargs="+", default=["throughput", "stall"], choices=["throughput", "stall"],
                    help="MB/s against DCP and a copy; a save's stall of training (sync, background, "
                         "DCP async_save)")
    args = ap.parse_args()
    import bench_checkpoint as me                     # rank processes import the tasks by name
    from minishard.core.launch import Ranks
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    print(f"# checkpoint benchmark, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; files in {root}")
    sizes, goals = args.world_sizes, {}
    try:
        if "stall" in args.what:
            run_stall(args, root, me, Ranks)
        for state in args.states if "throughput" in args.what else ():
            rounds = args.rounds if state == "small" else args.large_rounds
            pools = {N: Ranks(N) for N in sizes}
            try:
                nbytes = {N: pools[N].run(me.setup, str(root), state)[0] for N in sizes}
                other = {N: sizes[(i + 1) % len(sizes)] if len(sizes) > 1 else None
                         for i, N in enumerate(sizes)}
                done: dict[int, list] = {N: [] for N in sizes}
                for k in range(rounds):
                    for N in sizes:                     # the world sizes interleaved too
                        done[N].append(pools[N].run(me.one_round, str(root), k, other[N]))
            finally:
                for p in pools.values():
                    p.close()
            for N in sizes:
                goals[state, N] = report(state, N, other[N], nbytes[N], done[N])
            for N in sizes:
                shutil.rmtree(root / f"ref-n{N}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if goals:
        print("\nGoal: minishard save and load >= 0.70 x copy and >= 1.5 x DCP (medians of per-round ratios)")
    for (state, N), g in goals.items():
        for op, r in g.items():
            ok = r["copy"] >= 0.7 and r.get("dcp", 0) >= 1.5
            print(f"  {state:<6}{N} ranks  {op:<20} {r['copy']:.2f} x copy, "
                  f"{r.get('dcp', float('nan')):.2f} x DCP  {'met' if ok else 'NOT met'}")
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
