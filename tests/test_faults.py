"""Each planted fault (``minishard.instruments.faults``) trained on real ranks, then diagnosed by the doctor
from the files the ranks left: it names the fault, the rank and the collective, unit or
parameter; on healthy runs — including ones that look alike (ranks built from their own seeds
under a strategy that broadcasts rank 0's weights, bf16 with a master) — it finds nothing.

The hang is the issue's own case: a skipped collective on rank 1 of 4 under torchrun, which
must end within its timeout and leave dumps the doctor reads."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fault_tasks as T
from minishard.instruments import doctor
from minishard.cli import main
from minishard.instruments.faults import Fault
from minishard.training.config import ConfigError, TrainConfig
from minishard.training.loop import train
from minishard.core.model import GPT, config as model_config
from minishard.viewers.playback import fmt_bytes

WORLD, ODD = 4, 1                   # the fault goes on rank 1 of 4 (Fault's rank)
RUNS = {
    "healthy_fsdp": dict(strategy="fsdp", clip=1.0, accum=2),
    "healthy_ddp_own_seeds": dict(strategy="ddp", rank_seeds=True, clip=1.0),
    "healthy_torch_ddp_own_seeds": dict(strategy="torch_ddp", rank_seeds=True),
    "healthy_bf16_master": dict(strategy="zero2", precision="bf16_mixed", clip=1.0),
    "reorder": dict(strategy="fsdp", fault="reorder"),
    "torch_reorder": dict(strategy="torch_fsdp", fault="reorder"),
    "unsynced_ddp": dict(strategy="ddp", fault="unsynced-init"),
    "unsynced_fsdp": dict(strategy="fsdp", fault="unsynced-init"),
    "torch_fsdp_own_seeds": dict(strategy="torch_fsdp", rank_seeds=True),
    "no_master": dict(strategy="ddp", fault="no-master"),
    "local_clip": dict(strategy="fsdp", fault="local-clip", clip=0.5),
    "no_wrap": dict(strategy="fsdp", wrap="model"),
    "accum_unsharded": dict(strategy="fsdp", accum=2, accumulation="no_sync"),
}
N_PARAMS = GPT(T.SMALL["model"], device="meta").num_params()
N_LAYER = model_config(T.SMALL["model"]).n_layer


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faults")
    out = {}
    for name, knobs in RUNS.items():
        out[name] = root / name
        pools(WORLD).run(T.trained, str(out[name]), **knobs)
    return out


def found(directory) -> list[dict]:
    return doctor.diagnose(directory).as_dict()["findings"]


@pytest.mark.parametrize("name", [n for n in RUNS if n.startswith("healthy")])
def test_healthy_runs_find_nothing(runs, name):
    assert found(runs[name]) == []


def test_two_units_gathered_in_swapped_order_is_a_silent_desync_naming_rank_and_units(runs):
    for name in ("reorder", "torch_reorder"):           # minishard's FSDP and PyTorch's FSDP2 alike
        (f,) = found(runs[name])
        assert (f["kind"], f["ranks"]) == ("desync", [ODD]), name
        assert f"rank {ODD} all_gather of blocks.1" in f["title"], f["title"]
        assert "ranks 0, 2, 3 all_gather of blocks.0" in f["title"], f["title"]
        assert any("nothing failed" in e for e in f["evidence"]), f["evidence"]


def only_traces(run: Path, into: Path) -> Path:
    """The run's traces without its dumps and rings (a run recorded before rings, or cleaned)."""
    into.mkdir()
    for p in run.glob("rank*.jsonl"):
        shutil.copy(p, into / p.name)
    return into


def test_with_only_traces_the_swap_is_still_found_and_a_healthy_run_is_not_called_clean(runs, tmp_path, capsys):
    """No dump, no ring: the collectives each rank *completed*, in the order its trace holds
    them, stand in. The swapped units completed on every rank, so the desync shows; a healthy run
    gets exit status 3, not "nothing found" — a hang would look the same from its traces."""
    for name in ("reorder", "torch_reorder"):
        d = only_traces(runs[name], tmp_path / name)
        (f,) = found(d)
        assert (f["kind"], f["ranks"]) == ("desync", [ODD]), name
        assert f"rank {ODD} all_gather of blocks.1" in f["title"], f["title"]
        assert main(["doctor", str(d)]) == 1
    capsys.readouterr()
    assert main(["doctor", str(only_traces(runs["healthy_fsdp"], tmp_path / "healthy"))]) == 3
    out = capsys.readouterr().out
    assert f"no flight dumps, {WORLD} traces of a world of {WORLD}" in out, out
    assert "hangs and deaths cannot be checked (exit status 3" in out and "nothing found" not in out


