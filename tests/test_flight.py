"""The flight recorder: every rank's last collectives, written however a run ends.

Checked on real ranks: each collective minishard issues is entered once, numbered per group in
issue order (the same numbers on every rank), with its shapes, bytes, the unit or bucket, the
step and phase, the engine's line that issued it and the caller's, and completed when it is;
``TrainConfig(flight_dir=...)`` writes one file per rank at the end and, with the error, when a
rank raises; SIGTERM writes it too."""
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from minishard.core.flight import FlightRecorder, dumping
from minishard.training.loop import TrainConfig, train


def test_a_run_writes_every_collective_numbered_alike_on_every_rank(pools, tmp_path):
    res = pools(2).run(train, TrainConfig(strategy="fsdp", model="nano", steps=2, micro_batch=2,
                                          flight_dir=str(tmp_path)))
    dumps = [json.loads((tmp_path / f"flight_rank{r}.json").read_text()) for r in range(2)]
    events = pools(2).last_events
    for r, d in enumerate(dumps):
        assert (d["rank"], d["world_size"], d["reason"], d["error"]) == (r, 2, "end", None)
        ents = d["entries"]
        coll = [e for e in events if e["kind"] == "collective" and e["rank"] == r]
        # one entry per traced collective (the units' start-up broadcasts of rank 0's weights
        # included), numbered 0, 1, 2, ... in issue order
        assert len(ents) == len(coll) and [e["seq"] for e in ents] == list(range(len(ents)))
        assert Counter((e["op"], e["tag"], e["bytes"]) for e in ents) == \
            Counter((e["op"], e["tag"], e["payload"]) for e in coll)
        assert all(e["state"] == "completed" and e["t_completed"] >= e["t_issued"] for e in ents)
        rs = [e for e in ents if e["op"] == "reduce_scatter"]
        assert {e["phase"] for e in rs} == {"backward"} and {e["step"] for e in rs} == {0, 1}
        assert all(e["where"].startswith("minishard/strategies/fsdp/unit.py:") for e in rs)
        assert ents[0]["tag"] == "replicate" and ents[0]["step"] is None   # before the first step
        # the bytes and shapes: a reduce-scatter's payload is its input, numel x dtype size
        for e in rs:
            (shape,), (dtype,) = e["shapes"], e["dtypes"]
            assert e["bytes"] == 4 * shape[0] and dtype == "float32"
    # every rank numbered the same collectives the same way
    sig = [[(e["seq"], e["op"], e["shapes"], e["tag"]) for e in d["entries"]] for d in dumps]
    assert sig[0] == sig[1]
    assert res[0]["losses"]                      # (the run itself went on as ever)


def test_the_caller_is_the_first_line_outside_minishard_and_torch():
    import torch
    from minishard.core.comm import Comm
    comm = Comm(alone=True)
    comm.all_reduce(torch.ones(3), tag="mine")             # this line is the caller
    (e,) = comm.flight.entries
    assert e["caller"].startswith(f"tests/{os.path.basename(__file__)}:") and "in test_the_caller" in e["caller"]
    assert e["where"] == e["caller"]                       # issued from here, not from the engine
    assert (e["op"], e["shapes"], e["bytes"], e["state"]) == ("all_reduce", [[3]], 12, "completed")


def test_a_communicator_subclass_is_not_the_call_site():
    """A subclass of Comm (chapter 11's faults are one) overrides the communicator's own steps;
    the line that issued the collective is still its caller's, not the override's."""
    import torch
    from minishard.core.comm import Comm

    class Counting(Comm):
        def _begin(self, *args, **kw):
            self.began = getattr(self, "began", 0) + 1
            return super()._begin(*args, **kw)

    comm = Counting(alone=True)
    comm.all_reduce(torch.ones(3), tag="mine")             # this line is the caller
    (e,) = comm.flight.entries
    assert comm.began == 1 and "in test_a_communicator_subclass" in e["where"]
    assert e["where"] == e["caller"]


