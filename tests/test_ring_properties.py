"""The ring on disk (``minishard/core/flight_file.py``) closed for its kinds, under hypothesis:

* every record length, up to the slot and past it: a record that fits is read back as written,
  one that does not is cut to what matching the ranks needs, and neither reaches its neighbour;
* every point at which a write can stop: the writer's stores are journalled as it makes them
  (the ring writes by slice assignment, in order), and the file is read after every prefix of
  them, down to the byte — a record whose commit never landed is never read as that collective,
  never as completed; a completion is read only once its time is there; one torn slot at most,
  and every other record read as before;
* scrambled bytes: any file at all is read or refused with a ``ValueError`` (never another
  error, never a loop), and a ring whose header is kept but most of whose records are scrambled
  is refused whole, where one with a single torn record is read.

Examples are drawn reproducibly (``derandomize``) and bounded.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minishard.core import flight_file  # noqa: E402
from minishard.core.flight import FlightRecorder  # noqa: E402
from minishard.core.flight_file import HEADER_BYTES, RECORD, SLOT  # noqa: E402

ROOM = RECORD - SLOT.size                  # what a slot holds after its own header


def drawn(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _recorder(directory, capacity: int, prior: list[bool], run: str | None = "0123456789ab"):
    """A rank-1 recorder flying to ``directory`` with ``prior`` collectives written (each
    completed or not)."""
    rec = FlightRecorder(rank=1, world_size=2, capacity=capacity)
    rec.run = run
    rec.fly_to(directory)
    for k, done in enumerate(prior):
        e = _issue(rec, k)
        if done:
            rec.completed(e, 1.0 + k)
    return rec


def _issue(rec, k: int, **extra) -> dict:
    return rec.issued("all_reduce", "world", 2, (torch.zeros(3),), 12, f"b{k}", 0, "backward",
                      0.5 + k, **extra)


def _read(path: Path, raw: bytes) -> dict:
    return flight_file.decode(raw, path)             # (read's own, without a file per stop)


def _slot_of(n: int, capacity: int) -> int:
    return (n - 1) % capacity


# --------------------------------------------------------------------------- every record length

@drawn(60)
@given(capacity=st.integers(1, 3), before=st.integers(0, 4),
       length=st.one_of(st.integers(ROOM - 64, ROOM + 64), st.integers(0, 3 * RECORD)))
def test_a_record_of_any_length_is_read_as_written_or_cut_and_never_reaches_its_neighbour(
        capacity, before, length):
    with tempfile.TemporaryDirectory() as d:
        rec = _recorder(d, capacity, [True] * before)
        # (the entry's JSON without its detail, measured on a throwaway recorder: the detail
        # then brings it to about ``length``)
        probe = FlightRecorder(rank=1, world_size=2, capacity=1)
        base = len(json.dumps({**_issue(probe, before), "seq": before, "n": before + 1, "detail": ""},
                              separators=(",", ":")))
        detail = "x" * max(0, length - base)
        mine = _issue(rec, before, detail=detail)
        rec.completed(mine, 9.0)
        after = _issue(rec, before + 1)                # the next slot's record, written after it
        body = flight_file.read(flight_file.path_for(d, 1))
    full = len(json.dumps({**mine, "state": "issued", "t_completed": None}, separators=(",", ":")))
    assert body["torn"] == []
    got = {e["n"]: e for e in body["entries"]}
    if capacity > 1:                                   # (a ring of one keeps only the last)
        e = got[mine["n"]]
        assert e["cut"] is True if full > ROOM else "cut" not in e, (full, ROOM)
        for k in ("seq", "op", "bytes", "n"):
            assert e[k] == mine[k]
        if full <= ROOM:
            assert e["detail"] == detail and e["tag"] == mine["tag"] and e["shapes"] == [[3]]
        assert (e["state"], e["t_completed"]) == ("completed", 9.0)
    assert got[after["n"]]["tag"] == after["tag"] and got[after["n"]]["state"] == "issued"


# --------------------------------------------------------------------------- every point a write can stop

class Journal:
    """Stands for the ring's memory map: every store, in the order the writer made it."""

    def __init__(self, raw: bytes):
        self.raw, self.stores = bytearray(raw), []

    def __setitem__(self, where: slice, data) -> None:
        self.stores.append((where.start, bytes(data)))
        self.raw[where] = data

    def __getitem__(self, where):
        return self.raw[where]


def _stop_points(stores):
    """Every (stores applied whole, bytes of the next one): each point a process can die at."""
    for i, (_, data) in enumerate(stores):
        for k in range(len(data) + (i == len(stores) - 1)):
            yield i, k


def _applied(before: bytes, stores, i: int, k: int) -> bytes:
    raw = bytearray(before)
    for at, data in stores[:i]:
        raw[at:at + len(data)] = data
    if i < len(stores):
        at, data = stores[i]
        raw[at:at + k] = data[:k]
    return bytes(raw)


@drawn(25)
@given(capacity=st.integers(1, 4), prior=st.lists(st.booleans(), max_size=9),
       detail=st.integers(0, ROOM), complete=st.booleans())
