"""The analytic memory ledger: per-rank bytes predicted, category by category.

Given a parameter count (or a model), a world size, a strategy, a precision policy and an
optimizer, :func:`estimate` returns what each rank holds in each of the live ledger's categories
(``minishard/core/ledger.py``, which measures them). Mixed-precision AdamW keeps 2 + 2 + 4 + 4 + 4 =
16 bytes per parameter; ZeRO shards some of those categories across the N ranks.
:func:`gpt_activation_bytes` adds what minishard's GPT saves for backward. The planner
(``costmodel.py``) and the chapters' formula columns are this module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from minishard import strategies
from minishard.core.ledger import STATE_CATEGORIES

# --------------------------------------------------------------------------- the rules

# The ZeRO stage is a threshold (llm.c's idea): each kind of state names the stage from which it
# is sharded across ranks. Stages 1..3 are then one code path, and DDP is stage 0.
SHARDED_FROM_STAGE = {
    "master": 1, "exp_avg": 1, "exp_avg_sq": 1, "momentum": 1,   # optimizer state: ZeRO-1
    "grads": 2, "main_grads": 2,                                 # gradients:       ZeRO-2
    "params": 3,                                                 # parameters:      ZeRO-3 / FSDP
}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each precision-dependent category."""
    name: str
    params: int        # working weights used by forward/backward
    grads: int         # gradients produced by backward (and reduced)
    master: int        # fp32 master copy the optimizer updates (0: the params are the master)
    main_grads: int    # an fp32 copy of 16-bit gradients for the optimizer (0: none)
    state: int         # bytes of each optimizer moment element
    about: str


PRECISIONS = {
    "fp32": Precision("fp32", 4, 4, 0, 0, 4,
                      "everything fp32; the weights are their own master copy"),
    "bf16_mixed": Precision("bf16_mixed", 2, 2, 4, 0, 4,
                            "bf16 weights and grads, fp32 master weights and Adam moments"),
    "bf16": Precision("bf16", 2, 2, 0, 0, 2,
                      "bf16 weights, grads and moments, no fp32 master: a model cast to bf16 and "
                      "stepped as it is (torch's optimizers keep their state in the weights' dtype)"),
    "bf16_mixed_fp32_grads": Precision(
        "bf16_mixed_fp32_grads", 2, 4, 4, 0, 4,
        "bf16 weights; gradients accumulated and reduced in fp32 (Megatron's main_grad with bf16)"),
    "bf16_fsdp": Precision(
        "bf16_fsdp", 0, 4, 4, 0, 4,
        "FSDP2's MixedPrecisionPolicy(bf16, reduce fp32): the fp32 shards are the master, bf16 "
        "copies exist only while a unit is gathered, gradients reduced and kept in fp32"),
    "fp16_mixed": Precision(
        "fp16_mixed", 2, 2, 4, 4, 4,
        "fp16 weights and grads (loss scaling); the optimizer keeps fp32 copies of both "
        "(Megatron's main params and main grads)"),
}

OPTIMIZERS = {
    # optimizer name -> (state categories, bytes per element override or None = precision.state)
    "adamw": (("exp_avg", "exp_avg_sq"), None),
    "adamw_8bit": (("exp_avg", "exp_avg_sq"), 1),
    "sgd": ((), None),
    "sgd_momentum": (("momentum",), None),
}


@dataclass(frozen=True)
class Convention:
    """A bytes-per-parameter figure people quote, and the setting that produces it."""
    bytes_per_param: int
    precision: str
    optimizer: str
    breakdown: str
    source: str


