"""The flight recorder on disk as it flies: a file that holds a rank's last collectives whatever
kills the process.

A dump written on the way out (:mod:`minishard.core.flight`) needs the process to reach Python
again: a rank that gloo aborts in C++ (a collective whose sizes disagree), that the kernel's OOM
killer or a ``SIGKILL`` stops, that segfaults in an extension or calls ``os.abort()`` writes
nothing. PyTorch's NCCL flight recorder dumps from a watchdog thread for the same reason. Here
every record is written into a memory-mapped file *as* the collective is issued, and its state
changes in place when it completes: the kernel owns the pages, so they reach the file when the
process dies however it dies (not when the machine does).

    header    64 bytes: MAGIC, format version, rank, world size, capacity, record size, the
              run's id (``run_id.py``; 16 bytes, zeros in a ring written before run ids)
    records   ``capacity`` slots of ``RECORD`` bytes, a ring: collective n goes to slot
              (n - 1) % capacity, so the file keeps the last ``capacity`` and never grows

    a record  n (8 bytes, the recorder's count, 0: empty; written *last*: the commit),
              state (1 byte: ``I`` issued, ``C`` completed; ``F``: a fact, not a collective),
              t_completed (8 bytes), the entry as JSON (its length, 4 bytes, then the bytes;
              it carries n too)

A fact is what the doctor compares across ranks besides their collectives, short enough for a
slot (:meth:`FlightFile.noted`: the replicas' digest every few steps); :func:`read` returns the
facts apart from the entries, under their key, as a dump's ``facts`` holds them.

A record the process was writing when it died — its header n not the n inside its JSON, or JSON
cut short — is *torn*: :func:`read` names it and reads the rest. One process dying leaves at
most one torn record (the one it was writing); a ring most of whose records cannot be read was
scrambled by something else, and :func:`read` refuses it whole rather than read its few records
as a run. Why a memory-mapped ring and not
an append-only log: completing a collective is a 1-byte store here, where a log appends a second
line per collective and has to be cut and rotated to stay bounded (``benchmarks/bench_flight.py``
measures both).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

MAGIC = b"MSFLIGHT"
VERSION = 1
# magic, version, rank, world size, capacity, record, (pad), run id: a ring without one has zeros
# there, so the version stays 1 and a reader before run ids reads it as ever
HEADER = struct.Struct("<8sIIIII4x16s")
RUN_AT = HEADER.size - 16
HEADER_BYTES = 64
RECORD = 1024                               # bytes a slot holds: an entry's JSON is ~350
SLOT = struct.Struct("<QcxxxxxxxdI")        # n, state, (pad), t_completed, JSON length
ISSUED, COMPLETED, FACT = b"I", b"C", b"F"
EMPTY = bytes(SLOT.size)                    # a slot never written (one begun is torn, not empty)
_N, _T = struct.Struct("<Q"), struct.Struct("<d")       # a slot's n, and its t_completed


def path_for(directory, rank: int) -> Path:
    return Path(directory) / f"flight_rank{rank}.ring"


class FlightFile:
    """One rank's ring file, open for writing from the first collective on."""

    def __init__(self, directory, rank: int, world_size: int, capacity: int, run: str | None = None):
        self.path, self.capacity = path_for(directory, rank), capacity
        self.path.parent.mkdir(parents=True, exist_ok=True)
        size = HEADER_BYTES + capacity * RECORD
        # a fresh file (a previous run's ring goes); the map keeps its own handle, so the file
        # descriptor closes at once and the map closes with this object
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # (every store is a slice assignment, in the order written: a test replays any prefix)
        self._map[0:HEADER.size] = HEADER.pack(MAGIC, VERSION, rank, world_size, capacity, RECORD,
                                               (run or "").encode())
        self._n = 0

    def mark_run(self, run: str) -> None:
        """The run's id, once the ranks agreed it (a watch opens its ring before they do)."""
        self._map[RUN_AT:RUN_AT + 16] = run.encode().ljust(16, b"\0")

    def issued(self, entry: dict) -> int:
        """Write ``entry`` (state issued) into the next slot; returns its number, for
        :meth:`completed`. An entry too long for a slot loses its call sites, then its shapes."""
        self._n += 1
        n = self._n
        body = _encode(entry, n)
        at = HEADER_BYTES + (n - 1) % self.capacity * RECORD
        # n 0 (not yet committed) with the record, then the commit, last
        self._map[at:at + SLOT.size + len(body)] = SLOT.pack(0, ISSUED, 0.0, len(body)) + body
        self._map[at:at + 8] = _N.pack(n)
        return n

    def noted(self, key: str, fact: dict) -> bool:
        """Write ``fact`` into the next slot as a fact under ``key`` (``read`` returns it in
        ``facts[key]``). One too long for a slot is left out (False): the dump keeps it whole."""
        body = _JSON({**fact, "fact": key, "n": self._n + 1}).encode()
        if len(body) > RECORD - SLOT.size:
            return False
        self._n += 1
        at = HEADER_BYTES + (self._n - 1) % self.capacity * RECORD
        self._map[at:at + SLOT.size + len(body)] = SLOT.pack(0, FACT, 0.0, len(body)) + body
        _N.pack_into(self._map, at, self._n)               # the commit, last
        return True

    def completed(self, n: int, t: float) -> None:
        """Mark record ``n`` completed at ``t`` — if the ring has not overwritten it since."""
        at = HEADER_BYTES + (n - 1) % self.capacity * RECORD
        if _N.unpack(self._map[at:at + 8])[0] == n:
            self._map[at + 16:at + 24] = _T.pack(t)      # the time first, then the state that says
            self._map[at + 8:at + 9] = COMPLETED         # it is there


