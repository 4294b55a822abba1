"""Replicas that drift apart after the start (issue 50): the two silent DDP bugs a new user hit —
rank 1's optimizer built with another learning rate, rank 1 skipping ``optimizer.step()`` once —
under ``minishard.watch`` on PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2, where every
collective matches. The watch fingerprints the replicas and notes the optimizers' settings and
step counts every ``fingerprint_every`` steps (``instruments/replicas.py``); the doctor
(``instruments/drift.py``) names the rank, the first recorded step at which it differs and the
cause, and exits 1. Healthy, the same jobs exit 0 and say what was compared.

Then the records themselves: which steps are recorded (the cadence and the last, under
``train`` and under the watch), which parameters are replicas (DDP's, ZeRO's whole parameters,
the parameters an FSDP unit keeps whole, an HSDP replica group), what the ring keeps of them,
and the doctor against planted drifts — at a random step and rank, in hand-built dumps of 2 to 6
ranks and on real ranks."""
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minishard
from minishard.cli import main
from minishard.core import flight_file
from minishard.core.flight import FlightRecorder
from minishard.instruments import doctor, replicas
from minishard.training.config import ConfigError
from minishard.training.loop import TrainConfig, train

import drift_tasks
from drift_tasks import ODD, SKIPPED, STEPS
from flight_dumps import dump, entry, write

LAST = STEPS - 1


def _drift(out):
    found = doctor.diagnose(out).findings
    return found, [f for f in found if f.kind == "drift"]


# --------------------------------------------------------------------------- the user's jobs

@pytest.mark.parametrize("job", drift_tasks.JOBS)
def test_the_users_healthy_job_finds_nothing_and_says_what_it_compared(pools, tmp_path, job, capsys):
    out = tmp_path / job
    pools(2).run(drift_tasks.users_job, job, None, str(out))
    assert doctor.diagnose(out).findings == []
    assert main(["doctor", str(out)]) == 0
    said = capsys.readouterr().out
    if job == "fsdp2":            # every parameter sharded: nothing held as a replica
        assert f"settings and step counts agreed at every step recorded (steps 0, {LAST})" in said, said
        assert "Not compared: the weights after the start" in said, said
    else:
        assert (f"The replicas agreed at every step recorded (steps 0, {LAST}; 41 parameters held by "
                f"ranks 0, 1), and so did the optimizers' settings and step counts") in said, said


@pytest.mark.parametrize("job", drift_tasks.JOBS)
def test_rank_1_with_another_learning_rate_is_named_with_the_step_and_both_values(pools, tmp_path, job, capsys):
    out = tmp_path / job
    pools(2).run(drift_tasks.users_job, job, "lr", str(out))
    found, (f,) = _drift(out)
    assert found == [f] and f.ranks == [ODD], f.title
    assert f"another lr ({drift_tasks.ODD_LR} against rank 0's {drift_tasks.LR})" in f.title, f.title
    assert f"rank {ODD}'s optimizer, param group 0: lr {drift_tasks.ODD_LR}, rank 0's {drift_tasks.LR}" in f.evidence
    if job == "ddp":             # the replicas differ from the first step on
        assert "replica differs from rank 0's after step 0, the first step recorded" in f.title, f.title
        assert any(e.startswith(f"rank {ODD}: 41 of the 41 parameters held as replicas by ranks 0, 1 differ")
                   for e in f.evidence), f.evidence
        assert "of two ranks neither is a majority: rank 0, the lower, is the reference" in " ".join(f.evidence)
    else:                        # ZeRO broadcasts each part from its owner; FSDP2 has no replicas
        assert f.title.startswith(f"rank {ODD}'s optimizer has another lr") and "at step 0" in f.title, f.title
        why = "sends it to the others (ZeRO)" if job == "zero" else "every one is sharded"
        assert why in " ".join(f.evidence), f.evidence
    assert main(["doctor", str(out)]) == 1
    capsys.readouterr()


