"""The tiny GPT: deterministic, real-size configs on meta, and a chunked loss that never holds
the full logits."""
import torch

from minishard.core.model import GPT, batch, config
from minishard.training.parity import drift, params_of
from minishard.training.loop import TrainConfig, train


def test_same_seed_same_weights_and_batches_partition_the_global_batch():
    a, b = GPT("nano", seed=3), GPT("nano", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    cfg = config("nano")
    whole = batch(cfg, 5, 6)[0]
    parts = torch.cat([batch(cfg, 5, 2, r, 3)[0] for r in range(3)])
    assert torch.equal(whole, parts)


def test_llama3_8b_on_meta():
    assert GPT("llama3-8b", device="meta").num_params() == 8_030_261_248


def test_chunked_cross_entropy_trains_the_same_and_drops_the_logits():
    kw = dict(strategy="single", model="tiny", steps=2, micro_batch=4, return_params=True)
    full, chunked = train(None, TrainConfig(**kw)), train(None, TrainConfig(loss_chunk_tokens=128, **kw))
    cfg = config("tiny")
    # The chunked loss adds the same per-token terms grouped otherwise (chunks of 128 tokens,
    # then the chunks), so the two agree to the rounding of that sum, not bit for bit: another
    # order of n non-negative float32 terms moves their sum by at most (n - 1)·eps of itself.
    # (Bit-equal on one CPU, 1e-7 apart on another: the first loss's 7th digit.)
    n = 4 * cfg.seq_len
    tol = (n - 1) * torch.finfo(torch.float32).eps
    assert all(abs(a - b) <= tol * a for a, b in zip(full["losses"], chunked["losses"])), \
        (full["losses"], chunked["losses"])
    assert drift(chunked["params"], full["params"], params_of(GPT("tiny"))).overall <= 1e-3
    logits = 4 * cfg.seq_len * cfg.vocab_size * 4               # (B*T, V) fp32 log-softmax
    saved = full["ledger"]["category_peaks"]["activations"] - chunked["ledger"]["category_peaks"]["activations"]
    assert abs(saved - logits) <= 0.01 * logits


def test_grouped_query_attention_matches_llama_head_sharing():
    """Llama / Hugging Face share key/value head ``h // (n_head // n_kv_head)`` with query head
    ``h`` (``repeat_kv``: consecutive query heads share one k/v head). A GQA model whose heads
    were paired otherwise would compute another function from the same weights — a Llama
    checkpoint loaded into it would give wrong outputs. Checked against an explicit per-head
    loop and PyTorch's own ``scaled_dot_product_attention(enable_gqa=True)``."""
    import math
    import torch.nn.functional as F
    from minishard.core.model import Attention, GPTConfig
    cfg = GPTConfig(d_model=64, n_head=8, n_kv_head=2, bias=False)
    attn = Attention(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():                 # unit-scale weights: head mix-ups change the output by O(1)
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    B, T, H, Hkv, hd = 2, 16, 8, 2, 8
    x = torch.randn(B, T, cfg.d_model, generator=g)
    with torch.no_grad():
        got = attn(x)
        q, k, v = attn.qkv(x).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q = q.view(B, T, H, hd).transpose(1, 2)
        k, v = (t.view(B, T, Hkv, hd).transpose(1, 2) for t in (k, v))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        heads = []
        for h in range(H):
            kv = h // (H // Hkv)
            s = (q[:, h] @ k[:, kv].transpose(-2, -1)) / math.sqrt(hd)
            heads.append(s.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, kv])
        loop = attn.proj(torch.stack(heads, 1).transpose(1, 2).reshape(B, T, -1))
        sdpa = attn.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                         .transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(got, loop)        # float32 tolerances: summation order only
    torch.testing.assert_close(got, sdpa)


def test_a_llama_config_without_tie_word_embeddings_has_its_own_head():
    """Hugging Face's LlamaConfig defaults ``tie_word_embeddings`` to false: a config.json that
    leaves it out describes a model with a separate output head. Read as tied, Llama-3-8B would
    lose its 525M-parameter head and the ledger would plan 7.5B parameters, not Meta's 8.03B."""
    import json
    from pathlib import Path
    from minishard.core.hf_config import config_from_hf
    hf = json.loads((Path(__file__).parents[1] / "configs" / "llama3-8b.json").read_text())
    hf.pop("tie_word_embeddings")
    net = GPT(config_from_hf(hf), device="meta")
    assert net.head.weight is not net.tok_emb.weight
    assert net.num_params() == 8_030_261_248
