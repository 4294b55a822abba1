"""What a watch notes for the doctor beside the collectives, as ``train()`` does for minishard's
own runs (``minishard/instruments/health.py``): the fingerprint of the weights a rank starts from where it holds
them whole (DDP's replicas; FSDP2's DTensors are shards, different by design — for FSDP2, the
fingerprint the user took with ``minishard.fingerprint(model)`` before ``fully_shard`` and gave
as ``watch(built=)``), and per optimizer step the dtypes it stepped — with, where they are not
fp32, how many elements came out unchanged. Every ``fingerprint_every``-th step and at the end,
the replicas' fingerprints and the optimizer's settings and step count
(``minishard/instruments/replicas.py``): what tells replicas that drifted apart after the start.

Only a watch that keeps its own flight recorder notes them: under ``train()`` the run's recorder
already has them."""
from __future__ import annotations

import torch

from minishard.instruments import health, replicas
from . import deepspeed


def attach(w) -> None:
    facts = w.flight.facts
    facts["run"] = {"watched": w.kind, "world_size": w.tracer.world_size}
    whole = [(n, p) for n, p in w.model.named_parameters() if not _is_dtensor(p)]
    # replicas: DDP's, and DeepSpeed's below stage 3 (stage 3 holds partitions, as FSDP2 shards)
    if (w.kind == "ddp" or w.kind == "deepspeed" and deepspeed.stage(w.model) < 3) and whole:
        facts["weights_start"] = health.fingerprint((n.removeprefix("module."), p) for n, p in whole)
        # the ranks that must start from the same weights: DDP's group (not the world, when the
        # job holds other weights on each group: tensor or pipeline parallelism beside DDP)
        facts["weights_start_ranks"] = list(replicas.data_parallel_ranks(w.model))
    if w.built is not None:              # taken before fully_shard: what each rank built
        facts["weights_built"] = dict(w.built)
    opt = w._stepped
    w.replicas = replicas.ReplicaNotes(w.model, opt, w.flight, w.fingerprint_every)
    w._undo.append(w.replicas.close)
    if opt is None:
        return
    w._undo += health.note_steps(opt, facts, lambda: w.tracer.step, on=opt)


def _is_dtensor(p: torch.Tensor) -> bool:
    return type(p).__name__ == "DTensor" or hasattr(p, "to_local")
