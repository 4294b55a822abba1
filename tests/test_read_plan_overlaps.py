"""The checkpoint's read plan under overlapping requests (issue 39, C): a loader may ask for
ranges of one tensor that overlap, nest, touch or repeat (several regions of one rank, or
one load serving several needs). Checked on real files — each tensor's elements cut into pieces
in several ``rank*.safetensors`` files, written with their checksums — against what this file
computes from the needs alone:

* every requested element is read exactly once, however many needs ask for it, and each need
  gets its saved values back bit for bit;
* exactly the checksum blocks holding a requested element are read (whole blocks, no other),
  and the bytes read at safetensors' boundary are the bytes the plan claims, read by read;
* every read is verified: its checksums are the blocks' own, computed here; one corrupted
  byte in a block a need touches fails the read by name, one in any other block is never read.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from checkpoint_tasks import recording_reads  # noqa: E402
from minishard.checkpoint import CheckpointError, plan_reads  # noqa: E402
from minishard.checkpoint.format import (HASHES, METADATA, build_metadata, plan_file,  # noqa: E402
                                         read_metadata, tensor_bytes, write_safetensors)
from minishard.checkpoint.reads import read_verified  # noqa: E402
from minishard.checkpoint.regions import Region  # noqa: E402

# the files of 200 examples: in memory where there is a tmpfs (each file is fsync'd, as a save's)
TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


@st.composite
def checkpoint_case(draw):
    """Tensors cut into contiguous pieces over N files (one piece of a tensor per file, as a
    real save), a block size of 8..64 bytes (blocks of 2..32 elements), and random values."""
    N = draw(st.integers(1, 3))
    block_bytes = 8 * draw(st.integers(1, 8))
    tensors = {}
    for k in range(draw(st.integers(1, 3))):
        numel = draw(st.integers(1, 48))
        cuts = sorted(draw(st.lists(st.integers(1, max(numel - 1, 1)), max_size=min(N, numel) - 1,
                                    unique=True))) if numel > 1 else []
        tensors[f"t{k}"] = (numel, draw(st.sampled_from(sorted(DTYPES))), [0, *cuts, numel],
                            draw(st.permutations(range(N))))
    needs = []
    for _ in range(draw(st.integers(1, 10))):
        name = draw(st.sampled_from(sorted(tensors)))
        numel = tensors[name][0]
        kind = draw(st.sampled_from(["any", "nested", "adjacent", "overlapping", "repeated", "empty"]))
        prev = [(a, n) for t, a, n in needs if t == name and n]
        if kind != "any" and kind != "empty" and prev:
            a, n = draw(st.sampled_from(prev))
            if kind == "nested":                    # inside an earlier need
                lo = draw(st.integers(a, a + n - 1))
                need = (lo, draw(st.integers(1, a + n - lo)))
            elif kind == "adjacent":                # starts where an earlier one ends (or ends
                if a + n < numel and draw(st.booleans()):         # where it starts)
                    need = (a + n, draw(st.integers(1, numel - a - n)))
                else:
                    lo = draw(st.integers(0, a))
                    need = (lo, a - lo)
            elif kind == "overlapping":             # starts inside an earlier one, ends beyond
                lo = draw(st.integers(a, a + n - 1))
                need = (lo, draw(st.integers(a + n - lo, numel - lo)))
            else:
                need = (a, n)
        elif kind == "empty":
            need = (draw(st.integers(0, numel)), 0)
        else:
            lo = draw(st.integers(0, numel - 1))
            need = (lo, draw(st.integers(1, numel - lo)))
        needs.append((name, *need))
    corrupt = (draw(st.sampled_from(sorted(tensors))), draw(st.integers(0, 10**6)))
    return {"N": N, "block_bytes": block_bytes, "tensors": tensors, "needs": needs,
            "corrupt": corrupt, "seed": draw(st.integers(0, 2**31 - 1))}


def write_checkpoint(root: Path, case: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """The files and metadata.json, as a save writes them; the tensors' values."""
    g = torch.Generator().manual_seed(case["seed"])
    values = {n: torch.randn(numel, generator=g).to(DTYPES[d])
              for n, (numel, d, _, _) in case["tensors"].items()}
    regions = {r: [] for r in range(case["N"])}
    for name, (numel, d, bounds, ranks) in case["tensors"].items():
        for (a, b), r in zip(zip(bounds, bounds[1:]), ranks):
            regions[r].append(Region(name, a, values[name][a:b]))
    described = {n: ([numel], d) for n, (numel, d, _, _) in case["tensors"].items()}
    infos = []
    for r in range(case["N"]):
        state = SimpleNamespace(rank=r, world_size=case["N"], regions=regions[r],
                                tensors={n: ([numel], DTYPES[d]) for n, (numel, d, _, _) in case["tensors"].items()})
        entries, pieces, records, size = plan_file(state)
        _, sums = write_safetensors(root / f"rank{r}.safetensors", entries, [p.view for p in pieces],
                                    case["block_bytes"])
        for rec, s in zip(records, sums):
            rec["checksums"] = s
        infos.append({"rank": r, "bytes": size, "records": records, "strategy": "test",
                      "model": None, "optimizer": None, "tensors": described})
    meta = build_metadata(infos, step=0, block_bytes=case["block_bytes"])
    (root / METADATA).write_text(json.dumps(meta))
    return read_metadata(root), values


