"""A tiny GPT, small enough to train on a laptop's CPU ranks, shaped like the real thing.

Token embedding + learned positions -> L pre-norm blocks (attention, MLP) -> final norm -> a
head (untied by default). The same class builds real sizes (``CONFIGS["llama3-8b"]``) on the meta device,
so the ledger can count an 8B model without allocating it.

Determinism is part of the contract: ``GPT(cfg, seed)`` gives identical weights in every
process, and :func:`batch` gives each rank its own micro-batch of one global batch, so a strategy on
N ranks can be compared with one process training on the whole batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 4096
    seq_len: int = 128
    d_model: int = 256
    n_layer: int = 6
    n_head: int = 4
    n_kv_head: int | None = None     # grouped-query attention; None = n_head
    ffn_hidden: int | None = None    # None = 4 * d_model
    mlp: str = "gelu"                # "gelu" (GPT-2) or "swiglu" (Llama)
    norm: str = "layernorm"          # "layernorm" or "rmsnorm"
    bias: bool = True
    learned_pos: bool = True         # Llama uses rotary positions; we keep a table or nothing
    qkv_bias: bool | None = None     # the q, k, v projection's bias (Qwen2: yes); None = bias
    tie_embeddings: bool = False     # the head shares the token embedding's weight (GPT-2)

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head", "n_kv_head", "ffn_hidden"):
            value = getattr(self, name)
            if value is None and name in ("n_kv_head", "ffn_hidden"):      # (derived below)
                continue
            # n_layer 0 is a model of embeddings and head only: the cost model and the ledger's
            # formula take one block's activations as the difference from it
            least = 0 if name == "n_layer" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: {value!r} must be an integer >= {least}")
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.d_model)
        if self.d_model % self.n_head:
            raise ValueError(f"d_model: {self.d_model} is not divisible by n_head ({self.n_head}): "
                             f"each head is d_model / n_head wide")
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head: {self.n_kv_head} does not divide n_head ({self.n_head}): "
                             f"each key/value head serves n_head / n_kv_head query heads")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"unknown mlp {self.mlp!r}; expected 'gelu' or 'swiglu'")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"unknown norm {self.norm!r}; expected 'layernorm' or 'rmsnorm'")


# Llama's blocks: SwiGLU MLP, RMSNorm, no biases, no learned positions
LLAMA_BLOCKS = dict(mlp="swiglu", norm="rmsnorm", bias=False, learned_pos=False)

CONFIGS = {
    # the course's reference model: 6,868,992 parameters (docs/reference-figures.md)
    "tiny": GPTConfig(),
    "nano": GPTConfig(vocab_size=512, seq_len=32, d_model=64, n_layer=3, n_head=4),
    "gpt2-small": GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layer=12, n_head=12),
    # Llama-3-like shapes (rotary positions are not modelled: they carry no parameters)
    "llama3-8b": GPTConfig(vocab_size=128256, seq_len=8192, d_model=4096, n_layer=32, n_head=32,
                           n_kv_head=8, ffn_hidden=14336, **LLAMA_BLOCKS),
    # TinyLlama-1.1B's shapes: the >= 1B model of the GPU check (scripts/gpu_check.py)
    "tinyllama-1.1b": GPTConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_layer=22,
                                n_head=32, n_kv_head=4, ffn_hidden=5632, **LLAMA_BLOCKS),
    "llama3-70b": GPTConfig(vocab_size=128256, seq_len=8192, d_model=8192, n_layer=80, n_head=64,
                            n_kv_head=8, ffn_hidden=28672, **LLAMA_BLOCKS),
    "llama3-405b": GPTConfig(vocab_size=128256, seq_len=8192, d_model=16384, n_layer=126,
                             n_head=128, n_kv_head=8, ffn_hidden=53248, **LLAMA_BLOCKS),
}


def config(name: str, **overrides) -> GPTConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; expected one of {sorted(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.d_model, bias=cfg.bias) if cfg.norm == "layernorm" else RMSNorm(cfg.d_model)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head or cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        kv = self.n_kv_head * self.head_dim
        self.qkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * kv,
                             bias=cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        B, T, C = x.shape
        hd, kv = self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([C, kv, kv], dim=-1)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)          # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_head, hd).transpose(1, 2)       # (B, Hkv, T, hd)
        v = v.view(B, T, self.n_kv_head, hd).transpose(1, 2)
        if self.n_kv_head != self.n_head:                          # share each k/v head
            rep = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # explicit attention (not a fused kernel) so what is saved for backward is visible
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))    # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)             # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=cfg.bias)
        if self.swiglu:
            self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.fc(x) if self.swiglu else F.gelu(self.fc(x))
        return self.proj(h)


class Block(nn.Module):
    """One transformer block: the natural FSDP unit."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = _norm(cfg), Attention(cfg)
        self.ln2, self.mlp = _norm(cfg), MLP(cfg)

    def forward(self, x):                                          # (B, T, C) -> (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | str = "tiny", seed: int = 0, device=None):
        super().__init__()
        cfg = config(cfg) if isinstance(cfg, str) else cfg
        self.cfg = cfg
        self.recompute_activations = False          # activation checkpointing, per block
        self.loss_chunk_tokens: int | None = None   # chunked cross-entropy (see chunked_loss)
        with torch.device(device or "cpu"):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.learned_pos else None
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = _norm(cfg)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:                      # one tensor, counted (and sharded) once
            self.head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 style init from one seeded generator: identical weights in every process."""
        if next(self.parameters()).device.type == "meta":
            return
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:                                      # norm weights
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, idx, targets=None):
        B, T = idx.shape                                            # (B, T) token ids
        x = self.tok_emb(idx)                                       # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb.weight[:T]
        for block in self.blocks:
            if self.recompute_activations and torch.is_grad_enabled():
                # keep only the block's input; recompute its insides during backward
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        h = self.ln_f(x)                                            # (B, T, C)
        if targets is None:
            return self.head(h)                                     # (B, T, V)
        if self.loss_chunk_tokens:
            return self.chunked_loss(h, targets)
        logits = self.head(h)                                       # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def chunked_loss(self, h, targets):
        """Cross-entropy without ever holding the (B*T, V) logits: the head and the loss run
        on ``loss_chunk_tokens`` tokens at a time, each chunk recomputed in backward, so only one
        chunk's logits exist at once. The fix for a big-vocabulary head's memory spike."""
        h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)     # (B*T, C), (B*T,)
        n = self.loss_chunk_tokens
        total = h.new_zeros(())
        for i in range(0, h.size(0), n):
            total = total + checkpoint(self._chunk_loss_sum, h[i:i + n], targets[i:i + n],
                                       use_reentrant=False)
        return total / h.size(0)

    def _chunk_loss_sum(self, h, targets):
        return F.cross_entropy(self.head(h), targets, reduction="sum")


def batch(cfg: GPTConfig, step: int, micro_batch: int, rank: int = 0, world_size: int = 1,
          seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of the global batch for ``step``: (inputs, targets), each (B, T).

    The global batch (micro_batch * world_size sequences) depends only on (seed, step), so a
    single process training on all of it sees exactly what the N ranks see together.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = micro_batch * world_size
    # learnable synthetic text: each sequence counts up from a random start with a random stride
    # (mod V), so the loss visibly falls as the model learns the rule
    start = torch.randint(0, cfg.vocab_size, (rows, 1), generator=g)
    stride = torch.randint(1, 8, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    mine = tokens[rank * micro_batch:(rank + 1) * micro_batch]
    # clone: a slice of the global batch would share (and keep alive) its whole storage
    return mine[:, :-1].clone(), mine[:, 1:].clone()
