"""The doctor on hand-made flight dumps: each case one rule of ``minishard/instruments/doctor.py`` and
``minishard/instruments/causes.py`` that the runs on real ranks (test_doctor.py, test_faults.py) do not pin
down — which rank a tie names, a step or a broadcast's source that differs, a victim stuck in
another group, what counts as a timeout, the order of findings, bad input, the thresholds. Plus
the pieces the dumps are made of: fingerprints and the skip predicate of a planted fault."""
import json

import pytest
import torch

from minishard.instruments import causes, doctor, health
from minishard.instruments.faults import Fault
from minishard.cli import doctor as cli_doctor, main
from minishard.training.config import TrainConfig

WORLD = 4


def entry(seq, op="all_reduce", shape=(8,), dtype="float32", tag="bucket0", step=0, state="completed",
          group="world", size=WORLD, **extra):
    n = 1
    for d in shape:
        n *= d
    return {"seq": seq, "op": op, "group": group, "group_size": size, "shapes": [list(shape)],
            "dtypes": [dtype], "bytes": 4 * n, "tag": tag, "step": step, "phase": "backward",
            "state": state, "where": "x.py:1 in f", "caller": "", "t_issued": 0.0, "t_completed": 0.0,
            **extra}


def dump(rank, entries, reason="end", error=None, world=WORLD, time=0.0, facts=None):
    return {"v": 1, "rank": rank, "world_size": world, "capacity": 256, "reason": reason,
            "error": error, "time": time, "entries": entries, "facts": facts or {}}


def write(d, dumps):
    d.mkdir(parents=True, exist_ok=True)
    for body in dumps:
        (d / f"flight_rank{body['rank']}.json").write_text(json.dumps(body))
    return d


def kinds(d):
    return [(f.kind, f.ranks) for f in doctor.diagnose(d).findings]


def alike(n=3):
    return [entry(s) for s in range(n)]


