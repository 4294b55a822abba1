"""Release: complete tensors for inference engines, one file per layer, streamed from the shards.

Inference engines want complete tensors, not shards. The export writes them from the checkpoint
on disk, without ranks: the safetensors header of each output file is known from the metadata,
so each whole tensor is written as its verified pieces arrive, in order, one piece at a time —
the buffers held never exceed the largest piece (and its cast).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

from .format import CODES, DTYPES, FORMAT, element_size, read_metadata, resolve, write_safetensors
from .reads import plan_reads, read_verified


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
    layout Hugging Face loaders read. Streaming (see the module docstring): the buffers held
    never exceed the largest piece and its cast, at most the largest tensor (measured:
    ``peak_buffer_bytes``). Reads the checkpoint on disk: no ranks needed."""
    root = resolve(Path(path))
    meta = read_metadata(root)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = [n for n in meta["tensors"] if n.startswith("param/")]
    groups: dict[str | None, list[str]] = {}
    for n in params:
        groups.setdefault(_layer_of(n.split("/", 1)[1]), []).append(n)
    order = [g for g in groups if g is not None] + ([None] if None in groups else [])
    meter, weight_map, files, total = _Meter(), {}, [], 0
    for k, g in enumerate(order):
        fname = f"model-{k + 1:05d}-of-{len(order):05d}.safetensors"
        entries = []
        for n in groups[g]:
            t = meta["tensors"][n]
            d = dtype or DTYPES[t["dtype"]]
            nbytes = math.prod(t["shape"]) * torch.empty((), dtype=d).element_size()
            entries.append((n.split("/", 1)[1], CODES[d], t["shape"], nbytes))
            weight_map[n.split("/", 1)[1]] = fname
            total += nbytes
        tmp = out / f".{fname}.tmp"
        write_safetensors(tmp, entries, _streamed(root, meta, groups[g], dtype, meter))  # (no hashes: a release)
        os.replace(tmp, out / fname)
        files.append(fname)
    index = {"metadata": {"total_size": total, "source": FORMAT, "step": meta["step"]},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    largest = max(math.prod(meta["tensors"][n]["shape"]) * element_size(meta["tensors"][n]["dtype"])
                  for n in params)
    return {"files": files, "total_size": total, "peak_buffer_bytes": meter.peak,
            "largest_tensor_bytes": largest, "step": meta["step"]}


def _streamed(root: Path, meta: dict, names: list[str], dtype: torch.dtype | None, meter: _Meter):
    """Each tensor's pieces in order, verified, one at a time: the file gets the whole tensor,
    the process never holds more than one piece (and its cast)."""
    for n in names:
        for p in meta["tensors"][n]["pieces"]:
            for rd, v in read_verified(root, meta, plan_reads(meta, [(n, p["start"], p["numel"])]), meter):
                if dtype is not None and dtype != v.dtype:
                    cast = v.to(dtype)
                    meter.alloc(cast)
                    meter.free(v)
                    v = cast
                yield v
                meter.free(v)
                del v


def load_exported(out_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The exported weights as a plain state dict (read with safetensors: no pickle)."""
    from safetensors.torch import load_file
    out = Path(out_dir)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    state = {}
    for fname in dict.fromkeys(index["weight_map"].values()):
        state.update(load_file(str(out / fname)))
    return state
