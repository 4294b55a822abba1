"""Evidence that does not belong together is refused, not diagnosed (``minishard/instruments/one_run.py``).

Two real runs on the session's warm ranks (minishard's DDP, 2 and 3 steps, each leaving its
dumps, rings and traces); their files are then mixed, edited and scrambled as a user's folder
gets them: rank 0's files of one run beside rank 1's of the other, a trace that says another
world size, a ring whose records were scrambled under its header. Each is exit status 2 with the
files named and no diagnosis. Files written before run ids (the ids stripped) are read as they
always were, and the doctor says which files it could not check.
"""
import json
import random
import shutil
from pathlib import Path

import pytest

from minishard.cli import main
from minishard.core import flight_file, run_id
from minishard.course.ch11 import broken
from minishard.instruments import doctor


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("one_run")
    out = {"two": base / "two", "three": base / "three"}
    pools(2).run(broken, str(out["two"]), strategy="ddp")
    pools(2).run(broken, str(out["three"]), strategy="ddp", steps=3)
    return out


def ids(d: Path) -> dict[str, str | None]:
    """Each file's run id, as the file says it."""
    said = {p.name: json.loads(p.read_text()).get("run") for p in d.glob("flight_rank*.json")}
    said |= {p.name: flight_file.header(p)["run"] for p in d.glob("flight_rank*.ring")}
    return said | {p.name: json.loads(p.read_text().splitlines()[0]).get("run") for p in d.glob("rank*.jsonl")}


def mixed(runs, into: Path, theirs=("flight_rank1.json", "flight_rank1.ring", "rank1.jsonl")) -> Path:
    """Run "two"'s folder with rank 1's files (``theirs``) from run "three"."""
    shutil.copytree(runs["two"], into)
    for name in theirs:
        shutil.copy(runs["three"] / name, into / name)
    return into


def strip_ids(d: Path, names=None) -> Path:
    """The files as a minishard before run ids wrote them: no ``run`` in a dump, zeros in a
    ring's header, no header line in a trace."""
    for p in sorted(d.iterdir()):
        if names is not None and p.name not in names:
            continue
        if p.name.endswith(".json"):
            body = json.loads(p.read_text())
            del body["run"]
            p.write_text(json.dumps(body))
        elif p.suffix == ".ring":
            raw = bytearray(p.read_bytes())
            raw[flight_file.RUN_AT:flight_file.RUN_AT + 16] = bytes(16)
            p.write_bytes(bytes(raw))
        elif p.suffix == ".jsonl":
            p.write_text("".join(p.read_text().splitlines(keepends=True)[1:]))
    return d


def refused(d: Path, capsys) -> str:
    status = main(["doctor", str(d)])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, (status, out, err)
    return err


def test_every_file_of_a_run_carries_one_id_and_two_runs_two(runs):
    two, three = ids(runs["two"]), ids(runs["three"])
    assert sorted(two) == ["flight_rank0.json", "flight_rank0.ring", "flight_rank1.json",
                           "flight_rank1.ring", "rank0.jsonl", "rank1.jsonl"]
    assert len(set(two.values())) == len(set(three.values())) == 1
    (a,), (b,) = set(two.values()), set(three.values())
    assert a != b and run_id.SHAPE.fullmatch(a) and run_id.SHAPE.fullmatch(b)
    assert doctor.diagnose(runs["two"]).findings == [] and doctor.diagnose(runs["two"]).unchecked == []


@pytest.mark.parametrize("strategy", ["torch_ddp", "torch_fsdp"])
def test_a_run_recorded_by_the_watch_for_train_carries_the_runs_one_id(pools, tmp_path, strategy):
    """PyTorch's strategies under ``train``: the watch records them, lent the run's flight
    recorder and tracer, which carry the id the ranks agreed as the run started — the watch's
    own draw must not replace it. Every dump, ring and trace says one id, and the doctor reads
    them as one run (a dump saying the watch's id beside traces saying the run's was refused as
    two runs)."""
    out = tmp_path / strategy
    pools(2).run(broken, str(out), strategy=strategy)
    said = ids(out)
    assert sorted(said) == ["flight_rank0.json", "flight_rank0.ring", "flight_rank1.json",
                            "flight_rank1.ring", "rank0.jsonl", "rank1.jsonl"]
    (one,) = set(said.values())
    assert one is not None and run_id.SHAPE.fullmatch(one), said
    report = doctor.diagnose(out)
    assert report.findings == [] and report.unchecked == [] and report.run == one


