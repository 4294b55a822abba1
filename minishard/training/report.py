"""What a run returns, after its last step: the measurements, the ledger against its formula.

:func:`minishard.training.loop.train` calls :func:`outputs` once the steps are done; each number
here is measured (the meter, the live ledger) or asked of the strategy (``Built.layout_numel``,
``Built.transfer_bytes``), and set beside the analytic formula for the same run.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from minishard.core import model as model_mod
from minishard.core.comm import Comm
from minishard.core.launch import RankContext
from minishard.core.ledger import STATE_CATEGORIES, LiveLedger
from minishard.planner.analytic import estimate, gpt_activation_bytes
from minishard.strategies.registry import Built
from .config import TrainConfig
from .meter import Meter


def outputs(rank: RankContext, config: TrainConfig, cfg, meter: Meter, built: Built, first_step: int,
             w, ledger: LiveLedger | None, comm: Comm, ckpt: dict) -> dict[str, Any]:
    """After the last step: the measurements, the ledger against its formula, the checkpoints
    loaded and saved, the parameters and state asked for."""
    strategy = built.strategy
    out = measurements(rank, config, cfg, meter, built, first_step, w)
    if ledger is not None:
        out["ledger"] = ledger_report(ledger, config, cfg, strategy, rank.world_size, built)
    if ckpt:
        out["checkpoint"] = ckpt
    if config.return_params:
        out["params"] = built.full_parameters()
    if config.return_state:
        out["optimizer_state"] = built.optimizer.state_dict()
    if ledger is not None:
        out["ledger"]["by_device"] = ledger.by_device()
    for unit in built.units:            # the disk tier's files go with the run
        unit.release_tier()
    return out


def measurements(rank: RankContext, config: TrainConfig, cfg, meter: Meter, built: Built,
                  first_step: int, watched=None) -> dict[str, Any]:
    """What every run returns: the meter's per-step lists, and what they are (PyTorch's own
    strategies: what the watch measured, too)."""
    out: dict[str, Any] = {"rank": rank.rank, "world_size": rank.world_size,
                           "strategy": built.strategy.name, **meter.steps, "by_op": meter.by_op(),
                           "n_params": model_mod.GPT(cfg, device="meta").num_params(),
                           "first_step": first_step,
                           "loss_resolution": [loss_resolution(x, config) for x in meter.steps["losses"]],
                           "exposed_comm_measured": bool(built.units)}   # (only FSDP's units time it)
    if hasattr(built.optimizer, "layout"):
        out["layout"] = built.optimizer.layout()
    if watched is not None:
        steps = range(first_step, first_step + config.steps)
        out["watched"] = {"peak": watched.peak, "peak_snapshot": watched.peak_snapshot,
                          "wire": [watched.wire.get(s, 0) for s in steps]}
    return out


def ledger_report(ledger: LiveLedger, config: TrainConfig, cfg, strategy, world_size: int,
                   built: Built) -> dict:
    """The measured ledger, next to the analytic estimate for the same run: every knob it used
    (hybrid shard groups, recomputation, a chunked loss, offload) and the strategy's layout."""
    trainable = model_mod.GPT(cfg, device="meta")
    for name, p in trainable.named_parameters():
        if config.freeze and name.startswith(config.freeze):
            p.requires_grad_(False)
    precision = trained_precision(built, config)
    act = 0
    if config.track_activations:
        act = gpt_activation_bytes(cfg, config.micro_batch,
                                   dtype_bytes=2 if precision != "fp32" else 4,
                                   recompute=config.recompute, loss_chunk_tokens=config.loss_chunk_tokens,
                                   train_embedding=trainable.tok_emb.weight.requires_grad)
    est = estimate(trainable, world_size=world_size, strategy=strategy.name,
                   precision=strategy.ledger_precision(precision), optimizer=config.optimizer,
                   activation_bytes=act, shard_group=config.shard_size if strategy.hybrid else None,
                   **built.layout_numel())
    formula: dict[str, dict[str, int]] = {}   # offload: FSDP's sharded state moves to the tier together
    for c, nbytes in est.per_rank.items():
        formula.setdefault(config.offload if config.offload and c in STATE_CATEGORIES else "device", {})[c] = nbytes
    out = {"peak": ledger.peak, "peak_snapshot": ledger.peak_snapshot,
           "category_peaks": {c: b for (c, d), b in ledger.category_peaks.items() if d == ledger.device},
           "phase_peaks": ledger.phase_peaks, "final": ledger.current(), "estimate": est.per_rank,
           "formula": formula, "shard_group": est.shard_group, "precision": precision}
    if config.offload is not None:
        out["transfer_formula"] = transfer_formula(built, config)
    if config.track_activations and (config.recompute or config.loss_chunk_tokens):
        out["unseen"] = recomputed_bytes(cfg, config)
    return out


def trained_precision(built: Built, config: TrainConfig) -> str:
    """The precision the run trained in: the config's, unless the weights the optimizer steps
    are bf16 under an fp32 config — a model cast to bf16 with no master (chapter 11's
    ``no-master``), which the formula then counts as it is."""
    dtypes = {p.dtype for p in built.model.parameters() if p.requires_grad}
    return "bf16" if config.precision == "fp32" and dtypes == {torch.bfloat16} else config.precision


def recomputed_bytes(cfg, config: TrainConfig) -> dict[str, int]:
    """What backward recomputes lives outside the ledger's saved-tensor hooks: its size, by the
    same formula (a real device holds it on top of the measured peak)."""
    from dataclasses import replace
    x = 2 if config.precision == "bf16_mixed" else 4
    out = {}
    if config.recompute:
        one = [gpt_activation_bytes(replace(cfg, n_layer=n), config.micro_batch, dtype_bytes=x) for n in (0, 1)]
        out["one block's activations, while backward recomputes them"] = one[1] - one[0]
    if config.loss_chunk_tokens:
        tokens = min(config.loss_chunk_tokens, config.micro_batch * cfg.seq_len)
        out["one loss chunk's log-probabilities, while backward recomputes them"] = tokens * cfg.vocab_size * x
    return out


def transfer_formula(built: Built, config: TrainConfig) -> dict[str, int]:
    """Offload's bytes per step by formula: what each unit says one micro-batch moves
    (``FSDPUnit.transfer_bytes``), once per micro-batch."""
    h2d, d2h = built.transfer_bytes()
    return {"h2d_bytes": h2d * config.accum, "d2h_bytes": d2h * config.accum}


def loss_resolution(loss: float, config: TrainConfig) -> float:
    """The spacing of the numbers the loss is computed in, near this loss: a change smaller than
    this does not show (bf16 keeps 8 significant bits: steps of 1/16 near 8)."""
    eps = torch.finfo(torch.bfloat16 if config.precision == "bf16_mixed" else torch.float32).eps
    per_micro = abs(loss) / config.accum                   # each micro-batch's loss / accum is rounded
    if not (0 < per_micro < math.inf):                     # (a diverged loss has no spacing to state)
        return 0.0
    return eps * 2.0 ** math.floor(math.log2(per_micro))
