"""Real model configs: a Hugging Face-style ``config.json`` read from disk, as a ``GPTConfig``.

    minishard ledger --config configs/llama3-8b.json --world-size 8 --strategy zero3
    minishard plan   --config configs/qwen2-7b.json --gpus-per-node 8

Nothing is downloaded: the file is read locally and the model is built on the meta device, so
its parameter count is exact (shared tensors counted once). The families read are those whose
blocks minishard's GPT reproduces exactly — Llama, Mistral and Qwen2 (RMSNorm, SwiGLU, grouped
queries, rotary positions: no position table) and GPT-2 (LayerNorm, GELU, learned positions,
tied embeddings). Anything else is refused with the fields that were missing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .model import GPTConfig

LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED = LLAMA_LIKE + ("gpt2",)
_LLAMA_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "vocab_size")
_GPT2_FIELDS = ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions")


def read_hf_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no model config at {path} (a Hugging Face config.json)")
    if path.exists() and not path.is_file():
        raise ValueError(f"{path} is not a file (a Hugging Face config.json)")
    try:
        hf = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file (a Hugging Face config.json)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg.removesuffix(' at')} at line {e.lineno} "
                         f"column {e.colno}); a Hugging Face config.json is one JSON object") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path} holds a JSON {type(hf).__name__}, not a model config: a Hugging "
                         f"Face config.json is one JSON object (model_type, hidden_size, ...)")
    return hf


def _check_sizes(hf: dict, kind: str, required: tuple[str, ...]) -> None:
    """Refuse, by the config's own field names, a size that builds no model (or another model
    than the file describes): each an integer >= 1, the heads dividing the width."""
    optional = ("n_inner",) if kind == "gpt2" else ("num_key_value_heads", "max_position_embeddings",
                                                      "head_dim")
    for name in required + optional:
        value = hf.get(name)
        if name in optional and value is None:          # (absent, or null: the usual default)
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {value!r} must be an integer >= 1")
    width, heads = ("n_embd", "n_head") if kind == "gpt2" else ("hidden_size", "num_attention_heads")
    if hf[width] % hf[heads]:
        raise ValueError(f"{width}: {hf[width]} is not divisible by {heads} ({hf[heads]}): each "
                         f"attention head is {width} / {heads} wide")
    kv = hf.get("num_key_value_heads")
    if kind != "gpt2" and kv is not None and hf[heads] % kv:
        raise ValueError(f"num_key_value_heads: {kv} does not divide {heads} ({hf[heads]}): each "
                         f"key/value head serves {heads} / num_key_value_heads query heads")
    # (Mistral-Nemo, Qwen3: heads wider or narrower than the width split evenly; minishard's
    # attention splits the width, so its parameter count would be another model's)
    if kind != "gpt2" and hf.get("head_dim") is not None and hf["head_dim"] != hf[width] // hf[heads]:
        raise ValueError(f"head_dim: {hf['head_dim']} is not {width} / {heads} "
                         f"({hf[width] // hf[heads]}); minishard builds heads of that width only")
    if hf.get("tie_word_embeddings") is not None and not isinstance(hf["tie_word_embeddings"], bool):
        raise ValueError(f"tie_word_embeddings: {hf['tie_word_embeddings']!r} must be true or false")


def config_from_hf(path_or_dict: str | os.PathLike | dict, seq_len: int | None = None) -> GPTConfig:
    """The ``GPTConfig`` of a Llama / Mistral / Qwen2 / GPT-2 ``config.json``."""
    hf = path_or_dict if isinstance(path_or_dict, dict) else read_hf_config(path_or_dict)
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"model_type {kind!r} is not one minishard builds exactly; supported: "
                         f"{', '.join(SUPPORTED)} (fields read: {', '.join(_LLAMA_FIELDS)}, "
                         f"num_key_value_heads, tie_word_embeddings; GPT-2: {', '.join(_GPT2_FIELDS)})")
    required = _LLAMA_FIELDS if kind in LLAMA_LIKE else _GPT2_FIELDS
    missing = [f for f in required if f not in hf]
    if missing:
        raise ValueError(f"this {kind} config lacks {', '.join(missing)}, which every {kind} "
                         f"config.json has: is it the model's whole config.json?")
    _check_sizes(hf, kind, required)
    if kind == "gpt2":
        return GPTConfig(vocab_size=hf["vocab_size"], seq_len=seq_len or hf["n_positions"],
                         d_model=hf["n_embd"], n_layer=hf["n_layer"], n_head=hf["n_head"],
                         ffn_hidden=hf.get("n_inner") or 4 * hf["n_embd"], mlp="gelu",
                         norm="layernorm", bias=True, learned_pos=True, tie_embeddings=True)
    if hf.get("mlp_bias") or hf.get("attention_bias"):
        raise ValueError(f"this {kind} config has attention_bias/mlp_bias set; minishard builds "
                         f"the bias-free Llama blocks only")
    return GPTConfig(vocab_size=hf["vocab_size"],
                     seq_len=seq_len or hf.get("max_position_embeddings") or 4096,
                     d_model=hf["hidden_size"], n_layer=hf["num_hidden_layers"],
                     n_head=hf["num_attention_heads"],
                     n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                     ffn_hidden=hf["intermediate_size"], mlp="swiglu", norm="rmsnorm", bias=False,
                     learned_pos=False, qkv_bias=kind == "qwen2",
                     tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