def test_different_initial_weights_are_named_by_rank_and_parameter(runs):
    (replicas,) = found(runs["unsynced_ddp"])
    assert (replicas["kind"], replicas["ranks"]) == ("weights", [ODD])
    assert "started training from other weights than rank 0" in replicas["title"]
    assert replicas["evidence"][0].startswith(f"rank {ODD}: ") and "tok_emb.weight" in replicas["evidence"][0]
    (shards,) = found(runs["unsynced_fsdp"])
    assert (shards["kind"], shards["ranks"]) == ("weights", [ODD])
    assert "each rank sharded its own" in shards["title"]
    # PyTorch's FSDP2 broadcasts nothing (pytorch#148756): ranks built from their own seeds differ
    (theirs,) = found(runs["torch_fsdp_own_seeds"])
    assert (theirs["kind"], theirs["ranks"]) == ("weights", [1, 2, 3])


def test_bf16_without_a_master_is_named_with_the_updates_it_rounded_away(runs):
    (f,) = found(runs["no_master"])
    assert (f["kind"], f["ranks"]) == ("precision", list(range(WORLD)))
    assert "steps bfloat16 weights: no fp32 master" in f["title"]
    # DDP's optimizer steps every parameter on every rank: all of them are counted
    assert all(f"of {N_PARAMS:,} bfloat16 elements" in e for e in f["evidence"]), f["evidence"]
    assert len(f["evidence"]) == T.SMALL["steps"]


def test_a_norm_of_the_local_shards_differs_by_rank(runs):
    (f,) = found(runs["local_clip"])
    assert (f["kind"], f["ranks"]) == ("clip", list(range(WORLD)))
    assert "at step 0" in f["title"]
    assert all(f"rank {r}: " in f["evidence"][0] for r in range(WORLD))
    assert "no all-reduce of the squared norm" in f["evidence"][1]


def test_one_fsdp_unit_holding_every_parameter_is_named(runs):
    (f,) = found(runs["no_wrap"])
    assert (f["kind"], f["ranks"]) == ("memory", list(range(WORLD)))
    # the root alone: the whole model unsharded, fp32
    assert f"'root' holds 100 % of the parameters" in f["title"]
    assert f"holds {fmt_bytes(4 * N_PARAMS)} unsharded" in f["title"]


def test_accumulation_without_sync_names_the_full_gradients_kept(runs):
    (f,) = found(runs["accum_unsharded"])
    assert (f["kind"], f["ranks"]) == ("memory", list(range(WORLD)))
    # every unit's full fp32 gradient, the blocks and the root: the whole model's
    assert f"{fmt_bytes(4 * N_PARAMS)} of full gradients of {N_LAYER + 1} units" in f["title"]


# --------------------------------------------------------------------------- the hang, under torchrun

def test_a_skipped_collective_on_rank_1_of_4_under_torchrun_ends_in_its_timeout(tmp_path):
    trace, timeout = tmp_path / "hung", 4
    # PyTorch keeps its own flight recorder too (on gloo since 2.7): --torch-flight writes it beside
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={WORLD}", "-m", "minishard", "demo", "--model", "nano",
                           "--steps", "2", "--micro-batch", "2", "--fault", "skip-collective",
                           "--fault-rank", str(ODD), "--timeout", str(timeout), "--trace", str(trace),
                           "--torch-flight", "--quiet"], env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - start
    assert done.returncode != 0, done.stdout[-2000:]
    assert f"minishard doctor {trace}" in done.stderr, done.stderr[-2000:]
    reasons = {r: json.loads((trace / f"flight_rank{r}.json").read_text())["reason"] for r in range(WORLD)}
    # the waiting ranks time out together; on a loaded machine torchrun may stop one (SIGTERM,
    # written as such) after another's timeout ended it, before its own timeout fires
    waiting = [r for r in range(WORLD) if r != ODD]
    raised = [r for r in waiting if reasons[r] == "exception"]
    assert reasons[ODD] == "end" and raised and all(reasons[r] in ("exception", "sigterm") for r in waiting), reasons
    hang, timed_out = found(trace)
    assert (hang["kind"], hang["ranks"]) == ("hang", [ODD])
    assert f"rank {ODD} never issued seq" in hang["title"] and "(all_reduce of bucket0)" in hang["title"]
    assert "ranks 0, 2, 3 wait in it" in hang["title"]
    assert any("step 1, phase backward" in e for e in hang["evidence"]), hang["evidence"]
    assert timed_out["kind"] == "timeout" and timed_out["ranks"] == raised
    print(f"hung run ended in {seconds:.1f} s (collective timeout {timeout} s)")
    # within its timeout: starting 4 processes (~15 s on a busy 2-core machine), the timeout,
    # the dumps; without the timeout, gloo would wait 30 minutes
    assert seconds < 90
    # PyTorch's own dumps alone (a job that never imported minishard would leave only those)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for r in range(WORLD):
        shutil.copy(trace / f"torch_fr_trace_rank_{r}", theirs)
    (hang,) = found(theirs)
    assert (hang["kind"], hang["ranks"]) == ("hang", [ODD])
    assert f"rank {ODD} never issued seq" in hang["title"]
    assert "of group 'torch:default_pg' (all_reduce); ranks 0, 2, 3 wait in it" in hang["title"]


