"""minishard.watch at its edges: after exit, on a failed enter, when one rank cannot write, when
the step raises, on user collectives and subgroups, and what ``train`` does with it. Each test
pins a change an outsider planted in the watch that the first tests let through."""
import gc
import json
import os
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import minishard
from minishard.core import trace
from minishard.instruments.watching import WatchError
from test_watch import N, _build

STEP_KW = dict(model="nano", steps=2, micro_batch=2)


def _step(model, opt, cfg, step, rank):
    x, y = minishard.batch(cfg, step, 2, rank.rank, rank.world_size)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()


def _lines(path):
    return len(open(path).read().splitlines())


# --------------------------------------------------------------------------- rank tasks

def after_exit(rank, kind, out):
    """One step watched, then one more after the with: nothing more is written, everything the
    watch patched is back, and the same model can be watched again."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllGather,
                                                                       DefaultReduceScatter)
    model, opt = _build(kind)
    cfg = minishard.model_config("nano")
    hooks_before = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    with minishard.watch(model, opt, trace=f"{out}/first") as w:
        _step(model, opt, cfg, 0, rank)
        w.step()
    path = f"{out}/first/rank{rank.rank}.jsonl"
    at_exit = _lines(path)
    _step(model, opt, cfg, 1, rank)
    gc.collect()
    res = {"origin": w.tracer.origin, "closed": w._file.closed, "grew": _lines(path) - at_exit,
           "hooks": [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == hooks_before}
    if kind == "ddp":
        res["relay"] = model._minishard_watch_hook.watch
    else:
        pgs = [pg for m in model.modules() if hasattr(m, "_get_fsdp_state")
               for pg in m._get_fsdp_state()._fsdp_param_groups]
        res["patched"] = [k for pg in pgs for k in ("_to_unsharded", "_to_sharded", "_to_sharded_post_forward")
                          if k in pg.__dict__]
        res["comms"] = {type(pg._all_gather_comm) in (DefaultAllGather,) and
                        type(pg._reduce_scatter_comm) in (DefaultReduceScatter,) for pg in pgs}
    with minishard.watch(model, opt, trace=f"{out}/again") as w2:      # the same model again
        _step(model, opt, cfg, 2, rank)
        w2.step()
    res["again"] = Counter(json.loads(x)["op"] for x in open(f"{out}/again/rank{rank.rank}.jsonl")
                           if '"collective"' in x)
    return res


def failed_enter(rank, kind):
    """An instrument that fails while the watch attaches: every one attached before it is undone.
    Then a watch inside a watch is refused, and the outer one still records."""
    from minishard.instruments.watching import calls
    model, opt = _build(kind)
    hooks = lambda: len(model._forward_pre_hooks) + len(model._forward_hooks)     # noqa: E731 (FSDP2 has its own)
    hooks_before = hooks()
    orig = calls.attach
    calls.attach = lambda w: (_ for _ in ()).throw(RuntimeError("planted: attach failed"))
    try:
        with minishard.watch(model, opt):
            pass
    except RuntimeError as e:
        msg = str(e)
    finally:
        calls.attach = orig
    res = {"msg": msg, "hooks": hooks() - hooks_before,
           "wrapped": getattr(dist.all_reduce, "__minishard_watch__", False)}
    if kind == "ddp":
        res["relay"] = model._minishard_watch_hook.watch
    else:
        res["patched"] = sum(k in pg.__dict__ for m in model.modules() if hasattr(m, "_get_fsdp_state")
                             for pg in m._get_fsdp_state()._fsdp_param_groups
                             for k in ("_to_unsharded", "_to_sharded"))
    with minishard.watch(model, opt) as w:
        try:
            with minishard.watch(model, opt):
                pass
        except WatchError as e:
            res["nested"] = str(e)
        _step(model, opt, minishard.model_config("nano"), 0, rank)
        w.step()
    res["outer"] = sum(e["kind"] == "collective" for e in w.tracer.events)
    return res


def cannot_open(rank, out):
    model, opt = _build("ddp")
    t0 = time.perf_counter()
    try:
        with minishard.watch(model, opt, trace=out):
            return {"msg": None}
    except WatchError as e:
        return {"msg": str(e), "seconds": time.perf_counter() - t0}


def raises_mid_step(rank, out):
    """Step 1 raises between forward and backward, inside the with."""
    model, opt = _build("ddp")
    cfg = minishard.model_config("nano")
    try:
        with minishard.watch(model, opt, trace=out) as w:
            _step(model, opt, cfg, 0, rank)
            w.step()
            x, y = minishard.batch(cfg, 1, 2, rank.rank, rank.world_size)
            model(x, y)
            raise KeyError("planted")
    except KeyError:
        pass


def user_calls(rank):
    """A user's own collectives inside a watched DDP job: their payloads, and an async one's
    end time (rank 1 joins 0.5 s late)."""
    model, opt = _build("ddp")
    with minishard.watch(model, opt) as w:
        inp = torch.ones(4 * N)
        dist.reduce_scatter_tensor(torch.empty(4), inp)
        dist.all_gather_into_tensor(torch.empty(6 * N), torch.ones(6))
        if rank.rank == 1:
            time.sleep(0.5)
        dist.all_reduce(torch.ones(8), async_op=True).wait()
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.MAX)    # (HSDP's FSDP2 passes its op so)
        time.sleep(0.2)                          # the completion callback runs in gloo's thread
    return [{k: e[k] for k in ("op", "payload", "t", "t_end")} for e in w.tracer.events
            if e["kind"] == "collective"]


def ddp_pairs(rank, out):
    """4 ranks, two DDP jobs of 2 ranks each on their own groups, watched; a broadcast in the
    pair from its second member."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank.rank // 2]
    torch.manual_seed(0)
    net = minishard.GPT("nano")
    model = TorchDDP(net, process_group=mine, bucket_cap_mb=0.25)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with minishard.watch(model, opt, trace=out) as w:
        _step(model, opt, minishard.model_config("nano"), 0, rank)
        dist.broadcast(torch.ones(16), src=rank.rank // 2 * 2 + 1, group=mine)
        w.step()
    return sum(p.grad is None or True for p in net.parameters())


def train_unwatched(rank):
    from minishard.training.loop import TrainConfig, train
    seen = []
    train(rank, TrainConfig(strategy="torch_ddp", trace=False, **STEP_KW),
          on_step=lambda s: seen.append(getattr(dist.all_reduce, "__minishard_watch__", False)))
    return seen


def own_after_exit(rank):
    """minishard's own FSDP with its ledger: after the with, a forward enters no activations
    (the ledger's activations context closed with the watch)."""
    from minishard.strategies.fsdp import ShardedOptimizer
    torch.manual_seed(0)
    net = minishard.GPT("nano")
    ledger = minishard.LiveLedger()
    comm = minishard.Comm(ledger=ledger)
    minishard.strategies.fsdp.apply_fsdp(net, comm=comm, ledger=ledger)
    opt = ShardedOptimizer(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    cfg = minishard.model_config("nano")
    with minishard.watch(net, opt) as w:
        _step(net, opt, cfg, 0, rank)
        w.step()
    x, y = minishard.batch(cfg, 1, 2, rank.rank, rank.world_size)
    loss = net(x, y)
    held = ledger.current().get("activations", 0)
    loss.backward()
    return held


def rs_out_in_bf16(rank):
    """minishard's FSDP reducing in bf16 (a policy naming only the compute dtype): its ledger
    enters each reduce-scatter output at payload / N, in bf16."""
    torch.manual_seed(0)
    net = minishard.GPT("nano")
    tracer = minishard.Tracer(rank.rank, rank.world_size)
    ledger = minishard.LiveLedger(tracer)
    comm = minishard.Comm(tracer, ledger=ledger)
    mp = minishard.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    minishard.strategies.fsdp.apply_fsdp(net, comm=comm, ledger=ledger, mp_policy=mp)
    x, y = minishard.batch(minishard.model_config("nano"), 0, 2, rank.rank, rank.world_size)
    net(x, y).backward()
    rs = {e["tag"]: e for e in tracer.events if e["kind"] == "collective" and e["op"] == "reduce_scatter"}
    out = {e["tag"].split(":")[0]: e["bytes"] for e in tracer.events
           if e["kind"] == "alloc" and e["tag"].endswith(":rs_out")}
    return {u: (out[u], rs[u]["payload"] // rank.world_size, rs[u]["dtype"]) for u in rs}



def given_flight(rank):
    """A watched DDP step with the caller's own flight recorder: what it holds afterwards."""
    from minishard.core.flight import FlightRecorder
    model, opt = _build("ddp")
    mine = FlightRecorder(rank.rank, rank.world_size)
    with minishard.watch(model, opt, flight=mine) as w:
        _step(model, opt, minishard.model_config("nano"), 0, rank)
        w.step()
    traced = sorted(e["payload"] for e in w.tracer.events
                    if e["kind"] == "collective" and e["op"] == "all_reduce")
    held = sorted(e["bytes"] for e in mine.entries if e["op"] == "all_reduce" and e["state"] == "completed")
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"same": w.flight is mine, "traced": traced, "held": held, "grads": grads}


def own_moments(rank):
    """One AdamW step of minishard's DDP (with a ledger, and a plain torch optimizer), watched:
    the Adam moments the trace and the ledger end with."""
    torch.manual_seed(0)
    net = minishard.GPT("nano")
    ledger = minishard.LiveLedger()
    model = minishard.DDP(net, comm=minishard.Comm(ledger=ledger), ledger=ledger, bucket_cap_mb=0.25)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with minishard.watch(model, opt) as w:
        _step(model, opt, minishard.model_config("nano"), 0, rank)
        w.step()
    evs = trace.merge(w.tracer.events)
    last = trace.Replay(evs).snapshot(len(evs) - 1)[rank.rank]
    held = ledger.current()
    return {"psi": sum(p.numel() for p in net.parameters()),
            "trace": (last.get("exp_avg", 0), last.get("exp_avg_sq", 0)),
            "ledger": (held.get("exp_avg", 0), held.get("exp_avg_sq", 0))}


# --------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_after_exit_nothing_is_written_everything_is_restored_and_it_can_watch_again(pools, tmp_path, kind):
    res = pools(N).run(after_exit, kind, str(tmp_path))
    assert res[0]["origin"] == res[1]["origin"]           # one clock for all ranks: rank 0's
    for r in res:
        assert r["closed"] and r["grew"] == 0 and r["hooks"], r
        if kind == "ddp":
            assert r["relay"] is None
            assert r["again"]["all_reduce"] >= 1, r["again"]
        else:
            assert r["patched"] == [] and r["comms"] == {True}
            assert r["again"]["all_gather"] == 7 and r["again"]["reduce_scatter"] == 4, r["again"]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_failed_enter_undoes_what_it_attached_and_a_nested_watch_is_refused(pools, kind):
    for r in pools(N).run(failed_enter, kind):
        assert r["msg"] == "planted: attach failed" and r["hooks"] == 0 and r["wrapped"] is False
        assert r.get("relay") is None and r.get("patched", 0) == 0
        assert "another watch is already on" in r["nested"] and r["outer"] > 0


def test_when_one_rank_cannot_write_every_rank_fails_at_once(pools, tmp_path):
    (tmp_path / "rank1.jsonl").mkdir(parents=True)        # rank 1's file cannot be opened
    res = pools(N).run(cannot_open, str(tmp_path))
    assert "cannot write the trace" in res[1]["msg"] and "rank1.jsonl" in res[1]["msg"]
    assert "1 other rank(s) could not open their trace file" in res[0]["msg"]
    assert all(r["seconds"] < 30 for r in res)


def test_a_step_that_raises_leaves_its_phases_closed(pools, tmp_path):
    pools(N).run(raises_mid_step, str(tmp_path))
    events = trace.load(tmp_path)
    for r in range(N):
        evs = trace.rank_events(events, r)
        tail = [(e["name"], e["edge"], e["step"]) for e in evs[-2:]]
        assert tail == [("backward", "end", 1), ("step", "end", 1)], tail
        assert sum(s.name == "step" for s in trace.phase_spans(evs)) == 2


def test_a_users_own_collectives_are_recorded_as_torch_defines_them(pools):
    res = pools(N).run(user_calls)
    for r, evs in enumerate(res):
        by = {e["op"]: e for e in evs}
        assert by["reduce_scatter"]["payload"] == 4 * N * 4          # the input: N slices
        assert by["all_gather"]["payload"] == 6 * N * 4              # the output: N blocks
        assert [e["payload"] for e in evs if e["op"] == "all_reduce"] == [8 * 4, 3 * 4], evs
    late = next(e for e in res[0] if e["op"] == "all_reduce")
    assert late["t_end"] - late["t"] > 0.3                           # waited for rank 1


def test_ddp_on_subgroups_records_each_pairs_group(pools, tmp_path):
    pools(4).run(ddp_pairs, str(tmp_path))
    events = trace.load(tmp_path)
    coll = [e for e in events if e["kind"] == "collective"]
    assert {e["group"] for e in coll} == {2}
    ar = [e for e in coll if e["op"] == "all_reduce"]
    assert ar and all(e["wire"] == e["payload"] for e in ar)        # ring on 2: 2(2-1)/2 = 1
    bc = {e["rank"]: e["wire"] for e in coll if e["op"] == "broadcast"}
    assert bc == {0: 0, 1: 64, 2: 0, 3: 64}                          # the pair's second sends
    flights = [json.loads((tmp_path / f"flight_rank{r}.json").read_text()) for r in range(4)]
    names = [{e["group"] for e in f["entries"]} for f in flights]
    assert names[0] == names[1] != names[2] == names[3]              # each pair its own name


def test_train_without_trace_is_not_watched(pools):
    assert all(seen == [False, False] for seen in pools(N).run(train_unwatched))


def test_the_ledgers_activations_close_with_the_watch(pools):
    before = pools(N).run(own_after_exit)
    assert before == [0, 0]


def test_minishards_reduce_scatter_output_is_entered_in_the_reduce_dtype(pools):
    for r in pools(N).run(rs_out_in_bf16):
        assert set(r) == {"root", "blocks.0", "blocks.1", "blocks.2"}
        for unit, (entered, slice_bytes, dtype) in r.items():
            assert dtype == "bfloat16" and entered == slice_bytes, (unit, entered, slice_bytes)


def test_the_flight_recorder_given_to_watch_receives_the_collectives(pools):
    """``train()`` hands the watch its run's flight recorder (the one it dumps for the doctor);
    a user may hand their own. The watched job's collectives (DDP's bucket all-reduces) must be
    entered there: a watch that kept a private recorder would leave the dump the doctor reads
    empty of them."""
    for r in pools(N).run(given_flight):
        assert r["same"]
        assert r["traced"] and r["held"] == r["traced"], r
        assert sum(r["held"]) == r["grads"]          # every gradient byte all-reduced once


def test_adam_moments_of_minishards_ddp_with_a_torch_optimizer_are_counted(pools):
    """Watching minishard's DDP with a plain torch AdamW, the watch must enter the moments the
    optimizer creates at its first step (fp32, 4 bytes per parameter each, on every replica)
    in the strategy's ledger, as ``train_step`` does; otherwise the trace and the ledger show
    no optimizer state at all, and the memory the user reads is short by 8 bytes a parameter."""
    for r in pools(N).run(own_moments):
        assert r["trace"] == r["ledger"] == (4 * r["psi"], 4 * r["psi"]), r


def test_a_collective_whose_future_fails_stays_issued_never_completed():
    """A peer that dies fails the future of an async collective (gloo: "Connection reset by
    peer"): the watch records nothing for it, so its flight record stays issued, never completed
    — where the rank waited — and the doctor says the rank waits in it (tests/test_hf_llama.py:
    DeepSpeed's async all-gather, once recorded as completed)."""
    from types import SimpleNamespace
    from minishard.instruments.watching.session import Watch
    recorded = []
    w = SimpleNamespace(tracer=SimpleNamespace(now=lambda: 1.0))
    for outcome in ("completed", "failed"):
        fut = torch.futures.Future()
        Watch._when_done(w, SimpleNamespace(get_future=lambda fut=fut: fut), lambda t: recorded.append(outcome))
        if outcome == "completed":
            fut.set_result(None)
        else:
            fut.set_exception(RuntimeError("Connection reset by peer"))
    assert recorded == ["completed"]


def test_a_ddp_bucket_whose_all_reduce_fails_stays_issued_never_completed():
    """The same for DDP's bucket: its future's failure reaches DDP, and nothing is recorded."""
    from contextlib import nullcontext
    from types import SimpleNamespace
    from minishard.instruments.watching import ddp
    recorded = []
    w = SimpleNamespace(tracer=SimpleNamespace(now=lambda: 1.0, step=0), _track=lambda *a: None,
                        _issued=lambda *a: {}, _recording=nullcontext,
                        _collective=lambda *a, **k: recorded.append(a))
    bucket = SimpleNamespace(buffer=lambda: torch.zeros(4), index=lambda: 0)
    for outcome in ("completed", "failed"):
        fut = torch.futures.Future()
        chained = ddp._bucket(w, bucket, lambda group, b: fut, None)
        if outcome == "completed":
            fut.set_result(torch.zeros(4))
        else:
            fut.set_exception(RuntimeError("Connection reset by peer"))
            with pytest.raises(RuntimeError, match="Connection reset"):
                chained.wait()
    assert len(recorded) == 1
