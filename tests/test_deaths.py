"""The deaths that leave no dump: what the ring written as the run flew lets the doctor say.

A rank that gloo aborts in C++, that is ``SIGKILL``ed, that calls ``os.abort()`` never returns to
Python to write its flight dump; before the ring (``minishard/core/flight_file.py``) the doctor
then said "no flight dumps" and exited 0. Each case runs on real ranks in a pool of its own (the
death takes the pool with it), for minishard's engine and for PyTorch's DDP and FSDP2 under
``minishard.watch``: the doctor's findings name the rank, the collective (seq, op, bytes) and the
line, and ``minishard doctor`` exits 1. The same jobs run healthy find nothing and exit 0.

The default suite runs each death once on 2 ranks (minishard's engine: all four; PyTorch's DDP: the
size mismatch of the issue and the early exit; FSDP2: the kill mid-backward; DeepSpeed's ZeRO-2 and
ZeRO-3: the kill mid-backward and one collective more) and the mismatch on 4 ranks;
``MINISHARD_ALL_DEATHS=1`` runs every job with every death on 2 and 4 ranks.
"""
import os

import pytest

from minishard.cli import main
from minishard.core import flight_file, run_id
from minishard.core.run_id import read_header
from minishard.core.launch import RankError, Ranks
from minishard.course.ch11 import outcome
from minishard.instruments import doctor

import death_tasks
from death_tasks import DYING

ALL = os.environ.get("MINISHARD_ALL_DEATHS") == "1"
JOBS = ("minishard", "torch_ddp", "torch_fsdp", "deepspeed_zero2", "deepspeed_zero3")
DEFAULT = {("minishard", d, 2) for d in death_tasks.DEATHS} | {
    ("torch_ddp", "mismatch", 2), ("torch_ddp", "early", 2), ("torch_fsdp", "sigkill", 2),
    ("minishard", "mismatch", 4)} | {
    (f"deepspeed_zero{k}", d, 2) for k in (2, 3) for d in ("sigkill", "mismatch")}
CASES = [(j, d, n) for n in (2, 4) for j in JOBS for d in death_tasks.DEATHS
         if ALL or (j, d, n) in DEFAULT]
TIMEOUT_S = 6          # the collective timeout: how long the others wait for a rank that left


def _run(job: str, death: str | None, n: int, out, pool=None):
    task, args = ((death_tasks.minishard_engine, (death, str(out))) if job == "minishard" else
                  (death_tasks.deepspeed_job, (int(job[-1]), death, str(out))) if job.startswith("deepspeed")
                  else (death_tasks.torch_job, (job.removeprefix("torch_"), death, str(out))))
    if pool is not None:
        return pool.run(task, *args)
    with Ranks(n, timeout=120, collective_timeout=TIMEOUT_S) as own:
        with pytest.raises(RankError):
            own.run(task, *args)


@pytest.mark.parametrize("job,death,n", CASES)
def test_a_rank_that_dies_is_named_with_its_collective_and_line(tmp_path, job, death, n, capsys):
    out = tmp_path / "run"
    _run(job, death, n, out)
    found = {f.kind: f for f in doctor.diagnose(out).findings}
    text = "\n".join(f"{f.kind}: {f.title} | " + " | ".join(f.evidence) for f in found.values())
    if death == "mismatch" and job == "deepspeed_zero2":
        # DeepSpeed's ZeRO-1/2 reduce in a process group of their own: the extra all-reduce, in
        # the world group, pairs with nothing; each rank waits for the other in its own group
        f = next(f for f in doctor.diagnose(out).findings if "group 'world'" in f.title)
        assert f.kind == "hang" and DYING in f.ranks and "one collective more on rank 1" in f.title, text
        assert "[4] float32, 16 B" in " ".join(f.evidence) and "death_tasks.py" in " ".join(f.evidence), text
        assert "timeout" in found, text
    elif death == "mismatch":            # gloo aborts every rank the bad pair touched
        f = found["desync"]
        assert DYING in f.ranks, text
        assert "[4] float32, 16 B" in f.title and "seq " in f.title, text
        assert "death_tasks.py" in " ".join(f.evidence), text          # the extra call's line
        if job == "deepspeed_zero3":     # paired with an all-gather of another size: gloo did not
            assert "timeout" in found, text       # abort here, both ranks waited until the timeout
        else:
            assert "died" in found and DYING in found["died"].ranks, text
    elif death in ("sigkill", "abort"):
        f = found["died"]
        assert f.ranks == [DYING], text
        assert f"rank {DYING}, the last collective it recorded: seq " in f.evidence[0], text
        if death == "abort":             # it died inside the collective it had just issued
            assert "inside the collective" in f.title and "issued, never completed" in f.evidence[0], text
            assert "death_tasks.py" in f.evidence[0], text
        assert {"hang", "timeout"} & set(found) or "exception" in found, text
    else:                                # left cleanly; the others waited for it
        assert "died" not in found, text
        f = found["hang"]
        # (PyTorch's DDP waits in its buffer broadcast at forward, which it issues from C++ and no
        # record holds: the finding says the rank ended while the others waited)
        assert f.ranks == [DYING] and ("never issued seq" in f.title or "ended its run" in f.title), text
        assert any(k in found for k in ("timeout", "exception")), text
    assert main(["doctor", str(out)]) == 1
    capsys.readouterr()
    if job == "minishard":       # every rank the failure stopped (it raised, or the pool sent it
        _every_dump_has_its_trace(out)      # SIGTERM) left its trace beside its dump


