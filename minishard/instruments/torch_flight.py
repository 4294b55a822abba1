"""PyTorch's own Flight Recorder, read in minishard's words.

c10d keeps its own ring of each process group's last collectives — on gloo too, and by default in
torch 2.13 (its size: PyTorch's ``TORCH_FR_BUFFER_SIZE``; 0 turns it off): sequence number per
group, op (``profiling_name`` ``gloo:all_reduce``), input sizes and dtypes, and whether the work
has retired. NCCL writes it by itself on a timeout (``TORCH_FR_DUMP_TEMP_FILE`` + rank: a pickle);
on gloo a process writes it by calling ``torch._C._distributed_c10d._dump_fr_trace()`` (a pickle,
with each collective's Python stack; ``_dump_fr_trace_json()``: JSON, without), which minishard's
``dumping`` does when asked (``TrainConfig(torch_flight=True)``, ``demo --torch-flight``:
``torch_fr_trace_rank_{r}`` beside ``flight_rank{r}.json``).

A pickle is read with an unpickler that builds no object but dicts, lists, strings and numbers:
a dump holds nothing else, and a file that names a class or function is refused, not run.

:func:`read` turns either file into a dump the doctor reads like its own: each collective with its
``seq``, op, group (``torch:`` + PyTorch's name for it), shapes, dtypes, bytes and state — the
doctor then finds desyncs and hangs in a job that never imported minishard. Where a rank has both,
minishard's own dump is read (it also knows the unit, the step and the call site).
"""
from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path

JSON_NAME = re.compile(r"torch_fr_rank(\d+)\.json")
PICKLE_NAME = re.compile(r".*trace_rank_(\d+)")          # TORCH_FR_DUMP_TEMP_FILE's default names
DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
          "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
          "Bool": "bool"}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


class _PlainData(pickle.Unpickler):
    """Builds what pickle encodes by itself (dicts, lists, tuples, strings, bytes, numbers, None);
    a global — any class or function the file names — is refused before anything runs."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}; a flight-recorder dump holds only "
                                     f"dicts, lists, strings and numbers, so it is not read")


def _unpickle(raw: bytes):
    return _PlainData(io.BytesIO(raw)).load()


def rank_of(path: Path) -> int | None:
    m = JSON_NAME.fullmatch(path.name) or PICKLE_NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


def read(path: Path, rank: int, world_size: int) -> dict:
    """A c10d flight-recorder dump as a minishard dump (``reason`` ``torch``). Its groups are
    named ``torch:default_pg`` and ``torch:pg{id}`` (on gloo every other group's name reads
    ``undefined`` and its ``pg_config`` is empty: the id, the same on every rank that made the
    groups in one order, tells them apart); the world's size comes from the caller (how many
    ranks left a dump)."""
    from minishard.core.trace import TraceFormatError, not_utf8
    raw = path.read_bytes()
    try:
        body = json.loads(raw.decode("utf-8")) if path.suffix == ".json" else _unpickle(raw)
    except UnicodeDecodeError as e:
        line, where = not_utf8(e, raw)
        raise TraceFormatError(f"{path}:{line}: not UTF-8 text ({where}): a damaged dump, or not a "
                               f"PyTorch flight-recorder dump") from None
    except Exception as e:
        raise TraceFormatError(f"{path}: not a PyTorch flight-recorder dump ({type(e).__name__}: {e})") from None
    if not isinstance(body, dict) or not isinstance(body.get("entries"), list):
        raise TraceFormatError(f"{path}: a PyTorch flight-recorder dump has a list of entries")
    entries = []
    for i, e in enumerate(body["entries"]):
        if not isinstance(e, dict) or "profiling_name" not in e or "process_group" not in e:
            raise TraceFormatError(f"{path}: entry {i} has no profiling_name or process_group")
        if e.get("is_p2p"):
            continue                     # (send/recv: numbered apart; the doctor compares collectives)
        pg_id, name = (list(e["process_group"]) + ["", ""])[:2]
        default = name == "default_pg"
        group = "torch:default_pg" if default else f"torch:pg{pg_id}"
        dtypes = [DTYPES.get(d, str(d).lower()) for d in e.get("input_dtypes", [])]
        shapes = [list(s) for s in e.get("input_sizes", [])]
        nbytes = sum(_numel(s) * ITEMSIZE.get(d, 0) for s, d in zip(shapes, dtypes))
        frames = e.get("frames") or []
        entries.append({
            "seq": e.get("collective_seq_id", e.get("record_id")), "op": e["profiling_name"].split(":")[-1],
            "group": group, "group_size": world_size if default else 0, "shapes": shapes,
            "dtypes": dtypes, "bytes": nbytes, "tag": "", "step": None, "phase": None,
            # gloo's works retire when they end, failed or not, and stay "scheduled"
            "state": "completed" if e.get("state") == "completed" else "retired" if e.get("retired")
            else "issued", "where": _site(_outside(frames, "/torch/")[:1]),
            "caller": _site(_outside(frames, "/torch/", "/minishard/")[:1])})
    return {"v": 1, "rank": rank, "world_size": world_size, "capacity": None, "reason": "torch",
            "error": None, "time": None, "entries": entries, "facts": {}, "source": str(path),
            "first_seq": 1}       # (c10d numbers each group's collectives from 1: none issued is 0)


def _site(frames: list) -> str:
    return "".join(f"{f.get('filename')}:{f.get('line')} in {f.get('name')}" for f in frames)


def _outside(frames: list, *parts: str) -> list:
    """The frames (innermost first) of files in none of ``parts`` (nor Python's frozen ones)."""
    return [f for f in frames if not str(f.get("filename")).startswith("<frozen")
            and not any(p in str(f.get("filename")) for p in parts)]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
