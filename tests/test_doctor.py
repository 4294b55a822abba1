"""``minishard doctor``: hangs and desyncs named from the ranks' flight-recorder dumps alone.

Every dump is made on real ranks (one short-lived pool of 4, ``tests/doctor_tasks.py``), each
fault planted on one rank: a healthy HSDP run (nothing found, exit 0); a skipped all-reduce on
rank 1 of 4 (the LoRA hang); two all-reduces of different sizes issued in swapped order; one rank
reducing in another precision, with rank 0's ring too small to hold the first collectives; one
rank raising while the others wait; the skipped run with rank 1's dump gone (a rank killed before
it could write). Each finding names the fault, the rank, the collective's seq, op, shapes and
dtypes and the line that issued it. Bad input is exit 2 with the file (and line) named. The
doctor is run as the command line runs it (``main([...])``, in this process)."""
import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import doctor_tasks as T
from minishard.cli import main
from minishard.core.launch import Ranks, RankError
from minishard.training.loop import TrainConfig, train

TASKS = Path(T.__file__)
SCENARIOS = ("skipped_collective", "swapped_order", "precision_desync", "raised")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("doctor")
    dirs = {name: base / name for name in ("healthy", *SCENARIOS)}
    pool = Ranks(4, timeout=60)
    try:
        pool.run(train, TrainConfig(strategy="hsdp", shard_size=2, model="nano", steps=1,
                                    micro_batch=1, flight_dir=str(dirs["healthy"])))
        for name in SCENARIOS:
            try:
                pool.run(getattr(T, name), str(dirs[name]), timeout=20)
            except RankError as e:           # gloo may abort a rank whose sizes disagree
                assert "swapped" in name and "-6" in e.error, e
                break                        # (the pool is closed: swapped_order runs last)
    finally:
        # the faults leave collectives waiting forever: end the ranks, do not wait for them
        pool.close(reason="the doctor's faults left collectives waiting")
    # a rank killed (SIGKILL, the OOM killer) after its last collective writes no dump
    dirs["killed"] = base / "killed"
    shutil.copytree(dirs["skipped_collective"], dirs["killed"])
    (dirs["killed"] / f"flight_rank{T.SKIPPER}.json").unlink()
    return dirs


def doctor(directory, capsys) -> tuple[int, dict]:
    status = main(["doctor", str(directory), "--json"])
    return status, json.loads(capsys.readouterr().out)


def site(task, text: str) -> str:
    """``tests/doctor_tasks.py:N in task`` of the one line of ``task`` holding ``text``."""
    lines, first = inspect.getsourcelines(task)
    (n,) = [first + i for i, line in enumerate(lines) if text in line]
    return f"tests/{TASKS.name}:{n} in {task.__name__}"


def nbytes(numel: int, dtype=torch.float32) -> str:
    return f"{numel * dtype.itemsize} B"


def test_a_healthy_run_finds_nothing(runs, capsys):
    status = main(["doctor", str(runs["healthy"])])
    out = capsys.readouterr().out
    assert status == 0 and "nothing found" in out, out
    status, report = doctor(runs["healthy"], capsys)
    groups = {e["group"] for r in range(4)
              for e in json.loads((runs["healthy"] / f"flight_rank{r}.json").read_text())["entries"]}
    # HSDP on 4 ranks, shard size 2: each rank in one shard group and one replicate group,
    # each named by its members (so ranks of different groups are never compared)
    assert (status, report["findings"]) == (0, [])
    assert groups == {"shard[0, 1]", "shard[2, 3]", "replicate[0, 2]", "replicate[1, 3]"}, groups
    assert {d["reason"] for d in report["dumps"].values()} == {"end"}


def test_a_skipped_collective_names_the_rank_that_never_issued_it(runs, capsys):
    status, report = doctor(runs["skipped_collective"], capsys)
    (f,) = report["findings"]
    waiting = [r for r in range(4) if r != T.SKIPPER]
    # two collectives (seq 0, 1) before the skipped one: it is seq 2
    assert (status, f["kind"], f["ranks"]) == (1, "hang", [T.SKIPPER])
    assert f"rank {T.SKIPPER} never issued seq 2 of group 'world' (all_reduce of grads)" in f["title"]
    assert f"ranks {', '.join(map(str, waiting))} wait in it" in f["title"]
    theirs, mine = f["evidence"][0], f["evidence"][1]
    assert theirs.startswith(f"ranks {', '.join(map(str, waiting))}: seq 2 all_reduce of grads [{T.SIZES[1]}] "
                             f"float32, {nbytes(T.SIZES[1])}")
    assert "issued, never completed" in theirs and site(T.skipped_collective, 'tag="grads")') in theirs
    assert mine.startswith(f"rank {T.SKIPPER}, its last collective: seq 1 broadcast of weights [{T.SIZES[1]}]")
    assert "— completed" in mine and site(T.skipped_collective, 'tag="weights")') in mine


