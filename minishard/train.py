"""The training loop every chapter runs, on one rank, under any strategy.

``train(rank, strategy=..., steps=...)`` is a task for :class:`minishard.launch.Ranks` (and the
body of ``python -m minishard demo`` under torchrun). It builds the tiny GPT from its config,
wraps it with the strategy, trains on this rank's slice of each global batch, and returns what
the course shows: losses, step times, the measured ledger (peak, per phase, by category), the
bytes every collective moved — recorded by ``comm`` and counted by the OS — and, on request,
the final parameters for the parity tests.

Strategies: ``single`` (no communication: the reference), ``ddp_naive``, ``ddp``,
``zero1`` (reduce-scatter), ``zero1_allreduce`` (all-reduce, as the idea is first told), ``zero2``,
and PyTorch's own ``torch_ddp`` and ``torch_zero1`` (DDP + ZeroRedundancyOptimizer): the second
oracle and the benchmark baselines. ``precision="bf16_mixed"`` trains bf16 weights against an
fp32 master copy.
"""
from __future__ import annotations

import contextlib
import time
from contextlib import nullcontext as _null
from typing import Any

import torch
import torch.nn as nn

from . import model as model_mod
from .comm import Comm, bytes_written
from .ddp import DDP, NaiveDDP
from . import fsdp
from .offload import OffloadPolicy, Tier, prepare_optimizer_state
from .zero import ZeroOptimizer
from .launch import RankContext
from .ledger import LiveLedger, estimate, gpt_activation_bytes, track_optimizer_state
from .trace import Tracer

STRATEGIES = ("single", "ddp_naive", "ddp", "torch_ddp", "zero1", "zero1_allreduce", "zero2",
              "torch_zero1", "fsdp", "fsdp_flat", "torch_fsdp", "hsdp")
WRAPS = ("block", "model", "linear")
OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")
PRECISIONS = ("fp32", "bf16_mixed")
LEDGER_STRATEGY = {"single": "ddp", "ddp_naive": "ddp", "ddp": "ddp", "zero1": "zero1",
                   "zero1_allreduce": "zero1", "zero2": "zero2", "fsdp": "zero3", "fsdp_flat": "zero3",
                   "hsdp": "zero3"}