def test_a_write_stopped_anywhere_leaves_the_last_record_torn_or_whole_never_wrong(
        capacity, prior, detail, complete):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ring"
        rec = _recorder(d, capacity, prior)
        ring = flight_file.path_for(d, 1)
        before = ring.read_bytes()
        was = _read(path, before)
        journal = Journal(before)
        rec.file._map = journal                          # the writer's stores, journalled
        new = _issue(rec, len(prior), detail="y" * detail)
        if complete:
            rec.completed(new, 7.25)
        stores, n = journal.stores, new["n"]
        final = _read(path, _applied(before, stores, len(stores), 0))
        slot = _slot_of(n, capacity)
        at = HEADER_BYTES + slot * RECORD
        old = [e for e in was["entries"] if _slot_of(e["n"], capacity) == slot]
        others = [e for e in was["entries"] if _slot_of(e["n"], capacity) != slot]
        for i, k in _stop_points(stores):
            raw = _applied(before, stores, i, k)
            body = _read(path, raw)
            got = {e["n"]: e for e in body["entries"]}
            where = (i, k, len(stores))
            assert [got.get(e["n"]) for e in others] == others, where       # the rest as before
            assert len(body["torn"]) <= 1, where
            # (the commit is the record's second store: it has begun, and the header says n)
            committed = (i, k) > (1, 0) and raw[at:at + 8] == flight_file._N.pack(n)
            if committed:
                e = got[n]
                assert body["torn"] == [], where
                assert {k2: v for k2, v in e.items() if k2 not in ("state", "t_completed")} == \
                    {k2: v for k2, v in final["entries"][-1].items() if k2 not in ("state", "t_completed")}
                if e["state"] == "completed":                 # only once its time is there
                    assert complete and e["t_completed"] == 7.25, where
                else:
                    assert e["t_completed"] is None, where
            else:
                assert n not in got, where                    # never read as that collective
                if raw[at:at + RECORD] == before[at:at + RECORD]:
                    assert [got.get(e["n"]) for e in old] == old and body["torn"] == [], where
                else:                                         # the old record is gone: torn
                    assert not any(e["n"] in got for e in old), where
                    assert len(body["torn"]) == 1 and f"slot {slot}:" in body["torn"][0], where
        assert final["entries"][-1]["state"] == ("completed" if complete else "issued")


# --------------------------------------------------------------------------- scrambled bytes

@drawn(200)
@given(raw=st.one_of(
    st.binary(max_size=3 * RECORD),
    st.builds(lambda head, rest: head + rest,
              st.sampled_from([flight_file.MAGIC, flight_file.MAGIC + (1).to_bytes(4, "little")]),
              st.binary(max_size=3 * RECORD))))
def test_any_bytes_at_all_are_read_or_refused_by_name(raw):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "flight_rank0.ring"
        path.write_bytes(raw)
        try:
            body = flight_file.read(path)
        except ValueError as e:
            assert str(path) in str(e)
            return
    assert len(body["torn"]) <= max(1, len(body["entries"]))


@drawn(80)
@given(capacity=st.integers(2, 8), data=st.data())
def test_a_ring_whose_header_is_kept_and_most_records_scrambled_is_refused_whole(capacity, data):
    written = data.draw(st.integers(1, 2 * capacity), label="written")
    held = min(written, capacity)
    slots = sorted(data.draw(st.sets(st.integers(0, held - 1), max_size=held), label="scrambled"))
    with tempfile.TemporaryDirectory() as d:
        _recorder(d, capacity, [True] * written)
        ring = flight_file.path_for(d, 1)
        was = flight_file.read(ring)
        raw = bytearray(ring.read_bytes())
        for s in slots:
            junk = bytearray(data.draw(st.binary(min_size=RECORD, max_size=RECORD), label=f"slot {s}"))
            junk[0] |= 1                               # (a slot left all zeros reads as unwritten)
            raw[HEADER_BYTES + s * RECORD:HEADER_BYTES + (s + 1) * RECORD] = junk
        ring.write_bytes(bytes(raw))
        if len(slots) > 1 and 2 * len(slots) > held:
            with pytest.raises(ValueError, match=f"{len(slots)} of the {held} records in this ring cannot be read"):
                flight_file.read(ring)
            return
        body = flight_file.read(ring)
    kept = [e for e in was["entries"] if _slot_of(e["n"], capacity) not in slots]
    assert body["entries"] == kept and len(body["torn"]) == len(slots)


@drawn(40)
@given(capacity=st.integers(2, 6), data=st.data())
def test_a_whole_record_copied_into_another_slot_is_not_read_there(capacity, data):
    """A block of the file moved whole (a record, its header and its JSON agreeing with each
    other) into a slot collective n does not go to: torn, its number not quoted."""
    with tempfile.TemporaryDirectory() as d:
        _recorder(d, capacity, [True] * (capacity + 2))
        ring = flight_file.path_for(d, 1)
        raw = bytearray(ring.read_bytes())
    src = data.draw(st.integers(0, capacity - 1), label="from")
    dst = data.draw(st.integers(0, capacity - 1).filter(lambda s: s != src), label="to")
    raw[HEADER_BYTES + dst * RECORD:HEADER_BYTES + (dst + 1) * RECORD] = \
        raw[HEADER_BYTES + src * RECORD:HEADER_BYTES + (src + 1) * RECORD]
    body = _read(Path("moved.ring"), bytes(raw))
    slots = [_slot_of(e["n"], capacity) for e in body["entries"]]
    assert sorted(slots) == sorted(set(range(capacity)) - {dst})     # each once, in its own slot
    (torn,) = body["torn"]
    assert torn.startswith(f"slot {dst}:") and "collective ?" in torn
