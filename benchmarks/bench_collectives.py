"""gloo's collectives on this machine: why minishard's all-gather and reduce-scatter are point-to-point.

    python benchmarks/bench_collectives.py                 # 2 and 4 ranks, 28 MB (the tiny GPT)
    python benchmarks/bench_collectives.py --mb 8 --world-sizes 2

Times, interleaved round by round on one warm pool per world size, the collectives a step of
ZeRO or FSDP issues, on a buffer of ``--mb`` MB: gloo's ``all_reduce``; its ``all_to_all`` into a
buffer allocated once; the same ``all_to_all`` into a fresh receive buffer followed by the local
sum (minishard's gloo reduce-scatter until 2026-12-01); minishard's ``Comm.reduce_scatter`` (N-1
``isend``/``irecv`` pairs, ``PairwiseReduceScatter``: one slice straight into the output, no
buffer on two ranks); gloo's own ``all_gather_into_tensor`` and minishard's ``Comm.all_gather``
(N-1 ``isend``/``irecv`` pairs, ``PairwiseGather``). Median over the rounds of the slowest
rank's time; a barrier before each call.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minishard.core.comm import Comm
from minishard.core.launch import Ranks


def _all_to_all_and_sum(out, send, N):
    """The reduce-scatter minishard ran on gloo before: all_to_all into a fresh buffer, then the
    local sum. The fresh buffer is the point: a real step allocates it every time."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    torch.sum(recv.view(N, -1), dim=0, out=out)


def time_collectives(rank, numel: int, rounds: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    N, comm = dist.get_world_size(), Comm()
    full, part = torch.randn(numel - numel % N), torch.randn(numel // N)
    recv = torch.empty_like(full)
    ops = {
        "gloo all_reduce (2(N-1)/N S)": lambda: dist.all_reduce(full),
        "gloo all_to_all ((N-1)/N S)": lambda: dist.all_to_all_single(recv, full),
        "all_to_all, fresh buffer + sum": lambda: _all_to_all_and_sum(part, full, N),
        "minishard reduce_scatter (pairwise)": lambda: comm.reduce_scatter(part, full),
        "gloo all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, part),
        "minishard all_gather (pairwise)": lambda: comm.all_gather(full, part),
    }
    out: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            op()
            out[name].append(time.perf_counter() - t0)
    return out


def _self():
    """This file as an importable module: rank processes import a task by its module's name."""
    import importlib
    return importlib.import_module("bench_collectives")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=float, default=27.5)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    numel = int(args.mb * 1e6 / 4)
    print(f"# gloo collectives, {time.strftime('%Y-%m-%d %H:%M')}, {args.mb} MB fp32, "
          f"{args.rounds} rounds (first 2 dropped), median of the slowest rank, ms")
    for n in args.world_sizes:
        with Ranks(n) as ranks:
            res = ranks.run(_self().time_collectives, numel, args.rounds)
        print(f"\n{n} ranks")
        for name in res[0]:
            slowest = [max(r[name][i] for r in res) for i in range(2, args.rounds)]
            print(f"  {name:<34}{statistics.median(slowest) * 1e3:8.1f}")


if __name__ == "__main__":
    main()
