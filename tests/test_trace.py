"""Trace files: versioned, merged across ranks, exportable to Perfetto, fast to fold."""
import json

import pytest

from minishard import trace
from minishard.trace import LedgerTimeline, TraceFormatError, Tracer


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
    chrome = trace.to_chrome(_two_rank_events())
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