def test_the_ring_keeps_the_last_capacity_and_an_exception_is_written(tmp_path):
    import torch
    rec = FlightRecorder(capacity=3)
    for k in range(5):
        rec.issued("broadcast", "world", 1, (torch.zeros(2),), 8, f"t{k}", None, None, 0.0)
    assert [e["seq"] for e in rec.entries] == [2, 3, 4]    # the oldest dropped, numbers kept
    with pytest.raises(RuntimeError, match="planted"):
        with dumping(rec, tmp_path):
            raise RuntimeError("planted")
    d = json.loads((tmp_path / "flight_rank0.json").read_text())
    assert d["reason"] == "exception" and d["error"] == "RuntimeError: planted"
    assert [e["state"] for e in d["entries"]] == ["issued"] * 3
    # where it was raised: this test's own line, the raise and the user's code at once
    fn = test_the_ring_keeps_the_last_capacity_and_an_exception_is_written
    source, first = inspect.getsourcelines(fn)
    (n,) = [first + i for i, line in enumerate(source) if line.strip() == 'raise RuntimeError("planted")']
    here = f"tests/{os.path.basename(__file__)}:{n} in {fn.__name__}"
    assert d["raised"] == {"at": here, "caller": here}, d["raised"]


def test_an_exception_raised_inside_a_library_names_its_line_and_the_callers():
    """Raised inside torch (a collective without a process group): ``at`` is torch's line that
    raised, ``caller`` the innermost line outside minishard and torch — the user's."""
    import torch
    import torch.distributed as dist
    from minishard.core.flight import raised_at

    def users_step():
        dist.all_reduce(torch.ones(2))              # the user's line
    try:
        users_step()
    except (ValueError, RuntimeError) as e:
        raised = raised_at(e.__traceback__)
    line = inspect.getsourcelines(users_step)[1] + 1
    assert raised["caller"] == f"tests/{os.path.basename(__file__)}:{line} in users_step", raised
    assert "/torch/distributed/" in raised["at"], raised
    # raised in minishard's own code under Python's library (a rank's multiprocessing frames are
    # the same case): the library's frames are nobody's code to fix, the test's line is the caller
    from minishard.core.words import fmt_bytes
    try:
        json.loads('{"a": 1}', object_hook=fmt_bytes)          # json's frames, then minishard's
    except TypeError as e:
        raised = raised_at(e.__traceback__)
    assert raised["at"].startswith("minishard/core/words.py:") and raised["at"].endswith(" in fmt_bytes")
    assert raised["caller"].startswith(f"tests/{os.path.basename(__file__)}:"), raised


def test_sigterm_writes_the_recorder_then_terminates(tmp_path):
    """torchrun stops the other ranks with SIGTERM when one fails: the recorder is written
    first, then the process ends as SIGTERM ends it."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        from minishard.core.comm import Comm
        from minishard.core.flight import dumping
        from minishard.core.trace import Tracer
        tracer = Tracer(rank=3, world_size=4)
        rec = Comm(tracer).flight                 # (timed on the tracer's clock)
        rec.rank, rec.world_size = 3, 4
        with tracer.phase("forward"):
            rec.issued("all_reduce", "world", 4, (torch.zeros(1),), 4, "bucket0", 1, "backward", tracer.now())
        with dumping(rec, {str(tmp_path)!r}, tracer=tracer):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGTERM, out.stderr
    d = json.loads((tmp_path / "flight_rank3.json").read_text())
    assert d["reason"] == "sigterm" and d["entries"][0]["state"] == "issued"
    # the dump's time on the entries' clock (the trace's): how long the collective had waited
    assert d["t"] >= d["entries"][0]["t_issued"] > 0
    # and the rank's trace beside it: nobody else would collect its events (the player's)
    from minishard.core.trace import read_jsonl
    events = read_jsonl(tmp_path / "rank3.jsonl")
    assert [(e["kind"], e["name"], e["edge"]) for e in events] == [("phase", "forward", "begin"), ("phase", "forward", "end")]


def test_a_training_run_stopped_by_sigterm_leaves_its_dump_and_its_trace(tmp_path):
    """torchrun stops every rank when one fails (``--fault extra-collective``: gloo aborts one,
    the others get SIGTERM): each leaves its dump *and* its trace — the events of a rank that
    never returns are collected by nobody else — so the stopped run still has a player."""
    script = textwrap.dedent(f"""
        import os, signal
        from minishard.training.loop import TrainConfig, train
        def stop(info):                          # as torchrun stops a rank: mid-run, from outside
            if info["step"] == 1:
                os.kill(os.getpid(), signal.SIGTERM)
        train(None, TrainConfig(strategy="single", model="nano", steps=3, micro_batch=1,
                                flight_dir={str(tmp_path)!r}), on_step=stop)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGTERM, out.stderr
    assert json.loads((tmp_path / "flight_rank0.json").read_text())["reason"] == "sigterm"
    from minishard.cli import main
    from minishard.core.trace import read_jsonl
    steps = {e["step"] for e in read_jsonl(tmp_path / "rank0.jsonl") if e["kind"] == "phase" and "step" in e}
    assert steps == {0, 1}, steps                # as far as it got, and no further
    assert main(["view", str(tmp_path)]) == 0 and (tmp_path / "player.html").exists()