def _every_dump_has_its_trace(out) -> None:
    """What a rank stopped by a failure leaves: its dump and its trace (the player's, the doctor's
    ledger), whatever stopped it — and the run's player is written from them. (A rank that ended
    its run hands its events to whoever started it, as on success.)"""
    import json
    reasons = {int(p.stem.removeprefix("flight_rank")): json.loads(p.read_text())["reason"]
               for p in out.glob("flight_rank*.json")}
    stopped = {r for r, reason in reasons.items() if reason in ("exception", "sigterm")}
    traced = {int(p.stem.removeprefix("rank")) for p in out.glob("rank*.jsonl")}
    assert stopped and stopped <= traced, (reasons, sorted(traced))
    assert main(["view", str(out)]) == 0 and (out / "player.html").exists()


@pytest.mark.parametrize("job", JOBS)
def test_the_same_jobs_run_healthy_find_nothing(pools, tmp_path, job, capsys):
    out = tmp_path / "run"
    _run(job, None, 2, out, pool=pools(2))
    assert sorted(p.name for p in out.glob("flight_rank*")) == [
        "flight_rank0.json", "flight_rank0.ring", "flight_rank1.json", "flight_rank1.ring"]
    assert doctor.diagnose(out).findings == []
    # the run's id, agreed as it started (the engine's broadcast, the watch's first all-reduce),
    # in every file: the dumps, the rings and the traces' headers
    said = {p.name: doctor.read_dump(p)["run"] for p in out.glob("flight_rank*.json")}
    said |= {p.name: flight_file.header(p)["run"] for p in out.glob("flight_rank*.ring")}
    said |= {p.name: read_header(p)["run"] for p in out.glob("rank*.jsonl")}
    assert len(said) == (4 if job == "minishard" else 6) and len(set(said.values())) == 1, said
    assert run_id.SHAPE.fullmatch(said["flight_rank0.json"]) and doctor.diagnose(out).unchecked == []
    assert main(["doctor", str(out)]) == 0
    assert "nothing found" in capsys.readouterr().out


def test_fsdp2_ranks_that_built_different_weights_are_found_when_the_script_fingerprints_them(
        pools, tmp_path, capsys):
    """FSDP2 broadcasts nothing and then holds shards, different on every rank by design: the
    watch cannot tell different starting weights from its shards. One line before
    ``fully_shard`` — ``built = minishard.fingerprint(net)``, given as ``watch(built=built)`` —
    lets the doctor compare what each rank built; without it the doctor says it did not."""
    found = tmp_path / "fingerprinted"
    pools(2).run(death_tasks.fsdp2_own_seeds, str(found), True)
    (f,) = doctor.diagnose(found).findings
    assert (f.kind, f.ranks) == ("weights", [DYING]) and "built other weights than rank 0" in f.title
    assert main(["doctor", str(found)]) == 1
    blind = tmp_path / "not_fingerprinted"
    pools(2).run(death_tasks.fsdp2_own_seeds, str(blind), False)
    assert doctor.diagnose(blind).findings == []
    capsys.readouterr()
    assert main(["doctor", str(blind)]) == 0
    out = capsys.readouterr().out
    assert "Not compared: the weights each FSDP2 rank built" in out and "minishard.fingerprint" in out


def test_the_courses_extra_collective_leaves_only_rings_and_the_doctor_names_its_line(tmp_path, capsys):
    """Chapter 11's crash: ``fault="extra-collective"`` on rank 1 of minishard's DDP. gloo aborts
    rank 1 in C++ (SIGABRT, no dump, no trace); the pool says which signal; the doctor reads rank
    1's ring and names the extra all-reduce — its seq, size and the line that issued it — and the
    rank that died inside it."""
    out = tmp_path / "crash"
    with Ranks(2, timeout=120, collective_timeout=TIMEOUT_S) as own:
        with pytest.raises(RankError) as e:
            own.run(outcome, str(out), strategy="ddp", fault="extra-collective")
    assert e.value.rank == 1 and "killed by SIGABRT" in str(e.value), str(e.value)
    assert not (out / "flight_rank1.json").exists() and (out / "flight_rank1.ring").exists()
    found = {f.kind: f for f in doctor.diagnose(out).findings}
    f = found["desync"]
    assert 1 in f.ranks and "seq 2 of group 'world'" in f.title and "extra [4] float32, 16 B" in f.title, f.title
    assert "faults.py" in f.evidence[1] and "the_branch_only_this_rank_takes" in f.evidence[1], f.evidence
    assert found["died"].ranks == [1] and "inside the collective" in found["died"].title
    assert main(["doctor", str(out)]) == 1
    capsys.readouterr()
    _every_dump_has_its_trace(out)
