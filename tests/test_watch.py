"""minishard.watch on PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2 (2 gloo ranks).

Each job runs 2 steps of GPT("nano") (or a torch.nn.TransformerEncoder LM) under ``watch``, on
the warm 2-rank pool; the trace it streamed is then read back here with minishard's own readers
(``trace.load``, ``Replay``, ``minishard view``) and checked against the structure: collectives
per step, unit names, the params category to the byte. Bad input is refused with its message.
"""
import argparse
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import minishard
import minishard.instruments.doctor
from minishard.viewers import perfetto
from minishard.core import trace
from minishard.cli import view
from minishard.instruments.watching import WatchError

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
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    torch.manual_seed(0)
    net = EncoderLM() if kind == "encoder" else minishard.GPT("nano")
    if kind == "ddp_bf16":                    # bf16 weights and no master: what the doctor names
        net.to(torch.bfloat16)
    if kind in ("ddp", "zero", "ddp_sgd", "ddp_bf16"):
        model = TorchDDP(net, bucket_cap_mb=0.25)
        opt = (ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
               if kind == "zero" else torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
               if kind == "ddp_sgd" else torch.optim.AdamW(net.parameters(), lr=1e-3))
        return model, opt
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if kind == "fsdp_mp" else MixedPrecisionPolicy()
    # FSDP2's CPU offload: on a CPU-only machine it needs pin_memory=False (pinning asks for an
    # accelerator); the shards then stay where they are, and the optimizer steps them there
    off = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if kind == "fsdp_offload" else {}
    for block in (net.encoder.layers if kind == "encoder" else net.blocks):
        fully_shard(block, reshard_after_forward=raf, mp_policy=mp, **off)
    fully_shard(net, mp_policy=mp, **off)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def watched(rank, kind, out, raf=True):
    """2 steps of a torch job under watch; what the test needs to check the trace against."""
    from torch.distributed.fsdp import FSDPModule
    model, opt = _build(kind, raf)
    cfg = minishard.model_config("nano")
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


def own_watched(rank, kind, with_ledger, out):
    """2 steps of minishard's own strategy, built by hand as a user builds it (a Comm with no
    tracer: the watch lends its own), under watch."""
    from minishard.strategies.fsdp import ShardedOptimizer
    torch.manual_seed(0)
    net = minishard.GPT("nano")
    ledger = minishard.LiveLedger() if with_ledger else None
    comm = minishard.Comm(ledger=ledger)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)        # noqa: E731
    if kind == "fsdp":
        for i, block in enumerate(net.blocks):
            minishard.fully_shard(block, comm=comm, ledger=ledger, name=f"blocks.{i}")
        model = minishard.fully_shard(net, comm=comm, ledger=ledger, name="root")
        opt = ShardedOptimizer(net, adamw(net.parameters()))
    elif kind == "ddp":
        model, opt = minishard.DDP(net, comm=comm, ledger=ledger, bucket_cap_mb=0.25), adamw(net.parameters())
    else:
        model = net
        opt = minishard.ZeroOptimizer(net.parameters(), torch.optim.AdamW, stage=2, comm=comm,
                                      ledger=ledger, lr=1e-3, bucket_cap_mb=0.25)
    cfg = minishard.model_config("nano")
    peaks = lambda: {c: b for (c, d), b in ledger.category_peaks.items()} if ledger else None  # noqa: E731
    before = peaks()                             # (setting up broadcast rank 0's weights)
    with minishard.watch(model, opt, trace=out) as w:
        for step in range(STEPS):
            x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            w.step()
    return {"tracer_after": comm.tracer, "final": ledger.current() if ledger else None,
            "peaks_before": before, "peaks": peaks()}


def dies(rank, out):
    """Rank 1 is killed before step 1, once rank 0 is inside step 1's first all-gather (its ring
    holds it, issued): the pool stops rank 0 as soon as rank 1 dies, and a rank 0 still finishing
    step 0 on a loaded machine would leave both traces ending in step 0."""
    import os
    import signal
    import time
    from minishard.core import flight_file
    model, opt = _build("fsdp")
    cfg = minishard.model_config("nano")
    with minishard.watch(model, opt, trace=out) as w:
        for step in range(STEPS):
            if step == 1 and rank.rank == 1:
                ring, deadline = flight_file.path_for(out, 0), time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        if any(e.get("step") == 1 for e in flight_file.read(ring)["entries"]):
                            break
                    except (OSError, ValueError):       # (a record being written: read again)
                        pass
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            w.step()


