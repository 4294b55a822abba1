"""The doctor's rules, branch by branch, on flight dumps made by hand (``tests/flight_dumps.py``).

The runs on real ranks (test_doctor.py) and the first hand-made cases (test_doctor_edges.py)
pin the common paths: one world group, one rank at fault. Here each uncommon branch of
``minishard/instruments/doctor.py`` and ``minishard/instruments/torch_flight.py`` gets a case where a wrong branch names a
wrong rank, a wrong group or a wrong seq, or finds a hang that is not there: hangs inside the
shard and replicate groups of HSDP on 2x2 ranks, a failure on some ranks of a group only, a
cycle of ranks each waiting in another group, PyTorch's dumps of a group other than the default
one and with point-to-point entries. The property: the doctor names the rank that never issued
(or issued another) collective, the group and the seq — and never a rank outside that group."""
import json
import pickle

import pytest

from flight_dumps import (Collective, as_torch, dump, entry, found, named, never_issued_by, play,
                          torch_entry, write, write_played, write_torch)
from minishard.cli import doctor as cli_doctor
from minishard.instruments import doctor, torch_flight
from minishard.core.trace import TraceFormatError

SHARD = 2                                       # HSDP on 4 ranks: 2 shard groups x 2 replicas
WORLD = 4
SHARDS = [tuple(range(s, s + SHARD)) for s in range(0, WORLD, SHARD)]                  # (0, 1), (2, 3)
REPLICAS = [tuple(range(i, WORLD, SHARD)) for i in range(SHARD)]                        # (0, 2), (1, 3)


def hsdp_step(units: int = 2) -> list[Collective]:
    """One HSDP step as its groups see it: per unit, an all-gather and a reduce-scatter in each
    shard group, then an all-reduce of the shards across each replicate group."""
    out = []
    for u in range(units):
        for op in ("all_gather", "reduce_scatter"):
            out += [Collective(named("shard", g), g, op, 8 * (u + 1)) for g in SHARDS]
        out += [Collective(named("replicate", g), g, "all_reduce", 4 * (u + 1)) for g in REPLICAS]
    return out


def first_of(program, rank, group) -> int:
    """The program's index of ``rank``'s first collective in ``group``."""
    return next(k for k, c in enumerate(program) if c.group == group and rank in c.members)


# --------------------------------------------------------------------------- members: who should hold a group

def test_a_shard_member_that_never_issued_the_shard_group_is_named_there_and_only_it(tmp_path):
    """Rank 1 stops before its first shard[0, 1] collective: it holds none of that group, so only
    the group's name says it is a member. Rank 0 waits in it; ranks 2, 3 (the other shard group)
    go on until they need rank 0 or 1 and are never named."""
    program = hsdp_step()
    stopper, group = 1, named("shard", SHARDS[0])
    played = play(WORLD, program, stop=(stopper, first_of(program, stopper, group)))
    hangs = found(write_played(tmp_path, WORLD, played))
    assert {(g, s) for _, _, g, s in hangs} == never_issued_by(played, stopper, program) | set()
    assert (group, 0) in {(g, s) for _, _, g, s in hangs}
    assert all((kind, ranks) == ("hang", [stopper]) for kind, ranks, _, _ in hangs), hangs


def test_a_rank_stopped_in_the_second_unit_is_named_in_each_of_its_groups_the_others_passed(tmp_path):
    """The same on a later collective: a replicate member stopped after the first unit; the
    ranks of its shard group wait for it, its replica waits for it; the findings name it in
    each of its groups at the first seq it missed, and no other rank."""
    program = hsdp_step()
    stopper = REPLICAS[1][1]                           # rank 3
    k = [i for i, c in enumerate(program) if stopper in c.members][3]    # its first of unit 1
    played = play(WORLD, program, stop=(stopper, k))
    hangs = found(write_played(tmp_path, WORLD, played))
    assert {(g, s) for _, _, g, s in hangs} == never_issued_by(played, stopper, program)
    assert all((kind, ranks) == ("hang", [stopper]) for kind, ranks, _, _ in hangs), hangs