def test_naive_ddp_skips_its_gradient_all_reduces_in_the_last_step():
    """Naive DDP reduces its gradients after backward, in ``sync_gradients``: the skip-collective
    fault must skip them there, or a run that asked for the hang (``demo --strategy ddp_naive
    --fault skip-collective``) would train to the end and the doctor find nothing. One rank,
    alone, in this process: step 0 all-reduces every gradient (one call per parameter tensor,
    its fp32 bytes), the last step none."""
    net = GPT(T.SMALL["model"], device="meta")
    out = train(None, TrainConfig(strategy="ddp_naive", model=T.SMALL["model"], steps=2, micro_batch=1),
                hooks=Fault("skip-collective", 0))
    tensors = len(list(net.parameters()))
    assert out["calls"] == [tensors, 0]
    assert out["payload"] == [4 * N_PARAMS, 0]
    assert out["by_op"] == {"all_reduce": {"payload": 4 * N_PARAMS, "wire": 0, "calls": tensors}}


# --------------------------------------------------------------------------- refused before any rank starts

@pytest.mark.parametrize("fault, knobs, says", [
    (("crash",), {}, "fault='crash': unknown fault; expected one of skip-collective, reorder"),
    (("reorder",), dict(strategy="ddp"), "needs an FSDP strategy with one unit per block"),
    (("reorder",), dict(strategy="fsdp", wrap="model"), "needs an FSDP strategy with one unit per block"),
    (("reorder",), dict(strategy="fsdp", model_overrides={"n_layer": 1}), "has one block"),
    (("local-clip",), dict(strategy="zero2"), "plants a wrong gradient clip: set clip"),
    (("local-clip",), dict(strategy="ddp", clip=1.0), "its own norm is the global one"),
    (("skip-collective",), dict(strategy="torch_ddp"), "strategy='torch_ddp' is PyTorch's own and does not use it"),
    (("no-master",), dict(precision="bf16_mixed"), "keeps one: drop it"),
    (("extra-collective",), dict(strategy="zero2"), "choose ddp or ddp_naive, not strategy='zero2'"),
    (("extra-collective",), dict(strategy="torch_ddp"), "choose ddp or ddp_naive, not strategy='torch_ddp'"),
    (("unsynced-init",), dict(strategy="single"), "needs ranks that disagree"),
    (("reorder", -1), dict(strategy="fsdp"), "fault_rank=-1: must be a rank"),
    (("reorder", True), dict(strategy="fsdp"), "fault_rank=True: must be a rank"),
])
def test_a_fault_a_strategy_cannot_have_is_refused_by_name(fault, knobs, says):
    with pytest.raises(ConfigError) as e:
        Fault(*fault).check(TrainConfig(**knobs))
    assert says in str(e.value), str(e.value)


@pytest.mark.parametrize("knobs, says", [
    (dict(save_background=True), "save_background=True needs save_to"),
    (dict(save_every=2), "save_every=2 needs save_to"),
])
def test_a_save_knob_without_a_place_to_save_is_refused_by_name(knobs, says):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**knobs)
    assert says in str(e.value), str(e.value)


def test_train_refuses_a_fault_its_run_cannot_have_before_anything_is_built():
    """The hooks are checked first, in train itself: a fault ``demo`` did not vet (a notebook's
    own call) is refused by name, not planted into a run it cannot break as it says."""
    with pytest.raises(ConfigError, match="needs an FSDP strategy"):
        train(None, TrainConfig(strategy="ddp", model="nano", steps=1, micro_batch=1), hooks=Fault("reorder", 0))


@pytest.mark.parametrize("rank, world, refused", [(1, 2, False), (2, 2, True), (3, 4, False), (4, 4, True)])
def test_a_fault_rank_is_checked_against_the_world_the_run_meets(rank, world, refused):
    """Only the run knows the world's size; train() checks it first on every rank: a
    fault on rank ``world_size`` would land on no rank and the run would find nothing."""
    config, fault = TrainConfig(strategy="fsdp"), Fault("reorder", rank)
    if not refused:
        fault.check(config, world)
        return
    with pytest.raises(ConfigError) as e:
        fault.check(config, world)
    assert f"fault_rank={rank}: no such rank in a world of {world}" in str(e.value)