def test_pytorchs_own_recorder_is_written_beside_when_asked(pools, tmp_path):
    """``torch_flight=True`` writes c10d's own ring beside minishard's dumps (the doctor reads it
    for a job that never imported minishard); without it, no such file — and it is asked for by
    the config, never by reading an environment variable."""
    from minishard.instruments import torch_flight
    for asked in (True, False):
        d = tmp_path / str(asked)
        pools(2).run(train, TrainConfig(strategy="ddp", model="nano", steps=1, micro_batch=1,
                                        flight_dir=str(d), torch_flight=asked))
        theirs = sorted(p.name for p in d.glob("torch_fr_trace_rank_*"))
        assert theirs == (["torch_fr_trace_rank_0", "torch_fr_trace_rank_1"] if asked else [])
    ours = json.loads((tmp_path / "True" / "flight_rank0.json").read_text())["entries"]
    read = torch_flight.read(tmp_path / "True" / "torch_fr_trace_rank_0", 0, 2)["entries"]
    # c10d records every collective of the run minishard did (and may keep earlier runs' too)
    assert [e["op"] for e in read][-len(ours):] == [e["op"] for e in ours]
    with pytest.raises(ValueError, match="torch_flight=True needs flight_dir"):
        TrainConfig(torch_flight=True)


# --------------------------------------------------------------------------- on disk as it flies

def _ring(tmp_path, capacity=4, n=10, **entry):
    import torch
    rec = FlightRecorder(rank=1, world_size=2, capacity=capacity)
    rec.fly_to(tmp_path)
    entries = [rec.issued("all_reduce", "world", 2, (torch.zeros(3),), 12, f"b{k}", 0, "backward",
                          0.1 * k, **entry) for k in range(n)]
    return rec, entries


def test_the_ring_keeps_the_last_collectives_in_order_with_their_state(tmp_path):
    """The file holds the last ``capacity`` collectives, oldest first, each issued or completed
    as the process left it; a completion of one the ring has overwritten changes nothing."""
    from minishard.core import flight_file
    rec, entries = _ring(tmp_path)
    rec.completed(entries[0], 5.0)                     # long overwritten: no slot of its own
    for e in entries[6:9]:
        rec.completed(e, 1.25)
    body = flight_file.read(tmp_path / "flight_rank1.ring")
    assert (body["rank"], body["world_size"], body["capacity"], body["reason"]) == (1, 2, 4, "ring")
    assert [e["seq"] for e in body["entries"]] == [6, 7, 8, 9] and body["torn"] == []
    assert [e["state"] for e in body["entries"]] == ["completed"] * 3 + ["issued"]
    assert [e["t_completed"] for e in body["entries"]] == [1.25] * 3 + [None]
    assert body["entries"][0]["tag"] == "b6" and body["entries"][0]["shapes"] == [[3]]


def test_a_late_completion_of_an_overwritten_collective_leaves_the_slots_new_one_issued(tmp_path):
    """Collective 2 and collective 10 share a slot (capacity 4): completing 2 after the ring
    went past it must not mark 10, the one a dead rank was inside, completed."""
    from minishard.core import flight_file
    rec, entries = _ring(tmp_path)
    rec.completed(entries[1], 5.0)                     # n 2: its slot now holds n 10, issued
    last = flight_file.read(tmp_path / "flight_rank1.ring")["entries"][-1]
    assert (last["seq"], last["state"], last["t_completed"]) == (9, "issued", None)

