"""Checkpoints after sharding: every rank saves its own slice, and any layout can load them back.

A sharded run has no rank that holds the whole training state, so the state is saved the way it
is held: each rank writes the part it owns, all ranks in parallel. That raises two questions
this module answers in code:

1. **Resharding.** Can a checkpoint saved by N ranks under one strategy be loaded by M ranks
   under another (64 -> 32 after losing a node; ZeRO-1 -> FSDP)? Yes, if the checkpoint
   records *which elements of which tensor* each file holds, not "rank r's state".
2. **Release.** Inference engines want complete tensors, one file per layer, not shards. The
   export writes them from the checkpoint on disk, without ranks, streaming each tensor piece
   by piece (its buffers never exceed one piece).

**One description for every strategy.** Every tensor of the training state — each parameter,
and each optimizer state of each parameter (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``)
— is a flat index space of ``numel`` elements (row-major). What a rank holds is a list of
:class:`Region` s: elements ``[start, start + numel)`` of tensor ``name``, aliased by a 1-D
``view`` into the live parameter shard or optimizer state::

    strategy      parameters                                 optimizer state
    single, ddp   the whole tensor (a replica)               the whole tensor (a replica)
    zero1, zero2  the whole tensor (a replica)               its chunk of each bucket, cut at
                                                             the parameters' boundaries
    fsdp          its rows [r*c, (r+1)*c) of dim 0           the same rows
    fsdp_flat     its chunk of the unit's flat buffer, cut   the same elements
                  at the parameters' boundaries

A replica is saved once, not N times: rank r writes chunk r of it. Padding is never saved.
Loading is the same table read the other way: a rank needs every element its regions hold.

**On disk.** ``path/rank{r}.safetensors`` holds rank r's pieces, one 1-D tensor each (plain
little-endian bytes behind a JSON header: no pickle, so loading runs no code from the file);
``path/metadata.json`` lists every tensor's shape and dtype and every piece's file, key, first
element, byte offset and SHA-256 per 64 KiB block. A loader reads only the blocks that overlap
what it needs (:func:`plan_reads`), verifies them, and copies them into its views.

**Atomic.** The ranks write into a sibling temporary directory; files and directories are
fsync'd; only then is it renamed into place (an existing checkpoint is renamed aside first and
deleted last). A save killed at any point leaves the previous checkpoint loadable; a load that
fails on any rank changes nothing on any rank (read and verify everything, agree, then copy).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn

from .comm import Comm
from .optim_state import ensure_optimizer_state

FORMAT, VERSION = "minishard-checkpoint", 1
METADATA = "metadata.json"
# One SHA-256 per 64 KiB block: a rank reads whole blocks, so that what it reads can be verified
# without reading whole pieces. Smaller blocks: less read beyond the need, a longer metadata file
# (a real 8B run would pick MiBs).
BLOCK_BYTES = 64 << 10
STATE_KINDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
_DTYPES = {str(d).removeprefix("torch."): d for d in _CODES}          # "float32" -> torch.float32


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read. The message names the file and the tensor."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ====================================================================== what a rank holds

@dataclass
class Region:
    """Elements ``[start, start + numel)`` of checkpoint tensor ``name``, held in ``view``."""
    name: str                   # "param/blocks.0.attn.qkv.weight", "exp_avg/blocks.0.attn.qkv.weight"
    start: int
    view: torch.Tensor          # 1-D, aliasing the live parameter shard or optimizer state
    save: bool = True           # this rank writes these elements
    load: bool = True           # this rank must be given these elements
    cast: bool = False          # a working copy in another dtype (bf16 weights of an fp32 master):
                                # loaded from the master's values, never saved

    @property
    def numel(self) -> int:
        return self.view.numel()


@dataclass
class ShardedState:
    """This rank's part of the training state, described strategy-independently."""
    strategy: str
    rank: int
    world_size: int
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]   # name -> (global shape, dtype)
    regions: list[Region]
    optimizer: torch.optim.Optimizer | None                   # whose state the regions alias
    model_config: dict | None