_JSON = json.JSONEncoder(separators=(",", ":")).encode     # (made once: json.dumps with
                                                            # separators builds one per call)
# what an entry keeps when it is too long for its slot: what the doctor matches ranks on
MATCHED = ("seq", "op", "group", "group_size", "shapes", "dtypes", "bytes", "tag", "step", "phase",
           "state", "t_issued", "src", "n")


def _encode(entry: dict, n: int) -> bytes:
    room = RECORD - SLOT.size
    entry["n"] = n                              # (the dump carries it too: the same collective)
    body = _JSON(entry).encode()
    if len(body) > room:                        # keep what matching the ranks needs, then less
        kept = {k: entry[k] for k in MATCHED if k in entry}
        body = _JSON({**kept, "cut": True}).encode()
    if len(body) > room:                        # (many tensors: their dtypes, by kind, once each)
        body = _JSON({**kept, "shapes": [], "dtypes": sorted(set(map(str, kept.get("dtypes", [])))),
                      "tag": str(kept.get("tag", ""))[:64], "cut": True}).encode()
    if len(body) > room:                        # never past the slot: the collective by number alone
        # (a group named by hundreds of members: cut alike on every rank, so it still matches)
        body = _JSON({k: kept.get(k) for k in ("seq", "op", "group_size", "bytes", "n")}
                     | {"group": str(kept.get("group", ""))[:256], "shapes": [], "dtypes": [],
                        "state": "issued", "cut": True}).encode()
    return body


def header(path) -> dict:
    """A ring's header: ``rank``, ``world_size``, ``capacity``, ``record`` and ``run`` (None: a
    ring written before run ids). A file that is not a ring, or whose header cannot be a ring's,
    raises ``ValueError`` naming it."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    return _header(path, raw)


def _header(path: Path, raw: bytes) -> dict:
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise ValueError(f"{path}: not a minishard flight ring (no {MAGIC.decode()} header)")
    _, version, rank, world, capacity, record, run = HEADER.unpack_from(raw, 0)
    if version != VERSION:
        raise ValueError(f"{path}: flight ring format version {version}, but this minishard reads "
                         f"version {VERSION}")
    # (a header scrambled past its magic: slots smaller than their own header, or no slots, would
    # send the reader round one place of the file for ever)
    if record < SLOT.size or capacity < 1:
        raise ValueError(f"{path}: a flight ring's header with {capacity} slots of {record} bytes: "
                         f"damaged, not a ring this minishard wrote")
    run = run.rstrip(b"\0")
    try:
        run = run.decode("ascii") if run else None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: a flight ring's header whose run id is not text: damaged") from None
    return {"rank": rank, "world_size": world, "capacity": capacity, "record": record, "run": run}


def read(path) -> dict:
    """A ring file as a flight dump's body (``reason: "ring"``: the rank wrote no dump), its
    entries in the order they were issued, plus ``torn``: the slots the process was writing when
    it died, as sentences. A file that is not a ring, or most of whose records cannot be read
    (more than one: a process dying tears one at most), raises ``ValueError`` naming it."""
    path = Path(path)
    return decode(path.read_bytes(), path) | {"time": os.path.getmtime(path)}


def decode(raw: bytes, path) -> dict:
    """:func:`read` of a ring's bytes (``path``: the file errors name); its ``time`` is None."""
    head = _header(path, raw)
    capacity, record = head["capacity"], head["record"]
    entries, torn, facts = [], [], {}
    for slot in range(capacity):
        at = HEADER_BYTES + slot * record
        if at + SLOT.size > len(raw):
            torn.append(f"slot {slot}: the file ends inside it")
            break
        if raw[at:at + SLOT.size] == EMPTY:
            continue                                            # never written
        n, state, t_completed, length = SLOT.unpack_from(raw, at)
        ours = n and (n - 1) % capacity == slot                 # (collective n goes to this slot)
        try:
            entry = json.loads(raw[at + SLOT.size:at + SLOT.size + min(length, record - SLOT.size)])
            if not ours or not isinstance(entry, dict) or entry.get("n") != n:
                raise ValueError
        except (ValueError, RecursionError):                    # (RecursionError: "[[[[…")
            torn.append(f"slot {slot}: a record cut while it was written (collective "
                        f"{n if ours else '?'}), left out")
            continue
        if state == FACT:
            facts.setdefault(str(entry.pop("fact", "")), []).append(entry)
            continue
        entry["state"] = "completed" if state == COMPLETED else "issued"
        entry["t_completed"] = round(t_completed, 7) if state == COMPLETED else None
        entries.append(entry)
    if len(torn) > 1 and 2 * len(torn) > len(torn) + len(entries):
        raise ValueError(f"{path}: {len(torn)} of the {len(torn) + len(entries)} records in this ring "
                         f"cannot be read (a rank that dies tears one at most): scrambled or written "
                         f"over, not a ring one run left; nothing is read from it")
    entries.sort(key=lambda e: e["n"])
    for records in facts.values():
        records.sort(key=lambda e: e["n"])
    return {"rank": head["rank"], "world_size": head["world_size"], "capacity": capacity,
            "reason": "ring", "error": None, "time": None, "entries": entries,
            "facts": facts, "torn": torn, "run": head["run"]}