def test_a_subgroup_member_without_a_dump_is_the_one_blamed_not_the_member_that_waits(tmp_path):
    """Rank 3 was killed (no dump) in the middle of a step: rank 2 waits in shard[2, 3] and
    rank 1 in replicate[1, 3], each the only member left with a dump. The hang is rank 3's, in
    the group whose name lists it, not that of the rank waiting for it."""
    program = hsdp_step()
    killed = 3
    played = play(WORLD, program, stop=(killed, first_of(program, killed, named("shard", SHARDS[1])) + 2))
    d = write_played(tmp_path, WORLD, played)
    (d / f"flight_rank{killed}.json").unlink()
    got = found(d)
    assert got[0][:2] == ("missing_dump", [killed])
    hangs = got[1:]
    assert hangs and all((kind, ranks) == ("hang", [killed]) for kind, ranks, _, _ in hangs), got
    assert all(str(killed) in g for _, _, g, _ in hangs)
    titles = [f.title for f in doctor.diagnose(d).findings[1:]]
    assert all(f"rank {killed} left no dump" in t for t in titles), titles


def test_ranks_waiting_in_a_cycle_of_groups_are_a_hang_not_nothing(tmp_path):
    """Three pairs issued in a different order on each rank: rank 0 waits in a[0, 1] for rank 1,
    which waits in b[1, 2] for rank 2, which waits in c[0, 2] for rank 0. Every rank waits in
    another group's collective — none is a bystander of a hang caused elsewhere: each is named
    in the group whose collective it never issued."""
    world, a, b, c = 3, named("a", (0, 1)), named("b", (1, 2)), named("c", (0, 2))
    first = {0: (a, c), 1: (b, a), 2: (c, b)}           # each rank's order of its two groups
    d = write(tmp_path, [dump(r, [entry(0, group=first[r][0], size=2, state="issued")], world=world,
                              reason="timeout") for r in range(world)])
    got = sorted(found(d), key=lambda f: f[2])
    assert got == [("hang", [1], a, 0), ("hang", [2], b, 0), ("hang", [0], c, 0)], got


def test_a_victim_of_a_stopped_rank_through_another_waiting_rank_is_not_named(tmp_path):
    """A chain, not a cycle: rank 2 stopped; rank 1 waits in b[1, 2] for it; rank 0 waits in
    a[0, 1] for rank 1. Only rank 2 is the cause; rank 1 is behind in a[0, 1] only because it
    waits for rank 2."""
    world, a, b = 3, named("a", (0, 1)), named("b", (1, 2))
    d = write(tmp_path, [dump(0, [entry(0, group=a, size=2, state="issued")], world=world, reason="timeout"),
                         dump(1, [entry(0, group=b, size=2, state="issued")], world=world, reason="timeout"),
                         dump(2, [], world=world)])
    assert found(d) == [("hang", [2], b, 0)]


# --------------------------------------------------------------------------- desync: who is the odd one

@pytest.mark.parametrize("group", [named("tp", (0, 1, 2)), named("replicate", REPLICAS[1])])
def test_another_size_on_one_member_is_a_desync_named_by_the_majority_or_the_pair(tmp_path, group):
    """In a group of three the two that agree name the third; in a pair nobody outvotes
    anybody and both are named. A rank outside the group is never named."""
    members = tuple(map(int, group[group.index("[") + 1:-1].split(", ")))
    program = [Collective("world", tuple(range(WORLD)), "broadcast", 4)] + \
              [Collective(group, members, "all_reduce", 8 * k) for k in range(1, 4)]
    odd, k = members[-1], 2
    played = play(WORLD, program, change=(odd, k, Collective(group, members, "all_reduce", 1)))
    got = found(write_played(tmp_path, WORLD, played))
    blamed = [odd] if len(members) > 2 else list(members)
    assert got == [("desync", blamed, group, played.seq_of[k])], got


