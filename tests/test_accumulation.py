"""Gradient accumulation three ways (``TrainConfig.accumulation``), for FSDP and ZeRO-2: the same
training as one large batch, and the trade every mode makes measured on real ranks — bytes per
optimizer step to the byte, and the ledger's peak of the category each mode grows — against
its formula.

    sync       reduce-scatter every micro-batch (FSDP2's, torchtitan's and DeepSpeed's default)
    no_sync    hold every full gradient until the last micro-batch, reduce once
    gathered   (FSDP) keep every unit gathered from one micro-batch's backward to the next
               one's forward (FSDP2's ``set_reshard_after_backward(False)``)

For A micro-batches on N ranks, with P_u and G_u the gathered and reduced bytes of unit u (the
root is never resharded after forward) and each ring collective sending (N − 1)/N of them:

    sync       A·(Σ P + Σ_blocks P + Σ G)        no_sync   A·(Σ P + Σ_blocks P) + Σ G
    gathered   Σ P + A·Σ_blocks P + A·Σ G        ZeRO-2: sync A·G + P, no_sync G + P
"""
import pytest
import torch

from minishard.training.config import ConfigError, TrainConfig
from minishard.core.launch import RankContext
from minishard.core.model import GPT, config as model_config
from minishard.core.trace import LedgerTimeline
from minishard.training.loop import _batches, train

from parity import assert_parity, reference

A, MB = 3, 2
KW = dict(model="nano", steps=2, accum=A, optimizer="sgd_momentum", lr=0.05)
PSI = GPT("nano", device="meta").num_params()


def run(pool, strategy, mode):
    out = pool.run(train, TrainConfig(strategy=strategy, micro_batch=MB, accumulation=mode,
                                      return_params=True, **KW))
    events = [e for e in pool.last_events if e["rank"] == 0]
    timeline = LedgerTimeline.build(events)
    peak = {c: int(timeline.bytes[:, 0, i].max()) for i, c in enumerate(timeline.categories)}
    return out, events, peak


def payloads(events, op: str) -> dict[str, int]:
    """Each unit's (or bucket's) payload of ``op`` in the first step, as the sync run gathers it."""
    return {e["tag"]: e["payload"] for e in events
            if e["kind"] == "collective" and e["op"] == op and e.get("step") == 0}


@pytest.mark.parametrize("N", [2, 3])
def test_fsdp_three_ways_train_as_one_batch_and_trade_bytes_for_memory(pools, N):
    pool = pools(N)
    ref = reference(N, MB, **KW)
    runs = {mode: run(pool, "fsdp", mode) for mode in ("sync", "no_sync", "gathered")}
    for mode, (out, _, _) in runs.items():
        assert_parity(out, ref, what=mode)
    P, G = payloads(runs["sync"][1], "all_gather"), payloads(runs["sync"][1], "reduce_scatter")
    blocks = sum(b for u, b in P.items() if u != "root")
    ring = lambda n: (N - 1) * n // N                                        # noqa: E731
    want = {"sync": A * ring(sum(P.values()) + blocks + sum(G.values())),
            "no_sync": A * ring(sum(P.values()) + blocks) + ring(sum(G.values())),
            "gathered": ring(sum(P.values())) + A * ring(blocks) + A * ring(sum(G.values()))}
    for mode, (out, _, _) in runs.items():
        for r in out:
            assert r["wire"] == [want[mode]] * KW["steps"], (mode, r["rank"], r["wire"], want[mode])
    peak = {mode: p for mode, (_, _, p) in runs.items()}
    # no_sync: every full gradient (4 bytes a parameter) beside the shards' gradients
    assert peak["no_sync"]["grads"] == peak["no_sync"]["params"] + 4 * PSI
    assert peak["sync"]["grads"] < peak["no_sync"]["grads"]
    # gathered: every unit's full parameters at once, between micro-batches
    assert peak["gathered"]["unsharded"] == 4 * PSI > peak["sync"]["unsharded"]
    assert peak["gathered"]["grads"] == peak["sync"]["grads"]
    # and each unit's state says so: after a reduce-scatter it stays unsharded, but the last
    for unit in P:
        states = [e["state"] for e in runs["gathered"][1] if e["kind"] == "unit" and e["name"] == unit]
        after = [states[i + 1] for i, st in enumerate(states) if st == "reduce_scattering"]
        assert after == (["unsharded"] * (A - 1) + ["sharded"]) * KW["steps"], (unit, after)


@pytest.mark.parametrize("mode", ["sync", "no_sync", "gathered"])
def test_fsdp2_in_each_mode_moves_the_bytes_minishard_does(pools, mode):
    """PyTorch's FSDP2 (``set_requires_gradient_sync``, ``set_reshard_after_backward``) under
    watch, in the same mode: the same training, and the same bytes per step on every rank."""
    pool = pools(2)
    ours, theirs = (run(pool, s, mode) for s in ("fsdp", "torch_fsdp"))
    assert_parity(theirs[0], reference(2, MB, **KW), what=mode)

    def collectives(events, step):
        return sorted((e["op"], e["tag"], e["payload"], e["wire"]) for e in events
                      if e["kind"] == "collective" and e.get("step") == step)
    for step in range(KW["steps"]):
        assert collectives(theirs[1], step) == collectives(ours[1], step), (mode, step)
        assert sum(c[3] for c in collectives(theirs[1], step)) == ours[0][0]["wire"][step]


