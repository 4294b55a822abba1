"""The training loop every chapter runs, on one rank, under any strategy.

``train(rank, strategy=..., steps=...)`` is a task for :class:`minishard.launch.Ranks` (and the
body of ``python -m minishard demo`` under torchrun). It builds the tiny GPT from its config,
wraps it with the strategy, trains on this rank's slice of each global batch, and returns what
the course shows: losses, step times, the measured ledger (peak, per phase, by category), the
bytes every collective moved — recorded by ``comm`` and counted by the OS — and, on request,
the final parameters for the parity tests.

Strategies: ``single`` (no communication: the reference), ``ddp_naive``, ``ddp`` and
``torch_ddp`` (PyTorch's own DistributedDataParallel, the second oracle and the benchmark
baseline).
"""
from __future__ import annotations

import time
from contextlib import nullcontext as _null
from typing import Any

import torch
import torch.nn as nn

from . import model as model_mod
from .comm import Comm, bytes_written
from .ddp import DDP, NaiveDDP
from .launch import RankContext
from .ledger import LiveLedger, estimate, gpt_activation_bytes, track_optimizer_state
from .trace import Tracer

STRATEGIES = ("single", "ddp_naive", "ddp", "torch_ddp")
OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def wrap(net: nn.Module, strategy: str, comm: Comm, ledger: LiveLedger | None,
         bucket_cap_mb: float = 25.0) -> nn.Module:
    """Apply a strategy to a freshly built model (same weights on every rank)."""
    if strategy == "single":
        if ledger is not None:
            for name, p in net.named_parameters():
                ledger.track("params", p, f"param:{name}")
                p.grad = torch.zeros_like(p)
                ledger.track("grads", p.grad, f"grad:{name}")
        return net
    if strategy == "ddp_naive":
        m = NaiveDDP(net, comm, ledger)
        for name, p in net.named_parameters():
            p.grad = torch.zeros_like(p)
            if ledger is not None:
                ledger.track("grads", p.grad, f"grad:{name}")
        return m
    if strategy == "ddp":
        return DDP(net, comm, ledger, bucket_cap_mb=bucket_cap_mb)
    if strategy == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")


def train(rank: RankContext | None = None, *, strategy: str = "ddp", steps: int = 3,
          model: str = "tiny", micro_batch: int = 4, accum: int = 1, lr: float = 1e-3,
          optimizer: str = "adamw", bucket_cap_mb: float = 25.0, seed: int = 0,
          data_seed: int = 1234, track_activations: bool = True, trace: bool = True,
          return_params: bool = False, model_overrides: dict | None = None) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; each step sees ``accum`` micro-batches of
    ``micro_batch`` sequences per rank. Returns this rank's measurements (see module doc)."""
    if rank is None:                                   # plain single process, no launcher
        rank = RankContext(0, 1, torch.device("cpu"), Tracer(), "none")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if steps < 1 or micro_batch < 1 or accum < 1:
        raise ValueError(f"steps, micro_batch and accum must be >= 1 (got {steps}, {micro_batch}, {accum})")
    tracer = rank.tracer
    tracer.enabled = trace
    N = rank.world_size
    cfg = model_mod.config(model, **(model_overrides or {}))
    instrumented = strategy != "torch_ddp"
    ledger = LiveLedger(tracer) if instrumented else None
    comm = Comm(tracer, ledger=ledger)

    net = model_mod.GPT(cfg, seed=seed).to(rank.device)
    wrapped = wrap(net, strategy, comm, ledger, bucket_cap_mb)
    opt = make_optimizer(optimizer, net.parameters(), lr)
    comm.reset_counters()                              # count training traffic, not the set-up

    out: dict[str, Any] = {"rank": rank.rank, "world_size": N, "strategy": strategy,
                           "losses": [], "step_times": [], "wire": [], "payload": [],
                           "wchar": [], "calls": []}
    for step in range(steps):
        tracer.step = step
        w0, c0 = bytes_written(), dict(comm.totals)
        t0 = time.perf_counter()
        with tracer.phase("step"):
            loss_sum = 0.0
            for k in range(accum):
                x, y = model_mod.batch(cfg, step * accum + k, micro_batch, rank.rank, N, data_seed)
                x, y = x.to(rank.device), y.to(rank.device)
                last = k == accum - 1
                sync = wrapped.no_sync() if (not last and hasattr(wrapped, "no_sync")) else _null()
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
                opt.step()
                if ledger is not None:
                    track_optimizer_state(ledger, opt, net)
                opt.zero_grad(set_to_none=False)       # DDP's grads are views into its buckets
        out["step_times"].append(time.perf_counter() - t0)
        out["losses"].append(loss_sum)
        w1 = bytes_written()
        out["wchar"].append(None if w0 is None else w1 - w0)
        out["wire"].append(comm.totals["wire"] - c0["wire"])
        out["payload"].append(comm.totals["payload"] - c0["payload"])
        out["calls"].append(comm.totals["calls"] - c0["calls"])
    tracer.step = None

    n_params = sum(p.numel() for p in net.parameters())
    out["n_params"] = n_params
    out["by_op"] = comm.by_op
    if ledger is not None:
        act = gpt_activation_bytes(cfg, micro_batch) if track_activations else 0
        est = estimate(n_params=n_params, world_size=N,
                       strategy="ddp" if strategy != "single" else "ddp",
                       precision="fp32",
                       optimizer="adamw" if optimizer == "adamw" else optimizer,
                       activation_bytes=act)
        out["ledger"] = {"peak": ledger.peak, "peak_snapshot": ledger.peak_snapshot,
                         "phase_peaks": ledger.phase_peaks, "final": ledger.current(),
                         "estimate": est.per_rank}
    if return_params:
        out["params"] = {n: p.detach().cpu().clone() for n, p in net.named_parameters()}
    return out


def _phase(ledger, tracer, name):
    return ledger.phase(name) if ledger is not None else tracer.phase(name)
