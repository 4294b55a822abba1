"""The checkpoint format's checksums: every 64 KiB block of every piece carries the XXH3-64 of
exactly its bytes; a damaged block anywhere is named on load by file, tensor and element range;
version 1 checkpoints (SHA-256 per block) still load, verified."""
import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import xxhash

from minishard import checkpoint
from minishard.checkpoint import CheckpointError
from minishard.core.comm import Comm

import checkpoint_tasks


_trained = checkpoint_tasks.one_process_model


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A one-process checkpoint of the nano GPT + AdamW, and the model that saved it."""
    net, opt = _trained()
    path = tmp_path_factory.mktemp("fmt") / "good"
    checkpoint.save(net, opt, path, comm=Comm(), step=1)
    return path, net


def _pieces(meta: dict):
    for name, t in meta["tensors"].items():
        for p in t["pieces"]:
            yield name, p, p["numel"] * checkpoint.format.element_size(t["dtype"])


def test_each_block_carries_the_xxh3_of_exactly_its_bytes(good):
    path, _ = good
    meta = checkpoint.read_metadata(path)
    assert (meta["version"], meta["checksum"], meta["block_bytes"]) == (2, "xxh3_64", 64 << 10)
    B = meta["block_bytes"]
    blocks = 0
    for _, p, nbytes in _pieces(meta):
        data = (path / p["file"]).read_bytes()[p["offset"]:p["offset"] + nbytes]
        assert len(p["checksums"]) == math.ceil(nbytes / B)
        assert p["checksums"] == [xxhash.xxh3_64_hexdigest(data[i:i + B]) for i in range(0, nbytes, B)]
        blocks += len(p["checksums"])
    assert blocks > len(meta["tensors"])             # some pieces span several blocks


def _damage(src: Path, dst: Path, at: int, how: str) -> None:
    shutil.copytree(src, dst)
    f = dst / "rank0.safetensors"
    b = bytearray(f.read_bytes())
    if how == "bit":
        b[at] ^= 0x01                                 # one bit: the smallest corruption
    else:                                             # a torn write: 4 KiB of zeros
        b[at:at + 4096] = bytes(min(4096, len(b) - at))
    f.write_bytes(bytes(b))


def test_a_damaged_block_anywhere_is_named_by_file_tensor_and_elements(good, tmp_path):
    path, _ = good
    meta = checkpoint.read_metadata(path)
    pieces = sorted(_pieces(meta), key=lambda x: x[1]["offset"])
    big = max(pieces, key=lambda x: x[2])
    where = [(pieces[0], 0, "bit"),                       # the file's first data byte
             (pieces[-1], pieces[-1][2] - 1, "bit"),      # its last byte
             (big, big[2] // 2 + 3, "bit"),               # inside a block of the largest tensor
             (big, (big[2] // 2) // 4096 * 4096, "zeros")]
    for k, ((name, p, nbytes), off, how) in enumerate(where):
        net, opt = _trained(seed=3)
        before = [t.clone() for t in net.parameters()]
        _damage(path, tmp_path / f"bad{k}", p["offset"] + off, how)
        with pytest.raises(CheckpointError) as e:
            checkpoint.load(net, opt, tmp_path / f"bad{k}", comm=Comm())
        m = re.search(r"rank0.safetensors: checksum mismatch in (\S+), elements \[(\d+), (\d+)\)", str(e.value))
        assert m, e.value
        tensor, a, b = m.groups()
        element = p["start"] + off // 4
        assert tensor == name and int(a) <= element < int(b), (e.value, name, element)
        assert all(torch.equal(x, y) for x, y in zip(before, net.parameters()))    # nothing changed


def _as_version_1(src: Path, dst: Path) -> None:
    """The same files with the metadata a version 1 save wrote: SHA-256 per block, no
    ``checksum`` field."""
    shutil.copytree(src, dst)
    meta = json.loads((dst / "metadata.json").read_text())
    B = meta["block_bytes"]
    for name, p, nbytes in _pieces(meta):
        data = (dst / p["file"]).read_bytes()[p["offset"]:p["offset"] + nbytes]
        p["sha256"] = [hashlib.sha256(data[i:i + B]).hexdigest() for i in range(0, nbytes, B)]
        del p["checksums"]
    meta["version"] = 1
    del meta["checksum"]
    (dst / "metadata.json").write_text(json.dumps(meta, indent=1))


def test_a_version_1_checkpoint_still_loads_and_is_verified_with_sha256(good, tmp_path):
    path, saved = good
    _as_version_1(path, tmp_path / "v1")
    net, opt = _trained(seed=5)
    info = checkpoint.load(net, opt, tmp_path / "v1", comm=Comm())
    assert info["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), saved.parameters()))
    full = checkpoint.read_full(tmp_path / "v1")
    assert all(torch.equal(full[f"param/{n}"], p.detach()) for n, p in saved.named_parameters())
    meta = checkpoint.read_metadata(tmp_path / "v1")
    name, p, nbytes = max(_pieces(meta), key=lambda x: x[2])
    _damage(tmp_path / "v1", tmp_path / "v1bad", p["offset"] + nbytes // 3, "bit")
    with pytest.raises(CheckpointError, match=rf"rank0.safetensors: checksum mismatch in {name}, elements"):
        checkpoint.load(net, opt, tmp_path / "v1bad", comm=Comm())


def test_a_block_size_that_cuts_elements_is_refused_before_anything_is_written(tmp_path):
    """A checksum block must hold whole elements of every dtype (a multiple of 8 bytes): a block
    of 6 bytes once wrote a checkpoint that its own reader rejected as corrupted."""
    net = torch.nn.Linear(4, 3)
    for bad in (6, 0, -8, 12, 8.0):
        with pytest.raises(ValueError, match="block_bytes must be a positive multiple of 8"):
            checkpoint.save(net, None, tmp_path / "ck", step=0, block_bytes=bad)
    assert not any(tmp_path.iterdir())
    checkpoint.save(net, None, tmp_path / "ck", step=0, block_bytes=8)
    assert torch.equal(checkpoint.read_full(tmp_path / "ck")["param/weight"], net.weight.detach())


def test_a_commit_refuses_a_rank_file_that_is_gone_or_of_another_size(tmp_path):
    """Rank 0 writes the metadata (which marks a checkpoint complete) only if every rank's file
    is there with the bytes that rank reported."""
    from minishard.checkpoint import saving
    tmp, path = tmp_path / ".ck.saving", tmp_path / "ck"
    tmp.mkdir()
    (tmp / "rank0.safetensors").write_bytes(b"x" * 10)
    (tmp / "rank1.safetensors").write_bytes(b"x" * 12)
    meta = {"files": {"rank0.safetensors": {"rank": 0, "bytes": 10},
                      "rank1.safetensors": {"rank": 1, "bytes": 11}}}
    with pytest.raises(CheckpointError, match="rank 1 wrote 11 bytes .* it holds 12"):
        saving._commit(meta, tmp, path)
    (tmp / "rank1.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank 1 wrote 11 bytes .* the file is gone"):
        saving._commit(meta, tmp, path)
    assert not path.exists() and not (tmp / "metadata.json").exists()
    (tmp / "rank1.safetensors").write_bytes(b"x" * 11)
    saving._commit(meta, tmp, path)
    assert (path / "metadata.json").exists() and not tmp.exists()


def test_blocks_that_do_not_divide_a_mebibyte_are_checksummed_whole(tmp_path):
    """The writer hashes in ~1 MiB segments; a segment must hold whole blocks, or a block that
    straddles two segments gets two checksums and every later one shifts: the checkpoint would
    be refused as corrupt by its own reader. 24 KiB does not divide 1 MiB; 3 MiB exceeds it."""
    net = torch.nn.Linear(600, 500, bias=False)         # 300,000 float32: 1.2 MB, over 1 MiB
    nbytes = net.weight.numel() * net.weight.element_size()
    data = net.weight.detach().numpy().tobytes()
    assert nbytes > 1 << 20
    for B in (24 << 10, 3 << 20):
        path = tmp_path / f"b{B}"
        checkpoint.save(net, None, path, comm=Comm(), step=0, block_bytes=B)
        (p,) = checkpoint.read_metadata(path)["tensors"]["param/weight"]["pieces"]
        assert p["checksums"] == [xxhash.xxh3_64_hexdigest(data[i:i + B]) for i in range(0, nbytes, B)]
        other = torch.nn.Linear(600, 500, bias=False)
        checkpoint.load(other, None, path, comm=Comm())   # verifies every block
        assert torch.equal(other.weight, net.weight)


def _rank_info(rank: int, spans: list[tuple[int, int]]) -> dict:
    """What rank ``rank`` reports to the metadata: pieces ``[start, start + numel)`` of one
    10-element float32 tensor."""
    records = [{"tensor": "param/w", "file": f"rank{rank}.safetensors", "key": "param/w",
                "start": s, "numel": n, "offset": 128} for s, n in spans]
    return {"rank": rank, "bytes": 128 + 4 * sum(n for _, n in spans), "records": records,
            "strategy": "hand", "model": None, "optimizer": None,
            "tensors": {"param/w": ([10], "float32")}}


def test_the_metadata_refuses_pieces_that_overlap_even_when_their_sizes_add_up(tmp_path):
    """A layout bug that has two ranks save the same elements leaves others saved by none; if
    the pieces' sizes still add up to the tensor, only the overlap tells. Committing such a
    checkpoint would lose elements 8 and 9 (or the whole second half) without a word."""
    meta = checkpoint.format.build_metadata([_rank_info(0, [(0, 6)]), _rank_info(1, [(6, 4)])],
                                            step=0, block_bytes=64)
    assert [(p["start"], p["numel"]) for p in meta["tensors"]["param/w"]["pieces"]] == [(0, 6), (6, 4)]
    for spans in ([(0, 6)], [(4, 4)]), ([(0, 5)], [(0, 5)]):    # 6 + 4 = 5 + 5 = 10 elements
        with pytest.raises(CheckpointError, match=r"param/w: the pieces leave elements .* saved twice"):
            checkpoint.format.build_metadata([_rank_info(0, spans[0]), _rank_info(1, spans[1])],
                                             step=0, block_bytes=64)


def test_a_complete_checkpoint_is_preferred_to_the_previous_one_left_aside(tmp_path):
    """A save that dies after renaming its checkpoint into place but before deleting the
    previous one (``.ck.old``) leaves both: a load must give the new one, not silently go back
    a step. The one aside is used only when ``ck`` itself is incomplete."""
    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    assert not torch.equal(first.weight, second.weight)
    checkpoint.save(first, None, tmp_path / "first", comm=Comm(), step=1)
    checkpoint.save(second, None, tmp_path / "ck", comm=Comm(), step=2)
    shutil.copytree(tmp_path / "first", tmp_path / ".ck.old")
    target = torch.nn.Linear(4, 3)
    assert checkpoint.load(target, None, tmp_path / "ck", comm=Comm())["step"] == 2
    assert torch.equal(target.weight, second.weight)
    assert checkpoint.read_metadata(tmp_path / "ck")["step"] == 2
    assert torch.equal(checkpoint.read_full(tmp_path / "ck")["param/weight"], second.weight.detach())
    (tmp_path / "ck" / "metadata.json").unlink()          # ck incomplete: the one aside
    assert checkpoint.load(target, None, tmp_path / "ck", comm=Comm())["step"] == 1
    assert torch.equal(target.weight, first.weight)