def test_the_text_puts_the_finding_and_its_fix_first(runs, capsys):
    status = main(["doctor", str(runs["skipped_collective"])])
    lines = capsys.readouterr().out.splitlines()
    assert status == 1 and "written at the end: 1, reason 'timeout': 3" in lines[0], lines
    assert lines[1] == "1 finding, most important first:"
    assert lines[3].startswith(f"1. [hang] rank {T.SKIPPER} never issued seq 2 of group 'world' (all_reduce")
    assert lines[-1].startswith("   fix: the collective at seq 2 must run on every rank")


def test_two_ranks_issuing_all_reduces_in_swapped_order_is_a_desync_at_the_first(runs, capsys):
    status, report = doctor(runs["swapped_order"], capsys)
    f = report["findings"][0]
    small, large = (f"all_reduce of bucket{n} [{n}] float32, {nbytes(n)}" for n in T.SIZES)
    assert (status, f["kind"], f["ranks"]) == (1, "desync", [T.SKIPPER])
    assert f"at seq 0 of group 'world', ranks 0, 2, 3 {small}; rank {T.SKIPPER} {large}" in f["title"]
    mine = f"rank {T.SKIPPER}: seq 0 {large}"
    assert any(e.startswith(mine) and site(T.swapped_order, "works.append") in e for e in f["evidence"]), f["evidence"]
    # what follows a desync in its group is its consequence, not another finding
    assert [x["kind"] for x in report["findings"]] in (["desync"], ["desync", "missing_dump"])


def test_a_rank_in_another_precision_is_a_desync_in_dtype_past_a_dropped_ring(runs, capsys):
    status, report = doctor(runs["precision_desync"], capsys)
    (f,) = report["findings"]
    seq = T.LOSSES                                    # after LOSSES all-reduces alike
    held_by_rank0 = T.LOSSES + 1 - T.SMALL_RING       # rank 0's oldest seq still in its ring
    assert (status, f["kind"], f["ranks"]) == (1, "desync", [T.ODD_PRECISION])
    assert f"at seq {seq} of group 'world'" in f["title"]
    assert f"rank {T.ODD_PRECISION} all_reduce of grads [{T.SIZES[1]}] bfloat16, " \
           f"{nbytes(T.SIZES[1], torch.bfloat16)}" in f["title"]
    assert "ranks 0, 1, 3 all_reduce of grads" in f["title"] and "float16" in f["title"]
    assert f"seqs {held_by_rank0}..{seq - 1} compared" in f["evidence"][-1]


def test_an_exception_is_quoted_first_then_the_ranks_it_left_waiting(runs, capsys):
    """The cause first, then the collective it left the others in, then their timeouts (a
    timeout is how a hang ends, not a cause)."""
    status, report = doctor(runs["raised"], capsys)
    first, hang, timeouts = report["findings"]
    others = [r for r in range(4) if r != T.RAISER]
    assert (status, first["kind"], first["ranks"]) == (1, "exception", [T.RAISER])
    # the error, and the line that raised it
    raise_line = site(T.raised, 'raise RuntimeError("planted')
    assert first["title"] == (f"rank {T.RAISER} raised RuntimeError: planted: the data loader ran dry "
                              f"on this rank, at {raise_line}"), first["title"]
    assert f"rank {T.RAISER} raised it at {raise_line}" in first["evidence"]
    assert (hang["kind"], hang["ranks"]) == ("hang", [T.RAISER])
    assert f"rank {T.RAISER} never issued seq 1 of group 'world' (all_reduce of grads)" in hang["title"]
    assert (timeouts["kind"], timeouts["ranks"]) == ("timeout", others)
    # one line: the collective, how long the ranks waited in it (their dumps' clock: at least
    # the wait the task gave them), the error's own words only for --verbose
    m = re.fullmatch(r"ranks 0, 1, 2 gave up waiting in all_reduce of grads \(seq 1 of group 'world'\) "
                     r"after ([\d.]+)(?: to ([\d.]+))? s: timed out", timeouts["title"])
    assert m and float(m.group(1)) >= T.WAIT_S - 0.05, timeouts["title"]
    assert timeouts["details"] == [f"ranks 0, 1, 2's error, as raised: TimeoutError: all_reduce did not "
                                   f"complete in {T.WAIT_S} s"]
    plain = main(["doctor", str(runs["raised"])]), capsys.readouterr().out
    verbose = main(["doctor", str(runs["raised"]), "--verbose"]), capsys.readouterr().out
    assert plain[0] == verbose[0] == 1 and "did not complete in" not in plain[1]
    assert verbose[1].replace(f"   - {timeouts['details'][0]}\n", "") == plain[1]


