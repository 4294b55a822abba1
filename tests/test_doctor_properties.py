"""The doctor against a reference, on random runs: 2 to 6 ranks, random groups over them (each
named by its members, as minishard names a group that is not the world), a random program of
collectives (ops and sizes), played on the ranks by the pairing rule of ``tests/flight_dumps.py``
with at most one fault planted on one rank:

    stop     the rank stops before one collective (the LoRA hang: nothing to reduce here); the
             truth is every (group, seq) of its groups that another member issued and it never
             did, the first of each — the doctor must name exactly those, each with this rank
             alone, and nobody else (the ranks waiting for it, in any group, are not a cause)
    change   the rank issues another op or size at one collective, and every rank goes on
             (gloo paired them): one desync at that group and seq, naming the rank — or, in a
             pair, both members (nobody outvotes anybody)
    kill     a stop, and the rank's dump is gone too (SIGKILL, the OOM killer): the rank is
             named as missing, and each hang finding names it alone at a (group, seq) of the
             truth above — the one it stopped before among them (every other member issued
             that one); a member waiting elsewhere may leave the others unsaid
    nothing  no finding at all

The same runs are read again as PyTorch's recorder holds them (groups by id, seqs from 1,
point-to-point entries between them). There, a group that is not the world is known only by the
ranks that hold some of it (gloo records no member list): each program starts with one
collective in every group — as a run's start-up broadcasts do — and faults come after."""
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flight_dumps import (WORLD_GROUP, Collective, as_torch, found, named, never_issued_by, play,
                          torch_entry, write_played, write_torch)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
NUMELS = (4, 8, 16)
FAST = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@st.composite
def runs(draw, warm_up: bool = False, kinds=("nothing", "stop", "change", "kill")):
    """(world, program, fault): fault is None, ("stop" or "kill", rank, k) or ("change", rank, k,
    other)."""
    world = draw(st.integers(2, 6))
    subsets = st.lists(st.integers(0, world - 1), min_size=2, max_size=world, unique=True).map(
        lambda rs: tuple(sorted(rs)))
    groups = [(WORLD_GROUP, tuple(range(world)))]
    for i, members in enumerate(draw(st.lists(subsets, max_size=3, unique=True))):
        if len(members) < world:                     # (one spanning the world is the world)
            groups.append((named(f"g{i}", members), members))
    step = st.builds(Collective, st.sampled_from(groups).map(lambda g: g[0]), st.just(()),
                     st.sampled_from(OPS), st.sampled_from(NUMELS))
    body = draw(st.lists(step, min_size=1, max_size=12))
    start = [Collective(g, (), "broadcast", NUMELS[0]) for g, _ in groups[1:]] if warm_up else []
    members = dict(groups)
    program = [Collective(c.group, members[c.group], c.op, c.numel) for c in start + body]
    kind = draw(st.sampled_from(kinds))
    if kind == "nothing":
        return world, program, None
    k = draw(st.integers(len(start), len(program) - 1))
    rank = draw(st.sampled_from(program[k].members))
    if kind in ("stop", "kill"):
        return world, program, (kind, rank, k)
    c = program[k]
    other = draw(st.sampled_from([Collective(c.group, c.members, op, n) for op in OPS for n in NUMELS
                                  if (op, n) != (c.op, c.numel)]))
    return world, program, ("change", rank, k, other)


def expected(world, program, fault, played, group_name=lambda g: g, first=0) -> list[tuple]:
    """The findings the truth allows, as (kind, ranks, group, seq), sorted."""
    if fault is None:
        return []
    kind, rank, k, *_ = fault
    if kind == "stop":
        return sorted(("hang", [rank], group_name(g), s + first)
                      for g, s in never_issued_by(played, rank, program))
    members = program[k].members
    return [("desync", [rank] if len(members) > 2 else list(members), group_name(program[k].group),
             played.seq_of[k] + first)]


def played_with(world, program, fault):
    if fault is None:
        return play(world, program)
    if fault[0] in ("stop", "kill"):
        return play(world, program, stop=fault[1:])
    return play(world, program, change=fault[1:])


@FAST
@given(runs())
def test_the_doctor_names_exactly_the_planted_rank_group_and_seq(run):
    world, program, fault = run
    played = played_with(world, program, fault)
    killed = fault is not None and fault[0] == "kill"
    with tempfile.TemporaryDirectory() as d:
        write_played(Path(d), world, played)
        if killed:
            (Path(d) / f"flight_rank{fault[1]}.json").unlink()
        got = sorted(found(d))
    if not killed:
        assert got == expected(world, program, fault, played), (fault, got)
        return
    _, rank, k = fault
    truth = expected(world, program, ("stop", rank, k), played)
    gone, planted = ("missing_dump", [rank], None, None), ("hang", [rank], program[k].group, played.seq_of[k])
    assert gone in got and planted in got, (fault, got)
    assert all(f in truth for f in got if f != gone), (fault, got)


@FAST
@given(runs(warm_up=True), st.randoms(use_true_random=False))
def test_pytorch_dumps_of_the_same_run_name_the_same(run, rnd):
    """Point-to-point entries are slipped in after random collectives of a rank, numbered as
    NCCL numbers them (the collective seq id of the collective before): they change nothing.
    A killed rank's dump is gone: it is named missing, and each hang it left names it alone —
    in a subgroup too, whose members no dump lists. (Not the highest rank: PyTorch's dumps do
    not say the world's size, so the doctor counts the ranks that left one.)"""
    world, program, fault = run
    killed = fault is not None and fault[0] == "kill"
    if killed and fault[1] == world - 1:
        fault = ("kill", fault[1] - 1, fault[2]) if fault[1] - 1 in program[fault[2]].members else None
    played = played_with(world, program, fault)
    groups = dict.fromkeys(c.group for c in program)
    pg_of = {g: 0 if g == WORLD_GROUP else i + 1 for i, g in enumerate(groups)}
    theirs = as_torch(played, pg_of)
    for r, entries in theirs.items():
        for i in sorted(rnd.sample(range(len(entries)), k=min(2, len(entries))), reverse=True):
            e = entries[i]
            entries.insert(i + 1, torch_entry(e["collective_seq_id"], pg=e["pg_id"], op=f"send {r}->0", p2p=True))
    name = {g: "torch:default_pg" if i == 0 else f"torch:pg{i}" for g, i in pg_of.items()}
    if fault is not None and fault[0] == "kill":
        del theirs[fault[1]]
    with tempfile.TemporaryDirectory() as d:
        got = sorted(found(write_torch(Path(d), theirs)))
    if fault is None or fault[0] != "kill":
        assert got == expected(world, program, fault, played, name.get, first=1), (fault, got)
        return
    _, rank, k = fault
    truth = expected(world, program, ("stop", rank, k), played, name.get, first=1)
    gone = ("missing_dump", [rank], None, None)
    planted = ("hang", [rank], name[program[k].group], played.seq_of[k] + 1)
    assert gone in got and planted in got, (fault, got)
    assert all(f in truth for f in got if f != gone), (fault, got)
