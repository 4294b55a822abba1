"""DeepSpeed's ZeRO, run for real: watched (every collective it issues, what it holds, stage 3's
units), trained beside one process and beside minishard's ZeRO and PyTorch's FSDP2.

The watch is checked against two counts it does not make itself: DeepSpeed's own comms logger
(``deepspeed.comm.configure(prof_all=True)``: every collective, its message size) and what
DeepSpeed 0.19's ZeRO optimizer allocates, term by term
(``minishard.planner.deepspeed_estimator.deepspeed_holdings``, each term read in DeepSpeed's code).
Every run is on the warm pools, the nano model, two steps.
"""
import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

from minishard.cli import main
from minishard.core.trace import read_events as _read
from minishard.instruments import doctor
from minishard.instruments.watching import deepspeed as adapter
from minishard.planner.deepspeed_estimator import deepspeed_holdings
from minishard.training.loop import TrainConfig, train

import deepspeed                 # (make setup installs it: the tests never skip for its absence)
import deepspeed_tasks
from parity import as_reference, assert_parity, initial, reference

STAGE3 = {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
          "stage3_max_reuse_distance": 0}        # the nano model really partitioned, gathered unit by unit
BUCKET_MB = 0.15                                 # reduce_bucket_size 39,321 elements: several buckets


def read_events(path) -> list[dict]:
    return _read(path)[0]


# ----------------------------------------------------------------------------- the adapter
def test_the_adapter_names_the_deepspeed_it_was_checked_on_and_each_name_exists():
    assert deepspeed.__version__ in adapter.CHECKED_ON, (deepspeed.__version__, adapter.CHECKED_ON)
    assert all(len(why.split()) >= 3 for why in adapter.PRIVATE.values())
    missing = []
    for name in adapter.PRIVATE:
        parts = name.partition("#")[0].split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        try:
            for attribute in parts[i:]:
                obj = getattr(obj, attribute)
        except AttributeError as e:
            missing.append(f"{name}: {e}")
    assert not missing, "\n".join(missing)


def test_the_wrapped_methods_take_the_parameters_the_adapter_reads():
    """DeepSpeed's decorators hide its backend's signatures from ``inspect``: the adapter lists
    each wrapped method's parameters itself, and they must be the installed source's."""
    backend = importlib.import_module("deepspeed.comm.torch")
    tree = ast.parse(Path(inspect.getsourcefile(backend)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TorchBackend")
    defs = {f.name: tuple(a.arg for a in f.args.args[1:]) for f in cls.body if isinstance(f, ast.FunctionDef)}
    for method, (_, params, payload) in adapter.COLLECTIVES.items():
        assert defs.get(method) == params, (method, defs.get(method), params)
        assert payload in params


@pytest.fixture(scope="module")
def watched(pools, tmp_path_factory):
    """Each stage's user job, watched, on 2 ranks (and 3: a world that divides nothing)."""
    out = {}
    live = [n for n in adapter.PRIVATE if "#" in n]
    for N, stages in ((2, (0, 1, 2, 3)), (3, (1, 2, 3))):
        for stage in stages:
            d = tmp_path_factory.mktemp(f"ds{stage}n{N}")
            res = pools(N).run(deepspeed_tasks.user_job, stage, str(d), STAGE3 if stage == 3 else None,
                               bucket_cap_mb=BUCKET_MB, live=live)
            out[stage, N] = (d, res)
    return out


def test_every_attribute_the_adapter_reads_is_on_the_live_engines(watched):
    for stage in (1, 2, 3):
        _, res = watched[stage, 2]
        want = {n for n in res[0]["live"] if "Stage3" in n} if stage == 3 else \
            {n for n in res[0]["live"] if "stage_1_and_2" in n or "comm.comm" in n}
        gone = [n for n in want if not res[0]["live"][n]]
        assert not gone, f"stage {stage}: {gone}"


# ----------------------------------------------------------------------------- the collectives
# DeepSpeed's comm function -> the op the trace calls it
LOGGED = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "broadcast": "broadcast",
          "reduce_scatter_tensor": "reduce_scatter", "reduce": "reduce"}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_collective_deepspeed_issues_is_recorded_once_with_its_size(watched, stage):
    """The trace's collectives, op by op, are DeepSpeed's comms log: as many, the same sizes."""
    d, res = watched[stage, 2]
    for r in (0, 1):
        events = [e for e in read_events(d / f"rank{r}.jsonl") if e["kind"] == "collective"]
        assert events, f"stage {stage}: no collective recorded"
        for op, sizes in res[r]["logged"].items():
            assert op in LOGGED, f"DeepSpeed issued {op}, which the test does not map"
            ours = sorted(e["payload"] for e in events if e["op"] == LOGGED[op])
            # the comms logger counts an all-gather's input, the trace the gathered output
            theirs = [s * 2 for s in sizes] if op == "all_gather_into_tensor" else sizes
            assert ours == theirs, (stage, r, op, len(ours), len(theirs))
        assert sum(len(s) for s in res[r]["logged"].values()) == len(events)


def test_the_users_own_collectives_through_deepspeed_are_recorded_as_issued(pools, tmp_path):
    """The user's own collectives through ``deepspeed.comm``: an all-gather into N tensors moves
    every one of them (its payload their sum — N times the input DeepSpeed's comms log counts),
    one in a group of rank 0 alone is recorded in that group (size 1, its member named), and both
    name the user's line as where and as caller (no DeepSpeed line issued them)."""
    import json
    res = pools(2).run(deepspeed_tasks.user_job, 0, str(tmp_path), None, steps=1, users_gather=True)
    events = [e for e in read_events(tmp_path / "rank0.jsonl") if e["kind"] == "collective"]
    gathers = [e for e in events if e["op"] == "all_gather"]
    assert [e["payload"] for e in gathers] == [2 * 3 * 4], gathers
    assert res[0]["logged"]["all_gather"] == [3 * 4]      # (DeepSpeed's log: the input, one rank's)
    (alone,) = [e for e in events if e.get("members") == [0]]
    assert (alone["op"], alone["group"], alone["payload"], alone["wire"]) == ("all_reduce", 1, 8, 0)
    entries = json.loads((tmp_path / "flight_rank0.json").read_text())["entries"]
    mine = [e for e in entries if e["op"] == "all_gather" or e["group_size"] == 1]
    assert len(mine) == 2 and {e["group_size"] for e in mine} == {2, 1}, mine
    for e in mine:
        assert e["where"] == e["caller"] and "deepspeed_tasks.py" in e["where"], e
    # what a warm rank tells a library that reads torchrun's variables (DeepSpeed reads LOCAL_RANK)
    assert [r["env"] for r in res] == [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                        "LOCAL_WORLD_SIZE": "2"} for r in (0, 1)]