def test_a_rank_killed_before_writing_is_named_with_where_its_trace_ends(runs, capsys):
    status, report = doctor(runs["killed"], capsys)
    gone, hang = report["findings"]
    assert (status, gone["kind"], gone["ranks"]) == (1, "missing_dump", [T.SKIPPER])
    # its trace holds the collectives it completed: the broadcast was its last
    assert f"rank{T.SKIPPER}.jsonl" in gone["evidence"][0] and "broadcast" in gone["evidence"][0]
    assert (hang["kind"], hang["ranks"]) == ("hang", [T.SKIPPER])
    assert f"ranks 0, 2, 3 wait in all_reduce seq 2 of group 'world'; rank {T.SKIPPER} left no dump" \
        == hang["title"]


def test_ranks_whose_rings_dropped_the_skipped_seq_still_name_it(runs, tmp_path, capsys):
    """Ranks far ahead of the one that stopped may no longer hold the seq it never issued: each
    waiting rank's ring is cut to drop seq 2 and hold one later collective, seq 3."""
    d = tmp_path / "run"
    shutil.copytree(runs["skipped_collective"], d)
    for r in (r for r in range(4) if r != T.SKIPPER):
        body = json.loads((d / f"flight_rank{r}.json").read_text())
        *before, stuck = body["entries"]
        body["entries"] = before + [dict(stuck, seq=stuck["seq"] + 1)]
        (d / f"flight_rank{r}.json").write_text(json.dumps(body))
    status, report = doctor(d, capsys)
    (f,) = report["findings"]
    assert (status, f["kind"], f["ranks"]) == (1, "hang", [T.SKIPPER])
    assert f"rank {T.SKIPPER} never issued seq 2 of group 'world'; ranks 0, 2, 3 wait in seq 3" == f["title"]


def _cut(d: Path) -> tuple[Path, int]:
    text = (d / "flight_rank0.json").read_text()
    cut = text[: len(text) // 2]
    (d / "flight_rank0.json").write_text(cut)
    return d / "flight_rank0.json", cut.count("\n") + 1       # the decoder stops at the end


def _field(d: Path, **changes) -> tuple[Path, None]:
    path = d / "flight_rank0.json"
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body))
    return path, None


BAD = {
    "cut short": (_cut, "not JSON"),
    "a newer format": (lambda d: _field(d, v=99), "format version 99"),
    "no entries": (lambda d: _field(d, entries="none"), "a list of entries"),
    "another run's dump": (lambda d: _field(d, world_size=8), "the files disagree on the world size"),
}


@pytest.mark.parametrize("damage", BAD, ids=list(BAD))
def test_an_unreadable_dump_is_exit_2_naming_the_file(runs, tmp_path, capsys, damage):
    make, words = BAD[damage]
    d = tmp_path / "run"
    shutil.copytree(runs["skipped_collective"], d)
    path, line = make(d)
    status = main(["doctor", str(d)])
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1 and words in err and "Traceback" not in err, err
    named = str(path) + (f":{line}:" if line else "") if damage != "another run's dump" else str(d)
    assert named in err, err


@pytest.mark.parametrize("where", ["empty", "absent"])
def test_a_directory_with_nothing_to_read_is_exit_2(tmp_path, capsys, where):
    d = tmp_path / "run"
    if where == "empty":
        d.mkdir()
    status = main(["doctor", str(d)])
    err = capsys.readouterr().err
    assert status == 2 and re.search(re.escape(str(d)) + ": no (flight|such)", err), err