class _Holdings:
    """Collects regions while an adapter walks a strategy's layout."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.N = rank, world_size
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.regions: list[Region] = []

    def tensor(self, name: str, shape, dtype: torch.dtype) -> None:
        self.tensors.setdefault(name, (tuple(shape), dtype))

    def add(self, name: str, start: int, view: torch.Tensor, **flags) -> None:
        if view.numel():
            self.regions.append(Region(name, start, view, **flags))

    def replica(self, name: str, full: torch.Tensor) -> None:
        """Every rank holds the whole tensor: each needs all of it, rank r saves chunk r."""
        n = full.numel()
        c = math.ceil(n / self.N)
        lo, hi = min(self.rank * c, n), min((self.rank + 1) * c, n)
        self.add(name, 0, full, save=False)
        self.add(name, lo, full[lo:hi], load=False)


def _states(optimizer, p: torch.Tensor, where: str) -> dict[str, torch.Tensor]:
    """The per-element optimizer state of ``p`` (the step count is global: metadata)."""
    st = optimizer.state.get(p, {}) if optimizer is not None else {}
    unknown = set(st) - set(STATE_KINDS) - {"step"}
    if unknown:
        raise CheckpointError(f"optimizer state {sorted(unknown)} of {where} is not per-element "
                              f"state this checkpoint format knows ({', '.join(STATE_KINDS)})")
    return {k: st[k].detach().reshape(-1) for k in STATE_KINDS if k in st}


def describe(model: nn.Module, optimizer, comm: Comm) -> ShardedState:
    """What this rank holds of the training state, as regions of global tensors (see the module
    docstring). ``optimizer`` may be None (weights only). Creates missing optimizer state."""
    from . import fsdp
    from .zero import ZeroOptimizer
    h = _Holdings(comm.rank, comm.world_size)
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    if inner is not None and not isinstance(inner, torch.optim.Optimizer):
        raise CheckpointError(f"cannot checkpoint a {type(optimizer).__name__}: expected a torch "
                              f"optimizer, minishard's ZeroOptimizer or MasterWeights")
    if type(inner).__name__ == "ZeroRedundancyOptimizer":
        raise CheckpointError("PyTorch's ZeroRedundancyOptimizer keeps its own layout: use "
                              "minishard's zero1 strategy, or torch.distributed.checkpoint")
    if inner is not None:
        tier = getattr(optimizer, "tier", None)
        ensure_optimizer_state(inner, tier.zeros_like if tier is not None else torch.zeros_like)
    net = getattr(model, "module", model)            # DDP wrappers hold the replica in .module
    if isinstance(optimizer, ZeroOptimizer):
        strategy = f"zero{optimizer.stage}"
        order = _describe_zero(h, optimizer)
    elif fsdp.units(net):
        kinds = {u.layout.kind for u in fsdp.units(net)}
        strategy = "fsdp" if kinds == {"per_param"} else "fsdp_flat" if kinds == {"flat"} else "fsdp_mixed"
        if any(u.layout.N != comm.world_size for u in fsdp.units(net)):
            strategy = "hsdp"
        order = _describe_fsdp(h, net, inner)
    else:
        if any(type(p).__name__ == "DTensor" for p in net.parameters()):
            raise CheckpointError("PyTorch's fully_shard (DTensor) parameters: use "
                                  "torch.distributed.checkpoint, or minishard's fsdp strategy")
        strategy = "single" if comm.world_size == 1 else "ddp"
        masters = dict(zip(optimizer.params, optimizer.master)) if hasattr(optimizer, "master") else {}
        order = _describe_replicas(h, net, inner, masters)
    # model order, each parameter followed by its optimizer states: files and exports read well
    rank_of = {f: i for i, f in enumerate(order)}
    kind_of = {k: i for i, k in enumerate(("param",) + STATE_KINDS)}

    def key(name):
        kind, fqn = name.split("/", 1)
        return rank_of[fqn], kind_of[kind]

    tensors = {n: h.tensors[n] for n in sorted(h.tensors, key=key)}
    cfg = getattr(net, "cfg", None)
    return ShardedState(strategy, comm.rank, comm.world_size, tensors,
                        sorted(h.regions, key=lambda g: (key(g.name), g.start)), inner,
                        dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None)


def _describe_replicas(h: _Holdings, net: nn.Module, opt, masters: dict) -> list[str]:
    """single / DDP: every rank holds everything. With bf16 weights the fp32 master is what is
    saved; the bf16 weights are its rounded working copy."""
    order = []
    for fqn, p in net.named_parameters():
        order.append(fqn)
        src = masters.get(p, p)
        h.tensor(f"param/{fqn}", p.shape, src.dtype)
        h.replica(f"param/{fqn}", src.detach().reshape(-1))
        if src is not p:
            h.add(f"param/{fqn}", 0, p.detach().reshape(-1), save=False, cast=True)
        for kind, t in _states(opt, src, fqn).items():
            h.tensor(f"{kind}/{fqn}", p.shape, t.dtype)
            h.replica(f"{kind}/{fqn}", t)
    return order


def _describe_zero(h: _Holdings, zopt) -> list[str]:
    """ZeRO-1/2: parameters are replicas (the flat buffer is whole on every rank); the optimizer
    state of rank r is chunk r of every bucket, which may start or end inside a parameter."""
    names = {p: n for n, p in zopt.module.named_parameters()}
    r = h.rank
    for b, shard in zip(zopt.buckets, zopt.shards):
        lo_c, hi_c = r * b.chunk, (r + 1) * b.chunk           # our chunk, in bucket coordinates
        states = _states(zopt.optimizer, shard, f"ZeRO bucket {b.index}")
        for p, off in zip(b.params, b.offsets):
            fqn, name = names[p], f"param/{names[p]}"
            full = zopt.flat_params[b.start + off:b.start + off + p.numel()]
            lo, hi = max(off, lo_c), min(off + p.numel(), hi_c)   # our elements of p (bucket coords)
            mine = slice(lo - lo_c, max(hi, lo) - lo_c)            # ... in chunk coordinates
            if zopt.master is None:                                # the chunk aliases the buffer
                h.tensor(name, p.shape, p.dtype)
                h.add(name, 0, full, save=False)
                h.add(name, lo - off, shard.detach()[mine], load=False)
            else:                                                  # fp32 master chunk + bf16 copy
                h.tensor(name, p.shape, zopt.master_dtype)
                h.add(name, lo - off, shard.detach()[mine])
                h.add(name, 0, full, save=False, cast=True)
            for kind, t in states.items():
                h.tensor(f"{kind}/{fqn}", p.shape, t.dtype)
                h.add(f"{kind}/{fqn}", lo - off, t[mine])
    for fqn, p in zopt.module.named_parameters():                 # frozen: not in any bucket
        if not p.requires_grad:
            h.tensor(f"param/{fqn}", p.shape, p.dtype)
            h.replica(f"param/{fqn}", p.detach().reshape(-1))
    return list(names.values())


def _describe_fsdp(h: _Holdings, net: nn.Module, opt) -> list[str]:
    """FSDP: per-parameter layouts hold rows of dim 0, flat layouts a chunk of the unit's flat
    buffer; the optimizer state has the shard's shape, so the same elements."""
    from .fsdp import UnitState, units
    prefixes = {id(m): n for n, m in net.named_modules()}
    position = {id(m): i for i, m in enumerate(net.modules())}
    order = []
    for u in units(net):
        if u.state != UnitState.SHARDED:
            raise CheckpointError(f"FSDP unit {u.name} is {u.state.value}: save and load between "
                                  f"steps, when every unit holds only its shard")
        lay = u.layout
        r = lay.rank                    # in the unit's shard group (HSDP: shard groups of lay.N
        replica = h.rank // lay.N       # consecutive ranks, each group holding a full copy)
        for i, s in enumerate(lay.slots):
            prefix = prefixes[id(s.module)]
            fqn = f"{prefix}.{s.name}" if prefix else s.name
            order.append((position[id(s.module)], len(order), fqn))
            if lay.kind == "per_param":
                local = lay.sharded[i]
                rows = s.shape[0] if len(s.shape) else 1
                lo_row, hi_row = min(r * lay.rows[i], rows), min((r + 1) * lay.rows[i], rows)
                start, n, first = lo_row * lay.inner[i], (hi_row - lo_row) * lay.inner[i], 0
            else:
                local = lay.flat_shard
                off, lo_c = lay.offsets[i], r * lay.chunk
                lo, hi = max(off, lo_c), min(off + s.numel, lo_c + lay.chunk)
                start, n, first = lo - off, max(hi - lo, 0), lo - lo_c
            h.tensor(f"param/{fqn}", s.shape, local.dtype)
            h.add(f"param/{fqn}", start, local.detach().reshape(-1)[first:first + n], save=replica == 0)
            for kind, t in _states(opt, local, fqn).items():
                h.tensor(f"{kind}/{fqn}", s.shape, t.dtype)
                h.add(f"{kind}/{fqn}", start, t[first:first + n], save=replica == 0)
    return [fqn for *_, fqn in sorted(order)]             # model order, not unit order