def test_three_sides_at_one_seq_name_every_rank_outside_the_largest(tmp_path):
    sizes = {0: 8, 1: 8, 2: 4, 3: 2}
    d = write(tmp_path, [dump(r, [entry(0, numel=sizes[r])]) for r in range(WORLD)])
    assert found(d) == [("desync", [2, 3], "world", 0)]


@pytest.mark.parametrize("at_first", [True, False])
@pytest.mark.parametrize("what", ["tag", "numel"])
def test_a_desync_says_what_was_compared_and_whether_sizes_agreed(tmp_path, at_first, what):
    """Ring windows differ (rank 0 dropped its oldest): the seqs compared are those every rank
    still holds, said when some came before; a difference in the tag alone pairs up without an
    error, and the finding says the ranks computed with the wrong tensors."""
    oldest, n = 2, 6
    at = oldest if at_first else n - 1
    odd = {"tag": dict(tag="other"), "numel": dict(numel=1)}[what]

    def ring(r):
        return [entry(s, **(odd if (r, s) == (3, at) else {})) for s in range(oldest if r == 0 else 0, n)]
    (f,) = doctor.diagnose(write(tmp_path, [dump(r, ring(r)) for r in range(WORLD)])).findings
    assert (f.kind, f.ranks) == ("desync", [3]) and f"at seq {at} of group 'world'" in f.title
    assert any(f"seqs {oldest}..{at - 1} compared" in e for e in f.evidence) == (not at_first)
    assert any("nothing failed" in e for e in f.evidence) == (what == "tag")


def test_a_desync_in_one_group_hides_its_consequences_there_but_not_a_hang_elsewhere(tmp_path):
    shard, rep = named("shard", SHARDS[0]), named("replicate", REPLICAS[1])
    d = write(tmp_path, [
        dump(0, [entry(0, group=shard, size=2), entry(1, group=shard, size=2, state="issued")]),
        dump(1, [entry(0, group=shard, size=2, numel=1)]),            # desync at 0, then behind
        dump(2, []),
        dump(3, [entry(0, group=rep, size=2, state="issued")])])      # rank 1 never issued it
    assert sorted(found(d), key=str) == [("desync", [0, 1], shard, 0), ("hang", [1], rep, 0)]


# --------------------------------------------------------------------------- never issued: what is said

def test_a_seq_no_ring_still_holds_is_said_and_the_oldest_later_one_stands_in(tmp_path):
    shard = named("shard", SHARDS[1])
    d = write(tmp_path, [dump(2, [entry(s, group=shard, size=2) for s in (0, 1)]),
                         dump(3, [entry(3, group=shard, size=2, state="issued")])]   # its ring: the last one
                     + [dump(r, []) for r in SHARDS[0]])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("hang", [2])
    assert f.title == f"rank 2 never issued seq 2 of group {shard!r}; rank 3 waits in seq 3"
    assert f.evidence[0] == "seq 2 is no longer in any ring that went past it; the oldest later one is seq 3"


def test_the_first_seq_missed_is_that_of_the_rank_furthest_behind_whatever_its_number(tmp_path):
    """Rank 2 stopped after seq 1, rank 1 after seq 3, the others reached seq 5: the hang starts
    where the rank furthest behind stopped, though a lower rank is behind too."""
    last = {0: 5, 1: 3, 2: 1, 3: 5}
    d = write(tmp_path, [dump(r, [entry(s, state="issued" if s == 5 else "completed")
                                  for s in range(last[r] + 1)]) for r in range(WORLD)])
    (f,) = doctor.diagnose(d).findings
    furthest = min(last, key=last.get)
    assert sorted(f.ranks) == [1, 2] and f.title.startswith(f"rank 2 never issued seq {last[furthest] + 1} ")
    # rank 1 issued that one: it is named for where it stopped, not as one that never issued it
    assert "; rank 1 stopped after seq 3" in f.title and "ranks 1, 2 never issued" not in f.title