def optimizer_spec(name: str, lr: float) -> tuple[type, dict]:
    if name == "adamw":
        return torch.optim.AdamW, dict(lr=lr, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD, dict(lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD, dict(lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


class MasterWeights:
    """Mixed precision without sharding: bf16 working weights, an fp32 master copy that the
    optimizer updates, rounded back to bf16 after every step (what ZeRO then shards)."""

    def __init__(self, net: nn.Module, optimizer_class, ledger=None, **kwargs):
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.master = [nn.Parameter(p.detach().float()) for p in self.params]
        self.optimizer = optimizer_class(self.master, **kwargs)
        if ledger is not None:
            for i, m in enumerate(self.master):
                ledger.track("master", m, f"master:{i}")

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float()
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)
            m.grad = None

    def zero_grad(self, set_to_none: bool = False):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()


def wrap_targets(net: nn.Module, wrap: str) -> list[tuple[str, nn.Module]]:
    """The modules that become FSDP units below the root: each block, each Linear, or none."""
    if wrap == "block":
        return [(f"blocks.{i}", b) for i, b in enumerate(net.blocks)]
    if wrap == "linear":
        return [(n, m) for n, m in net.named_modules() if isinstance(m, nn.Linear)]
    if wrap == "model":
        return []
    raise ValueError(f"unknown wrap policy {wrap!r}; expected one of {WRAPS}")


def build(net: nn.Module, strategy: str, comm: Comm, ledger: LiveLedger | None, *,
          optimizer: str = "adamw", lr: float = 1e-3, precision: str = "fp32",
          bucket_cap_mb: float = 25.0, wrap: str = "block",
          reshard_after_forward: bool = True, reshard_root: bool = False,
          prefetch: int = 0, offload: str | None = None,
          offload_dir: str | None = None, shard_size: int = 2) -> tuple[nn.Module, Any]:
    """Apply a strategy to a freshly built model (same weights on every rank): returns the model
    to call and the optimizer to step."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    opt_class, opt_kwargs = optimizer_spec(optimizer, lr)
    mixed = precision == "bf16_mixed"
    if strategy in ("fsdp", "fsdp_flat", "hsdp"):
        mp = fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed else None
        replicate = None
        if strategy == "hsdp":          # shard inside "nodes" of shard_size ranks, replicate across
            comm, replicate = comm.split(shard_size)
            net._hsdp_comms = (comm, replicate)
        tier = None
        if offload is not None:
            state_bytes = 16 * sum(p.numel() for p in net.parameters()) // comm.world_size
            tier = Tier(OffloadPolicy(offload, offload_dir), comm.rank, needed_bytes=state_bytes)
        kw = dict(comm=comm, ledger=ledger, mp_policy=mp, offload=tier, replicate=replicate,
                  layout="flat" if strategy == "fsdp_flat" else "per_param")
        for name, m in wrap_targets(net, wrap):
            fsdp.fully_shard(m, reshard_after_forward=reshard_after_forward, name=name, **kw)
        fsdp.fully_shard(net, name="root", reshard_after_forward=True if reshard_root else None, **kw)
        fsdp.set_prefetch(net, prefetch, prefetch)
        opt = opt_class([p for p in net.parameters() if p.requires_grad], **opt_kwargs)
        if tier is not None:
            prepare_optimizer_state(opt, tier)     # the moments live in the tier too
            opt.tier = tier
        return net, opt
    if strategy == "torch_fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed else MixedPrecisionPolicy()
        for _, m in wrap_targets(net, wrap):
            fully_shard(m, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        fully_shard(net, mp_policy=mp)
        return net, opt_class([p for p in net.parameters() if p.requires_grad], **opt_kwargs)
    if mixed:
        net.to(torch.bfloat16)
    if strategy.startswith("zero"):
        opt = ZeroOptimizer(net, opt_class, stage=int(strategy[4]), comm=comm, ledger=ledger,
                            reduce="all_reduce" if strategy == "zero1_allreduce" else "reduce_scatter",
                            master_dtype=torch.float32 if mixed else None,
                            bucket_cap_mb=bucket_cap_mb, **opt_kwargs)
        return net, opt
    if strategy in ("torch_ddp", "torch_zero1"):
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)
        if strategy == "torch_zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return model, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=opt_class,
                                                  **opt_kwargs)
        return model, opt_class(net.parameters(), **opt_kwargs)
    if strategy == "ddp":
        model = DDP(net, comm, ledger, bucket_cap_mb=bucket_cap_mb)
    elif strategy == "ddp_naive":
        model = NaiveDDP(net, comm, ledger)
    else:
        model = net
        if ledger is not None:
            for name, p in net.named_parameters():
                ledger.track("params", p, f"param:{name}")
    if strategy != "ddp":               # grads allocated up front, so the ledger sees them
        for name, p in net.named_parameters():
            p.grad = torch.zeros_like(p)
            if ledger is not None:
                ledger.track("grads", p.grad, f"grad:{name}")
    if mixed:
        return model, MasterWeights(net, opt_class, ledger, **opt_kwargs)
    return model, opt_class(net.parameters(), **opt_kwargs)


def train(rank: RankContext | None = None, *, strategy: str = "ddp", steps: int = 3,
          model: str = "tiny", micro_batch: int = 4, accum: int = 1, lr: float = 1e-3,
          optimizer: str = "adamw", bucket_cap_mb: float = 25.0, seed: int = 0,
          data_seed: int = 1234, track_activations: bool = True, trace: bool = True,
          precision: str = "fp32", clip: float | None = None, wrap: str = "block",
          reshard_after_forward: bool = True, reshard_root: bool = False, recompute: bool = False,
          prefetch: int = 0, device_budget: int | None = None, offload: str | None = None,
          offload_dir: str | None = None, shard_size: int = 2,
          loss_chunk_tokens: int | None = None,
          freeze: tuple[str, ...] = (), fsdp_accumulate_unsharded: bool = False,
          return_params: bool = False, return_state: bool = False, model_overrides: dict | None = None,
          resume_from: str | None = None, save_to: str | None = None) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; each step sees ``accum`` micro-batches of
    ``micro_batch`` sequences per rank. Returns this rank's measurements (see module doc).
    ``resume_from``: start from a checkpoint (any world size or strategy) at its step;
    ``save_to``: save a checkpoint after the last step (``minishard.checkpoint``, chapter 09)."""
    if rank is None:                                   # plain single process, no launcher
        rank = RankContext(0, 1, torch.device("cpu"), Tracer(), "none")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if rank.world_size > 1 and strategy == "single":
        raise ValueError("strategy 'single' trains one process; use world size 1")
    if steps < 1 or micro_batch < 1 or accum < 1:
        raise ValueError(f"steps, micro_batch and accum must be >= 1 (got {steps}, {micro_batch}, {accum})")
    tracer = rank.tracer
    tracer.enabled = trace
    N = rank.world_size
    cfg = model_mod.config(model, **(model_overrides or {}))
    instrumented = not strategy.startswith("torch_")
    ledger = LiveLedger(tracer, budget=device_budget) if instrumented else None
    comm = Comm(tracer, ledger=ledger)

    net = model_mod.GPT(cfg, seed=seed).to(rank.device)
    net.recompute_activations = recompute
    net.loss_chunk_tokens = loss_chunk_tokens
    for name, p in net.named_parameters():
        if any(name.startswith(f) for f in freeze):
            p.requires_grad_(False)
    wrapped, opt = build(net, strategy, comm, ledger, optimizer=optimizer, lr=lr,
                         precision=precision, bucket_cap_mb=bucket_cap_mb, wrap=wrap,
                         reshard_after_forward=reshard_after_forward, reshard_root=reshard_root,
                         prefetch=prefetch, offload=offload, offload_dir=offload_dir,
                         shard_size=shard_size)
    no_sync = getattr(wrapped, "no_sync", None) or getattr(opt, "no_sync", None)
    if strategy in ("fsdp", "fsdp_flat", "hsdp"):
        # FSDP's default accumulates reduced slices (a reduce-scatter per micro-batch, little
        # memory); no_sync keeps full gradients until the last micro-batch (one reduce-scatter)
        no_sync = (lambda: fsdp.no_sync(net)) if fsdp_accumulate_unsharded else None
    elif strategy == "torch_fsdp":
        no_sync = lambda: _torch_fsdp_no_sync(net)  # noqa: E731
    first_step, ckpt = 0, {}
    if resume_from is not None:
        from . import checkpoint
        ckpt["load"] = checkpoint.load(wrapped, opt, resume_from, comm=comm)
        first_step = ckpt["load"]["step"]
    for c in [comm, *getattr(net, "_hsdp_comms", ())]:
        c.reset_counters()                             # count training traffic, not the set-up

    out: dict[str, Any] = {"rank": rank.rank, "world_size": N, "strategy": strategy,
                           "losses": [], "step_times": [], "wire": [], "payload": [],
                           "wchar": [], "calls": [], "exposed_comm": [], "transfer": []}
    fsdp_units = fsdp.units(net) if strategy in ("fsdp", "fsdp_flat", "hsdp") else []
    comms = [comm, *getattr(net, "_hsdp_comms", ())]   # hybrid: count every group's traffic
    for step in range(first_step, first_step + steps):
        tracer.step = step
        w0, c0 = bytes_written(), _totals(comms)
        e0 = sum(u.exposed_s for u in fsdp_units)
        x0 = _transfers(fsdp_units)
        t0 = time.perf_counter()
        with tracer.phase("step"):
            loss_sum = 0.0
            for k in range(accum):
                x, y = model_mod.batch(cfg, step * accum + k, micro_batch, rank.rank, N, data_seed)
                x, y = x.to(rank.device), y.to(rank.device)
                last = k == accum - 1
                sync = no_sync() if (not last and no_sync is not None) else _null()
                with sync:
                    with _phase(ledger, tracer, "forward"):
                        with (ledger.activations() if (ledger and track_activations) else _null()):
                            loss = wrapped(x, y) / accum
                    with _phase(ledger, tracer, "backward"):
                        loss.backward()
                loss_sum += loss.item()
            if strategy == "ddp_naive":
                with tracer.phase("sync_gradients"):
                    wrapped.sync_gradients()
            with _phase(ledger, tracer, "optimizer"):
                if clip is not None:
                    if hasattr(opt, "clip_grad_norm_"):
                        opt.clip_grad_norm_(clip)              # sharded: a global norm
                    else:
                        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                opt.step()
                if ledger is not None and isinstance(opt, torch.optim.Optimizer):
                    track_optimizer_state(ledger, opt, net,
                                          device=opt.tier.name if hasattr(opt, "tier") else None)
                elif ledger is not None and isinstance(opt, MasterWeights):
                    track_optimizer_state(ledger, opt.optimizer, prefix="master_")
                opt.zero_grad(set_to_none=False)       # DDP's grads are views into its buckets
        out["step_times"].append(time.perf_counter() - t0)
        out["losses"].append(loss_sum)
        w1 = bytes_written()
        out["wchar"].append(None if w0 is None else w1 - w0)
        c1 = _totals(comms)
        out["wire"].append(c1["wire"] - c0["wire"])
        out["payload"].append(c1["payload"] - c0["payload"])
        out["calls"].append(c1["calls"] - c0["calls"])
        out["exposed_comm"].append(sum(u.exposed_s for u in fsdp_units) - e0)
        x1 = _transfers(fsdp_units)
        out["transfer"].append({k: x1[k] - x0[k] for k in x1})
    tracer.step = None

    n_params = model_mod.GPT(cfg, device="meta").num_params(trainable_only=False)
    out["n_params"] = n_params
    out["by_op"] = {}
    for c in comms:
        for op, v in c.by_op.items():
            acc = out["by_op"].setdefault(op, {"payload": 0, "wire": 0, "calls": 0})
            for k in acc:
                acc[k] += v[k]
    if hasattr(opt, "layout"):
        out["layout"] = opt.layout()
    if ledger is not None:
        act = gpt_activation_bytes(cfg, micro_batch, dtype_bytes=2 if precision == "bf16_mixed" else 4) \
            if track_activations else 0
        prec = "bf16_fsdp" if (precision == "bf16_mixed" and strategy.startswith("fsdp")) else precision
        trainable = model_mod.GPT(cfg, device="meta")
        for name, p in trainable.named_parameters():
            if any(name.startswith(f) for f in freeze):
                p.requires_grad_(False)
        est = estimate(trainable, world_size=N, strategy=LEDGER_STRATEGY[strategy],
                       precision=prec, optimizer=optimizer, activation_bytes=act)
        out["ledger"] = {"peak": ledger.peak, "peak_snapshot": ledger.peak_snapshot,
                         "category_peaks": {c: b for (c, d), b in ledger.category_peaks.items()
                                            if d == ledger.device},
                         "phase_peaks": ledger.phase_peaks, "final": ledger.current(),
                         "estimate": est.per_rank}
    if save_to is not None:
        from . import checkpoint
        ckpt["save"] = checkpoint.save(wrapped, opt, save_to, comm=comm, step=first_step + steps)
    if ckpt:
        out["checkpoint"] = ckpt
    if return_params:
        if strategy in ("fsdp", "fsdp_flat", "hsdp"):
            full = fsdp.full_parameters(net)
        elif strategy == "torch_fsdp":
            full = {n: p.full_tensor() for n, p in net.named_parameters()}
        else:
            full = dict(net.named_parameters())
        out["params"] = {n: p.detach().cpu().float().clone() for n, p in full.items()}
    if return_state:
        out["optimizer_state"] = opt.state_dict()
    if ledger is not None:
        out["ledger"]["by_device"] = ledger.by_device()
    if hasattr(opt, "tier"):
        opt.tier.cleanup()
    return out


def _phase(ledger, tracer, name):
    return ledger.phase(name) if ledger is not None else tracer.phase(name)


@contextlib.contextmanager
def _torch_fsdp_no_sync(net):
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


def _transfers(units) -> dict:
    """Offload traffic so far, summed over units: bytes and seconds each way."""
    out = {"h2d_bytes": 0, "d2h_bytes": 0, "h2d_s": 0.0, "d2h_s": 0.0}
    for u in units:
        for d in ("h2d", "d2h"):
            out[f"{d}_bytes"] += u.transfers.bytes[d]
            out[f"{d}_s"] += u.transfers.seconds[d]
    return out


def _totals(comms) -> dict:
    return {k: sum(c.totals[k] for c in comms) for k in ("payload", "wire", "calls")}