def local_state(model: nn.Module, optimizer, comm: Comm) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """A copy of what this rank holds: tensor name -> [(start, values)] (tests assemble these)."""
    out: dict[str, list] = {}
    for g in describe(model, optimizer, comm).regions:
        if g.load and not g.cast:
            out.setdefault(g.name, []).append((g.start, g.view.clone()))
    return out


# ====================================================================== safetensors, by hand

def _header(entries: list[tuple[str, str, list[int], int]]) -> bytes:
    """The JSON header of a safetensors file whose tensors ``(key, dtype code, shape, nbytes)``
    follow in this order. Written by hand so that offsets are known before any data exists (the
    planner computes them for saves that never ran) and data can be streamed (the export)."""
    h: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for key, code, shape, nbytes in entries:
        h[key] = {"dtype": code, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(h, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)             # data starts 8-byte aligned, as the library's


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_safetensors(file: Path, entries: list, tensors: Iterable[torch.Tensor],
                       hash_bytes: int | None = None) -> tuple[int, list[list[str]]]:
    """Write a safetensors file: 8-byte little-endian header length, the header, then each
    tensor's bytes as ``tensors`` yields them (one at a time). With ``hash_bytes``, also the
    SHA-256 of every block of that many bytes of each tensor, computed as the block is written
    (one pass over the data while it is in cache: ~15% faster than hashing first). fsync'd;
    returns the file's size and the hashes per tensor."""
    header = _header(entries)
    hashes = []
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for t in tensors:
            data = _bytes(t)
            if hash_bytes is None:
                f.write(data)
                continue
            hs = []
            for i in range(0, len(data), 16 * hash_bytes):    # write 16 blocks at a time
                seg = data[i:i + 16 * hash_bytes]
                hs += [hashlib.sha256(seg[j:j + hash_bytes]).hexdigest()
                       for j in range(0, len(seg), hash_bytes)]
                f.write(seg)
            hashes.append(hs)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(header) + sum(e[3] for e in entries), hashes


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ====================================================================== save

def _file_layout(state: ShardedState) -> tuple[list, list[Region], list[dict], int]:
    """Rank r's file: its safetensors entries, the regions they hold, one record per piece
    (tensor, key, first element, byte offset in the file), and the file's size."""
    pieces = [g for g in state.regions if g.save]
    keys = [g.name for g in pieces]
    if len(set(keys)) != len(keys):
        raise CheckpointError(f"rank {state.rank} holds two pieces of one tensor (a layout bug)")
    entries = [(g.name, _CODES[state.tensors[g.name][1]], [g.numel],
                g.numel * g.view.element_size()) for g in pieces]
    data_start = 8 + len(_header(entries))
    records, off = [], data_start
    for g, e in zip(pieces, entries):
        records.append({"tensor": g.name, "file": f"rank{state.rank}.safetensors", "key": g.name,
                        "start": g.start, "numel": g.numel, "offset": off})
        off += e[3]
    return entries, pieces, records, off


def _metadata(states_info: list[dict], *, step: int | None, block_bytes: int) -> dict:
    """metadata.json from every rank's description (the same code for real saves and for the
    planner's imagined ones)."""
    first = states_info[0]
    tensors = {name: {"shape": list(shape), "dtype": dtype, "pieces": []}
               for name, (shape, dtype) in first["tensors"].items()}
    files = {}
    for info in states_info:
        if info["tensors"] != first["tensors"]:
            raise CheckpointError(f"rank {info['rank']} describes other tensors than rank 0: the "
                                  f"ranks do not hold the same model")
        files[f"rank{info['rank']}.safetensors"] = {"rank": info["rank"], "bytes": info["bytes"]}
        for rec in info["records"]:
            tensors[rec["tensor"]]["pieces"].append({k: v for k, v in rec.items() if k != "tensor"})
    for name, t in tensors.items():              # every element saved exactly once: a self-check
        t["pieces"].sort(key=lambda p: p["start"])
        at = 0
        for p in t["pieces"]:
            if p["start"] != at:
                raise CheckpointError(f"{name}: the pieces leave elements {at}..{p['start']} unsaved "
                                      f"or saved twice (a layout bug)")
            at += p["numel"]
        if at != math.prod(t["shape"]):
            raise CheckpointError(f"{name}: pieces cover {at} of {math.prod(t['shape'])} elements")
    return {"format": FORMAT, "version": VERSION, "step": step, "strategy": first["strategy"],
            "world_size": len(states_info), "model": first["model"], "optimizer": first["optimizer"],
            "block_bytes": block_bytes, "tensors": tensors, "files": files}


def _optimizer_info(inner) -> dict | None:
    if inner is None:
        return None
    steps = {float(st["step"]) for st in inner.state.values() if "step" in st}
    if len(steps) > 1:
        raise CheckpointError(f"parameters have taken different numbers of optimizer steps "
                              f"{sorted(steps)}: this format keeps one global step")

    def plain(v):
        return float(v) if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v

    groups = [{k: plain(v) for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return {"class": type(inner).__name__, "step": steps.pop() if steps else None,
            "param_groups": groups}


def save(model: nn.Module, optimizer, path: str | os.PathLike, *, comm: Comm, step: int,
         block_bytes: int = BLOCK_BYTES) -> dict:
    """Every rank writes its pieces to ``path/rank{r}.safetensors``, rank 0 the metadata; the
    directory appears at ``path`` atomically (see the module docstring). A collective: every
    rank calls it, and every rank raises the same error if any rank fails. Returns this rank's
    numbers: bytes written, seconds, and (on rank 0) the metadata."""
    t0 = time.perf_counter()
    path = Path(path)
    tmp = path.parent / f".{path.name}.saving"
    file = tmp / f"rank{comm.rank}.safetensors"

    # 1. what this rank holds and where each piece will sit in its file; rank 0 checks the target
    error, info = None, None
    try:
        state = describe(model, optimizer, comm)
        entries, pieces, records, size = _file_layout(state)
        info = {"rank": comm.rank, "bytes": size, "records": records, "strategy": state.strategy,
                "model": state.model_config, "optimizer": _optimizer_info(state.optimizer),
                "tensors": {n: (list(s), _dtype_name(d)) for n, (s, d) in state.tensors.items()}}
    except CheckpointError as e:
        error = str(e)
    infos = comm.all_gather_object((error, info))
    _raise_if_any([e for e, _ in infos])
    infos = [i for _, i in infos]
    steps = {i["optimizer"]["step"] for i in infos if i["optimizer"]} - {None}
    if len(steps) > 1:
        raise CheckpointError(f"ranks disagree on the optimizer step: {sorted(steps)}")
    if infos[0]["optimizer"]:
        infos[0]["optimizer"]["step"] = steps.pop() if steps else None
    error = _on_rank0(comm, lambda: _prepare_target(path, tmp, sum(i["bytes"] for i in infos)))
    _raise_if_any(comm.all_gather_object(error))     # (also: nobody writes before tmp exists)

    # 2. every rank writes its own file, in parallel; checksums per block go to the metadata
    error, hashes = None, []
    t1 = time.perf_counter()
    try:
        written, hashes = _write_safetensors(file, entries, (g.view for g in pieces), block_bytes)
        if written != size:
            raise OSError(f"wrote {written} bytes, expected {size}")
    except OSError as e:
        what = f"pieces of {pieces[0].name} ..." if pieces else "no pieces"
        error = f"cannot write {file} ({what}): {type(e).__name__}: {e}"
    write_s = time.perf_counter() - t1
    results = comm.all_gather_object((error, hashes))
    errors = [e for e, _ in results]
    if any(errors) and comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_if_any(errors)
    for i, (_, hs) in zip(infos, results):
        for rec, h in zip(i["records"], hs):
            rec["sha256"] = h

    # 3. rank 0: the metadata last (its presence marks a complete checkpoint), then the renames
    meta = _metadata(infos, step=step, block_bytes=block_bytes) if comm.rank == 0 else None
    error = _on_rank0(comm, lambda: _commit(meta, tmp, path))
    errors = comm.all_gather_object(error)
    if any(errors) and comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_if_any(errors)
    return {"path": str(path), "step": step, "rank": comm.rank, "bytes_written": size,
            "seconds": time.perf_counter() - t0, "write_seconds": write_s, "metadata": meta}


def _commit(meta: dict, tmp: Path, path: Path) -> None:
    with open(tmp / METADATA, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    _swap_in(tmp, path)


def _on_rank0(comm: Comm, fn) -> str | None:
    """Run ``fn`` on rank 0 only; its failure becomes a message every rank will raise."""
    if comm.rank != 0:
        return None
    try:
        return fn()
    except (OSError, CheckpointError) as e:
        return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _raise_if_any(errors: list) -> None:
    for e in errors:
        if e:
            raise CheckpointError(e)


def _prepare_target(path: Path, tmp: Path, nbytes: int) -> None:
    """Checks before any byte is written: the parent exists or can be made, ``path`` is ours to
    replace, the disk has room; leftovers of an interrupted save are cleaned up."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint directory {path.parent}: {e}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"the checkpoint directory {path.parent} is not writable")
    old = path.parent / f".{path.name}.old"
    if not path.exists() and (old / METADATA).exists():
        os.rename(old, path)             # a save died between its two renames: put it back
    if path.exists() and not (path.is_dir() and (path / METADATA).exists()):
        raise CheckpointError(f"{path} exists and is not a minishard checkpoint; not replacing it")
    free = shutil.disk_usage(path.parent).free
    if nbytes > free:
        raise CheckpointError(f"the checkpoint directory {path.parent} has {free / 2**20:.1f} MiB "
                              f"free; the checkpoint needs {nbytes / 2**20:.1f} MiB")
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)          # an interrupted save's half-written files
    tmp.mkdir()


def _swap_in(tmp: Path, path: Path) -> None:
    """Rename the complete new checkpoint into place. The old one is renamed aside first and
    deleted last, so at every instant a complete checkpoint exists under ``path`` or aside."""
    old = path.parent / f".{path.name}.old"
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


# ====================================================================== reading and planning

def _resolve(path: Path) -> Path:
    """``path``, or — if a save died between its two renames — the previous checkpoint aside."""
    old = path.parent / f".{path.name}.old"
    if not (path / METADATA).exists() and (old / METADATA).exists():
        return old
    return path


def read_metadata(path: str | os.PathLike) -> dict:
    """The checkpoint's metadata.json, after checking that this code can read its format."""
    file = _resolve(Path(path)) / METADATA
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file} does not exist: {path} is not a (complete) checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read as JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} metadata file")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {meta.get('version')!r}; this minishard "
                              f"reads version {VERSION}")
    return meta


@dataclass(frozen=True)
class Read:
    """One contiguous read: whole checksum blocks of one saved piece."""
    file: str
    key: str
    tensor: str
    start: int                  # first element read, in the tensor's index space
    numel: int
    offset: int                 # byte offset in the file
    nbytes: int
    piece_lo: int               # first element read, within the piece
    block: int                  # elements per checksum block
    sha256: tuple | None        # expected hash of each block read (None: an imagined save)


def plan_reads(meta: dict, needs: Iterable[tuple[str, int, int]]) -> list[Read]:
    """The reads that deliver the elements ``needs`` = [(tensor, start, numel)]: for each saved
    piece overlapping them, the whole checksum blocks that cover the overlap (so that what is
    read can be verified), merged into contiguous reads."""
    wanted: dict[str, list[tuple[int, int]]] = {}
    for name, start, n in needs:
        if name not in meta["tensors"]:
            raise CheckpointError(f"the checkpoint has no tensor {name}")
        if n:
            wanted.setdefault(name, []).append((start, start + n))
    reads = []
    for name in [n for n in meta["tensors"] if n in wanted]:      # metadata (model) order
        t = meta["tensors"][name]
        size = torch.empty((), dtype=_DTYPES[t["dtype"]]).element_size()
        block = meta["block_bytes"] // size
        for p in t["pieces"]:
            ps, pe = p["start"], p["start"] + p["numel"]
            blocks = set()
            for a, b in wanted[name]:
                lo, hi = max(a, ps), min(b, pe)
                if lo < hi:
                    blocks.update(range((lo - ps) // block, (hi - ps - 1) // block + 1))
            for first, last in _runs(sorted(blocks)):
                lo, hi = first * block, min((last + 1) * block, p["numel"])
                sha = tuple(p["sha256"][first:last + 1]) if p.get("sha256") else None
                reads.append(Read(p["file"], p["key"], name, ps + lo, hi - lo,
                                  p["offset"] + lo * size, (hi - lo) * size, lo, block, sha))
    return reads


def _runs(xs: list[int]) -> Iterator[tuple[int, int]]:
    """[0, 1, 2, 5, 6] -> (0, 2), (5, 6)"""
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        yield xs[i], xs[j]
        i = j + 1


def _read(root: Path, meta: dict, reads: list[Read], meter: "_Meter | None" = None
          ) -> Iterator[tuple[Read, torch.Tensor]]:
    """Execute reads file by file, verifying sizes and checksums; yields (read, values)."""
    from safetensors import SafetensorError, safe_open
    by_file: dict[str, list[Read]] = {}
    for rd in reads:
        by_file.setdefault(rd.file, []).append(rd)
    for fname, rs in by_file.items():
        file = root / fname
        what = f"{rs[0].tensor}" + (f" and {len(rs) - 1} more pieces" if len(rs) > 1 else "")
        info = meta["files"].get(fname)
        if info is None:
            raise CheckpointError(f"{root / METADATA} lists pieces in {fname} but not the file")
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"missing shard file {file}: it holds {what}") from None
        if size != info["bytes"]:
            raise CheckpointError(f"{file} is {size:,} bytes, {METADATA} says {info['bytes']:,}: "
                                  f"the file is truncated or was replaced (it holds {what})")
        try:
            with safe_open(str(file), framework="pt") as f:
                for rd in rs:
                    sl = f.get_slice(rd.key)
                    if sl.get_dtype() != _CODES[_DTYPES[meta["tensors"][rd.tensor]["dtype"]]]:
                        raise CheckpointError(f"{file}: {rd.key} is {sl.get_dtype()}, {METADATA} "
                                              f"says {meta['tensors'][rd.tensor]['dtype']}")
                    values = sl[rd.piece_lo:rd.piece_lo + rd.numel]
                    if meter is not None:
                        meter.alloc(values)
                    if rd.sha256 is None:
                        raise CheckpointError(f"{root / METADATA} has no checksums for {rd.tensor}")
                    for k, want in enumerate(rd.sha256):
                        got = hashlib.sha256(_bytes(values[k * rd.block:(k + 1) * rd.block])).hexdigest()
                        if got != want:
                            a = rd.start + k * rd.block
                            raise CheckpointError(
                                f"{file}: checksum mismatch in {rd.tensor}, elements "
                                f"[{a}, {min(a + rd.block, rd.start + rd.numel)}): the file is corrupted")
                    yield rd, values
        except SafetensorError as e:
            raise CheckpointError(f"{file} is not a readable safetensors file ({e}); it holds {what}") from None


def read_full(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors from a checkpoint, verified (one process, no ranks): for tests and tools."""
    root = _resolve(Path(path))
    meta = read_metadata(root)
    names = list(meta["tensors"]) if names is None else list(names)
    out = {n: torch.empty(math.prod(meta["tensors"][n]["shape"]), dtype=_DTYPES[meta["tensors"][n]["dtype"]])
           for n in names}
    for rd, v in _read(root, meta, plan_reads(meta, [(n, 0, out[n].numel()) for n in names])):
        out[rd.tensor][rd.start:rd.start + rd.numel] = v
    return {n: t.view(meta["tensors"][n]["shape"]) for n, t in out.items()}


# ====================================================================== load

def _check_compatible(meta: dict, state: ShardedState, root: Path, with_optimizer: bool) -> None:
    """Names, shapes, dtypes and optimizer state kinds must match; world size and strategy need
    not (that is what resharding is for)."""
    file = root / METADATA
    saved = meta["tensors"]
    ours = {n for n in state.tensors if n.startswith("param/")}
    theirs = {n for n in saved if n.startswith("param/")}
    for missing, where in ((ours - theirs, "the checkpoint lacks"), (theirs - ours, "the model lacks")):
        if missing:
            names = sorted(n.split("/", 1)[1] for n in missing)
            raise CheckpointError(f"{file}: parameter names do not match — {where} "
                                  f"{names[:4]}{' ...' if len(names) > 4 else ''}")
    if with_optimizer:
        opt = meta.get("optimizer") or {}
        ours_s = {n for n in state.tensors if not n.startswith("param/")}
        theirs_s = {n for n in saved if not n.startswith("param/")}
        cls = type(state.optimizer).__name__
        if opt.get("class") not in (None, cls) or ours_s != theirs_s:
            diff = sorted(ours_s ^ theirs_s)
            raise CheckpointError(f"{file}: optimizer state saved by {opt.get('class')} does not fit "
                                  f"this {cls} (e.g. {diff[:2]}); pass optimizer=None to load the "
                                  f"weights only")
    for name, (shape, dtype) in state.tensors.items():
        if name not in saved:
            continue
        if list(shape) != saved[name]["shape"]:
            raise CheckpointError(f"{file}: {name.split('/', 1)[1]} has shape {list(shape)} in the "
                                  f"model, {saved[name]['shape']} in the checkpoint ({name})")
        if _dtype_name(dtype) != saved[name]["dtype"]:
            raise CheckpointError(f"{file}: dtype mismatch for {name}: saved as {saved[name]['dtype']}, "
                                  f"the model holds {_dtype_name(dtype)}")


def load(model: nn.Module, optimizer, path: str | os.PathLike, *, comm: Comm) -> dict:
    """Load a checkpoint saved by any number of ranks under any strategy into this rank's part
    of ``model`` and ``optimizer`` (None: weights only). A collective. Each rank reads only the
    blocks that overlap what it holds, verifies them, and — once every rank has succeeded —
    copies them in; on any failure nothing is changed on any rank. Returns the saved step, the
    bytes this rank read, the seconds, and the reads."""
    t0 = time.perf_counter()
    error, staged, reads = None, [], []
    try:
        root = _resolve(Path(path))
        meta = read_metadata(root)
        state = describe(model, optimizer, comm)
        _check_compatible(meta, state, root, optimizer is not None)
        targets = [g for g in state.regions if g.load and (optimizer is not None or g.name.startswith("param/"))]
        reads = plan_reads(meta, [(g.name, g.start, g.numel) for g in targets])
        staged = list(_read(root, meta, reads))          # read and verify all, change nothing yet
    except (CheckpointError, OSError) as e:
        error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    _raise_if_any(comm.all_gather_object(error))

    by_tensor: dict[str, list] = {}
    for rd, v in staged:
        by_tensor.setdefault(rd.tensor, []).append((rd, v))
    with torch.no_grad():
        for g in targets:                                 # commit: copy into the live views
            for rd, v in by_tensor.get(g.name, []):
                a, b = max(g.start, rd.start), min(g.start + g.numel, rd.start + rd.numel)
                if a < b:
                    g.view[a - g.start:b - g.start].copy_(v[a - rd.start:b - rd.start])
        opt = meta.get("optimizer")
        if optimizer is not None and opt:
            _restore_optimizer(state.optimizer, opt)
    return {"step": meta["step"], "rank": comm.rank, "bytes_read": sum(r.nbytes for r in reads),
            "seconds": time.perf_counter() - t0, "reads": reads, "saved_world_size": meta["world_size"],
            "saved_strategy": meta["strategy"]}


def _restore_optimizer(inner: torch.optim.Optimizer, saved: dict) -> None:
    """The global step count and the hyperparameters (a schedule may have changed the lr)."""
    if saved["step"] is not None:
        for st in inner.state.values():
            if "step" in st:
                st["step"].fill_(saved["step"])
    if len(saved["param_groups"]) == len(inner.param_groups):
        for group, values in zip(inner.param_groups, saved["param_groups"]):
            for k, v in values.items():
                if k in group:
                    group[k] = tuple(v) if isinstance(v, list) else v


# ====================================================================== plans without ranks

class _LayoutComm(Comm):
    """Rank ``rank`` of a world that need not exist: enough to build a strategy's layout on the
    meta device (replication broadcasts do nothing: meta tensors have no values)."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(None)
        self.rank, self.world_size, self.backend = rank, world_size, "none"

    def broadcast(self, tensor, src: int = 0, **kw):
        return None

    def all_gather_object(self, obj):
        raise RuntimeError("a layout-only comm cannot communicate")


def layout(strategy: str, rank: int, world_size: int, model_config, *, optimizer: str = "adamw",
           **build_options) -> ShardedState:
    """What rank ``rank`` of ``world_size`` would hold under ``strategy`` — computed on the meta
    device, from the layout math alone (no ranks, no memory)."""
    from .model import GPT, GPTConfig
    from .strategies import build
    from .config import TrainConfig
    cfg = GPTConfig(**model_config) if isinstance(model_config, dict) else model_config
    comm = _LayoutComm(rank, world_size)
    built = build(GPT(cfg, device="meta"), TrainConfig(strategy, optimizer=optimizer, **build_options), comm)
    return describe(built.model, built.optimizer, comm)


def _optimizer_name(meta: dict) -> str:
    kinds = {n.split("/", 1)[0] for n in meta["tensors"]}
    return "adamw" if "exp_avg" in kinds else "sgd_momentum" if "momentum_buffer" in kinds else "sgd"


def layout_metadata(strategy: str, world_size: int, model_config, *, optimizer: str = "adamw",
                    step: int = 0, block_bytes: int = BLOCK_BYTES, **build_options) -> dict:
    """The metadata a save by ``world_size`` ranks under ``strategy`` would write — files, pieces,
    byte offsets — without running it (no checksums: nothing to hash). For planning what
    resharding a 64-rank run would read, on a laptop."""
    infos = []
    for r in range(world_size):
        st = layout(strategy, r, world_size, model_config, optimizer=optimizer, **build_options)
        _, _, records, size = _file_layout(st)
        infos.append({"rank": r, "bytes": size, "records": records, "strategy": st.strategy,
                      "model": st.model_config, "optimizer": {"class": type(st.optimizer).__name__,
                                                              "step": step, "param_groups": []},
                      "tensors": {n: (list(s), _dtype_name(d)) for n, (s, d) in st.tensors.items()}})
    return _metadata(infos, step=step, block_bytes=block_bytes)


@dataclass
class ReshardPlan:
    """For each new rank, the reads that load it: which byte ranges of which saved files."""
    saved_world_size: int
    world_size: int
    reads: list[list[Read]]
    file_rank: dict[str, int]
    needed_bytes: list[int]         # bytes each new rank needs (the reads add whole blocks)

    def bytes_matrix(self) -> list[list[int]]:
        """``m[new][saved]``: bytes new rank ``new`` reads from saved rank ``saved``'s file."""
        m = [[0] * self.saved_world_size for _ in range(self.world_size)]
        for new, rs in enumerate(self.reads):
            for rd in rs:
                m[new][self.file_rank[rd.file]] += rd.nbytes
        return m

    def bytes_read(self) -> list[int]:
        return [sum(rd.nbytes for rd in rs) for rs in self.reads]

    def files_read(self) -> list[list[int]]:
        return [sorted({self.file_rank[rd.file] for rd in rs}) for rs in self.reads]


def plan(metadata: dict, strategy: str, world_size: int, model_config=None,
         **build_options) -> ReshardPlan:
    """What loading this checkpoint on ``world_size`` ranks under ``strategy`` reads, per new
    rank — the same reads :func:`load` executes, computed without launching anything."""
    cfg = model_config if model_config is not None else metadata["model"]
    reads, needed = [], []
    for r in range(world_size):
        st = layout(strategy, r, world_size, cfg, optimizer=_optimizer_name(metadata), **build_options)
        regions = [g for g in st.regions if g.load]
        reads.append(plan_reads(metadata, [(g.name, g.start, g.numel) for g in regions]))
        needed.append(sum(g.numel * g.view.element_size() for g in regions if not g.cast))
    return ReshardPlan(metadata["world_size"], world_size, reads,
                       {f: info["rank"] for f, info in metadata["files"].items()}, needed)


# ====================================================================== export

class _Meter:
    """Bytes of the buffers the export holds right now, and the most it ever held."""

    def __init__(self):
        self.live, self.peak = 0, 0

    def alloc(self, t: torch.Tensor) -> None:
        self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live)

    def free(self, t: torch.Tensor) -> None:
        self.live -= t.numel() * t.element_size()


def _layer_of(fqn: str) -> str | None:
    """``blocks.3.attn.qkv.weight`` -> ``blocks.3``: the layer a parameter belongs to."""
    m = re.match(r"^(.*?\.\d+)\.", fqn)
    return m.group(1) if m else None


def export(path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None) -> dict:
    """Consolidated weights for inference: one safetensors file per layer (one for the rest:
    embeddings, final norm, head) and ``model.safetensors.index.json`` (``weight_map``), the
    layout Hugging Face loaders read. Streaming: the header is known from the metadata, so each
    whole tensor is written as its verified pieces arrive, in order, one piece at a time — the
    buffers held never exceed the largest piece (and its cast), at most the largest tensor
    (measured: ``peak_buffer_bytes``). Reads the checkpoint on disk: no ranks needed."""
    root = _resolve(Path(path))
    meta = read_metadata(root)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = [n for n in meta["tensors"] if n.startswith("param/")]
    groups: dict[str | None, list[str]] = {}
    for n in params:
        groups.setdefault(_layer_of(n.split("/", 1)[1]), []).append(n)
    order = [g for g in groups if g is not None] + ([None] if None in groups else [])
    meter, weight_map, files, total = _Meter(), {}, [], 0

    def streamed(names):
        """Each tensor's pieces in order, verified, one at a time: the file gets the whole tensor,
        the process never holds more than one piece (and its cast)."""
        for n in names:
            for p in meta["tensors"][n]["pieces"]:
                for rd, v in _read(root, meta, plan_reads(meta, [(n, p["start"], p["numel"])]), meter):
                    if dtype is not None and dtype != v.dtype:
                        cast = v.to(dtype)
                        meter.alloc(cast)
                        meter.free(v)
                        v = cast
                    yield v
                    meter.free(v)
                    del v

    for k, g in enumerate(order):
        fname = f"model-{k + 1:05d}-of-{len(order):05d}.safetensors"
        entries = []
        for n in groups[g]:
            t = meta["tensors"][n]
            d = dtype or _DTYPES[t["dtype"]]
            nbytes = math.prod(t["shape"]) * torch.empty((), dtype=d).element_size()
            entries.append((n.split("/", 1)[1], _CODES[d], t["shape"], nbytes))
            weight_map[n.split("/", 1)[1]] = fname
            total += nbytes
        tmp = out / f".{fname}.tmp"
        _write_safetensors(tmp, entries, streamed(groups[g]))      # (no hashes: a release)
        os.replace(tmp, out / fname)
        files.append(fname)
    index = {"metadata": {"total_size": total, "source": FORMAT, "step": meta["step"]},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    largest = max(math.prod(meta["tensors"][n]["shape"]) * torch.empty((), dtype=_DTYPES[meta["tensors"][n]["dtype"]]).element_size()
                  for n in params)
    return {"files": files, "total_size": total, "peak_buffer_bytes": meter.peak,
            "largest_tensor_bytes": largest, "step": meta["step"]}


def load_exported(out_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The exported weights as a plain state dict (read with safetensors: no pickle)."""
    from safetensors.torch import load_file
    out = Path(out_dir)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    state = {}
    for fname in dict.fromkeys(index["weight_map"].values()):
        state.update(load_file(str(out / fname)))
    return state