def test_fsdp2s_hybrid_shards_are_replicas_across_their_replica_group(pools, tmp_path):
    """FSDP2 on a (replicate, shard) mesh: a DTensor's ``Replicate`` dimension makes the ranks
    along it replicas of one shard — compared, and the rank with another lr named."""
    healthy, planted = tmp_path / "healthy", tmp_path / "lr"
    pools(2).run(drift_tasks.users_job, "hsdp2", None, str(healthy))
    assert [(s["ranks"], len(s["prints"])) for s in _records(healthy)[0]["sets"]] == [([0, 1], 41)]
    assert doctor.diagnose(healthy).findings == []
    pools(2).run(drift_tasks.users_job, "hsdp2", "lr", str(planted))
    (f,) = _drift(planted)[1]
    assert f.ranks == [ODD] and "replica differs from rank 0's after step 0" in f.title and "another lr" in f.title


@pytest.mark.parametrize("seeds", ("apart", "same"))
def test_ddp_on_groups_of_its_own_compares_each_groups_replicas_within_it(pools, tmp_path, seeds):
    """PyTorch's DDP on two pairs of four ranks (``process_group=``), as beside tensor or
    pipeline parallelism: each pair's replicas are a set of their own, compared within the pair —
    the pairs differ by design (another seed each, "apart"; or fed other batches). Healthy:
    nothing found, not a drift or a start apart across the pairs; rank 3's other lr is named
    against rank 2, its pair's reference."""
    healthy, planted = tmp_path / "healthy", tmp_path / "lr"
    pool = pools(4)
    pool.run(drift_tasks.pairs_job, str(healthy), None, seeds)
    for r in range(4):
        pair = [r // 2 * 2, r // 2 * 2 + 1]
        assert [(s["ranks"], len(s["prints"])) for s in _records(healthy, r)[0]["sets"]] == [(pair, 41)]
    assert doctor.diagnose(healthy).findings == []
    pool.run(drift_tasks.pairs_job, str(planted), "lr", seeds)
    found, (f,) = _drift(planted)
    assert found == [f] and f.ranks == [3], [g.title for g in found]
    assert "rank 3's replica differs from rank 2's after step 0" in f.title, f.title
    assert f"another lr ({drift_tasks.ODD_LR} against rank 2's {drift_tasks.LR})" in f.title, f.title


@pytest.mark.parametrize("job", ("ddp", "fsdp2"))
def test_rank_1_that_skipped_one_optimizer_step_is_named_with_that_step(pools, tmp_path, job, capsys):
    out = tmp_path / job
    pools(2).run(drift_tasks.users_job, job, "skip", str(out))
    found, (f,) = _drift(out)
    assert found == [f] and f.ranks == [ODD], f.title
    assert f"optimizer did not step at step {SKIPPED}" in f.title, f.title
    # the first record after the skipped step is the last step's (every 10: steps 0 and LAST)
    assert f"after step {LAST}" in f.title or f"found at step {LAST}" in f.title, f.title
    assert (f"rank {ODD}'s optimizer had stepped {STEPS - 1} times after step {LAST}, rank 0's {STEPS} "
            f"times; it took no step at step {SKIPPED}") in f.evidence, f.evidence
    if job == "ddp":
        assert "they were equal after step 0, the record before" in f.evidence
    assert main(["doctor", str(out)]) == 1
    capsys.readouterr()


def test_under_zero_a_skipped_step_is_loud_and_the_rank_that_skipped_it_is_named(tmp_path, capsys):
    """ZeroRedundancyOptimizer's step broadcasts each rank's part: rank 1, skipping it, is a
    step ahead; rank 0's broadcasts pair with its next all-reduce and the ranks time out. The
    desync says where; the drift finding says who skipped which step."""
    from minishard.core.launch import RankError, Ranks
    out = tmp_path / "zero"
    with Ranks(2, timeout=120, collective_timeout=3) as own:
        with pytest.raises(RankError):
            own.run(drift_tasks.users_job, "zero", "skip", str(out))
    found, (f,) = _drift(out)
    assert f.ranks == [ODD] and f"optimizer did not step at step {SKIPPED}: rank 0 did" in f.title, f.title
    assert f"rank {ODD} issued no collective in step {SKIPPED}'s optimizer phase" in f.evidence[0]
    assert "desync" in {g.kind for g in found}
    assert main(["doctor", str(out)]) == 1
    capsys.readouterr()


@pytest.mark.parametrize("rank0_last_step", (0, 1))
def test_a_rank_past_a_steps_optimizer_phase_with_none_of_its_collectives_is_named_one_still_in_it_is_not(
        tmp_path, rank0_last_step):
    """ZeRO's step sends each rank's stepped part to the others in the optimizer phase: rank 1
    issued those of step 0, rank 0 none. Gone on to step 1, rank 0 skipped step 0's optimizer
    step; stopped in step 0 (its backward's all-reduce never completed), it is a hang's rank, not
    one that skipped a step."""
    rank0 = [entry(0, step=0, phase="backward", size=2, state="issued" if rank0_last_step == 0 else "completed")]
    if rank0_last_step == 1:
        rank0.append(entry(1, step=1, phase="backward", size=2, op="broadcast", state="issued"))
    rank1 = [entry(0, step=0, phase="backward", size=2), entry(1, step=0, phase="optimizer", op="broadcast", size=2,
                                                             state="issued")]
    write(tmp_path, [dump(0, rank0, world=2), dump(1, rank1, world=2)])
    skipped = [f for f in doctor.diagnose(tmp_path).findings if f.kind == "drift"]
    if rank0_last_step == 0:
        assert skipped == []
    else:
        (f,) = skipped
        assert f.ranks == [0] and f.title == "rank 0's optimizer did not step at step 0: rank 1 did", f.title


@pytest.mark.parametrize("kind,bug", [("ddp", "lr"), ("zero", "lr"), ("fsdp", "lr"), ("zero", None)])
def test_minishards_own_strategies_under_the_watch(pools, tmp_path, kind, bug):
    out = tmp_path / kind
    pools(2).run(drift_tasks.own_job, kind, bug, str(out))
    found = doctor.diagnose(out).findings
    if bug is None:
        assert found == []
        return
    (f,) = found
    assert f.kind == "drift" and f.ranks == [ODD] and "another lr" in f.title, f.title
    assert ("replica differs" in f.title) == (kind == "ddp"), f.title


# --------------------------------------------------------------------------- what is recorded

def _records(out, rank=0) -> list[dict]:
    return json.loads((out / f"flight_rank{rank}.json").read_text())["facts"]["replicas"]


@pytest.mark.parametrize("strategy", ("ddp", "torch_ddp"))
def test_train_records_every_kth_step_and_the_last_once(pools, tmp_path, strategy):
    out = tmp_path / strategy
    pools(2).run(train, TrainConfig(strategy=strategy, model="nano", steps=4, micro_batch=2,
                                    flight_dir=str(out), fingerprint_every=2))
    records = _records(out)
    assert [r["step"] for r in records] == [0, 2, 3]
    assert [r["optimizer_steps"] for r in records] == [1, 3, 4]
    assert records[0]["settings"][0]["lr"] == TrainConfig.lr
    (s,) = records[0]["sets"]
    assert s["ranks"] == [0, 1] and len(s["prints"]) == 41 and "tok_emb.weight" in s["prints"]


def test_under_the_watch_the_cadence_and_an_unended_last_step(pools, tmp_path):
    out = tmp_path / "every"
    pools(2).run(drift_tasks.users_job, "ddp", None, str(out), steps=4, every=1)
    assert [r["step"] for r in _records(out)] == [0, 1, 2, 3]
    out = tmp_path / "end"
    pools(2).run(drift_tasks.users_job, "ddp", None, str(out), steps=3, every=None)
    assert [r["step"] for r in _records(out)] == [2]


def test_a_long_run_keeps_every_fingerprint_in_its_first_and_latest_records_only(pools, tmp_path):
    """Past ``KEPT`` records, the second oldest keeps only its digests: the dump stays small, the
    digests still find the first step at which rank 1 differs, and a later record that kept the
    fingerprints names the parameters."""
    out = tmp_path / "long"
    steps = replicas.KEPT + 4
    pools(2).run(drift_tasks.users_job, "ddp", "skip", str(out), steps=steps, every=1)
    records = _records(out)
    whole = [r["step"] for r in records if "prints" in r["sets"][0]]
    assert [r["step"] for r in records] == list(range(steps))
    assert whole == [0, *range(steps - replicas.KEPT + 1, steps)], whole
    (f,) = _drift(out)[1]
    assert f.ranks == [ODD] and f"after step {SKIPPED}, the first step recorded" in f.title, f.title
    assert f"optimizer did not step at step {SKIPPED}" in f.title
    first_whole = min(s for s in whole if s >= SKIPPED)
    assert any(f"the parameters are named from step {first_whole}'s" in e for e in f.evidence), f.evidence


def test_replica_sets_of_minishards_own_strategies(pools, tmp_path):
    """FSDP's shards are in no set, the parameters a unit keeps whole are (every rank holds them);
    HSDP's shards are replicas across its replica group."""
    kept = tmp_path / "kept"
    pools(2).run(train, TrainConfig(strategy="fsdp", model="nano", steps=1, micro_batch=2,
                                    flight_dir=str(kept), param_persistence_threshold=64))
    (s,) = _records(kept)[0]["sets"]
    small = {n for n, p in minishard.GPT(minishard.model_config("nano"), device="meta").named_parameters()
             if p.numel() <= 64}
    assert s["ranks"] == [0, 1] and set(s["prints"]) == small and small
    hybrid = tmp_path / "hsdp"
    pools(2).run(train, TrainConfig(strategy="hsdp", shard_size=1, model="nano", steps=1, micro_batch=2,
                                    flight_dir=str(hybrid)))
    (s,) = _records(hybrid)[0]["sets"]
    assert s["ranks"] == [0, 1] and len(s["prints"]) == 41


def test_what_the_ring_keeps_is_read_back_as_the_facts(tmp_path):
    rec = FlightRecorder(1, 2, capacity=4)
    rec.fly_to(tmp_path)
    prints = {"w": "00" * 8}
    rec.note("replicas", {"step": 0}, {"step": 0, "optimizer_steps": 1, "settings": "ab",
                                       "sets": [[[0, 1], replicas.digest(prints)]]})
    rec.issued("all_reduce", "world", 2, [torch.zeros(2)], 8, "", 0, "backward", 0.0)
    assert rec.file.noted("replicas", {"sets": "x" * flight_file.RECORD}) is False   # too long: left out
    body = flight_file.read(flight_file.path_for(tmp_path, 1))
    assert [e["op"] for e in body["entries"]] == ["all_reduce"]
    (kept,) = body["facts"]["replicas"]
    assert kept["sets"] == [[[0, 1], replicas.digest(prints)]] and kept["step"] == 0
    assert rec.facts["replicas"] == [{"step": 0}]


def test_a_rank_known_by_its_ring_alone_is_compared_by_digest(tmp_path):
    same, other = {"w": "1" * 16, "b": "2" * 16}, {"w": "1" * 16, "b": "3" * 16}
    full = dump(0, [], world=2)
    full["facts"] = {"replicas": [_full(0, same), _full(4, same)], "fingerprint_every": 4}
    write(tmp_path, [full])
    f = FlightRecorder(1, 2)
    f.fly_to(tmp_path)
    for step, prints in ((0, same), (4, other)):
        f.note("replicas", {}, {"step": step, "optimizer_steps": step + 1, "settings":
                                replicas.settings_digest(SETTINGS), "sets": [[[0, 1], replicas.digest(prints)]]})
    (finding,) = doctor.diagnose(tmp_path).findings[-1:]
    assert finding.kind == "drift" and finding.ranks == [1] and "after step 4" in finding.title
    assert "no record of both keeps a fingerprint per parameter: a ring's does not" in " ".join(finding.evidence)


SETTINGS = [{"lr": 0.1, "momentum": 0.0}]


def _full(step, prints, ranks=(0, 1), settings=SETTINGS, optimizer_steps=None):
    return {"step": step, "optimizer_steps": step + 1 if optimizer_steps is None else optimizer_steps,
            "settings": settings, "sets": [{"ranks": list(ranks), "prints": prints}]}


def test_the_fingerprint_sees_values_not_strides_and_every_byte():
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    (base,) = replicas.fingerprint([("w", t)]).values()
    assert replicas.fingerprint([("w", t.t().contiguous().t())]) == {"w": base}     # other strides
    assert replicas.fingerprint([("w", t.t())])["w"] != base                         # other values
    assert replicas.fingerprint([("w", t.view(4, 3))])["w"] != base
    assert replicas.fingerprint([("w", t.view(torch.int32))])["w"] != base
    flipped = t.clone()
    flipped.view(torch.int32)[2, 3] ^= 1
    assert replicas.fingerprint([("w", flipped)])["w"] != base
    assert replicas.fingerprint([("s", torch.tensor(1.0))])["s"] != replicas.fingerprint([("s", torch.tensor(2.0))])["s"]


def test_settings_are_the_groups_without_their_parameters_as_json_values():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [p]}, {"params": [], "lr": torch.tensor(0.5)}], lr=0.1)
    opt.param_groups[0]["hook"] = print                          # (not a setting: left out)
    opt.param_groups[0]["max_norm"] = float("inf")
    groups = replicas.settings(opt)
    assert groups[0]["lr"] == 0.1 and groups[0]["betas"] == [0.9, 0.999] and groups[1]["lr"] == 0.5
    assert "params" not in groups[0] and "hook" not in groups[0] and groups[0]["max_norm"] == "inf"
    json.dumps(groups)