# Each row is checked against ``estimate`` (tests/test_ledger.py); the sources are in
# docs/reference-figures.md ("Bytes per parameter").
_CONVENTIONS = [
    ("bf16_mixed", "adamw", "2 + 2 + 4 + 4 + 4: 16-bit weights and grads, fp32 master, m, v",
     "ZeRO paper §3.1 (2Ψ + 2Ψ + KΨ, K = 12)"),
    ("fp32", "adamw", "4 + 4 + 4 + 4: the fp32 weights are their own master",
     "Megatron-Core distributed optimizer: 'fp32 param, fp32 grads' = 16"),
    ("bf16_fsdp", "adamw", "4 + 4 + 4 + 4: fp32 shards are the master; bf16 only while gathered",
     "PyTorch FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)"),
    ("bf16_mixed_fp32_grads", "adamw", "2 + 4 + 4 + 4 + 4: gradients accumulated in fp32",
     "Megatron-Core distributed optimizer: 'float16 param, fp32 grads' = 18"),
    ("fp16_mixed", "adamw", "2 + 2 + 4 + 4 + 4 + 4: 16-bit grads plus fp32 main grads",
     "Megatron-Core distributed optimizer: 'float16 param, float16 grads' = 20"),
    ("bf16_mixed", "adamw_8bit", "2 + 2 + 4 + 1 + 1: 8-bit Adam moments",
     "Dettmers et al., 8-bit Optimizers via Block-wise Quantization"),
    ("fp32", "sgd_momentum", "4 + 4 + 4: weights, grads, momentum", "torch.optim.SGD(momentum > 0)"),
    ("fp32", "sgd", "4 + 4: weights and grads", "torch.optim.SGD(momentum = 0)"),
]


def conventions() -> list[Convention]:
    """The bytes-per-parameter figures people quote, each with the setting behind it."""
    return [Convention(int(estimate(n_params=1, precision=prec, optimizer=opt).bytes_per_param),
                       prec, opt, breakdown, source)
            for prec, opt, breakdown, source in _CONVENTIONS]



@dataclass
class Estimate:
    """Per-rank bytes by category, with how they were derived."""
    n_params: int
    world_size: int
    strategy: str
    precision: str
    optimizer: str
    per_rank: dict[str, int]                       # category -> bytes on each rank
    sharded: dict[str, bool]                       # category -> sharded across ranks?
    full: dict[str, int] = field(default_factory=dict)   # category -> bytes if unsharded
    shard_group: int | None = None                 # ranks a sharded category is split over

    @property
    def state_bytes(self) -> int:
        """Model state on one rank: everything but activations and temporary buffers."""
        return sum(v for k, v in self.per_rank.items() if k in STATE_CATEGORIES)

    @property
    def total(self) -> int:
        return sum(self.per_rank.values())

    @property
    def bytes_per_param(self) -> float:
        """Model-state bytes per parameter on one rank (16.0 for bf16-mixed AdamW under DDP)."""
        return self.state_bytes / self.n_params

    def table(self, unit: float = 2**30, unit_name: str = "GiB") -> str:
        lines = [f"{'category':<14}{'per rank':>14}  sharded"]
        for k, v in self.per_rank.items():
            lines.append(f"{k:<14}{v / unit:>10.3f} {unit_name}  {'yes' if self.sharded.get(k) else 'no'}")
        lines.append(f"{'total':<14}{self.total / unit:>10.3f} {unit_name}")
        return "\n".join(lines)