def test_collectives_issued_before_the_ring_opened_go_in_first(tmp_path):
    import torch
    from minishard.core import flight_file
    rec = FlightRecorder(rank=0, world_size=2)
    done = rec.issued("broadcast", "world", 2, (torch.zeros(2),), 8, "start", None, None, 0.0)
    rec.completed(done, 0.5)
    rec.fly_to(tmp_path)
    rec.issued("all_reduce", "world", 2, (torch.zeros(2),), 8, "b0", 0, "backward", 1.0)
    got = flight_file.read(flight_file.path_for(tmp_path, 0))["entries"]
    assert [(e["op"], e["state"]) for e in got] == [("broadcast", "completed"), ("all_reduce", "issued")]


def test_a_record_cut_while_it_was_written_is_named_and_the_rest_read(tmp_path):
    """A process killed inside a record's write leaves its commit number behind its JSON: the
    record is named torn and left out, every other one is read."""
    from minishard.core import flight_file
    rec, _ = _ring(tmp_path, n=6)
    path = tmp_path / "flight_rank1.ring"
    raw = bytearray(path.read_bytes())
    slot = flight_file.HEADER_BYTES + (6 - 1) % 4 * flight_file.RECORD    # the last one written
    raw[slot:slot + 8] = (2).to_bytes(8, "little")     # the commit of the lap before it
    path.write_bytes(bytes(raw))
    body = flight_file.read(path)
    assert [e["seq"] for e in body["entries"]] == [2, 3, 4]
    assert len(body["torn"]) == 1 and "slot 1" in body["torn"][0] and "cut" in body["torn"][0]
    raw[slot + flight_file.SLOT.size + 5] = 0xFF       # and JSON that no longer parses
    path.write_bytes(bytes(raw))
    assert len(flight_file.read(path)["torn"]) == 1


def test_an_entry_too_long_for_its_slot_keeps_what_matching_needs(tmp_path):
    from minishard.core import flight_file
    rec, _ = _ring(tmp_path, n=1, detail="x" * 3 * flight_file.RECORD)
    body = flight_file.read(tmp_path / "flight_rank1.ring")
    (e,) = body["entries"]
    assert body["torn"] == [] and e["cut"] is True and "detail" not in e
    assert (e["op"], e["seq"], e["bytes"], e["shapes"], e["tag"]) == ("all_reduce", 0, 12, [[3]], "b0")


def test_a_file_that_is_not_a_ring_is_named_by_the_doctor(tmp_path):
    from minishard.cli import main
    (tmp_path / "flight_rank0.ring").write_bytes(b"not a ring at all")
    assert main(["doctor", str(tmp_path)]) == 2