def test_a_cadence_that_is_not_one_is_refused_where_it_is_given():
    with pytest.raises(ConfigError, match=r"fingerprint_every=0: must be an integer >= 1"):
        TrainConfig(fingerprint_every=0, flight_dir="x")
    with pytest.raises(ConfigError, match=r"fingerprint_every=5 needs flight_dir"):
        TrainConfig(fingerprint_every=5)
    assert TrainConfig(fingerprint_every=None, flight_dir="x").fingerprint_every is None
    with pytest.raises(ValueError, match=r"fingerprint_every=True: must be an integer >= 1"):
        minishard.watch(torch.nn.Linear(2, 2), fingerprint_every=True)
    assert TrainConfig().fingerprint_every == replicas.EVERY


def test_the_command_line_names_its_flag(capsys):
    assert main(["demo", "--fingerprint-every", "0", "--trace", "t", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--fingerprint-every 0: must be an integer >= 1" in err, err
    assert main(["demo", "--fingerprint-every", "3", "--world-size", "2"]) == 2
    assert "--fingerprint-every 3 needs --trace" in capsys.readouterr().err


def test_dumps_without_records_say_the_weights_after_the_start_were_not_compared(tmp_path, capsys):
    write(tmp_path, [dump(r, [], world=2) for r in range(2)])
    assert main(["doctor", str(tmp_path)]) == 0
    assert "Not compared: the weights after the start and the optimizers' settings" in capsys.readouterr().out


def test_a_damaged_record_is_refused_naming_the_file(tmp_path, capsys):
    bodies = [dump(r, [], world=2) for r in range(2)]
    bodies[1]["facts"] = {"replicas": [{"sets": []}]}
    write(tmp_path, bodies)
    assert main(["doctor", str(tmp_path)]) == 2
    assert "flight_rank1.json: replicas record 0 cannot be read" in capsys.readouterr().err


# --------------------------------------------------------------------------- planted at random

FAST = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def planted(draw):
    """(world, every, steps, the planted step, the planted rank, its kind, the parameter)."""
    world = draw(st.integers(2, 6))
    steps = draw(st.integers(1, 30))
    every = draw(st.one_of(st.none(), st.integers(1, 12)))
    at = draw(st.integers(0, steps - 1))
    # with two ranks neither is a majority: the doctor names rank 1, so that is where it goes
    odd = 1 if world == 2 else draw(st.integers(0, world - 1))
    kind = draw(st.sampled_from(("weights", "lr", "skip")))
    return world, every, steps, at, odd, kind, draw(st.integers(0, 4))


def _recorded_steps(every, steps) -> list[int]:
    return sorted({s for s in range(steps) if every and s % every == 0} | {steps - 1})


@FAST
@given(planted())
def test_a_drift_planted_in_hand_built_dumps_is_named_at_its_step_and_rank(tmp_path_factory, case):
    world, every, steps, at, odd, kind, param = case
    names = [f"blocks.{i}.w" for i in range(5)]
    bodies = []
    for r in range(world):
        records, notes = [], []
        for s in range(steps):
            if not (kind == "skip" and r == odd and s == at):
                notes.append({"step": s, "param_dtypes": ["float32"]})
            if s not in _recorded_steps(every, steps):
                continue
            drifted = r == odd and s >= at
            prints = {n: f"a{i:015x}" if not (drifted and (kind != "weights" or i == param)) else f"d{s:07x}{r:08x}"
                      for i, n in enumerate(names)}
            lr = 0.2 if kind == "lr" and drifted else 0.1
            records.append(_full(s, prints, range(world), [{"lr": lr, "momentum": 0.0}],
                                 len(notes)))
        body = dump(r, [], world=world)
        body["facts"] = {"replicas": records, "steps": notes, "fingerprint_every": every}
        bodies.append(body)
    out = write(tmp_path_factory.mktemp("planted"), bodies)
    found, (f,) = _drift(out)
    first = min(s for s in _recorded_steps(every, steps) if s >= at)
    assert f.ranks == [odd], (case, f.title)
    assert f"after step {first}, the first step recorded" in f.title, (case, f.title)
    n = 1 if kind == "weights" else len(names)
    assert any(e.startswith(f"rank {odd}: {n} of the {len(names)} parameters") for e in f.evidence), f.evidence
    if kind == "weights":
        assert f.title.endswith(": every collective matched") and f"({names[param]};" in " ".join(f.evidence)
    elif kind == "lr":
        assert f.title.endswith("its optimizer has another lr (0.2 against rank " + f"{0 if odd else 1}'s 0.1)")
    else:
        assert f.title.endswith(f"its optimizer did not step at step {at}"), (case, f.title)
    others = [r for r in range(world) if r != odd]
    assert (f"of two ranks neither is a majority: rank 0, the lower, is the reference" if world == 2 else
            f"{'rank' if len(others) == 1 else 'ranks'} {', '.join(map(str, others))} agree: the majority, "
            f"the reference") in " ".join(f.evidence), f.evidence
    earlier = [s for s in _recorded_steps(every, steps) if s < first]
    assert (f"they were equal after step {earlier[-1]}, the record before" if earlier else
            f"step {first} is the first step recorded: they differed from the first step on") in f.evidence


@settings(max_examples=4, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(at=st.integers(0, STEPS - 1), every=st.integers(1, 4), param=st.integers(0, 40))
def test_a_drift_planted_on_real_ranks_is_named_at_its_step_and_rank(pools, tmp_path_factory, at, every, param):
    names = [n for n, _ in minishard.GPT(minishard.model_config("nano"), device="meta").named_parameters()]
    out = tmp_path_factory.mktemp("nudged")
    pools(2).run(drift_tasks.nudged, str(out), at, names[param], every)
    found, (f,) = _drift(out)
    first = min(s for s in _recorded_steps(every, STEPS) if s >= at)
    assert found == [f] and f.ranks == [ODD], f.title
    assert f"after step {first}, the first step recorded" in f.title and f.title.endswith("every collective matched")
    # the nudged parameter differs, and with DDP's averaged gradients the others stay equal
    assert any(e.startswith(f"rank {ODD}: 1 of the 41 parameters held as replicas by ranks 0, 1")
               and f"({names[param]};" in e for e in f.evidence), f.evidence