def test_one_rank_a_step_ahead_at_the_same_tag_is_a_desync(tmp_path):
    """The same op, shape and tag at one seq, but rank 1's belongs to the next step: it skipped
    one step's reduction and its next paired with the others' (sizes agree: no error)."""
    d = write(tmp_path, [dump(r, [entry(0), entry(1, step=1 if r == 1 else 0)]) for r in range(WORLD)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("desync", [1])
    # the title says what differs, not the same collective twice
    assert f.title.endswith(": at seq 1 of group 'world', ranks 0, 2, 3 all_reduce of bucket0 [8] float32, "
                            "32 B, step 0; rank 1 all_reduce of bucket0 [8] float32, 32 B, step 1"), f.title


def test_a_desync_of_one_op_and_shape_says_the_step_and_line_of_each_side(tmp_path):
    """A watched PyTorch job: untagged all-reduces of one shape, rank 1's from another line
    and step (it ran one more no-grad forward). The title tells the sides apart by what differs —
    the step and the line — and says neither where the collectives already differ by what they move."""
    lines = {0: "train.py:108 in main", 1: "train.py:99 in main"}
    d = write(tmp_path, [dump(r, [entry(0, tag="", step=2 + r, where=lines[r])], world=2) for r in range(2)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("desync", [0, 1])
    assert f.title.endswith("rank 0 all_reduce [8] float32, 32 B, step 2, at train.py:108 in main; "
                            "rank 1 all_reduce [8] float32, 32 B, step 3, at train.py:99 in main"), f.title
    tagged = write(tmp_path / "tagged", [dump(r, [entry(0, tag=f"blocks.{r}", where=lines[r])], world=2)
                                         for r in range(2)])
    (f,) = doctor.diagnose(tagged).findings
    assert f.title.endswith("rank 0 all_reduce of blocks.0 [8] float32, 32 B; "
                            "rank 1 all_reduce of blocks.1 [8] float32, 32 B"), f.title


def test_a_one_against_one_split_names_both_ranks(tmp_path):
    d = write(tmp_path, [dump(r, [entry(0), entry(1, shape=(8,) if r == 0 else (4,))], world=2)
                         for r in range(2)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("desync", [0, 1])


def test_a_broadcast_from_another_source_on_one_rank_is_a_desync(tmp_path):
    d = write(tmp_path, [dump(r, [entry(0, op="broadcast", tag="replicate", src=1 if r == 2 else 0)])
                         for r in range(WORLD)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("desync", [2])
    assert f.title.endswith("ranks 0, 1, 3 broadcast of replicate [8] float32, 32 B, from rank 0; "
                            "rank 2 broadcast of replicate [8] float32, 32 B, from rank 1"), f.title


def test_the_rank_furthest_behind_is_where_the_hang_starts(tmp_path):
    """Rank 1 stopped after seq 1, rank 2 after seq 3, the others reached seq 5."""
    last = {0: 5, 1: 1, 2: 3, 3: 5}
    d = write(tmp_path, [dump(r, [entry(s, state="issued" if s == 5 else "completed")
                                  for s in range(last[r] + 1)]) for r in range(WORLD)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("hang", [1, 2])
    assert "never issued seq 2 of group 'world'" in f.title


def test_a_rank_with_no_collective_in_a_world_group_is_the_one_behind(tmp_path):
    d = write(tmp_path, [dump(r, [] if r == 1 else [entry(0, state="issued")]) for r in range(WORLD)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("hang", [1])
    assert any("holds no collective of group 'world'" in e for e in f.evidence)


def test_only_ranks_still_waiting_are_said_to_wait(tmp_path):
    d = write(tmp_path, [dump(0, alike(2) + [entry(2, state="completed")]),
                         dump(1, alike(2)),
                         dump(2, alike(2) + [entry(2, state="issued")]),
                         dump(3, alike(2) + [entry(2, state="issued")])])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("hang", [1]) and f.title.endswith("ranks 2, 3 wait in it"), f.title


def test_a_rank_stuck_in_another_groups_collective_is_a_victim_not_the_cause(tmp_path):
    """Hybrid sharding: rank 1 never issued shard[0, 1]'s reduce-scatter; rank 0 waits in it and
    so never reached replicate[0, 2]'s all-reduce, which rank 2 waits in. The cause is rank 1."""
    shard = dict(group="shard[0, 1]", size=2)
    rep = dict(group="replicate[0, 2]", size=2)
    d = write(tmp_path, [
        dump(0, [entry(0, op="reduce_scatter", state="issued", **shard)]),
        dump(1, []),
        dump(2, [entry(0, op="reduce_scatter", **dict(shard, group="shard[2, 3]")),
                 entry(0, state="issued", **rep)]),
        dump(3, [entry(0, op="reduce_scatter", **dict(shard, group="shard[2, 3]"))])])
    found = doctor.diagnose(d).findings
    assert [(f.kind, f.ranks) for f in found if f.kind == "hang"] == [("hang", [1])], \
        [(f.kind, f.ranks, f.title) for f in found]


@pytest.mark.parametrize("error, timeout", [
    ("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv", True),
    ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234", True),
    ("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer", True),
    ("TimeoutError: all_reduce did not complete in 2.0 s", True),
    ("RuntimeError: Application timeout caused pair closure", True),
    ("ValueError: a batch timeout_s of -1 makes no sense", False),
    ("RuntimeError: the data loader timed out reading shard 3", False),
])
def test_what_counts_as_giving_up_on_a_collective(tmp_path, error, timeout):
    d = write(tmp_path, [dump(r, alike(), reason="exception" if r == 2 else "end",
                              error=error if r == 2 else None) for r in range(WORLD)])
    # (a rank that timed out while the others ended their runs: those ended before it, named)
    assert kinds(d) == ([("hang", [0, 1, 3]), ("timeout", [2])] if timeout else [("exception", [2])])


GLOO_SAYS = {"timed out": "RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                          "Timed out waiting 3000ms for recv operation to complete",
             "a peer went away": "RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                                 "Connection closed by peer [127.0.0.1]:37794. This is typically caused by a\n"
                                 "remote worker crashing. Check the logs of the remote worker. GLHF!"}


@pytest.mark.parametrize("how", [("timed out",), ("a peer went away",), ("timed out", "a peer went away")])
def test_a_timeout_is_one_line_gloos_words_only_verbose(tmp_path, how, capsys):
    """Ranks 0 and 2 gave up in seq 2, each with gloo's own words (C++ source paths, a second
    line): the title names the collective, how long (no clock: gloo's own count, else nothing)
    and how they gave up — in one line, without gloo's text, which ``--verbose`` adds."""
    errors = {0: GLOO_SAYS[how[0]], 2: GLOO_SAYS[how[-1]]}
    d = write(tmp_path, [dump(r, alike(2) + ([entry(2, state="issued")] if r != 1 else []),
                              reason="exception" if r != 1 else "end", error=errors.get(r), world=3)
                         for r in range(3)])
    (timeout,) = [f for f in doctor.diagnose(d).findings if f.kind == "timeout"]
    why = how[0] if len(how) == 1 else "timed out or lost a peer"
    wait = "" if how == ("a peer went away",) else " after 3.0 s"      # (gloo's 3000ms: the one count)
    assert timeout.title == (f"ranks 0, 2 gave up waiting in all_reduce of bucket0 (seq 2 of group "
                             f"'world'){wait}: {why}"), timeout.title
    assert "\n" not in timeout.title and "/__w/" not in " ".join(timeout.evidence)
    assert main(["doctor", str(d)]) == 1
    plain = capsys.readouterr().out
    assert main(["doctor", str(d), "--verbose"]) == 1
    verbose = capsys.readouterr().out
    assert "/__w/" not in plain and "GLHF" not in plain
    for r, error in errors.items():
        first, *rest = error.splitlines()
        assert f"{'ranks 0, 2' if len(how) == 1 else f'rank {r}'}'s error, as raised: {first}" in verbose
        assert all(f"\n     {line}\n" in verbose for line in rest), verbose


def test_an_exception_says_its_first_line_without_a_libraries_source_path(tmp_path, capsys):
    """gloo's abort, raised as an exception on a rank that survived it: the title quotes the
    error's first line without the C++ file it came from; its whole text is --verbose's."""
    error = ("RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
             "op.preamble.length <= op.nbytes. 145112 vs 4.\nReceived data size doesn't match")
    d = write(tmp_path, [dump(r, alike(), reason="exception" if r == 1 else "end",
                              error=error if r == 1 else None, world=2) for r in range(2)])
    (f,) = [f for f in doctor.diagnose(d).findings if f.kind == "exception"]
    assert f.title == "rank 1 raised RuntimeError: op.preamble.length <= op.nbytes. 145112 vs 4.", f.title
    assert f.details == [f"rank 1's error, as raised: {error}"]


def test_the_earliest_error_is_the_cause_and_the_later_one_its_consequence(tmp_path):
    d = write(tmp_path, [dump(3, alike(), "exception", "RuntimeError: planted", time=1.0),
                         dump(0, alike(), "exception", "KeyError: 'x'", time=2.0),
                         dump(1, alike()), dump(2, alike())])
    first, second = doctor.diagnose(d).findings
    assert (first.ranks, second.ranks) == ([3], [0])
    assert "raised after rank 3 did" in second.fix


@pytest.mark.parametrize("gone", [0, WORLD - 1])
def test_a_missing_dump_is_named_first_rank_or_last(tmp_path, gone):
    d = write(tmp_path, [dump(r, alike()) for r in range(WORLD) if r != gone])
    assert kinds(d) == [("missing_dump", [gone])]


def test_causes_come_in_their_order_and_any_finding_exits_1(tmp_path, capsys):
    facts = {"steps": [{"step": 0, "param_dtypes": ["bfloat16"], "low_precision_elements": 10,
                        "unchanged": 5, "grad_norm": 1.0}]}
    d = write(tmp_path, [dump(r, alike(), facts=dict(facts, steps=[dict(facts["steps"][0], grad_norm=1.0 + r)]))
                         for r in range(WORLD)])
    assert [k for k, _ in kinds(d)] == ["clip", "precision"]
    assert main(["doctor", str(d)]) == 1
    out = capsys.readouterr().out
    report = doctor.diagnose(d)
    assert all(e in out for f in report.findings for e in f.evidence)       # the text says it all
    assert "(50.0 %)" in out


@pytest.mark.parametrize("norms, odd", [((1.0, 1.0, 1.0, 1.0), None), ((1.0, 1.0, 1.0001, 1.0), 2),
                                       ((1.0, 1.0), None), ((1.0, 1.0001), 1)])
def test_one_global_norm_agrees_to_the_bit_a_local_one_does_not(norms, odd):
    """On any number of ranks, two included (the smallest world that can disagree)."""
    dumps = {r: dump(r, [], world=len(norms), facts={"steps": [{"step": 0, "param_dtypes": ["float32"],
                                                                "grad_norm": n}]})
             for r, n in enumerate(norms)}
    found = causes.clip(dumps)
    assert bool(found) == (odd is not None)
    if found:
        assert found[0].ranks == list(range(len(norms)))
        assert f"rank {odd} differ" in found[0].evidence[1]


@pytest.mark.parametrize("norm", [None, 2.5])
def test_nothing_found_says_clipped_by_one_norm_only_of_a_run_that_clipped(tmp_path, norm):
    """The line after "nothing found" lists what the facts let the doctor compare: the
    agreement of the gradient norms is claimed only where the ranks noted one."""
    facts = {"steps": [{"step": 0, "param_dtypes": ["float32"], "grad_norm": norm}]}
    d = write(tmp_path, [dump(r, alike(), facts=facts) for r in range(WORLD)])
    out = "\n".join(cli_doctor.text(doctor.diagnose(d)))
    assert "nothing found" in out and "stepped fp32 weights" in out
    assert ("clipped by one gradient norm" in out) == (norm is not None)


def test_a_weight_that_differs_anywhere_is_named(tmp_path):
    prints = {f"p{i}": f"{i:016x}" for i in range(5)}
    d = write(tmp_path, [dump(r, alike(), facts={
        "weights_start": dict(prints, p4="ffffffffffffffff") if r == 2 else prints,
        "start_not_replicated": [5]}) for r in range(WORLD)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("weights", [2])
    assert "1 of 5 parameters" in f.evidence[0] and "first: p4" in f.evidence[0]
    assert any("told not to broadcast" in e for e in f.evidence)


def test_a_root_holding_a_large_vocabulary_beside_wrapped_blocks_is_not_a_finding():
    assert not causes._one_unit({"root": 60, "blocks.0": 40})            # wrapped: the embedding
    assert causes._one_unit({"root": 100})                                # no wrap policy
    assert causes._one_unit({"root": 10, "blocks.0": 70, "blocks.1": 20})  # a unit below the root
    assert not causes._one_unit({"root": 10, "blocks.0": 45, "blocks.1": 45})


@pytest.mark.parametrize("damage, says", [
    (lambda b: dict(b, rank=2), "the dump says rank 2, its name rank 3"),
    (lambda b: dict(b, entries=[{k: v for k, v in entry(0).items() if k != "op"}]), "entry 0 has no op"),
])
def test_a_dump_that_contradicts_itself_is_exit_2(tmp_path, capsys, damage, says):
    write(tmp_path, [dump(r, alike()) for r in range(WORLD - 1)])
    (tmp_path / "flight_rank3.json").write_text(json.dumps(damage(dump(3, alike()))))
    assert main(["doctor", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err


def test_a_rank_outside_the_world_is_exit_2(tmp_path, capsys):
    write(tmp_path, [dump(r, alike()) for r in range(WORLD)] + [dump(WORLD, alike())])
    assert main(["doctor", str(tmp_path)]) == 2
    assert f"rank {WORLD} in a world of {WORLD}" in capsys.readouterr().err


# --------------------------------------------------------------------------- what the dumps are made of

def test_a_fingerprint_sees_dtype_shape_and_every_byte():
    t = torch.arange(12, dtype=torch.float32)
    base = health.fingerprint([("w", t)])["w"]
    assert health.fingerprint([("w", t.clone())])["w"] == base
    assert health.fingerprint([("w", t.view(3, 4))])["w"] != base
    assert health.fingerprint([("w", t.view(torch.int32))])["w"] != base
    last = t.clone()
    last[-1] = torch.nextafter(last[-1], torch.tensor(100.0))             # one bit, the last byte
    assert health.fingerprint([("w", last)])["w"] != base


@pytest.mark.parametrize("strategy, phase", [("ddp", "backward"), ("ddp_naive", "sync_gradients")])
def test_skip_collective_skips_from_the_last_steps_first_reduction_on(strategy, phase):
    skip = Fault("skip-collective", 1).skip(1, last_step=2)
    assert Fault("skip-collective", 1).skip(0, last_step=2) is None
    assert not skip("all_reduce", "bucket0", 1, phase)                    # an earlier step
    assert not skip("all_gather", "blocks.2", 2, "backward")              # not a reduction
    assert not skip("all_reduce", "grad_norm", 2, "optimizer")            # not the gradients'
    assert skip("all_reduce", "bucket0", 2, phase)
    assert skip("all_gather", "params0", 2, "optimizer")                  # and everything after


def test_unsynced_init_is_refused_where_pytorch_broadcasts_anyway():
    from minishard.training.config import ConfigError
    with pytest.raises(ConfigError, match="broadcasts rank 0's weights in its constructor"):
        Fault("unsynced-init").check(TrainConfig(strategy="torch_ddp"))
    Fault("unsynced-init").check(TrainConfig(strategy="torch_fsdp"))      # FSDP2 does not


def test_a_new_finding_is_one_function_and_one_line_in_causes(tmp_path, monkeypatch, capsys):
    """Adding a kind of finding touches one module: a function that reads the run and decides,
    and its line in ``causes.CAUSES``. The doctor runs it, orders it after the existing ones,
    ``minishard doctor`` prints it with its evidence and fix and exits 1, ``--json`` carries it."""
    def steps_noted(report):
        lacking = sorted(r for r, d in report.dumps.items() if not (d.get("facts") or {}).get("steps"))
        return [causes.Finding("unnoted", lacking, "no step was noted", [f"rank {r}: no steps" for r in lacking],
                               "note every step")] if lacking else []
    monkeypatch.setattr(causes, "CAUSES", [*causes.CAUSES, causes.Cause("unnoted", steps_noted)])
    facts = {"weights_start": {"p": "0" * 16}}
    d = write(tmp_path, [dump(r, alike(), facts=facts) for r in range(WORLD)])
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks, doctor.kinds()[-1]) == ("unnoted", list(range(WORLD)), "unnoted")
    assert main(["doctor", str(d)]) == 1
    out = capsys.readouterr().out
    assert "[unnoted] no step was noted" in out and "rank 0: no steps" in out and "note every step" in out
    assert main(["doctor", str(d), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["findings"][0]["kind"] == "unnoted"


@pytest.mark.parametrize("fault_rank", [0, 2])
def test_unsynced_init_rebuilds_the_weights_of_its_rank_only(fault_rank):
    """The doctor names the ranks whose weights differ from the lowest rank's: the fault must leave
    every other rank's weights as built, whichever rank it is planted on (rank 0 included)."""
    from minishard.core.model import GPT
    config = TrainConfig(strategy="ddp", model="nano")
    built = GPT("nano", seed=config.seed).state_dict()
    fault = Fault("unsynced-init", fault_rank)
    for rank in range(3):
        mine = fault.model(GPT("nano", seed=config.seed), config, rank).state_dict()
        same = all(torch.equal(mine[n], built[n]) for n in built)
        assert same == (rank != fault_rank), (fault_rank, rank)


def test_skip_collective_skips_a_reduce_scatter_of_the_last_steps_gradients():
    """ZeRO-2 and FSDP reduce the gradients with reduce-scatters: the rank that believes it has
    nothing to reduce skips the last step's first one, and everything after it."""
    skip = Fault("skip-collective", 1).skip(1, last_step=2)
    assert not skip("reduce_scatter", "blocks.1", 1, "backward")          # an earlier step
    assert not skip("all_gather", "blocks.1", 2, "backward")
    assert skip("reduce_scatter", "blocks.1", 2, "backward")
    assert skip("all_gather", "blocks.0", 2, "backward")


def test_a_rank_that_died_after_its_last_collective_completed_is_not_said_to_be_inside_it():
    """``died``: "inside the collective it issued last" only for a ring whose last entry is still
    issued; a rank that died between collectives (its last one completed) is named, not placed."""
    dumps = {0: dump(0, [entry(0), entry(1, state="issued")], reason="ring"),
             1: dump(1, [entry(0), entry(1)], reason="ring")}
    found = doctor.died(dumps)
    assert found.ranks == [0, 1]
    assert found.title.endswith("; rank 0 inside the collective it issued last"), found.title


def test_a_hang_names_the_rank_that_died_inside_it_and_the_ones_that_wait():
    """``never_completed``: of the ranks stuck in a collective, one that left only its ring died
    inside it — the finding is about that rank; the others wait in it."""
    dumps = {0: dump(0, [entry(0), entry(1, state="issued")], reason="ring", world=2),
             1: dump(1, [entry(0), entry(1, state="issued")], reason="exception", world=2,
                     error="RuntimeError: timed out after 6 s")}
    held = {r: {e["seq"]: e for e in b["entries"]} for r, b in dumps.items()}
    found = doctor.never_completed("world", held, [0, 1], [], dumps)
    assert found.ranks == [0]
    assert found.title == "rank 0 died inside all_reduce seq 1 of group 'world'; rank 1 waits in it", found.title


def test_a_rank_that_died_is_not_one_that_left_early():
    """``left_early`` is about ranks that *ended* their run (a dump with reason "end") while the
    others timed out; a rank that left only its ring died, which ``died`` reports."""
    waiting = dump(1, [entry(0), entry(1, state="issued")], reason="exception", world=3,
                   error="RuntimeError: timed out after 6 s")
    dumps = {0: dump(0, [entry(0), entry(1, state="issued")], reason="ring", world=3), 1: waiting}
    assert doctor.left_early(dumps) is None
    dumps[2] = dump(2, [entry(0)], reason="end", world=3)
    assert doctor.left_early(dumps).ranks == [2]


def test_a_ranks_dump_is_read_over_the_ring_it_also_left(tmp_path):
    """A rank that lived to write ``flight_rank{r}.json`` also leaves the ring it flew with: the
    dump (its reason, its facts) is what the doctor reads; the ring stands in only for a missing one."""
    import torch
    from minishard.core.flight import FlightRecorder
    from minishard.instruments.records import read_dir
    rec = FlightRecorder(rank=0, world_size=2)
    rec.fly_to(tmp_path)
    rec.completed(rec.issued("all_reduce", "world", 2, (torch.zeros(2),), 8, "b0", 0, "backward", 0.0), 0.5)
    rec.dump(tmp_path, "end")
    ring_only = FlightRecorder(rank=1, world_size=2)
    ring_only.fly_to(tmp_path)
    report = read_dir(tmp_path)
    assert {r: b["reason"] for r, b in report.dumps.items()} == {0: "end", 1: "ring"}