def test_stage_3s_parameters_under_the_threshold_are_gathered_once_and_kept_by_name(pools, tmp_path):
    """With ``stage3_param_persistence_threshold`` 1,000 on the nano model the biases and norms are
    kept whole, the weights partitioned: the gathered bytes tagged ``persistent`` are exactly the
    parameters at most that size, and a gather that also carries a larger weight (the first fetch
    of a Linear, weight and bias together) is the unit's own, not called persistent."""
    zero = {"stage3_param_persistence_threshold": 1000, "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0}
    res = pools(2).run(deepspeed_tasks.user_job, 3, str(tmp_path), zero, bucket_cap_mb=BUCKET_MB)
    held = _held_by_tag(tmp_path / "rank0.jsonl", category=True)
    from minishard.core.model import GPT
    sizes = {name: p.numel() for name, p in GPT("nano", device="meta").named_parameters()}
    small = sum(n for n in sizes.values() if n <= 1000)
    assert sum(v for (c, k), v in held.items() if "persistent:" in k) == 4 * small
    unit_sizes = {}
    for name, n in sizes.items():
        unit_sizes.setdefault(name.rpartition(".")[0], []).append(n)
    for e in read_events(tmp_path / "rank0.jsonl"):
        if e["kind"] == "collective" and e["tag"].startswith("persistent:"):
            unit = e["tag"].removeprefix("persistent:").split(" ")[0]
            assert max(unit_sizes[unit]) <= 1000 or e["payload"] <= 4 * 2 * 1000, e


def test_an_untagged_collective_is_named_by_the_deepspeed_function_that_issued_it(watched):
    d, _ = watched[2, 2]
    tags = {e["tag"] for e in read_events(d / "rank0.jsonl") if e["kind"] == "collective"}
    assert {"allreduce_bucket", "get_grad_norm_direct"} <= tags, tags


def test_a_unit_is_unsharded_only_when_every_parameter_is_there():
    """A unit's state from its parameters' (``Adapter.refresh``): all available — unsharded; any
    in flight — unsharding; some available and none in flight (a prefetch bucket that took only
    part of a module) — not yet unsharded: sharded."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as S
    emitted = []

    class P:
        def __init__(self, status):
            self.ds_status = status
    a = adapter.Adapter.__new__(adapter.Adapter)
    a.w = type("W", (), {"_emit": lambda self, kind, **f: emitted.append((f["name"], f["state"]))})()
    a._status, a.units = S, {}
    a.unit_params = {"both": [P(S.AVAILABLE), P(S.AVAILABLE)], "half": [P(S.AVAILABLE), P(S.NOT_AVAILABLE)],
                     "flying": [P(S.INFLIGHT), P(S.AVAILABLE)], "none": [P(S.NOT_AVAILABLE)]}
    a.refresh()
    assert dict(emitted) == {"both": "unsharded", "flying": "unsharding"}     # (sharded: no change)
    assert a.units.get("half", "sharded") == "sharded"


def test_a_bucket_reduced_to_each_owner_is_recorded_as_deepspeed_sends_it(pools, tmp_path):
    """With ``use_multi_rank_bucket_allreduce`` off, stage 2 reduces each part of a bucket to the
    rank that owns it (``reduce``, a tree to that rank): every one recorded, the same sizes as
    DeepSpeed logs, and what a rank sends is the part's bytes when it does not own it, else 0."""
    res = pools(2).run(deepspeed_tasks.user_job, 2, str(tmp_path), {"use_multi_rank_bucket_allreduce": False},
                       bucket_cap_mb=BUCKET_MB)
    for r in (0, 1):
        reduces = [e for e in read_events(tmp_path / f"rank{r}.jsonl") if e["kind"] == "collective"
                   and e["op"] == "reduce"]
        assert sorted(e["payload"] for e in reduces) == res[r]["logged"]["reduce"] and reduces
        sent = {e["wire"] for e in reduces if e["wire"]}
        assert sent and all(e["wire"] in (0, e["payload"]) for e in reduces)
        assert any(e["wire"] == 0 for e in reduces)             # the parts it owns: nothing sent


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_optimizer_is_watched_and_on_a_cpu_moves_nothing(pools, tmp_path, stage):
    """ZeRO-Offload (``offload_optimizer`` to the CPU, torch's AdamW stepping there) runs and is
    watched: every collective as DeepSpeed logs it, the fp32 partition found. On this machine the
    CPU is the device, so every storage is entered on the device — what offload moves shows only
    where an accelerator computes (the watch enters a CPU storage there as host)."""
    zero = {"offload_optimizer": {"device": "cpu"}, **(STAGE3 if stage == 3 else {})}
    res = pools(2).run(deepspeed_tasks.user_job, stage, str(tmp_path), zero, bucket_cap_mb=BUCKET_MB)
    for r in (0, 1):
        events = read_events(tmp_path / f"rank{r}.jsonl")
        ops = [e for e in events if e["kind"] == "collective"]
        assert len(ops) == sum(len(s) for s in res[r]["logged"].values())
        held = _held_by_tag(tmp_path / f"rank{r}.jsonl")
        assert held.get("fp32 partition" if stage < 3 else "fp32 partitions", 0) > 0, sorted(held)
        assert {e["device"] for e in events if e["kind"] == "alloc"} == {"device"}


# ----------------------------------------------------------------------------- the ledger
def _held_by_tag(path, category: bool = False) -> dict:
    """The most bytes each tag (or, with ``category``, each (category, tag)) held at once over the
    run: a tag's allocations minus its frees."""
    now, most = {}, {}
    for e in read_events(path):
        if e["kind"] in ("alloc", "free"):
            key = (e["category"], e["tag"]) if category else e["tag"]
            now[key] = now.get(key, 0) + (e["bytes"] if e["kind"] == "alloc" else -e["bytes"])
            most[key] = max(most.get(key, 0), now[key])
    return most


@pytest.mark.parametrize("stage,N", [(1, 2), (2, 2), (3, 2), (1, 3), (2, 3), (3, 3)])
def test_what_the_watch_measures_is_deepspeeds_holdings_term_by_term(watched, stage, N):
    """Every term of DeepSpeed's ZeRO optimizer to the byte, on every rank — the flat buffer
    padded to 2N, the fp32 copy of the partition stages 1–3 keep even in fp32 training, the
    gradient partition holding whole parameters, the reduce bucket — and the moments; stage 1's
    full gradients too (autograd's, before the buckets take them)."""
    d, res = watched[stage, N]
    bucket = int(BUCKET_MB * 2 ** 20) // 4
    for r in range(N):
        held = _held_by_tag(d / f"rank{r}.jsonl", category=True)
        want = deepspeed_holdings(stage, res[r]["numels"], N, r, bucket)
        moments = {k: v for k, v in held.items() if k[1].startswith("opt:exp_avg")}
        assert moments == {("exp_avg", "opt:exp_avg:0"): want["exp_avg"][1],
                           ("exp_avg_sq", "opt:exp_avg_sq:0"): want["exp_avg_sq"][1]}
        for term, (category, nbytes) in want.items():
            if term.startswith("exp_avg"):
                continue
            got = (sum(v for (c, k), v in held.items() if c == category and k.startswith("grad:"))
                   if term.startswith("every full") else held.get((category, term)))
            assert got == nbytes, (f"stage {stage}, N={N}, rank {r}: {term} ({category}): measured {got}, "
                                   f"formula {nbytes}")


def test_stage_3_gathers_each_submodule_by_name_and_frees_it(watched):
    d, res = watched[3, 2]
    events = list(read_events(d / "rank0.jsonl"))
    states = {}
    for e in events:
        if e["kind"] == "unit":
            states.setdefault(e["name"], []).append(e["state"])
    assert "blocks.0.attn.qkv" in states and "head" in states, sorted(states)
    for unit, seq in states.items():
        assert "unsharded" in seq and seq[-1] == "sharded", (unit, seq)
    gathers = {e["tag"] for e in events if e["kind"] == "collective" and e["op"] == "all_gather"}
    assert "blocks.0.attn.qkv" in gathers or "prefetch:blocks.0.attn.qkv" in gathers, gathers
    held = _held_by_tag(d / "rank0.jsonl")
    # a unit's gathered parameters, padded to N: its qkv Linear's weight and bias, whole
    assert held["unsharded:blocks.0.attn.qkv"] == 4 * (3 * 64 * 64 + 3 * 64), held
    assert res[0]["held"].get("unsharded", 0) == 0          # all given back after the step


def test_each_collective_names_the_deepspeed_line_that_issued_it_and_the_users(watched):
    """The flight recorder's two call sites, past DeepSpeed's plumbing (its communicator and its
    nvtx decorator): ``where`` DeepSpeed's own line (its reduction of a bucket, its fetch of a
    unit), ``caller`` the user's loop."""
    import json
    for stage in (2, 3):
        d, _ = watched[stage, 2]
        entries = json.loads((d / "flight_rank0.json").read_text())["entries"]
        assert entries
        for e in entries:
            assert "deepspeed/runtime/" in e["where"], e
            assert "deepspeed_tasks.py" in e["caller"], e
        wheres = {e["where"].rpartition(" in ")[2] for e in entries}
        assert ("allreduce_bucket" in wheres) if stage == 2 else ("_dist_allgather_fn" in wheres), wheres


def test_replicas_are_fingerprinted_below_stage_3_and_not_at_it(watched):
    """Stages 0–2 hold the weights whole on every rank: the watch notes their fingerprint for the
    doctor (ranks that start apart are found), and every few steps the replicas' (ranks that
    drift apart are); stage 3 holds partitions, different by design."""
    import json
    for stage in (0, 2, 3):
        d, _ = watched[stage, 2]
        facts = [json.loads((d / f"flight_rank{r}.json").read_text())["facts"] for r in (0, 1)]
        sets = [s for rec in facts[0]["replicas"] for s in rec["sets"]]
        assert facts[0]["replicas"] and all(rec["settings"] for rec in facts[0]["replicas"])
        if stage < 3:
            assert facts[0]["weights_start"] == facts[1]["weights_start"] and facts[0]["weights_start"]
            assert sets and all(s["ranks"] == [0, 1] for s in sets)     # and every few steps after
        else:
            assert "weights_start" not in facts[0] and not sets


def test_stage_3s_defaults_keep_a_small_model_whole(pools, tmp_path):
    """Left at its defaults, DeepSpeed's stage 3 keeps every parameter under 1e5 elements whole —
    every one of the nano model's — and gathers them again after each step, outside any fetch:
    the watch enters them as gathered parameters (``persistent:``), all 4Ψ of them."""
    res = pools(2).run(deepspeed_tasks.user_job, 3, str(tmp_path), None, bucket_cap_mb=BUCKET_MB)
    held = _held_by_tag(tmp_path / "rank0.jsonl", category=True)
    persistent = {k: v for k, v in held.items() if k[1].startswith("unsharded:persistent:")}
    assert persistent and all(c == "unsharded" for c, _ in persistent)
    assert res[0]["held"]["unsharded"] == 4 * sum(res[0]["numels"])


def test_a_warm_rank_gives_back_torchs_linear_after_deepspeeds_stage_3(pools, watched):
    """DeepSpeed's ZeRO-3 replaces ``torch.nn.functional.linear`` with its memory-efficient one for
    good; the next task on a warm rank (the stage-3 runs above ran on these) computes with
    torch's, as it would in a fresh process."""
    assert pools(2).run(deepspeed_tasks.linear_module) == ["torch._C._nn"] * 2


def test_the_player_and_the_doctor_read_a_deepspeed_trace(watched, capsys):
    for stage in (2, 3):
        d, _ = watched[stage, 2]
        assert main(["view", str(d)]) == 0
        assert (d / "player.html").exists()
        assert doctor.diagnose(d).findings == []
        assert main(["doctor", str(d)]) == 0
    capsys.readouterr()


from hypothesis import given, settings, strategies as st


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(1, 5))
def test_a_gradient_partition_holds_every_parameter_with_an_element_in_the_part(numels, N):
    """Stages 1–2's gradient partition, counted element by element instead of by ranges: the
    parameters with at least one element among the part's are held whole, from the first one's
    start to the last one's end or the part's end, whichever is further (the last rank's part
    runs into the padding) — whatever the sizes, so that a boundary falling on a parameter's
    first or last element is counted right."""
    psi = sum(numels)
    flat = -(-psi // (2 * N)) * 2 * N
    part = flat // N
    starts = [sum(numels[:i]) for i in range(len(numels))]
    for r in range(N):
        lo, hi = r * part, (r + 1) * part
        touching = [i for i, (s, n) in enumerate(zip(starts, numels)) if set(range(s, s + n)) & set(range(lo, hi))]
        want = (max(hi, starts[touching[-1]] + numels[touching[-1]]) - min(lo, starts[touching[0]])
                if touching else 0)
        got = deepspeed_holdings(2, numels, N, r, 8)["gradient partition (whole parameters)"]
        assert got == ("grads", 4 * want), (numels, N, r)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_knob_reaches_deepspeed_as_its_setting_and_what_it_cannot_take_is_refused(stage):
    """``TrainConfig`` → DeepSpeed's config, knob by knob, and the refusals, for every stage
    (written out, not read from the mapping)."""
    from minishard.strategies.deepspeed_native import DS_DEFAULTS, deepspeed_config
    from minishard.training.config import ConfigError
    s = f"deepspeed_zero{stage}"
    z = deepspeed_config(TrainConfig(strategy=s, micro_batch=3, bucket_cap_mb=1.0, clip=0.5), stage)
    assert (z["train_micro_batch_size_per_gpu"], z["gradient_accumulation_steps"], z["gradient_clipping"]) == (3, 1, 0.5)
    assert z["zero_optimization"]["stage"] == stage and z["zero_optimization"]["reduce_bucket_size"] == 2 ** 18
    bounds = dict(prefetch_bucket_size=111, max_live_parameters=222, param_persistence_threshold=333)
    if stage == 3:
        zz = deepspeed_config(TrainConfig(strategy=s, **bounds), 3)["zero_optimization"]
        assert (zz["stage3_prefetch_bucket_size"], zz["stage3_max_live_parameters"], zz["stage3_max_reuse_distance"],
                zz["stage3_param_persistence_threshold"]) == (111, 222, 222, 333)
        defaults = deepspeed_config(TrainConfig(strategy=s), 3)["zero_optimization"]
        assert all(defaults[k] == v for k, v in DS_DEFAULTS.items())
    else:
        for name, value in bounds.items():
            with pytest.raises(ConfigError, match=name):
                TrainConfig(strategy=s, **{name: value})
    if stage == 0:
        with pytest.raises(ConfigError, match="offload"):
            TrainConfig(strategy=s, offload="host")
    else:
        zo = deepspeed_config(TrainConfig(strategy=s, offload="host"), stage)["zero_optimization"]
        assert zo["offload_optimizer"] == {"device": "cpu"}
        assert ("offload_param" in zo) == (stage == 3)
        with pytest.raises(ConfigError, match="async-I/O op"):
            TrainConfig(strategy=s, offload="disk", offload_dir="/tmp/x")
    for name in ("save_to", "resume_from"):
        with pytest.raises(ConfigError, match="from_deepspeed"):
            TrainConfig(strategy=s, **{name: "/tmp/ck"})


# ----------------------------------------------------------------------------- parity
MB = 2


@pytest.mark.parametrize("N", [2, 3])
def test_deepspeed_trains_like_one_process_from_rank_0s_weights(pools, N):
    """Rank r builds its model from seed r: DeepSpeed broadcasts rank 0's weights at
    ``initialize`` (stages 0–2) and stage 3 partitions rank 0's, so every stage trains like one
    process from rank 0's weights — fp32 SGD, whose update is linear in the gradient (a missing
    1/N or a partition never reduced moves a tensor by ~100 % of its movement; summation order
    by < 1e-4, as for minishard's strategies: the bound is the same 1e-3)."""
    kw = dict(model="nano", steps=2, optimizer="sgd", lr=0.5, bucket_cap_mb=BUCKET_MB)
    ref = reference(N, MB, **kw)
    for stage in range(4):
        extra = dict(param_persistence_threshold=0, max_live_parameters=0) if stage == 3 else {}
        ours = pools(N).run(train, TrainConfig(strategy=f"deepspeed_zero{stage}", micro_batch=MB,
                                               return_params=True, rank_seeds=True, **kw, **extra))
        assert_parity(ours, ref, rtol=1e-3, what=f"deepspeed_zero{stage}, N={N}, ranks seeded apart")


def test_minishards_zero_and_pytorchs_fsdp2_train_as_deepspeeds_stages(pools):
    """Side by side from the same weights on 3 ranks, fp32 AdamW: minishard's ZeRO-k against
    DeepSpeed's stage k (k = 1, 2), and minishard's FSDP and PyTorch's FSDP2 against DeepSpeed's
    stage 3 — losses at every step within 1e-6 and every tensor within 2e-3 of its movement: each
    side differs from one process by summation order only (each within 2e-3 of it, the bound
    test_parity.py derives for AdamW), and the reduction orders differ between them."""
    kw = dict(model="nano", steps=3, optimizer="adamw", lr=1e-3, bucket_cap_mb=BUCKET_MB, micro_batch=MB,
              return_params=True)
    init = initial("nano")
    pairs = [("zero1", "deepspeed_zero1", {}), ("zero2", "deepspeed_zero2", {}),
             ("fsdp", "deepspeed_zero3", dict(param_persistence_threshold=0, max_live_parameters=0)),
             ("torch_fsdp", "deepspeed_zero3", dict(param_persistence_threshold=0, max_live_parameters=0))]
    theirs_cache = {}
    for mine, theirs, extra in pairs:
        if theirs not in theirs_cache:
            theirs_cache[theirs] = pools(3).run(train, TrainConfig(strategy=theirs, **kw, **extra))
        ours = pools(3).run(train, TrainConfig(strategy=mine, **kw))
        assert_parity(ours, as_reference(theirs_cache[theirs], init), loss_rtol=1e-6, rtol=2e-3,
                      what=f"{mine} against {theirs}")


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("knobs,words", [
    (dict(precision="bf16_mixed"), "fp32"), (dict(accum=2), "one micro-batch"),
    (dict(save_to="x"), "from_deepspeed"), (dict(prefetch=1), "FSDP"), (dict(wrap="linear"), "FSDP")])
def test_what_deepspeeds_strategies_do_not_do_here_is_refused_by_name(knobs, words):
    from minishard.training.config import ConfigError
    with pytest.raises(ConfigError, match=words):
        TrainConfig(strategy="deepspeed_zero3", **knobs).refuse_unused()


def test_a_deepspeed_module_that_is_not_the_engine_is_refused_with_the_way_out():
    """DeepSpeed's own modules other than its data-parallel engine — a pipeline module inside a
    model, the pipeline engine (a subclass of the engine, whose step is ``train_batch``) — are
    named and refused."""
    from minishard.instruments.watching import WatchError, watch

    class Fake(torch.nn.Module):
        pass
    Fake.__module__ = "deepspeed.runtime.pipe.module"
    with pytest.raises(WatchError, match="watch the engine deepspeed.initialize returned"):
        watch(torch.nn.Sequential(Fake()))
    engine = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    pipe = type("PipelineEngine", (engine,), {"__module__": "deepspeed.runtime.pipe.engine"})
    with pytest.raises(WatchError, match="PipelineEngine is DeepSpeed's but not its data-parallel engine"):
        watch(pipe())
    assert adapter.is_engine(engine()) and not adapter.is_engine(pipe())