@pytest.mark.parametrize("N", [2, 3])
def test_zero2_no_sync_holds_the_full_gradients_in_its_buckets_and_reduces_once(pools, N):
    pool = pools(N)
    ref = reference(N, MB, **KW)
    (sync, ev, peak_sync), (quiet, _, peak_quiet) = (run(pool, "zero2", m) for m in ("sync", "no_sync"))
    assert_parity(sync, ref, what="sync")
    assert_parity(quiet, ref, what="no_sync")
    G, P = sum(payloads(ev, "reduce_scatter").values()), sum(payloads(ev, "all_gather").values())
    ring = lambda n: (N - 1) * n // N                                        # noqa: E731
    assert all(r["wire"] == [A * ring(G) + ring(P)] * KW["steps"] for r in sync)
    assert all(r["wire"] == [ring(G) + ring(P)] * KW["steps"] for r in quiet)
    assert peak_quiet["grads"] == peak_sync["grads"] + G      # every bucket's buffer, held


def test_modes_are_refused_where_they_mean_nothing():
    with pytest.raises(ConfigError, match="ZeRO-2 holds them whole"):
        TrainConfig(strategy="zero2", accumulation="gathered")
    with pytest.raises(ConfigError, match="accumulation"):
        TrainConfig(strategy="fsdp", accumulation="sometimes")
    with pytest.raises(ConfigError, match="applies to FSDP and ZeRO-2 only"):
        TrainConfig(strategy="ddp", accumulation="no_sync")


def test_every_step_sees_new_micro_batches_on_every_rank():
    """A step's accum micro-batches on N ranks are A*N distinct pieces of data, and the next
    step's are new ones: no sequence is seen twice in a run (the reference trains on the same
    batches, so parity alone would not see steps that overlap)."""
    cfg, N, steps = model_config("nano"), 2, 3
    config = TrainConfig(strategy="fsdp", model="nano", accum=A, micro_batch=MB)
    seen = []
    for step in range(steps):
        for r in range(N):
            rank = RankContext(r, N, torch.device("cpu"), None, "gloo")
            batches = _batches(cfg, config, step, rank)
            assert len(batches) == A and all(x.shape == (MB, cfg.seq_len) for x, _ in batches)
            seen += [tuple(x.flatten().tolist()) for x, _ in batches]
    # (whole micro-batches compared: with nano's small vocabulary two single sequences may agree)
    assert len(seen) == steps * N * A and len(set(seen)) == len(seen)


def _one_process(lr: float = 0.5):
    """A built run of one process with plain SGD (an update linear in the gradient): the
    registry's ``Built`` itself, which holds nothing back and synchronises nothing."""
    from minishard.strategies import Built, get
    net = GPT("nano", seed=0)
    return Built(get("single"), net, torch.optim.SGD(net.parameters(), lr=lr))


def _micro_batches():
    from minishard.core.model import batch
    return [batch(model_config("nano"), k, 1) for k in range(A)]


def test_a_step_of_micro_batches_is_one_step_of_their_whole_batch():
    """Each micro-batch's loss is divided by their number: A micro-batches step the parameters as
    one batch of all of them does (SGD: by the same gradient, their mean), and the step returns
    that batch's mean loss. The parity tests cannot see a wrong scale here — their one-process
    reference runs the same ``train_step`` with the same accum."""
    from minishard.training.step import train_step
    micro = _micro_batches()
    whole = (torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))
    init = dict(GPT("nano", seed=0).named_parameters())
    by_micro, by_whole = _one_process(), _one_process()
    loss_a, loss_1 = train_step(by_micro, micro), train_step(by_whole, [whole])
    assert loss_a == pytest.approx(loss_1, rel=1e-5)
    params_a = dict(by_micro.model.named_parameters())
    for n, p in by_whole.model.named_parameters():
        moved = (p - init[n]).abs().max()
        assert (params_a[n] - p).abs().max() <= 1e-3 * moved + 1e-7, n


def test_a_step_zeroes_the_gradients_in_place():
    """After every step each gradient is zero, in the tensor it had (``zero_grad(set_to_none=False)``):
    the gradient buffers live through the whole run, as the ledger and the memory formulas count
    them, and the next backward allocates none."""
    from minishard.training.step import train_step
    built, micro = _one_process(), _micro_batches()
    train_step(built, micro)
    grads = {n: p.grad for n, p in built.model.named_parameters()}
    assert all(g is not None and not g.any() for g in grads.values())
    train_step(built, micro)
    assert all(p.grad is grads[n] and not p.grad.any() for n, p in built.model.named_parameters())