def test_the_doctor_cannot_check_a_run_that_left_only_traces(tmp_path, capsys):
    """No dump and no ring: hangs and deaths cannot be told from a trace, and the doctor says so
    with an exit status of its own (3), never "nothing found"."""
    from minishard.cli import main
    from minishard.core import trace
    t = trace.Tracer(0, 1, origin=0.0)
    with t.phase("forward"):
        pass
    trace.write_dir(t.events, tmp_path)
    assert main(["doctor", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert "cannot be checked (exit status 3 when nothing is found)" in out and "minishard.watch" in out
    assert "nothing found" not in out


def test_a_collective_of_many_tensors_stays_inside_its_slot(tmp_path):
    """However many tensors a collective moves, its record fits its slot: the next one is not
    written over, and the last slot does not overflow the file."""
    import torch
    from minishard.core import flight_file
    rec = FlightRecorder(rank=0, world_size=2, capacity=2)
    rec.fly_to(tmp_path)
    many = tuple(torch.zeros(1, dtype=torch.bfloat16 if k % 2 else torch.float32) for k in range(400))
    for k in range(3):                                   # the last slot too, then a wrap
        rec.issued("all_reduce", "world", 2, many, 800, f"b{k}" * 200, 0, "backward", 0.1 * k)
    body = flight_file.read(flight_file.path_for(tmp_path, 0))
    assert body["torn"] == [] and [e["seq"] for e in body["entries"]] == [1, 2]
    assert all(e["cut"] and e["op"] == "all_reduce" and e["bytes"] == 800 for e in body["entries"])


def test_a_group_named_by_hundreds_of_ranks_stays_inside_its_slot(tmp_path):
    """A subgroup is named by its members: on a large world the name alone can outgrow a slot.
    The record is cut to the collective's number, op and bytes, and still fits."""
    import torch
    from minishard.core import flight_file
    rec = FlightRecorder(rank=0, world_size=600, capacity=2)
    rec.fly_to(tmp_path)
    group = "shard[" + ", ".join(map(str, range(0, 600, 2))) + "]"
    for k in range(3):
        rec.issued("all_gather", group, 300, (torch.zeros(4),), 16, "blocks.0", 0, "forward", 0.1 * k)
    body = flight_file.read(flight_file.path_for(tmp_path, 0))
    assert body["torn"] == [] and [(e["seq"], e["op"], e["bytes"]) for e in body["entries"]] == [
        (1, "all_gather", 16), (2, "all_gather", 16)]


# ---- a run that left only traces (no dump, no ring): what the doctor reads from them

def _only_traces_run(directory, world, per_rank):
    """Traces with collective events only: ``per_rank`` rank -> [(op, tag, numel, issued, done,
    members or None)], in the order they completed (the order a trace holds them)."""
    from minishard.core import trace
    events = []
    for r, collectives in per_rank.items():
        t = trace.Tracer(r, world, origin=0.0)
        for op, tag, numel, issued, done, members in collectives:
            t.emit("collective", t=issued, t_end=done, op=op, payload=4 * numel, wire=4 * numel,
                   dtype="float32", group=len(members) if members else world, tag=tag, step=0,
                   **({"members": members} if members else {}))
        events += t.events
    trace.write_dir(events, directory)
    return directory


def test_with_only_traces_a_trace_that_stops_short_is_not_called_a_hang(tmp_path, capsys):
    """A trace holds what completed: rank 1's trace ending one collective before rank 0's says
    nothing of whether rank 1 issued it. No finding, and exit status 3 (not checked), not 1."""
    from minishard.cli import main
    from minishard.instruments import doctor
    ar = lambda k: ("all_reduce", f"bucket{k}", 8, 0.1 * k, 0.1 * k + 0.05, None)  # noqa: E731
    d = _only_traces_run(tmp_path, 2, {0: [ar(0), ar(1), ar(2)], 1: [ar(0), ar(1)]})
    assert doctor.diagnose(d).findings == []
    assert main(["doctor", str(d)]) == 3
    assert "hangs and deaths cannot be checked" in capsys.readouterr().out


def test_with_only_traces_collectives_are_compared_in_the_order_issued_not_completed(tmp_path):
    """Two prefetched all-gathers, issued in the same order on both ranks; on rank 0 the second
    completed first. Their seqs are the order issued (the flight recorder's): no desync."""
    from minishard.cli import main
    d = _only_traces_run(tmp_path, 2, {
        0: [("all_gather", "blocks.1", 8, 1.1, 1.3, None), ("all_gather", "blocks.0", 8, 1.0, 1.5, None)],
        1: [("all_gather", "blocks.0", 8, 1.0, 1.2, None), ("all_gather", "blocks.1", 8, 1.1, 1.4, None)]})
    assert main(["doctor", str(d)]) == 3


def test_with_only_traces_a_desync_in_a_subgroup_is_a_finding_naming_its_group(tmp_path):
    """Ranks 0 and 1 swap two units in their shard group, ranks 2 and 3 do not: a desync of
    group[0, 1], its collectives described in elements; exit status 1, not 3."""
    from minishard.cli import main
    from minishard.instruments import doctor
    ag = lambda tag, k, m: ("all_gather", tag, 8, k, k + 0.05, m)  # noqa: E731
    d = _only_traces_run(tmp_path, 4, {
        0: [ag("blocks.0", 1.0, [0, 1]), ag("blocks.1", 1.1, [0, 1])],
        1: [ag("blocks.1", 1.0, [0, 1]), ag("blocks.0", 1.1, [0, 1])],
        2: [ag("blocks.0", 1.0, [2, 3]), ag("blocks.1", 1.1, [2, 3])],
        3: [ag("blocks.0", 1.0, [2, 3]), ag("blocks.1", 1.1, [2, 3])]})
    (f,) = doctor.diagnose(d).findings
    assert (f.kind, f.ranks) == ("desync", [0, 1]), (f.kind, f.ranks)
    assert "of group 'group[0, 1]'" in f.title and "all_gather of blocks.0 [8] float32, 32 B" in f.title, f.title
    assert main(["doctor", str(d)]) == 1
