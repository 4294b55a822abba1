"""DeepSpeed's ZeRO as strategies: stages 0–3 of the library ZeRO comes from, trained by the same
``train_step`` on the same batches as minishard's ZeRO and PyTorch's FSDP2, so the course compares
them on one model and one global batch (chapters 03–05 and 10, ``make bench``).

DeepSpeed drives its own step: ``engine.backward(loss)`` (its reduction hooks and the end of
backward) and ``engine.step()`` (the clip, the optimizer, the all-gather of stages 1–2, the
zeroing), so :class:`DeepSpeedBuilt` answers ``backward`` and ``step`` with them. The engine is
built from ``TrainConfig``'s knobs, each mapped to the DeepSpeed setting of the same idea:

    micro_batch            train_micro_batch_size_per_gpu (one micro-batch a step: accum 1)
    optimizer, lr          the same torch optimizer minishard builds, given to DeepSpeed to wrap
    clip                   gradient_clipping (DeepSpeed clips inside its step)
    bucket_cap_mb          reduce_bucket_size and allgather_bucket_size, in elements of fp32
    prefetch_bucket_size   stage3_prefetch_bucket_size          (None: DeepSpeed's default)
    max_live_parameters    stage3_max_live_parameters and stage3_max_reuse_distance
    param_persistence_threshold   stage3_param_persistence_threshold
    offload="host"         offload_optimizer to the CPU (ZeRO-Offload: the fp32 partition, its
                           gradient and the moments there, the step there), and at stage 3
                           offload_param too; the optimizer stays torch's (not DeepSpeedCPUAdam,
                           a C++ op this install does not build). On a machine without an
                           accelerator the CPU *is* the device: it runs, and nothing moves.

DeepSpeed is imported only when such a strategy is built (``pip install deepspeed``: the engine
never needs it). What DeepSpeed does not do here is refused before a rank starts
(``TrainConfig``): bf16 (this CPU has no bf16 matmuls worth timing), gradient accumulation (its
micro-step counter, not the step, decides when to reduce), minishard's checkpoints (DeepSpeed saves
its own: ``engine.save_checkpoint``; ``minishard.checkpoint.from_deepspeed`` converts them).
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from .registry import Built, optimizer_spec

# DeepSpeed's defaults for the bounds minishard leaves unset (deepspeed/runtime/zero/config.py)
DS_DEFAULTS = {"stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000,
               "stage3_max_reuse_distance": 1_000_000_000, "stage3_param_persistence_threshold": 100_000}


def deepspeed_config(config, stage: int) -> dict:
    """The DeepSpeed config a ``TrainConfig`` means (see the module's table)."""
    elements = int(config.bucket_cap_mb * 2 ** 20) // 4          # fp32 elements in a bucket
    zero = {"stage": stage, "reduce_bucket_size": elements,
            # stage 1/2's all-gather bucket must be a multiple of DeepSpeed's alignment (2 x 8)
            "allgather_bucket_size": max(16, elements // 16 * 16)}
    if stage == 3:
        live = config.max_live_parameters
        zero.update({
            "stage3_prefetch_bucket_size": _or(config.prefetch_bucket_size, "stage3_prefetch_bucket_size"),
            "stage3_max_live_parameters": _or(live, "stage3_max_live_parameters"),
            # reuse distance: how soon a released parameter is needed again for DeepSpeed to
            # keep it; bounded with the live parameters, so that a bound set is a bound kept
            "stage3_max_reuse_distance": _or(live, "stage3_max_reuse_distance"),
            "stage3_param_persistence_threshold": _or(config.param_persistence_threshold,
                                                      "stage3_param_persistence_threshold")})
    if config.offload == "host":
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": config.micro_batch, "gradient_accumulation_steps": 1,
            "zero_force_ds_cpu_optimizer": False,    # (torch's optimizer on the CPU partition)
            "gradient_clipping": config.clip or 0.0, "zero_optimization": zero,
            # SGD is element-wise as Adam is: DeepSpeed's partitions serve it the same way, but
            # DeepSpeed names only its own tested optimizers and refuses the rest without this
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2 ** 31 - 1, "wall_clock_breakdown": False}


def _or(value, name: str) -> int:
    return DS_DEFAULTS[name] if value is None else value


class DeepSpeedBuilt(Built):
    """A DeepSpeed engine, answering the step: its own backward and step; the optimizer the
    instruments hook is the torch optimizer DeepSpeed steps on this rank's partition."""

    def __init__(self, strategy, engine, comm, net: nn.Module):
        import deepspeed
        self.engine, self.net, self._deepspeed = engine, net, deepspeed
        inner = getattr(engine.optimizer, "optimizer", None)
        torch_opt = inner if isinstance(inner, torch.optim.Optimizer) else engine.optimizer
        super().__init__(strategy, engine, torch_opt, (comm,))

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()           # clips, steps, (stages 1-2) all-gathers, zeroes the gradients
        norm = self.engine.get_global_grad_norm()
        self.last_grad_norm = None if norm is None else torch.as_tensor(float(norm))

    def zero_grad(self) -> None:
        """DeepSpeed's step zeroed them already."""

    def clip_grad_norm(self, max_norm: float):
        """DeepSpeed clips inside its step (``gradient_clipping``, set from ``TrainConfig.clip``);
        the norm it clipped by is :attr:`last_grad_norm` once the step ran."""
        return self.last_grad_norm

    def _parameters(self) -> dict[str, torch.Tensor]:
        if self.engine.zero_optimization_stage() < 3:
            return dict(self.net.named_parameters())
        params = dict(self.net.named_parameters())
        # stage 3: every rank holds a partition; gathered (a collective) to be read whole
        with self._deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}


def build_deepspeed(strategy, net, config, comm, ledger, *, stage: int) -> DeepSpeedBuilt:
    """``net`` wrapped by ``deepspeed.initialize`` at ZeRO ``stage``, over the run's process group."""
    import deepspeed
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)    # its INFO lines, every build
    deepspeed.init_distributed(dist_backend=comm.backend, verbose=False)
    opt_class, opt_kwargs = optimizer_spec(config.optimizer, config.lr)
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        optimizer=lambda params: opt_class(params, **opt_kwargs),
        config=deepspeed_config(config, stage))
    return DeepSpeedBuilt(strategy, engine, comm, net)
