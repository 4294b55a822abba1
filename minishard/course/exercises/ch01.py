"""Chapter 01 exercise: write the memory ledger of one DDP rank.

Mixed-precision AdamW keeps, for every parameter, bf16 weights and gradients, an fp32 master
copy and two fp32 Adam moments; plain fp32 AdamW needs no separate master copy (the weights are
their own). Write the per-rank state by ledger category. The check compares it with minishard's
analytic ledger (``estimate``) for models from 1 to 405 B parameters, then with the *measured*
ledger of 2 real ranks training the nano model.
"""
from __future__ import annotations

from . import attempt, call, expect, pools

STATE = ("params", "grads", "master", "exp_avg", "exp_avg_sq")


def ddp_state_bytes(n_params: int, precision: str) -> dict[str, int]:
    """Bytes of model state one DDP rank holds, by category (``params``, ``grads``, ``master``,
    ``exp_avg``, ``exp_avg_sq``; leave out a category the setting does not have), for AdamW with
    ``precision`` "fp32" or "bf16_mixed"."""
    raise NotImplementedError("ddp_state_bytes: your code here")


def _nonzero(d: dict) -> dict:
    return {k: int(v) for k, v in d.items() if v}


@attempt
def check_ddp_state_bytes(fn=None, ranks=None) -> None:
    from minishard import GPT, estimate
    from minishard.training.loop import TrainConfig, train

    fn = fn or ddp_state_bytes
    sizes = {"nano": GPT("nano", device="meta").num_params(), "1B": 10**9,
             "llama3-8b": GPT("llama3-8b", device="meta").num_params(), "405B": 405 * 10**9}
    for precision in ("fp32", "bf16_mixed"):
        per_rank = {}
        for name, n in sizes.items():
            want = per_rank[name] = _nonzero(estimate(n_params=n, world_size=1, strategy="ddp", precision=precision,
                                     optimizer="adamw").per_rank)
            got = _nonzero(call(fn, n, precision))
            expect(got == want, f"{name} ({n:,} parameters), {precision}: you say {got}, the "
                   f"ledger says {want}")
        print(f"{precision}: agrees with estimate() for {', '.join(sizes)}; "
              f"llama3-8b: {sum(per_rank['llama3-8b'].values()) / 1e9:.1f} GB per DDP rank")
    with pools(ranks) as get:
        out = get(2).run(train, TrainConfig(strategy="ddp", steps=2, model="nano", micro_batch=1, precision="bf16_mixed", track_activations=False))
    got = _nonzero(call(fn, out[0]["n_params"], "bf16_mixed"))
    for o in out:
        measured = {c: o["ledger"]["peak_snapshot"].get(c, 0) for c in STATE}
        print(f"measured on rank {o['rank']}: {_nonzero(measured)}")
        expect(_nonzero(measured) == got, f"rank {o['rank']} measured {_nonzero(measured)}, you "
               f"predicted {got}")
