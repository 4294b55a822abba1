"""Rank tasks of the DeepSpeed-checkpoint tests (importable by the rank processes): DeepSpeed's
own engine trains the nano GPT, saves with ``engine.save_checkpoint``, and — DeepSpeed's own
resume — a fresh engine built from other weights loads it with ``engine.load_checkpoint`` and
trains on. One launch per ZeRO stage serves every assertion of tests/test_from_deepspeed.py."""
import logging

import torch

from minishard.core.model import GPT, batch, config
from minishard.strategies.deepspeed_native import deepspeed_config
from minishard.training.config import TrainConfig

MODEL = "nano"


def _engine(stage: int, micro_batch: int, seed: int):
    """A DeepSpeed engine over a nano GPT built from ``seed``, at ZeRO ``stage``. Stage 3 with
    every bound at its smallest, so that the tiny model's parameters are really partitioned and
    gathered (DeepSpeed's defaults — 1e9 live parameters, 1e5 persistent — keep them whole)."""
    import deepspeed
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    bounds = dict(param_persistence_threshold=0, max_live_parameters=0, prefetch_bucket_size=0) if stage == 3 else {}
    cfg = TrainConfig(f"deepspeed_zero{stage}", model=MODEL, micro_batch=micro_batch, **bounds)
    net = GPT(config(MODEL), seed=seed)
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters()],
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
        config=deepspeed_config(cfg, stage))
    return engine, net


def _train(engine, net, rank, first: int, steps: int, micro_batch: int) -> list[float]:
    """Steps ``first .. first + steps - 1`` on this rank's part of each global batch; the losses
    averaged over the ranks (what minishard's ``train`` reports per rank is its own: the mean of
    ranks' means is the global batch's mean)."""
    losses = []
    for step in range(first, first + steps):
        x, y = batch(net.cfg, step, micro_batch, rank.rank, rank.world_size)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / rank.world_size)
    return losses


def _params(engine, net) -> dict[str, torch.Tensor]:
    """The whole parameters (stage 3: gathered, a collective)."""
    if engine.zero_optimization_stage() < 3:
        return {n: p.detach().clone() for n, p in net.named_parameters()}
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        return {n: p.detach().clone() for n, p in net.named_parameters()}


def _state(net) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's own account of each parameter's fp32 master and AdamW moments, whole
    (``deepspeed.utils.safe_get_full_*``: gathered from the partitions, a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    return {n: {"param": safe_get_full_fp32_param(p).clone(),
                **{k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}}
            for n, p in net.named_parameters()}


def save_and_resume(rank, stage: int, ds_dir: str, steps: int, resume_steps: int, micro_batch: int) -> dict:
    """Train ``steps`` steps at ZeRO ``stage`` from seed 0 and save (``ds_dir/global_step{steps}``);
    then, unless ``resume_steps`` is 0, DeepSpeed's own resume: a fresh engine built from *other*
    weights (seed 7, so that a load that restored nothing shows) loads the checkpoint and trains
    ``resume_steps`` more. Returns the losses, what was saved (DeepSpeed's own account of each
    master and moment) and the resumed run's losses and whole parameters."""
    engine, net = _engine(stage, micro_batch, seed=0)
    losses = _train(engine, net, rank, 0, steps, micro_batch)
    saved = _state(net)
    engine.save_checkpoint(ds_dir)
    engine.destroy()
    if not resume_steps:
        return {"rank": rank.rank, "losses": losses, "saved": saved}
    again, net2 = _engine(stage, micro_batch, seed=7)
    again.load_checkpoint(ds_dir)
    resumed = _train(again, net2, rank, again.global_steps, resume_steps, micro_batch)
    out = {"rank": rank.rank, "losses": losses, "saved": saved, "resumed_losses": resumed,
           "resumed": _params(again, net2)}
    again.destroy()
    return out
