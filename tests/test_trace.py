"""Trace files: versioned, merged across ranks, exportable to Perfetto, fast to fold."""
import json

import pytest

from minishard.viewers import perfetto
from minishard.core import trace
from minishard.core.trace import LedgerTimeline, TraceFormatError, Tracer


def _two_rank_events():
    evs = []
    for r in (0, 1):
        t = Tracer(r, 2, origin=0.0)
        with t.phase("forward"):
            t.emit("alloc", category="params", bytes=100, tag="p", device="device")
            t.emit("collective", op="all_reduce", payload=64, wire=64, dtype="float32",
                   group=2, tag="b0", t_end=t.now() + 0.001)
        t.emit("free", category="params", bytes=100, tag="p", device="device")
        evs += t.events
    return evs


def test_roundtrip_through_jsonl_files(tmp_path):
    evs = _two_rank_events()
    trace.write_dir(evs, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    back = trace.load(tmp_path)
    assert back == trace.merge(evs)
    assert all(e["v"] == trace.SCHEMA_VERSION for e in back)


def test_other_schema_version_is_refused(tmp_path):
    ev = dict(_two_rank_events()[0], v=99)
    (tmp_path / "rank0.jsonl").write_text(json.dumps(ev) + "\n")
    with pytest.raises(TraceFormatError, match="schema version 99"):
        trace.load(tmp_path)


def test_not_json_and_empty_dir_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no rank"):
        trace.load(tmp_path)
    (tmp_path / "rank0.jsonl").write_text("{not json\n")
    with pytest.raises(TraceFormatError, match="rank0.jsonl:1"):
        trace.load(tmp_path)


def test_unknown_event_kind_is_refused():
    with pytest.raises(ValueError, match="unknown event kind"):
        Tracer().emit("malloc")


def test_chrome_export_has_compute_and_comm_tracks_per_rank():
    chrome = perfetto.to_chrome(_two_rank_events())
    evs = chrome["traceEvents"]
    assert {(e["pid"], e["tid"]) for e in evs if e.get("ph") == "X"} == {(0, 1), (1, 1)}
    assert {(e["pid"], e["tid"]) for e in evs if e.get("ph") in "BE"} == {(0, 0), (1, 0)}
    names = {e["args"]["name"] for e in evs if e.get("name") == "thread_name"}
    assert names == {"compute", "communication"}
    json.dumps(chrome)


def test_ledger_timeline_is_the_fold_of_alloc_and_free():
    evs = trace.merge(_two_rank_events())
    tl = LedgerTimeline.build(evs)
    for i in range(len(evs)):
        want = {r: {"params": 0} for r in (0, 1)}
        for e in evs[:i + 1]:
            if e["kind"] in ("alloc", "free"):
                want[e["rank"]]["params"] += e["bytes"] if e["kind"] == "alloc" else -e["bytes"]
        assert tl.at(i) == want


# --------------------------------------------------------------------------- the fold every reader shares

def _ev(t, rank, kind, seq=0, **fields):
    return {"v": trace.SCHEMA_VERSION, "rank": rank, "seq": seq, "t": t, "kind": kind, **fields}


def _phase(t, rank, name, edge, step=0, **fields):
    return _ev(t, rank, "phase", name=name, edge=edge, step=step, **fields)


def test_phase_fold_pairs_begin_and_end_per_rank_and_names_the_phase_of_every_event():
    evs = [_phase(0.0, 0, "step", "begin"), _phase(0.1, 0, "forward", "begin"),
           _phase(0.15, 1, "forward", "begin"),                          # rank 1 interleaves
           _phase(0.2, 0, "wait_unshard", "begin", unit="blocks.0"),
           _ev(0.25, 0, "alloc", category="activations", bytes=8, tag="a", device="device"),
           _phase(0.3, 0, "wait_unshard", "end", unit="blocks.0"),
           _phase(0.4, 0, "forward", "end"), _phase(0.45, 1, "forward", "end"),
           _phase(0.5, 0, "backward", "begin"), _phase(0.9, 0, "backward", "end"),
           _phase(1.0, 0, "step", "end")]
    fold = trace.PhaseFold()
    labels = [fold.add(e) for e in evs]
    assert labels == ["", "forward", "forward", "wait_unshard blocks.0", "wait_unshard blocks.0",
                      "wait_unshard blocks.0", "forward", "forward", "backward", "backward", ""]
    got = [(s.rank, s.name, s.unit, s.t0, s.t1) for s in fold.spans]     # in the order they ended
    assert got == [(0, "wait_unshard", "blocks.0", 0.2, 0.3), (0, "forward", None, 0.1, 0.4),
                   (1, "forward", None, 0.15, 0.45), (0, "backward", None, 0.5, 0.9),
                   (0, "step", None, 0.0, 1.0)]
    assert trace.phase_spans(evs) == fold.spans


def test_open_phases_end_at_the_time_asked():
    fold = trace.PhaseFold()
    for e in [_phase(0.0, 0, "step", "begin"), _phase(0.1, 0, "forward", "begin")]:
        fold.add(e)
    assert [(s.name, s.t0, s.t1) for s in fold.open_spans(0.5)] == [("step", 0.0, 0.5), ("forward", 0.1, 0.5)]
    assert fold.spans == []


def test_unit_spans_follow_each_units_states_until_the_next():
    evs = [_ev(t, 0, "unit", name=n, state=s) for t, n, s in [
        (0.0, "b0", "unsharding"), (0.1, "b0", "unsharded"), (0.2, "b1", "unsharding"),
        (0.3, "b0", "sharded"), (0.4, "b1", "unsharded"), (0.5, "b1", "reduce_scattering"),
        (0.6, "b1", "sharded"), (0.7, "b0", "unsharding")]]
    got = [(s.unit, s.state, s.t0, s.t1, s.until) for s in trace.unit_spans(evs)]
    assert got == [("b0", "unsharding", 0.0, 0.1, "unsharded"), ("b0", "unsharded", 0.1, 0.3, "sharded"),
                   ("b1", "unsharding", 0.2, 0.4, "unsharded"),
                   ("b1", "unsharded", 0.4, 0.5, "reduce_scattering"),
                   ("b1", "reduce_scattering", 0.5, 0.6, "sharded"),
                   ("b0", "unsharding", 0.7, 0.7, None)]                 # still in flight at the end


def test_rank_events_are_in_the_order_the_rank_recorded_them():
    t = Tracer(0, 1, origin=0.0)
    t.emit("alloc", category="params", bytes=4, tag="p", device="device")
    t.emit("collective", t=0.0, op="all_reduce", payload=4, wire=4, dtype="float32", group=1,
           tag="b", t_end=t.now())                                       # started before the alloc
    merged = trace.merge(t.events)
    assert [e["kind"] for e in merged] == ["collective", "alloc"]
    assert [e["kind"] for e in trace.rank_events(merged, 0)] == ["alloc", "collective"]


def test_replay_is_the_same_fold_fed_at_once_or_one_event_at_a_time():
    evs = trace.merge(_two_rank_events() + [_ev(5.0, 1, "unit", seq=9, name="root", state="unsharded")])
    whole, live = trace.Replay(evs), trace.Replay()
    for e in evs:
        live.append(e)
    timeline = LedgerTimeline.build(evs)
    for i in range(len(evs)):
        assert whole.snapshot(i) == live.snapshot(i) == timeline.at(i)
        assert whole.unit_states(i) == live.unit_states(i)
        assert whole.phase(i) == live.phase(i)
    assert whole.unit_states(len(evs) - 1) == {0: {"root": "sharded"}, 1: {"root": "unsharded"}}
    assert whole.phase(1) == "forward" and whole.ymax == 100
    assert [e["op"] for e in whole.traffic()] == ["all_reduce", "all_reduce"]
    assert whole.collective_at(whole.traffic()[0]["t"])["kind"] == "collective"


def test_chrome_export_is_in_microseconds_and_each_ranks_memory_is_its_own():
    """Perfetto reads ``ts``/``dur`` in microseconds: a collective of 1 ms lasts 1000 there. Each
    rank's memory counter holds that rank's categories only (rank 0 allocates parameters, rank 1
    gradients)."""
    evs = []
    for r in (0, 1):
        t = Tracer(r, 2, origin=0.0)
        t.emit("alloc", category=("params", "grads")[r], bytes=100 * (r + 1), tag="p", device="device")
        start = t.now()        # given as the event's start: a loaded machine's delay is not in it
        t.emit("collective", t=start, op="all_reduce", payload=64, wire=64, dtype="float32",
               group=2, tag="b0", t_end=start + 0.001)
        evs += t.events
    out = perfetto.to_chrome(evs)["traceEvents"]
    for c in (e for e in out if e.get("ph") == "X"):
        assert abs(c["dur"] - 1000.0) < 0.5, c           # 1 ms = 1000 µs (times kept to 0.1 µs)
    counters = {e["pid"]: e["args"] for e in out if e.get("ph") == "C"}
    assert counters == {0: {"params": 100}, 1: {"grads": 200}}


def test_collective_in_flight_is_the_one_whose_last_rank_joined():
    """Every rank records its own event for the same all-reduce; the ring cannot move until the
    last rank has joined, so the viewer's ring must show the rank that arrived last (rank 1 here,
    which joined at 1.2 s), not rank 0 that has been waiting since 1.0 s."""
    evs = trace.merge([
        _ev(1.0, 0, "collective", op="all_reduce", payload=64, wire=96, dtype="float32", group=2,
            tag="b0", t_end=1.5),
        _ev(1.2, 1, "collective", op="all_reduce", payload=64, wire=96, dtype="float32", group=2,
            tag="b0", t_end=1.5)])
    rp = trace.Replay(evs)
    assert rp.collective_at(1.1)["rank"] == 0            # only rank 0 has joined yet
    assert rp.collective_at(1.3)["rank"] == 1            # both in flight: the later joiner
    assert rp.collective_at(1.6) is None                 # both finished


def test_every_reader_reads_a_cut_trace_by_its_own_policy(tmp_path):
    """One reader (``trace.read_events``), three meanings of a bad line: a replay refuses the
    file, naming the line; the doctor reads up to the cut (a rank that died); the viewer reads
    around it. The doctor's account of where the trace stops names the line and the last
    collective before it."""
    from minishard.instruments import doctor
    evs = [e for e in _two_rank_events() if e["rank"] == 0]
    lines = [json.dumps(e) for e in evs]
    lines.insert(3, lines[3][: len(lines[3]) // 2])             # a line cut mid-event
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=r"rank0.jsonl:4: not JSON"):
        trace.read_events(path)
    before, bad = trace.read_events(path, damaged="stop")
    assert before == evs[:3] and [n for n, _ in bad] == [4]
    around, bad = trace.read_events(path, damaged="skip")
    assert around == evs and [n for n, _ in bad] == [4] and bad[0][1].startswith("not JSON")
    end = doctor.trace_end(path)
    assert "stops at line 4 (not JSON" in end and "all_reduce" in end, end
    with pytest.raises(ValueError, match="damaged='ignore'"):
        trace.read_events(path, damaged="ignore")


def test_a_readers_own_test_and_the_fields_every_event_needs_are_asked_of_each_line(tmp_path):
    """``read_events``: a line that decodes is still refused if it lacks a field every event has
    (rank, seq, t, kind) or if the reader's own test (``also``) refuses it — by the reader's policy."""
    good = dict(Tracer(0, 1, origin=0.0).emit("free", category="params", bytes=1, tag="p", device="device"))
    no_seq = {k: v for k, v in good.items() if k != "seq"}
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in (good, no_seq, dict(good, kind="odd"), good)) + "\n")
    events, bad = trace.read_events(path, damaged="skip",
                                    also=lambda ev: "odd kind" if ev["kind"] == "odd" else None)
    assert events == [good, good]
    assert [n for n, _ in bad] == [2, 3] and "'seq'" in bad[0][1] and bad[1][1] == "odd kind"
