"""Rank tasks for tests/test_hf_llama.py: a Hugging Face ``transformers`` Llama built from a small
config (nothing downloaded) trained as a user's own job under ``minishard.watch`` — PyTorch's DDP,
FSDP2 (``fully_shard`` on each decoder layer, then the root) and DeepSpeed ZeRO-3.

Every rank builds the same weights (one seed); each rank draws its own token batches (seeded by
step and rank); the loss is the model's own (``labels=``: it shifts them itself). With
``death="sigkill"``, rank ``DYING`` SIGKILLs itself in step ``STEP``'s backward when the gradient
reaches the first decoder layer's output: the last layer's backward has run (its gathers, under
ZeRO-3 and FSDP2), the first layer's has not.
"""
import logging
import os
import signal

import torch

import minishard

DYING = 1
STEP = 1
STEPS = 2
VOCAB, SEQ, BATCH = 96, 16, 2
JOBS = ("zero3", "fsdp2", "ddp")


def llama():
    """A two-layer Llama of 86,336 parameters, the same on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def tokens(step: int, rank: int) -> torch.Tensor:
    """This rank's batch of step ``step``: ``BATCH`` sequences of ``SEQ`` token ids."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(VOCAB, (BATCH, SEQ), generator=g)


def zero3_config() -> dict:
    """DeepSpeed ZeRO-3 on a tiny model: every parameter partitioned (no persistence threshold),
    gathered when its submodule runs and released after (no prefetch; bounds of 0 where
    DeepSpeed's defaults of 1e9 would keep the whole model gathered after its first step)."""
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                                  "stage3_prefetch_bucket_size": 0},
            "steps_per_print": 2 ** 31 - 1, "wall_clock_breakdown": False}


def wrapped(job: str, net):
    """``net`` wrapped for ``job``: (the model to call and watch, the optimizer)."""
    if job == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(net)
    elif job == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in net.model.layers:          # a unit per decoder layer, then the root
            fully_shard(layer)
        model = fully_shard(net)
    else:
        import deepspeed
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=net, model_parameters=net.parameters(), config=zero3_config(),
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        return engine, optimizer
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(rank, job: str, out: str, death: str | None = None) -> list[float]:
    """``STEPS`` steps of ``job`` watched into the trace directory ``out``; this rank's losses."""
    net = llama()
    model, optimizer = wrapped(job, net)
    if death == "sigkill" and rank.rank == DYING:
        def on_output(module, args, output):
            if w.tracer.step == STEP:
                hidden = output[0] if isinstance(output, tuple) else output
                hidden.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
        net.model.layers[0].register_forward_hook(on_output)
    losses = []
    with minishard.watch(model, optimizer, trace=out) as w:
        for step in range(STEPS):
            x = tokens(step, rank.rank)
            loss = model(input_ids=x, labels=x).loss
            if job == "zero3":                  # DeepSpeed's engine: its backward, its step
                model.backward(loss)
                model.step()
            else:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            w.step()
            losses.append(loss.item())
    return losses


def healthy(rank, outs: dict) -> dict:
    """Every job in ``JOBS``, one after the other on the same ranks: {job: losses}."""
    return {job: train(rank, job, outs[job]) for job in JOBS}
