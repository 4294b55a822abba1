"""GPU check: what the CPU course can only model, measured on a real GPU. Prints one table.

    python scripts/gpu_check.py             # on a CUDA machine, under 5 minutes
    python scripts/gpu_check.py --dry-run   # the same code path on CPU with a tiny model

1. Bandwidths: device-to-device copy (HBM), pinned and pageable host<->device copies (PCIe or
   NVLink-C2C) — the numbers behind "offload turns a capacity problem into a transfer problem".
2. A single-rank FSDP step (bf16 compute, fp32 shards, AdamW) of a >= 1 B-parameter model
   (TinyLlama-1.1B shapes), with the sharded state on the device and offloaded to pinned host
   memory: step time, transfer bytes and seconds, device peak.
3. The live ledger's device peak against ``torch.cuda.max_memory_allocated`` (what the ledger
   cannot see: cuBLAS workspaces, autograd temporaries, allocator rounding).
4. ``minishard.watch`` on PyTorch's own FSDP2 ``fully_shard`` over NCCL: the watched ledger's
   total at each phase edge of the last step against ``torch.cuda.memory_allocated`` there.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from minishard.core.c10d import init_group
from minishard.core.launch import RankContext
from minishard.core.trace import Tracer
from minishard.training.loop import TrainConfig, train

GB = 1e9


def bandwidth(src: torch.Tensor, dst: torch.Tensor, repeats: int, cuda: bool) -> float:
    """GB/s of dst.copy_(src), median of ``repeats``."""
    times = []
    for _ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return src.numel() * src.element_size() / times[len(times) // 2] / GB


def watch_fsdp2(device: torch.device, cuda: bool, steps: int) -> list[tuple[str, str, str]]:
    """PyTorch's FSDP2 (each block, then the root; AdamW) watched on this one rank: at every
    phase edge of the last step, the watch's ledger against the allocator's count."""
    import minishard
    from minishard.core.trace import Replay
    from torch.distributed.fsdp import fully_shard
    size = "tiny" if cuda else "nano"
    net = minishard.GPT(size).to(device)
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    allocated: dict[int, int] = {}             # phase event's seq -> bytes the allocator holds

    def at_phase(ev: dict) -> None:
        if ev["kind"] == "phase":
            allocated[ev["seq"]] = torch.cuda.memory_allocated() if cuda else 0
    tracer = Tracer(0, 1, sink=at_phase)
    cfg = minishard.model_config(size)
    with minishard.watch(net, opt, trace=tracer) as w:
        for step in range(steps):
            x, y = (t.to(device) for t in minishard.batch(cfg, step, 2, 0, 1))
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
            w.step()
    rp, rows = Replay(tracer.events), []
    for i, e in enumerate(rp.events):
        if e["kind"] == "phase" and e.get("step") == steps - 1 and e["name"] != "step":
            ledger, real = sum(rp.snapshot(i)[0].values()), allocated[e["seq"]]
            rows.append((f"watch FSDP2 ({size}), {e['name']} {e['edge']}", f"ledger {ledger / GB:.3f} GB",
                         f"allocated {real / GB:.3f} GB, ledger/real {ledger / real:.3f}" if real else "dry run"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny model: test the script")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device: run with --dry-run to exercise the script on CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.set_num_threads(min(16, os.cpu_count() or 1))
    rows = []

    # ---- 1. bandwidths
    n = (1 << 28) if cuda else (1 << 22)                 # 1 GiB of fp32 on GPU, 16 MiB on CPU
    a = torch.empty(n, device=device)
    b = torch.empty(n, device=device)
    rows.append(("device -> device copy (HBM)", f"{bandwidth(a, b, 5, cuda):.1f} GB/s", "measured"))
    for pinned in ((True, False) if cuda else (False,)):
        h = torch.empty(n, pin_memory=pinned and cuda)
        label = "pinned" if pinned and cuda else "pageable"
        rows.append((f"host -> device ({label})", f"{bandwidth(h, a, 5, cuda):.1f} GB/s", "measured"))
        rows.append((f"device -> host ({label})", f"{bandwidth(a, h, 5, cuda):.1f} GB/s", "measured"))
    del a, b, h

    # ---- 2./3. one-rank FSDP steps, state on the device and offloaded
    store = dist.HashStore()
    init_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
               timeout=timedelta(seconds=120))
    model = "tinyllama-1.1b" if cuda else "nano"
    overrides = {"seq_len": 1024} if cuda else {}
    for offload in (None, "host"):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        ctx = RankContext(0, 1, device, Tracer(keep=False), "nccl" if cuda else "gloo")
        t0 = time.perf_counter()
        out = train(ctx, TrainConfig(strategy="fsdp", model=model, model_overrides=overrides, steps=args.steps, micro_batch=1, precision="bf16_mixed", offload=offload, track_activations=True))
        wall = time.perf_counter() - t0
        led = out["ledger"]
        tag = "state on device" if offload is None else "state offloaded to host"
        rows.append((f"FSDP step, {out['n_params'] / 1e9:.2f} B params, {tag}",
                     f"{sorted(out['step_times'])[len(out['step_times']) // 2]:.3f} s/step", f"{wall:.0f} s total"))
        x = out["transfer"][-1]
        if offload:
            rows.append(("  offload traffic per step",
                         f"h2d {x['h2d_bytes'] / GB:.2f} GB in {x['h2d_s']:.3f} s, "
                         f"d2h {x['d2h_bytes'] / GB:.2f} GB in {x['d2h_s']:.3f} s", "measured"))
        rows.append(("  ledger device peak", f"{led['peak'] / GB:.2f} GB",
                     ", ".join(f"{k} {v / GB:.2f}" for k, v in led["peak_snapshot"].items())))
        if cuda:
            real = torch.cuda.max_memory_allocated()
            rows.append(("  torch.cuda.max_memory_allocated", f"{real / GB:.2f} GB",
                         f"ledger/real = {led['peak'] / real:.3f}"))
    rows += watch_fsdp2(device, cuda, args.steps)
    dist.destroy_process_group()

    width = max(len(r[0]) for r in rows)
    print(f"# minishard GPU check — {torch.cuda.get_device_name(0) if cuda else 'CPU dry run'}, "
          f"torch {torch.__version__}")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:<28}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