def count_params(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Parameters of a module, each shared tensor once. Works on the meta device."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        n += p.numel()
    return n


def shard_numel(numel: int, world_size: int) -> int:
    """Elements each rank stores of a flat buffer of ``numel`` split N ways (last rank padded)."""
    return math.ceil(numel / world_size)


def estimate(model: torch.nn.Module | None = None, *, n_params: int | None = None,
             world_size: int = 1, strategy: str = "ddp", precision: str = "bf16_mixed",
             optimizer: str = "adamw", activation_bytes: int = 0, shard_group: int | None = None,
             numel: tuple[int, int] | None = None, frozen: int = 0) -> Estimate:
    """Analytic per-rank memory of the training state.

    Pass a model (any device, meta included) or ``n_params``. ``activation_bytes`` (per rank) can
    come from :func:`gpt_activation_bytes`. Sharded categories hold ``ceil(n/N)`` elements per rank
    (a flat buffer split N ways, padded). A run's knobs: ``shard_group`` (hybrid sharding: split
    over groups of this many ranks, replicated across them); ``numel`` (elements a replicated and
    a sharded category hold, as the strategy's layout pads them: exact for that layout);
    ``frozen`` (elements of frozen weights kept: no gradient, no optimizer state).
    """
    if (model is None) == (n_params is None):
        raise ValueError("pass exactly one of model= or n_params=")
    if model is not None:
        n_params = count_params(model, trainable_only=True)
        if n_params == 0:
            raise ValueError(f"{type(model).__name__} has no trainable parameters to account for")
    if not isinstance(n_params, int) or n_params < 1:
        raise ValueError(f"n_params must be a positive integer, got {n_params!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    stage = strategies.get(strategy).stage      # (a ValueError names the strategies there are)
    group = world_size if shard_group is None else shard_group
    if not isinstance(group, int) or group < 1 or world_size % group:
        raise ValueError(f"shard_group must divide the world size {world_size}, got {shard_group!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZERS)}")

    prec = PRECISIONS[precision]
    state_cats, state_bytes = OPTIMIZERS[optimizer]
    bpp = {"params": prec.params} if prec.params else {}
    bpp["grads"] = prec.grads
    if prec.main_grads:
        bpp["main_grads"] = prec.main_grads
    if prec.master:
        bpp["master"] = prec.master
    for c in state_cats:
        bpp[c] = state_bytes or prec.state

    replica_elems, shard_elems = numel if numel is not None else (n_params, shard_numel(n_params, group))
    per_rank, sharded, full = {}, {}, {}
    for cat, b in bpp.items():
        is_sharded = stage >= SHARDED_FROM_STAGE[cat] and group > 1
        elems = shard_elems if is_sharded else replica_elems
        per_rank[cat], sharded[cat], full[cat] = elems * b, is_sharded, n_params * b
    if frozen:                 # weights only, in the working precision (FSDP's fp32 shards: master)
        per_rank["params" if prec.params else "master"] += frozen * (prec.params or prec.master)
    if activation_bytes:
        per_rank["activations"], sharded["activations"] = int(activation_bytes), False
    return Estimate(n_params, world_size, strategy, precision, optimizer, per_rank, sharded, full, group)


def gpt_activation_bytes(cfg, micro_batch: int, seq_len: int | None = None,
                         dtype_bytes: int = 4, flash_attention: bool = False,
                         recompute: bool = False, loss_chunk_tokens: int | None = None,
                         train_embedding: bool = True) -> int:
    """Bytes autograd saves for backward in one forward of :class:`minishard.core.model.GPT`.

    Derived op by op from what each autograd node keeps; the measured ledger (saved-tensor
    hooks) checks it exactly. B = micro_batch, T = seq_len, C = d_model, H = heads, F = MLP
    hidden, V = vocab, L = layers, x = bytes of the compute dtype. Parameters are not counted
    (they are already in the ledger), and a tensor saved by two ops is counted once.

    ``flash_attention=True`` models a fused attention kernel instead (what real training uses,
    and the planner assumes): it keeps q, k, v, its output and one log-sum-exp per row, never
    the T x T scores.

    ``recompute``: a block keeps only its input (its insides are made again in backward, one
    block at a time, never saved in forward); ``loss_chunk_tokens``: the head runs chunk by chunk,
    recomputed in backward, so no log-softmax is kept; ``train_embedding=False``: no token ids.
    """
    B, T = micro_batch, seq_len or cfg.seq_len
    C, H, F, V, L = cfg.d_model, cfg.n_head, cfg.ffn_hidden, cfg.vocab_size, cfg.n_layer
    x, BT = dtype_bytes, B * T
    if cfg.norm == "layernorm":                    # one fused op: input, mean and rstd
        norm = BT * C * x + 2 * BT * x
    else:                                          # rms_norm is composite on CPU and upcasts:
        norm = 2 * BT * C * 4 + BT * 4             # fp32 input, rstd, normalised input
    per_block = (
        norm                                       # ln1
        + BT * C * x                               # qkv projection: its input (ln1's output)
        + 3 * BT * C * x                           # q, k, v: contiguous copies made by the two
                                                   # batched matmuls (k, v after GQA repeat)
        + (B * H * T * 4 + BT * C * x if flash_attention   # fused: log-sum-exp and output
           else T * T                              # the causal mask (bool) kept by masked_fill
           + B * H * T * T * x)                    # softmax output: kept by softmax and by att @ v
        + BT * C * x                               # out projection: its input
        + norm                                     # ln2
        + BT * C * x                               # MLP up projection(s): their input
        + (3 if cfg.mlp == "swiglu" else 1) * BT * F * x   # gelu input | silu input, silu out, up out
        + BT * F * x                               # down projection: its input
    )
    if recompute:
        per_block = BT * C * x                     # the block's input, kept by its checkpoint
    embed = BT * 8 if train_embedding else 0       # token ids (int64) for the embedding backward
    head = (norm + BT * C * x + BT * 8             # final norm, the head's input, targets (int64)
            + (0 if loss_chunk_tokens else BT * V * x + x))   # log-softmax of the logits; loss weight
    return L * per_block + embed + head