def test_rank_1s_files_from_another_run_are_refused_naming_each_file_under_its_run(runs, tmp_path, capsys):
    err = refused(mixed(runs, tmp_path / "mixed"), capsys)
    (a,), (b,) = set(ids(runs["two"]).values()), set(ids(runs["three"]).values())
    assert (f"files of 2 different runs in one folder — run {a}: flight_rank0.json, flight_rank0.ring, "
            f"rank0.jsonl; run {b}: flight_rank1.json, flight_rank1.ring, rank1.jsonl") in err, err


def test_one_trace_from_another_run_is_enough_to_refuse(runs, tmp_path, capsys):
    err = refused(mixed(runs, tmp_path / "mixed", theirs=("rank1.jsonl",)), capsys)
    (b,) = set(ids(runs["three"]).values())
    assert f"run {b}: rank1.jsonl —" in err, err


def test_without_ids_the_same_folder_is_read_as_before_and_said_unchecked(runs, tmp_path, capsys):
    """What the doctor did before run ids, and does for files written then: the mix is read as
    one run (rank 0 stopped a step short of rank 1: a hang it never had) — and the report ends
    saying that no file carried a run id."""
    d = strip_ids(mixed(runs, tmp_path / "mixed"))
    assert main(["doctor", str(d)]) == 1
    out = capsys.readouterr().out
    assert "[hang] rank 0 never issued" in out, out
    assert out.splitlines()[-1].startswith("not checked to be one run's files: none of them carries a run id")


def test_a_file_without_an_id_beside_a_run_is_named_not_refused(runs, tmp_path, capsys):
    d = strip_ids(shutil.copytree(runs["two"], tmp_path / "run"), names={"rank1.jsonl"})
    assert main(["doctor", str(d)]) == 0
    (a,) = set(v for v in ids(runs["two"]).values())
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"not checked to be run {a}'s: rank1.jsonl carries no run id"), last
    assert doctor.diagnose(d).unchecked == ["rank1.jsonl"]


def test_files_that_disagree_on_the_world_size_are_refused_naming_them(runs, tmp_path, capsys):
    d = shutil.copytree(runs["two"], tmp_path / "run")
    lines = (d / "rank1.jsonl").read_text().splitlines(keepends=True)
    lines[0] = json.dumps({**json.loads(lines[0]), "world_size": 4}) + "\n"
    (d / "rank1.jsonl").write_text("".join(lines))
    err = refused(d, capsys)
    assert ("the files disagree on the world size, as files of different runs do — 2 ranks in "
            "flight_rank0.json, flight_rank0.ring, rank0.jsonl, flight_rank1.json, flight_rank1.ring; "
            "4 ranks in rank1.jsonl") in err, err


@pytest.mark.parametrize("scrambled", ["every slot", "the records written"])
def test_a_ring_most_of_whose_records_are_scrambled_is_refused(runs, tmp_path, capsys, scrambled):
    """Rank 1's dump gone, so its ring stands in (a rank that died), and the ring's records
    scrambled under its header: refused by name — not a death with one torn line per slot."""
    d = shutil.copytree(runs["two"], tmp_path / "run")
    (d / "flight_rank1.json").unlink()
    ring = d / "flight_rank1.ring"
    held = len(flight_file.read(ring)["entries"])
    raw = bytearray(ring.read_bytes())
    end = len(raw) if scrambled == "every slot" else flight_file.HEADER_BYTES + held * flight_file.RECORD
    noise = random.Random(0)
    raw[flight_file.HEADER_BYTES:end] = bytes(noise.randrange(1, 256) for _ in range(end - flight_file.HEADER_BYTES))
    ring.write_bytes(bytes(raw))
    err = refused(d, capsys)
    assert f"{ring}:" in err and "records in this ring cannot be read" in err, err


def test_a_ring_with_the_one_torn_record_a_death_leaves_is_still_read(runs, tmp_path, capsys):
    d = shutil.copytree(runs["two"], tmp_path / "run")
    (d / "flight_rank1.json").unlink()
    ring = d / "flight_rank1.ring"
    last = len(flight_file.read(ring)["entries"]) - 1
    raw = bytearray(ring.read_bytes())
    at = flight_file.HEADER_BYTES + last * flight_file.RECORD
    raw[at:at + 8] = bytes(8)                          # its commit never landed
    ring.write_bytes(bytes(raw))
    found = {f.kind: f for f in doctor.diagnose(d).findings}
    assert found["died"].ranks == [1] and any("slot" in e for e in found["died"].evidence)
    assert main(["doctor", str(d)]) == 1
    capsys.readouterr()
