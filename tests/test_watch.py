"""minishard.watch on PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2 (2 gloo ranks).

Each job runs 2 steps of GPT("nano") (or a torch.nn.TransformerEncoder LM) under ``watch``, on
the warm 2-rank pool; the trace it streamed is then read back here with minishard's own readers
(``trace.load``, ``Replay``, ``minishard view``) and checked against the structure: collectives
per step, unit names, the params category to the byte. Bad input is refused with its message.
"""
import argparse
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import minishard
from minishard import trace
from minishard.cli import view
from minishard.watch import WatchError

N, STEPS = 2, 2


# --------------------------------------------------------------------------- rank tasks

class EncoderLM(torch.nn.Module):
    """A model the project does not define: token embedding, torch's TransformerEncoder, head."""

    def __init__(self, vocab=256, d=32, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=64, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x, y):
        logits = self.head(self.encoder(self.emb(x)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _build(kind, raf=True):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    torch.manual_seed(0)
    net = EncoderLM() if kind == "encoder" else minishard.GPT("nano")
    if kind in ("ddp", "zero"):
        model = TorchDDP(net, bucket_cap_mb=0.25)
        opt = (ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
               if kind == "zero" else torch.optim.AdamW(net.parameters(), lr=1e-3))
        return model, opt
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if kind == "fsdp_mp" else MixedPrecisionPolicy()
    for block in (net.encoder.layers if kind == "encoder" else net.blocks):
        fully_shard(block, reshard_after_forward=raf, mp_policy=mp)
    fully_shard(net, mp_policy=mp)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def watched(rank, kind, out, raf=True):
    """2 steps of a torch job under watch; what the test needs to check the trace against."""
    from torch.distributed.fsdp import FSDPModule
    model, opt = _build(kind, raf)
    cfg = minishard.config("nano")
    with minishard.watch(model, opt, trace=out) as w:
        for step in range(STEPS):
            if kind == "encoder":
                g = torch.Generator().manual_seed(step * N + rank.rank)
                x = torch.randint(0, 256, (2, 16), generator=g)
                y = torch.roll(x, -1, 1)
            else:
                x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            w.step()
    local = {}
    for p in model.parameters():
        st = (p.to_local() if hasattr(p, "to_local") else p).untyped_storage()
        local[st.data_ptr()] = st.nbytes()
    return {"params_bytes": sum(local.values()), "psi": sum(p.numel() for p in model.parameters()),
            "units": sorted(n or "root" for n, m in model.named_modules() if isinstance(m, FSDPModule)),
            "wrapped_after": [getattr(dist, f).__name__ for f in ("all_reduce", "broadcast")]}


def refused(rank, what, out):
    """A watch that must fail in __enter__; its message, and whether it left anything behind."""
    model, opt = _build("ddp")
    try:
        with minishard.watch(model, opt, trace=out):
            raise AssertionError("entered")
    except WatchError as e:
        msg = str(e)
    return {"msg": msg, "hooks": len(model._forward_pre_hooks) + len(model._forward_hooks),
            "dist": getattr(dist.all_reduce, "__minishard_watch__", False)}


# --------------------------------------------------------------------------- helpers

def _run(pools, tmp_path, kind, raf=True):
    out = tmp_path / kind
    res = pools(N).run(watched, kind, str(out), raf)
    events = trace.load(out)
    return res, events, out


def _per_step(events, op, rank=0):
    return {s: [e for e in events if e["kind"] == "collective" and e["op"] == op
                and e["rank"] == rank and e["step"] == s] for s in range(STEPS)}


def _readable(out, events):
    """minishard's readers take the trace unchanged: Replay, LedgerTimeline, view's player."""
    rp = trace.Replay(events)
    assert rp.ranks == [0, 1] and rp.n == len(events)
    trace.unit_spans(events)
    got, problems = view.read(out)
    assert problems == [] and len(got) == len(events)
    assert view.run(argparse.Namespace(trace_dir=str(out), out=None, title=None)) == 0
    assert (out / view.DEFAULT_NAME).stat().st_size > 0
    spans = trace.phase_spans(events)
    assert {s.name for s in spans} == {"step", "forward", "backward", "optimizer"}
    assert sum(1 for s in spans if s.name == "step" and s.rank == 0) == STEPS
    return rp


def _params_exact(rp, res):
    last = rp.snapshot(rp.n - 1)
    for r in (0, 1):
        assert last[r]["params"] == res[r]["params_bytes"]
        assert res[r]["wrapped_after"] == ["all_reduce", "broadcast"]   # the dist wrappers are gone


# --------------------------------------------------------------------------- the jobs

def test_torch_ddp(pools, tmp_path):
    res, events, out = _run(pools, tmp_path, "ddp")
    rp = _readable(out, events)
    _params_exact(rp, res)
    psi = res[0]["psi"]
    for s, ars in _per_step(events, "all_reduce").items():
        assert all(e["tag"].startswith("bucket") for e in ars)
        assert sum(e["payload"] for e in ars) == 4 * psi, (s, [(e["tag"], e["payload"]) for e in ars])
        assert all(e["wire"] == e["payload"] for e in ars)      # ring: 2(N-1)/N = 1 on 2 ranks
    assert len(_per_step(events, "all_reduce")[1]) == 3         # nano's 3 buckets after the rebuild
    last = rp.snapshot(rp.n - 1)[0]
    assert last["exp_avg"] == last["exp_avg_sq"] == 4 * psi
    assert last["comm_buffers"] == 4 * psi                      # the rebuilt buckets; step 0's freed


def test_torch_zero(pools, tmp_path):
    res, events, out = _run(pools, tmp_path, "zero")
    rp = _readable(out, events)
    _params_exact(rp, res)
    psi = res[0]["psi"]
    for s in range(STEPS):
        assert sum(e["payload"] for e in _per_step(events, "all_reduce")[s]) == 4 * psi
        bc = _per_step(events, "broadcast")[s]
        assert len(bc) == 41 and sum(e["payload"] for e in bc) == 4 * psi   # one per parameter
        assert {e["tag"] for e in bc} == {"dist.broadcast"}
    last = rp.snapshot(rp.n - 1)
    assert last[0]["exp_avg"] + last[1]["exp_avg"] == 4 * psi  # opt.optim.state: each its part
    assert 0 < last[0]["exp_avg"] < 4 * psi


@pytest.mark.parametrize("raf", [True, False])
def test_torch_fsdp2(pools, tmp_path, raf):
    res, events, out = _run(pools, tmp_path, "fsdp", raf)
    rp = _readable(out, events)
    _params_exact(rp, res)
    units = res[0]["units"]
    assert units == ["blocks.0", "blocks.1", "blocks.2", "root"]
    assert sorted(rp.unit_names) == units
    for s in range(STEPS):
        ags = Counter(e["tag"] for e in _per_step(events, "all_gather")[s])
        assert ags == {"root": 1, **{b: 2 if raf else 1 for b in units[:3]}}, (s, ags)
        rss = Counter(e["tag"] for e in _per_step(events, "reduce_scatter")[s])
        assert rss == {u: 1 for u in units}, (s, rss)
    # FSDP2 reshards before it reduce-scatters: each block's `sharded` comes before its RS
    r0 = trace.rank_events(events, 0, step=1)
    for b in units[:3]:
        seq = [("rs" if e["kind"] == "collective" else e["state"]) for e in r0
               if (e["kind"] == "unit" and e["name"] == b)
               or (e["kind"] == "collective" and e["op"] == "reduce_scatter" and e["tag"] == b)]
        assert seq[-2:] == ["sharded", "rs"], (b, seq)
    # the gathered parameters: the root and one block at most when resharding after forward
    peak = max(rp.snapshot(i)[0].get("unsharded", 0) for i in range(rp.n))
    assert peak == (470_784 if raf else 4 * res[0]["psi"])
    assert rp.snapshot(rp.n - 1)[0]["unsharded"] == 0


def test_fsdp2_mixed_precision_gathers_bf16(pools, tmp_path):
    res, events, out = _run(pools, tmp_path, "fsdp_mp")
    _readable(out, events)
    ags = _per_step(events, "all_gather")[1]
    rss = _per_step(events, "reduce_scatter")[1]
    assert {e["dtype"] for e in ags} == {"bfloat16"} and {e["dtype"] for e in rss} == {"float32"}
    assert sum(e["payload"] for e in rss) == 4 * res[0]["psi"]


def test_a_model_the_project_does_not_define(pools, tmp_path):
    res, events, out = _run(pools, tmp_path, "encoder")
    rp = _readable(out, events)
    _params_exact(rp, res)
    layers = ["encoder.layers.0", "encoder.layers.1"]
    assert sorted(rp.unit_names) == layers + ["root"]
    for s in range(STEPS):
        ags = Counter(e["tag"] for e in _per_step(events, "all_gather")[s])
        assert all(ags[name] == 2 for name in layers), ags


# --------------------------------------------------------------------------- bad input

def test_unsupported_wrappers_are_named():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    fsdp1 = FSDP1.__new__(FSDP1)                 # the type is what is refused: no group needed
    torch.nn.Module.__init__(fsdp1)
    with pytest.raises(WatchError, match="FSDP1 FullyShardedDataParallel .*supported are "
                                         ".*DistributedDataParallel.*fully_shard"):
        minishard.watch(fsdp1)
    DeepSpeedEngine = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    with pytest.raises(WatchError, match="DeepSpeedEngine is DeepSpeed's; supported are"):
        minishard.watch(DeepSpeedEngine())
    with pytest.raises(WatchError, match="Linear is wrapped by nothing watch knows"):
        minishard.watch(torch.nn.Linear(2, 2))


def test_no_process_group_fails_on_enter(monkeypatch):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    ddp = TorchDDP.__new__(TorchDDP)
    torch.nn.Module.__init__(ddp)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    w = minishard.watch(ddp)
    with pytest.raises(WatchError, match="process group is not initialised; call "
                                         "dist.init_process_group"):
        w.__enter__()


def test_unwritable_trace_dir_fails_on_enter_and_leaves_nothing(pools, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    res = pools(N).run(refused, "dir", str(blocker / "trace"))
    for r in res:
        assert "cannot write the trace" in r["msg"] and "a_file/trace/rank" in r["msg"], r["msg"]
        assert r["hooks"] == 0 and r["dist"] is False