def test_ranks_ahead_that_differ_are_shown_one_by_one_and_none_waiting_is_not_said(tmp_path):
    """Ranks 0 and 2 completed seq 1 from different lines (dumps written at different moments:
    rank 1's before it got there): no rank waits, and the evidence shows each rank's line."""
    d = write(tmp_path, [dump(r, [entry(0)] + ([] if r == 1 else [entry(1, where=f"f.py:{r} in g")]),
                              world=3, reason="sigterm" if r == 1 else "end") for r in range(3)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("hang", [1])
    assert f.title == "rank 1 never issued seq 1 of group 'world' (all_reduce of grads)"
    assert [e.split(":")[0] for e in f.evidence[:2]] == ["rank 0", "rank 2"]
    assert ("rank 1's dump was written when it was sent SIGTERM (torchrun stopping it after another "
            "rank failed)") in f.evidence


def test_a_failure_on_one_rank_of_a_shard_group_names_it_and_no_rank_outside(tmp_path):
    """Rank 1 raised before its second shard collective; rank 0 waits; the other shard group and
    the replicas finished. The error is quoted first, then the hang is rank 1's — nobody else's."""
    shard, error = named("shard", SHARDS[0]), "RuntimeError: planted: the loader ran dry"
    ok = [entry(s, group=named("shard", SHARDS[1]), size=2) for s in range(2)]
    d = write(tmp_path, [
        dump(0, [entry(0, group=shard, size=2), entry(1, group=shard, size=2, state="issued")], reason="timeout"),
        dump(1, [entry(0, group=shard, size=2)], reason="exception", error=error, time=1.0),
        dump(2, ok), dump(3, ok)])
    assert found(d) == [("exception", [1], None, None), ("hang", [1], shard, 1)]
    hang = doctor.diagnose(d).findings[1]
    assert f"rank 1's dump was written as it raised {error}" in hang.evidence


@pytest.mark.parametrize("reason, words", [
    ("end", "rank 1's dump was written at the end of its run"),
    ("exception", "rank 1's dump was written as it raised RuntimeError: planted"),
    ("sigterm", "rank 1's dump was written when it was sent SIGTERM"),
    ("ring", "rank 1 wrote no dump: it died, and its ring is read instead"),
    ("torch", "rank 1's dump is PyTorch's own flight recorder's (it records no reason)"),
    ("trace", "rank 1 left no flight record: the collectives it completed were read from its trace")])
def test_how_the_rank_behind_left_its_record_is_said_in_words(tmp_path, reason, words):
    """The hang's evidence says how the rank behind left its record, in a sentence, whatever
    the reason its record was written (not "written on ring", the reason's bare name)."""
    d = write(tmp_path, [dump(0, [entry(0), entry(1, state="issued")], world=2, reason="exception",
                              error="TimeoutError: waited"),
                         dump(1, [entry(0)], world=2, reason=reason, error="RuntimeError: planted")])
    (hang,) = [f for f in doctor.diagnose(d).findings if f.kind == "hang"]
    said = [e for e in hang.evidence if e.startswith("rank 1 ") or e.startswith("rank 1's")]
    assert said and said[-1].startswith(words), hang.evidence
    assert f"on {reason}" not in " ".join(hang.evidence), hang.evidence


# --------------------------------------------------------------------------- never completed

def test_a_collective_every_member_issued_and_none_completed_blames_those_stuck(tmp_path):
    rep = named("replicate", REPLICAS[0])
    d = write(tmp_path, [dump(r, [entry(0, group=rep, size=2, state="issued")] if r in REPLICAS[0] else [])
                         for r in range(WORLD)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("hang", list(REPLICAS[0]))
    assert f.title == f"ranks 0, 2 wait in all_reduce seq 0 of group {rep!r}" and "every rank issued it" in f.fix


def test_what_ranks_that_raised_left_in_flight_is_not_a_hang(tmp_path):
    """Ranks 2 and 3 raised inside the replicate[... ] all-reduce the others completed earlier:
    their in-flight entries are abandoned, the finding is their error alone."""
    d = write(tmp_path, [dump(r, [entry(0, state="issued" if r >= 2 else "completed")],
                              reason="exception" if r >= 2 else "end",
                              error="RuntimeError: planted" if r >= 2 else None) for r in range(WORLD)])
    assert found(d) == [("exception", [2, 3], None, None)]


def test_ranks_stuck_in_a_collective_some_other_ranks_never_dumped_blame_those(tmp_path):
    d = write(tmp_path, [dump(r, [entry(0, state="issued")]) for r in range(WORLD - 1)])
    assert found(d) == [("missing_dump", [WORLD - 1], None, None), ("hang", [WORLD - 1], "world", 0)]


# --------------------------------------------------------------------------- PyTorch's own dumps

def test_a_hang_in_a_torch_subgroup_names_the_pair_member_and_its_seq(tmp_path):
    """A pair made with new_group (``torch:pg1``: gloo leaves its name ``undefined``): rank 1 of
    the pair issued its first collective, not its second; rank 0 waits; rank 2, in the default
    group only, is never named."""
    pair = {0: [torch_entry(1), torch_entry(1, pg=1), torch_entry(2, pg=1, retired=False)],
            1: [torch_entry(1), torch_entry(1, pg=1)],
            2: [torch_entry(1)]}
    d = write_torch(tmp_path, pair)
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("hang", [1])
    assert f.title == "rank 1 never issued seq 2 of group 'torch:pg1' (all_reduce); rank 0 waits in it"
    assert "rank 1's dump is PyTorch's own flight recorder's (it records no reason)" in f.evidence


def test_a_rank_with_none_of_the_default_group_is_named_the_world_says_it_is_a_member(tmp_path):
    d = write_torch(tmp_path, {0: [torch_entry(1, retired=False)], 1: [torch_entry(1, retired=False)],
                               2: [torch_entry(1, pg=1)]})
    assert found(d) == [("hang", [2], "torch:default_pg", 1)]


def test_point_to_point_entries_are_not_collectives(tmp_path):
    """NCCL records a send and a recv with the collective seq id of the collective before them:
    read as collectives they would replace it at that seq (a send against a recv: a desync)."""
    d = write_torch(tmp_path, {
        0: [torch_entry(1), torch_entry(1, op="send 0->1", p2p=True), torch_entry(2, retired=False)],
        1: [torch_entry(1), torch_entry(1, op="recv 0<-1", p2p=True)]})
    assert found(d) == [("hang", [1], "torch:default_pg", 2)]


def test_a_torch_entry_read_in_minishard_words(tmp_path):
    """Each field's branch: the group by id, a world size for the default one only, the state
    from ``completed``, ``retired`` or neither, bytes from sizes and dtypes (an unknown dtype
    named as it is), the seq from ``record_id`` where the collective seq id is absent, the call
    site from the first frame outside torch."""
    frames = [{"filename": "/x/torch/distributed/c10d.py", "line": 1, "name": "all_reduce"},
              {"filename": "/home/me/train.py", "line": 7, "name": "step"}]
    rows = [torch_entry(3, numel=5, dtype="Double", frames=frames),
            torch_entry(2, pg=4, dtype="Float8_e4m3fn", retired=False),
            {k: v for k, v in torch_entry(0, state="completed", retired=False).items() if k != "collective_seq_id"}]
    path = tmp_path / "torch_fr_trace_rank_0"
    path.write_bytes(pickle.dumps({"entries": [dict(e, record_id=i + 10) for i, e in enumerate(rows)]}))
    world = 4
    got = torch_flight.read(path, 0, world)["entries"]
    assert [(e["group"], e["group_size"], e["seq"], e["state"]) for e in got] == [
        ("torch:default_pg", world, 3, "retired"), ("torch:pg4", 0, 2, "issued"),
        ("torch:default_pg", world, 12, "completed")]
    assert (got[0]["bytes"], got[0]["dtypes"], got[0]["where"]) == (5 * 8, ["float64"], "/home/me/train.py:7 in step")
    assert (got[1]["dtypes"], got[1]["bytes"]) == (["float8_e4m3fn"], 0)
    (tmp_path / "p2p.json").write_text(json.dumps({"entries": [torch_entry(1, p2p=True)]}))
    assert torch_flight.read(tmp_path / "p2p.json", 0, world)["entries"] == []


class _Planted:
    """What a hostile file would carry: unpickled by ``pickle.loads``, it runs a call."""
    ran: list = []

    def __reduce__(self):
        return (_Planted.ran.append, ("ran",))


def test_a_torch_dump_that_names_a_class_or_function_is_refused_not_run(tmp_path):
    """PyTorch writes its dumps with pickle; reading one must not run what a file names: only
    dicts, lists, strings and numbers are built, anything else is refused with a clear error."""
    path = tmp_path / "torch_fr_trace_rank_0"
    path.write_bytes(pickle.dumps({"entries": [torch_entry(1)], "payload": _Planted()}))
    with pytest.raises(TraceFormatError, match=r"names .*_Planted.ran.append|names builtins"):
        torch_flight.read(path, 0, 1)
    assert _Planted.ran == []
    path.write_bytes(pickle.dumps({"entries": [torch_entry(1)], "pg": ("0", "default_pg")}))
    assert [e["seq"] for e in torch_flight.read(path, 0, 1)["entries"]] == [1]


def test_a_torch_entry_names_the_innermost_frames_outside_torch_and_outside_minishard(tmp_path):
    """c10d keeps a work's stack innermost first: ``where`` is the first frame outside torch (a
    minishard wrapper when one issued the collective), ``caller`` the first outside torch and
    minishard — the user's line that asked, not the script's top that started everything."""
    frames = [{"filename": "/x/torch/distributed/c10d.py", "line": 1, "name": "all_reduce"},
              {"filename": "/x/minishard/core/comm.py", "line": 5, "name": "all_reduce"},
              {"filename": "/home/me/model.py", "line": 42, "name": "step"},
              {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"},
              {"filename": "/home/me/train.py", "line": 7, "name": "<module>"}]
    d = write_torch(tmp_path, {0: [torch_entry(1, frames=frames)]})
    (e,) = torch_flight.read(d / "torch_fr_rank0.json", 0, 1)["entries"]
    assert (e["where"], e["caller"]) == ("/x/minishard/core/comm.py:5 in all_reduce",
                                         "/home/me/model.py:42 in step")
    assert doctor.site(e) == ("; at /x/minishard/core/comm.py:5 in all_reduce, "
                                    "called from /home/me/model.py:42 in step")


def test_the_same_run_read_from_torch_dumps_names_the_same_rank(tmp_path):
    """The HSDP stop above, as c10d's recorders hold it (groups by id, seqs from 1): the same
    rank, each group by its id, each seq one higher."""
    program = hsdp_step()
    stopper = 3
    k = [i for i, c in enumerate(program) if stopper in c.members][3]
    played = play(WORLD, program, stop=(stopper, k))
    pg_of = {g: i + 1 for i, g in enumerate(dict.fromkeys(c.group for c in program))}
    hangs = found(write_torch(tmp_path, as_torch(played, pg_of)))
    want = {(f"torch:pg{pg_of[g]}", s + 1) for g, s in never_issued_by(played, stopper, program)}
    assert {(g, s) for _, _, g, s in hangs} == want
    assert all((kind, ranks) == ("hang", [stopper]) for kind, ranks, _, _ in hangs), hangs


def test_what_was_read_says_which_dumps_are_minishards_and_which_pytorchs(tmp_path):
    """The report's first line counts the dumps by how they were written: minishard's by their
    reason (the end of the run, an exception), PyTorch's own flight recorder's as such."""
    ours = tmp_path / "ours"
    ours.mkdir()
    for r in range(2):
        (ours / f"flight_rank{r}.json").write_text(json.dumps(dump(r, [entry(0, size=2)], world=2,
                                                   reason=("end", "exception")[r])))
    assert cli_doctor.what_was_read(doctor.read_dir(ours)) == \
        "2 flight dumps of a world of 2 (written at the end: 1, on an exception: 1), 0 traces"
    theirs = write_torch(tmp_path / "theirs", {0: [torch_entry(1)], 1: [torch_entry(1)]})
    assert cli_doctor.what_was_read(doctor.read_dir(theirs)) == \
        "2 flight dumps of a world of 2 (PyTorch's own: 2), 0 traces"
    every = tmp_path / "every"
    every.mkdir()
    for r, reason in enumerate(("ring", "sigterm", "exception", "end", "sigterm")):
        (every / f"flight_rank{r}.json").write_text(json.dumps(dump(r, [entry(0, size=5)], world=5, reason=reason)))
    assert cli_doctor.what_was_read(doctor.read_dir(every)) == (
        "5 flight dumps of a world of 5 (written at the end: 1, on an exception: 1, on SIGTERM: 2, "
        "rings of ranks that died: 1), 0 traces")


def _stream_and_one_more(tmp_path, ahead_also_waits_in_it: bool):
    """Two ranks share a stream of collectives in a group of their own (DeepSpeed's ZeRO-2 reduces
    in one); rank 1 issues, instead of the stream's seq 3, a collective of the world group, which
    rank 0 never used. (Or, ``ahead_also_waits_in_it``: rank 1 issued seq 3 of the stream too.)"""
    ds = named("ds", (0, 1))
    stream = lambda r, n: [entry(s, group=ds, size=2, state="issued" if s == 3 else "completed")
                           for s in range(n)]
    extra = entry(0, numel=4, size=2, state="issued", where="job.py:7 in extra")
    ranks = [dump(0, stream(0, 4), world=2, reason="exception"),
             dump(1, stream(1, 4 if ahead_also_waits_in_it else 3) + [extra], world=2, reason="exception")]
    return doctor.diagnose(write(tmp_path, ranks)).findings


def test_a_collective_in_a_group_the_others_never_used_is_named_as_one_more_on_its_rank(tmp_path):
    """Rank 1 left the stream it shared with rank 0 to issue the world group's first collective:
    one collective more on rank 1 (or one fewer on rank 0) — both named, the line in the
    evidence; rank 0 is still named for the stream rank 1 stopped short in."""
    found = _stream_and_one_more(tmp_path, ahead_also_waits_in_it=False)
    world = next(f for f in found if "group 'world'" in f.title)
    assert world.ranks == [0, 1] and "one collective more on rank 1, or one fewer on rank 0" in world.title
    assert any("job.py:7 in extra" in line for line in world.evidence)
    stream = next(f for f in found if "group 'ds[0, 1]'" in f.title)
    assert stream.ranks == [1] and stream.title.startswith("rank 1 never issued seq 3")


def test_a_rank_ahead_that_issued_what_the_others_wait_in_did_not_leave_their_stream(tmp_path):
    """The same, but rank 1 issued the stream's seq 3 too: rank 0 does not wait for rank 1 there,
    so nothing says rank 1 left the stream for the world group's collective."""
    found = _stream_and_one_more(tmp_path, ahead_also_waits_in_it=True)
    world = next(f for f in found if "group 'world'" in f.title)
    assert world.ranks == [0] and "one collective more" not in world.title