def in_memory(rank, mode):
    """trace=None keeps the events in w.tracer.events; trace=rank.tracer sends them to the
    pool's tracer (they come back with the results)."""
    model, opt = _build("ddp")
    cfg = minishard.model_config("nano")
    with minishard.watch(model, opt, trace=None if mode == "none" else rank.tracer) as w:
        x, y = minishard.batch(cfg, 0, 2, rank.rank, rank.world_size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        w.step()
    return {"kept": len(w.tracer.events), "same": w.tracer is rank.tracer,
            "ops": Counter(e["op"] for e in w.tracer.events if e["kind"] == "collective")}


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
    chrome = json.loads(perfetto.write_chrome(events, out / "trace.json").read_text())   # Perfetto
    assert sum(e.get("tid") == 1 and e["ph"] == "X" for e in chrome["traceEvents"]) == \
        sum(e["kind"] == "collective" for e in events)           # the communication track
    spans = trace.phase_spans(events)
    # (minishard's own FSDP also traces its waits, per unit)
    assert {s.name for s in spans if s.unit is None} == {"step", "forward", "backward", "optimizer"}
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
    # on gloo the CPU is the device the job computes on: no byte is host memory
    allocs = [e for e in events if e["kind"] == "alloc"]
    assert allocs and {e["device"] for e in allocs} == {"device"}
    # beside the trace, the facts the doctor reads: DDP's replicas start equal, fp32 stepped
    facts = [json.loads((out / f"flight_rank{r}.json").read_text())["facts"] for r in range(N)]
    assert facts[0]["weights_start"] == facts[1]["weights_start"] and len(facts[0]["weights_start"]) == 41
    assert [n["param_dtypes"] for n in facts[0]["steps"]] == [["float32"]] * STEPS
    assert minishard.instruments.doctor.diagnose(out).findings == []


def test_a_watched_ddp_in_bf16_without_a_master_is_named(pools, tmp_path):
    _run(pools, tmp_path, "ddp_bf16")
    (f,) = minishard.instruments.doctor.diagnose(tmp_path / "ddp_bf16").findings
    assert (f.kind, f.ranks) == ("precision", [0, 1])
    assert len(f.evidence) == STEPS and all("bfloat16 elements the optimizer stepped came out unchanged"
                                            in e for e in f.evidence)


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
    from minishard.course.side_by_side import collectives
    for r in range(N):               # the owners' broadcasts come with the optimizer's step
        for s in range(STEPS):
            assert {c["phase"] for c in collectives(events, r, s) if c["op"] == "broadcast"} == {"optimizer"}
    last = rp.snapshot(rp.n - 1)
    assert last[0]["exp_avg"] + last[1]["exp_avg"] == 4 * psi  # opt.optim.state: each its part
    assert 0 < last[0]["exp_avg"] < 4 * psi


@pytest.mark.parametrize("kind,raf", [("fsdp", True), ("fsdp", False), ("fsdp_offload", True)])
def test_torch_fsdp2(pools, tmp_path, kind, raf):
    res, events, out = _run(pools, tmp_path, kind, raf)
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
    # the flight recorder beside the trace: torch's collectives, numbered alike on every rank
    dumps = [json.loads((out / f"flight_rank{r}.json").read_text()) for r in range(N)]
    assert all(d["reason"] == "end" for d in dumps)
    sig = [[(e["group"], e["seq"], e["op"], e["shapes"], e["tag"]) for e in d["entries"]] for d in dumps]
    assert sig[0] == sig[1] and len(sig[0]) == sum(e["kind"] == "collective" and e["rank"] == 0 for e in events)
    assert all(e["state"] == "completed" for d in dumps for e in d["entries"])
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
    # DeepSpeed's engine is watched (tests/test_deepspeed.py); its other modules are named
    PipelineModule = type("PipelineModule", (torch.nn.Module,), {"__module__": "deepspeed.runtime.pipe.module"})
    with pytest.raises(WatchError, match="PipelineModule is DeepSpeed's but not its data-parallel "
                                         r"engine \(DeepSpeedEngine, ZeRO stages 0-3: watch the engine "
                                         r"deepspeed.initialize returned\). Supported are"):
        minishard.watch(PipelineModule())
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


# --------------------------------------------------------------------------- more jobs, more ranks

def test_four_ranks(pools, tmp_path):
    """FSDP2 and DDP on 4 ranks: every collective's group is 4, the counts per step as on 2;
    the same model on the same batch saves the same activations under both (parameters and
    gathered parameters are not activations)."""
    acts = {}
    for kind in ("fsdp", "ddp"):
        out = tmp_path / kind
        res = pools(4).run(watched, kind, str(out))
        events = trace.load(out)
        rp = trace.Replay(events)
        assert rp.ranks == [0, 1, 2, 3]
        coll = [e for e in events if e["kind"] == "collective"]
        assert {e["group"] for e in coll} == {4}
        last = rp.snapshot(rp.n - 1)
        assert all(last[r]["params"] == res[r]["params_bytes"] for r in range(4))
        for r in range(4):
            per_step = Counter((e["step"], e["op"]) for e in coll if e["rank"] == r)
            if kind == "fsdp":    # root once, 3 blocks twice; 4 units reduce-scattered
                assert all(per_step[(s, "all_gather")] == 7 and per_step[(s, "reduce_scatter")] == 4
                           for s in range(STEPS)), per_step
            else:                 # one bucket at step 0, DDP's 3 rebuilt ones after
                assert per_step[(0, "all_reduce")] == 1 and per_step[(1, "all_reduce")] == 3, per_step
        acts[kind] = [max(rp.snapshot(i)[r].get("activations", 0) for i in range(rp.n)) for r in range(4)]
        # ring all-reduce of one bucket: each rank sends 2(N-1)/N of it
        if kind == "ddp":
            assert all(e["wire"] == 2 * 3 * e["payload"] // 4 for e in coll)
    assert acts["ddp"] == acts["fsdp"] and min(acts["ddp"]) > 0, acts


def test_demo_torch_strategies_write_the_full_trace_through_watch(pools):
    """train() (the demo's loop) watches PyTorch's own strategies: units, buckets, broadcasts."""
    from minishard.training.loop import TrainConfig, train
    pool = pools(N)
    for strategy, ops in (("torch_fsdp", {"all_gather", "reduce_scatter"}),
                          ("torch_ddp", {"all_reduce"}), ("torch_zero1", {"all_reduce", "broadcast"})):
        res = pool.run(train, TrainConfig(strategy=strategy, model="nano", steps=STEPS, micro_batch=2))
        events = pool.last_events
        rp = trace.Replay(events)
        for r in range(N):           # the run report's figures are the trace's
            w = res[r]["watched"]
            totals = [sum(rp.snapshot(i)[r].values()) for i in range(rp.n)]
            assert w["peak"] == max(totals) and sum(w["peak_snapshot"].values()) == w["peak"]
            assert w["wire"] == [sum(e["wire"] for e in events if e["kind"] == "collective"
                                     and e["rank"] == r and e["step"] == s) for s in range(STEPS)]
        coll = [e for e in events if e["kind"] == "collective"]
        assert {e["op"] for e in coll} == ops, strategy
        spans = trace.phase_spans(events)
        # one step span per step per rank: train_step's own phases are not written twice
        assert Counter(s.name for s in spans if s.rank == 0) == {
            "step": STEPS, "forward": STEPS, "backward": STEPS, "optimizer": STEPS}, strategy
        assert {e["step"] for e in coll} == set(range(STEPS))
        assert trace.Replay(events).snapshot(len(events) - 1)[0]["params"] > 0
        if strategy == "torch_fsdp":
            assert {e["name"] for e in events if e["kind"] == "unit"} == {
                "root", "blocks.0", "blocks.1", "blocks.2"}
    # unwatched when the run does not trace
    pool.run(train, TrainConfig(strategy="torch_fsdp", model="nano", steps=1, micro_batch=2, trace=False))
    assert pool.last_events == []


@pytest.mark.parametrize("kind", ["fsdp", "ddp", "zero2"])
def test_minishard_own_strategies(pools, tmp_path, kind):
    """minishard's own strategies, built by hand, record into the watch's trace: with their
    ledger (its every byte, exactly) and without one (the watch counts memory itself)."""
    psi = 217_664                                    # GPT("nano")'s parameters
    for with_ledger in (True, False):
        out = tmp_path / f"{kind}-{with_ledger}"
        res = pools(N).run(own_watched, kind, with_ledger, str(out))
        assert all(r["tracer_after"] is None for r in res)          # lent, then given back
        events = trace.load(out)
        rp = _readable(out, events)
        coll = [e for e in events if e["kind"] == "collective" and e["rank"] == 0]
        ops = Counter((e["step"], e["op"]) for e in coll)
        if kind == "fsdp":
            assert sorted(rp.unit_names) == ["blocks.0", "blocks.1", "blocks.2", "root"]
            assert all(ops[(s, "reduce_scatter")] == 4 for s in range(STEPS)), ops
        elif kind == "ddp":
            for s in range(STEPS):       # every gradient byte all-reduced each step, in buckets
                assert sum(e["payload"] for e in coll if e["step"] == s and e["op"] == "all_reduce") == 4 * psi
        else:
            assert all(ops[(s, "reduce_scatter")] >= 1 and ops[(s, "all_gather")] >= 1
                       for s in range(STEPS)), ops
        last = rp.snapshot(rp.n - 1)
        for r in range(N):
            if with_ledger:              # the trace ends where the strategy's own ledger ends
                assert {c: b for c, b in last[r].items() if b} == res[r]["final"], (kind, r)
                peaks = {}
                for i in range(rp.n):
                    for c, b in rp.snapshot(i)[r].items():
                        peaks[c] = max(peaks.get(c, 0), b)
                for c, b in res[r]["peaks"].items():      # each peak the ledger reached inside
                    if b > res[r]["peaks_before"].get(c, 0):
                        assert peaks[c] == b, (kind, r, c)
            else:
                assert last[r]["params"] > 0 and last[r]["exp_avg"] == last[r]["exp_avg_sq"] > 0


def test_trace_none_keeps_events_and_a_tracer_receives_them(pools):
    for mode in ("none", "tracer"):
        res = pools(N).run(in_memory, mode)
        for r in res:
            assert r["kept"] > 0 and r["ops"]["all_reduce"] == 1   # step 0: DDP's one bucket
            assert r["same"] == (mode == "tracer")


def test_a_rank_that_dies_leaves_readable_traces(tmp_path):
    """Every rank streams its trace a line at a time: rank 1 killed before step 1, both files
    read back whole — rank 1's up to its step 0, rank 0's into step 1."""
    from minishard.core.launch import RankError, Ranks
    out = tmp_path / "dies"
    with Ranks(2, timeout=120) as own:           # its own pool: a rank is killed on purpose
        with pytest.raises(RankError):
            own.run(dies, str(out))
    events = trace.load(out)                     # every line parses: no half-written event
    got, problems = view.read(out)                # the player says which rank stopped early
    assert len(got) == len(events) and len(problems) == 1, problems
    assert "rank1.jsonl" in problems[0] and "ends in step 0" in problems[0] and "stopped early" in problems[0]
    r1 = trace.rank_events(events, 1)
    r0 = trace.rank_events(events, 0)
    assert max(e.get("step", 0) for e in r1) == 0
    assert r1[-1] == {**r1[-1], "kind": "phase", "name": "step", "edge": "end"}
    assert any(e["kind"] == "phase" and e["name"] == "forward" and e["step"] == 1 for e in r0)
    # rank 0's flight recorder, written as its watch unwound: the all-gather it was left in
    d = json.loads((out / "flight_rank0.json").read_text())
    assert d["reason"] == "exception" and d["error"]
    last = d["entries"][-1]
    assert (last["op"], last["step"], last["state"]) == ("all_gather", 1, "issued"), last
    # where it raised — the user's line, its forward (FSDP2 gathers there) — and how long the
    # all-gather had waited by then, on the clock of the entries' times
    import inspect
    source, first = inspect.getsourcelines(dies)
    (n,) = [first + i for i, line in enumerate(source) if line.strip() == "model(x, y).backward()"]
    assert d["raised"]["caller"] == f"tests/test_watch.py:{n} in dies", d["raised"]
    assert d["t"] >= last["t_issued"]
    assert not (out / "flight_rank1.json").exists()       # killed: nothing written


def test_sgd_momentum_is_the_momentum_category(pools, tmp_path):
    res, events, out = _run(pools, tmp_path, "ddp_sgd")
    last = trace.Replay(events).snapshot(len(events) - 1)
    assert all(last[r]["momentum"] == 4 * res[r]["psi"] for r in range(N))
    assert "exp_avg" not in last[0]


def test_the_reentrancy_guard_survives_an_exception():
    import threading
    from minishard.instruments.watching import Watch
    w = Watch.__new__(Watch)
    w._guard = threading.local()
    with pytest.raises(RuntimeError):
        with w._recording():
            raise RuntimeError("a collective failed inside a hook")
    assert not w._quiet()            # a later user collective is recorded again