def test_the_command_line_names_the_fault_flags(capsys):
    assert main(["demo", "--fault", "crash", "--world-size", "2"]) == 2
    assert "--fault crash: unknown fault" in capsys.readouterr().err
    assert main(["demo", "--fault-rank", "2", "--world-size", "2"]) == 2
    assert "--fault-rank 2 is the rank a fault is planted on: set --fault, or drop it" in capsys.readouterr().err
    assert main(["demo", "--strategy", "fsdp", "--fault", "reorder", "--fault-rank", "2",
                 "--world-size", "2"]) == 2
    assert "--fault-rank 2: no such rank in a world of 2" in capsys.readouterr().err
    assert main(["demo", "--timeout", "0", "--world-size", "2"]) == 2
    assert "--timeout 0.0: a collective's timeout must be a positive" in capsys.readouterr().err


def test_an_unreadable_pytorch_dump_is_exit_2_naming_it(tmp_path, capsys):
    (tmp_path / "nccl_trace_rank_0").write_bytes(b"not a pickle")
    assert main(["doctor", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nccl_trace_rank_0'}: not a PyTorch flight-recorder dump" in err, err


def test_running_out_of_memory_is_split_into_its_causes_largest_first(tmp_path):
    """One rank, FSDP with prefetch 2 on a device of 2.86 MiB: the allocation that fails is
    named with the ledger's exact count, and what it held is split into what one can change."""
    import torch

    from minishard.core.launch import RankContext
    from minishard.core.ledger import DeviceOutOfMemory
    from minishard.training.loop import train
    from minishard.core.trace import Tracer
    rank = RankContext(0, 1, torch.device("cpu"), Tracer(), "none")
    with pytest.raises(DeviceOutOfMemory) as oom:
        try:
            train(rank, TrainConfig(strategy="fsdp", prefetch=2, device_budget=3_000_000,
                                    flight_dir=str(tmp_path), **T.SMALL))
        finally:
            rank.tracer.write_jsonl(tmp_path / "rank0.jsonl")
    e = oom.value
    raised, memory = found(tmp_path)
    assert (raised["kind"], memory["kind"], memory["ranks"]) == ("exception", "memory", [0])
    assert f"held {fmt_bytes(sum(e.held.values()))}, allocating {fmt_bytes(e.nbytes)} of {e.category}" \
        in memory["title"]
    state = sum(b for c, b in e.held.items() if c not in ("activations", "unsharded", "comm_buffers"))
    said = {line.split(":")[0] for line in memory["evidence"]}
    assert f"parameters' shards, gradients and optimizer state {fmt_bytes(state)}" in said
    assert f"activations {fmt_bytes(e.held['activations'])}" in said
    # the units gathered are the ledger's unsharded bytes, unit by unit
    (units,) = [line for line in memory["evidence"] if "gathered at once" in line]
    assert "root" in units and "smaller prefetch depth" in units
    # largest first: here the state (every shard, its gradient) outweighs the activations
    assert state > e.held["activations"] and memory["evidence"][0].startswith("parameters' shards")


def test_every_ranks_dump_names_the_fault_and_the_rank_it_was_planted_on(runs):
    """The run's config in each rank's dump (``facts["run"]``) says which fault was planted and
    on which rank — the same on every rank, the healthy ones included."""
    for name, fault in (("unsynced_ddp", "unsynced-init"), ("reorder", "reorder"), ("no_master", "no-master")):
        for r in range(WORLD):
            run = json.loads((runs[name] / f"flight_rank{r}.json").read_text())["facts"]["run"]
            assert (run["fault"], run["fault_rank"]) == (fault, ODD), (name, r, run)
    run = json.loads((runs["healthy_fsdp"] / "flight_rank0.json").read_text())["facts"]["run"]
    assert "fault" not in run and "fault_rank" not in run, run


def test_the_run_report_counts_the_precision_a_fault_planted(pools):
    """``no-master`` casts the weights to bf16 under an fp32 config: the formula follows what
    was trained — bf16 weights, gradients and moments, no master — so the peak is the formula,
    not half of an fp32 one explained away as "not all alive at the peak"."""
    import fault_tasks
    for strategy in ("ddp", "zero2", "fsdp"):
        planted, plain = (pools(2).run(fault_tasks.ledger_of, f, strategy=strategy)[0]
                          for f in ("no-master", None))
        assert (planted["precision"], plain["precision"]) == ("bf16", "fp32"), strategy
        for c in ("params", "exp_avg", "exp_avg_sq"):
            assert planted["estimate"][c] * 2 == plain["estimate"][c], (strategy, c)
        if strategy == "ddp":            # replicas: every category alive at the peak, exactly
            assert {c: b for c, b in planted["peak_snapshot"].items() if b} == \
                {c: b for c, b in planted["estimate"].items() if b}
