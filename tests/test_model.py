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