def needed_blocks(meta: dict, needs) -> dict[tuple[str, str], set[int]]:
    """(file, key) -> the blocks of that piece holding a needed element: computed element by
    element, from the needs and the pieces alone."""
    out: dict[tuple[str, str], set[int]] = {}
    for name, a, n in needs:
        t = meta["tensors"][name]
        block = meta["block_bytes"] // DTYPES[t["dtype"]].itemsize
        for e in range(a, a + n):
            p = next(p for p in t["pieces"] if p["start"] <= e < p["start"] + p["numel"])
            out.setdefault((p["file"], p["key"]), set()).add((e - p["start"]) // block)
    return out


def flip_a_byte(root: Path, meta: dict, case: dict) -> tuple[str, str, int]:
    """Corrupt one byte of one block of a piece of the drawn tensor; (file, key, block)."""
    name, pick = case["corrupt"]
    t = meta["tensors"][name]
    size = DTYPES[t["dtype"]].itemsize
    block = meta["block_bytes"] // size
    places = [(p, b) for p in t["pieces"] for b in range(math.ceil(p["numel"] / block))]
    p, b = places[pick % len(places)]
    at = p["offset"] + b * block * size + (pick // len(places)) % min(block * size, (p["numel"] - b * block) * size)
    data = bytearray((root / p["file"]).read_bytes())
    data[at] ^= 0x40
    (root / p["file"]).write_bytes(bytes(data))
    return p["file"], p["key"], b


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=checkpoint_case())
def test_overlapping_needs_are_each_read_once_and_verified(case):
    with tempfile.TemporaryDirectory(prefix="minishard-reads-", dir=TMP) as tmp:
        root = Path(tmp)
        meta, values = write_checkpoint(root, case)
        needs = case["needs"]
        reads = plan_reads(meta, needs)
        with recording_reads() as seen:
            delivered = list(read_verified(root, meta, reads))

        # every requested element read exactly once; every need gets its saved values back
        count = {n: torch.zeros(v.numel(), dtype=torch.int64) for n, v in values.items()}
        got = {n: torch.full((v.numel(),), float("nan"), dtype=v.dtype) for n, v in values.items()}
        for rd, v in delivered:
            count[rd.tensor][rd.start:rd.start + rd.numel] += 1
            got[rd.tensor][rd.start:rd.start + rd.numel] = v
        for name, a, n in needs:
            assert (count[name][a:a + n] == 1).all(), (name, a, n, count[name].tolist())
            assert torch.equal(got[name][a:a + n], values[name][a:a + n]), (name, a, n)
        assert all((c <= 1).all() for c in count.values()), "an element read twice"

        # exactly the blocks holding a needed element, whole; the bytes read are the plan's
        want = needed_blocks(meta, needs)
        read_blocks: dict[tuple[str, str], set[int]] = {}
        for rd in reads:
            blocks = range(rd.piece_lo // rd.block, math.ceil((rd.piece_lo + rd.numel) / rd.block))
            read_blocks.setdefault((rd.file, rd.key), set()).update(blocks)
            piece = next(p for p in meta["tensors"][rd.tensor]["pieces"]
                         if (p["file"], p["key"]) == (rd.file, rd.key))
            end = rd.piece_lo + rd.numel
            assert rd.piece_lo % rd.block == 0 and (end % rd.block == 0 or end == piece["numel"]), rd
            # verified against the blocks' own checksums, computed here from the saved values
            saved = tensor_bytes(values[rd.tensor][piece["start"]:piece["start"] + piece["numel"]])
            bb = meta["block_bytes"]
            assert rd.checksums == tuple(HASHES["xxh3_64"](saved[b * bb:(b + 1) * bb]) for b in blocks), rd
        assert read_blocks == want, (read_blocks, want, needs)
        assert sorted((f, k, lo, hi) for f, k, lo, hi, _ in seen) == \
            sorted((rd.file, rd.key, rd.piece_lo, rd.piece_lo + rd.numel) for rd in reads)
        assert sum((hi - lo) * size for *_, lo, hi, size in seen) == sum(rd.nbytes for rd in reads)

        # one flipped byte: found if a need touches its block, never read otherwise
        file, key, block = flip_a_byte(root, meta, case)
        if block in want.get((file, key), ()):
            with pytest.raises(CheckpointError, match="checksum mismatch"):
                list(read_verified(root, meta, reads))
        else:
            list(read_verified(root, meta, reads))


def test_overlapping_needs_by_hand():
    """The smallest case of each shape, one piece, blocks of 2 float32 elements: nested,
    overlapping and touching needs merge into the reads of the blocks they cover."""
    case = {"N": 1, "block_bytes": 8, "tensors": {"t0": (20, "float32", [0, 20], [0])}, "seed": 0}
    with tempfile.TemporaryDirectory() as tmp:
        meta, _ = write_checkpoint(Path(tmp), case)
    spans = lambda needs: [(rd.start, rd.numel) for rd in plan_reads(meta, needs)]   # noqa: E731
    assert spans([("t0", 2, 10), ("t0", 4, 2)]) == [(2, 10)]                     # nested
    assert spans([("t0", 4, 2), ("t0", 2, 10)]) == [(2, 10)]                     # nested, second
    assert spans([("t0", 2, 9), ("t0", 5, 2), ("t0", 15, 2)]) == [(2, 10), (14, 4)]
    assert spans([("t0", 0, 5), ("t0", 3, 6)]) == [(0, 10)]                     # overlapping
    assert spans([("t0", 0, 4), ("t0", 4, 4)]) == [(0, 8)]                       # touching
    assert spans([("t0", 0, 2), ("t0", 0, 2)]) == [(0, 2)]                       # repeated
