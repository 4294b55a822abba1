"""DeepSpeed's checkpoints, read without running their code, and resharded like any other.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag of the last save) and, under
``dir/global_stepN/``, one optimizer file per data-parallel rank plus the model's files::

    stage 1, 2   mp_rank_00_model_states.pt                      rank 0: the module, the names
                 zero_pp_rank_{r}_mp_rank_00_optim_states.pt     rank r: its partition of each
                                                                 flat group, fp32, and its AdamW
                                                                 moments over the same elements
    stage 3      zero_pp_rank_{r}_mp_rank_00_model_states.pt     every rank: the names (and its
                                                                 frozen fragments)
                 zero_pp_rank_{r}_mp_rank_00_optim_states.pt     rank r: its partition of *each
                                                                 parameter*, one after another

They are pickles: ``torch.load`` of such a file runs whatever code the file names, unless it is
told ``weights_only=True`` — then it builds tensors and plain containers only, and refuses every
other type by name. DeepSpeed's files name four types of DeepSpeed's own (``ALLOWED``, found by
loading real checkpoints until nothing was refused). Each is let in under its name as a *stand-in*
that only receives the fields the file holds: no DeepSpeed code runs (DeepSpeed need not even be
installed), and any other name — ``os.system`` in a planted pickle — is refused, named.

**The layouts, undone.** Stage 1/2 (``stage_1_and_2.py``) flattens each parameter group into one
vector — the parameters in ``param_shapes`` order, each followed by its ``param_alignment_paddings``,
the whole padded to a multiple of 2 x world size — and rank r holds elements ``[r*P, (r+1)*P)``
of it, saved with its tail of padding cut off. Stage 3 (``stage3.py``) cuts *each parameter* into
world-size pieces of ``ceil(numel / world size)`` elements (the last padded) and rank r's flat
group is its piece of every parameter, one after another. Either way, which elements of which
parameter rank r holds is arithmetic on the names and shapes; :func:`from_deepspeed` checks every
rank's lengths against it before believing it.

**The layout written.** Each DeepSpeed rank's file becomes one minishard file holding the same
elements — the fp32 master, ``exp_avg`` and ``exp_avg_sq`` of every parameter it held, padding
removed — with the metadata that says which elements each piece is. No tensor is gathered: a
rank's file is memory-mapped, its pieces are written straight from the map, one rank at a time, so
the conversion holds at most one rank's partition (and, with the page cache, less). Resharding is
then what it always is (:func:`.loading.load` on any world size and strategy, :func:`.export`):
the converted checkpoint is one more layout of pieces.

Not read (each refused with one line naming the file): stage 0 and DeepSpeed's bf16 optimizer
without ZeRO (no partitions to undo), tensor- or pipeline-parallel (``mp_rank_01``, ``layer_*``)
and expert-parallel checkpoints, frozen parameters and buffers (minishard's format keeps trained
parameters and their optimizer state only).
"""
from __future__ import annotations

import math
import os
import pickle
import re
import shutil
from pathlib import Path

import torch

from .format import (BLOCK_BYTES, STATE_KINDS, CheckpointError, build_metadata, dtype_name, plan_file,
                     write_safetensors)
from .regions import Region, ShardedState
from .saving import _check_target, _commit


# ====================================================================== what may be unpickled

class _Fields:
    """A DeepSpeed object as data: the unpickler creates it and hands it the fields the file holds
    (``__setstate__``); nothing else of it exists, so nothing of DeepSpeed's runs."""
    __slots__ = ("fields",)

    def __setstate__(self, fields) -> None:
        self.fields = fields


def _zero_stage(value: int) -> int:
    """``ZeroStageEnum(3)`` as the file calls it: an ``int`` Enum, read as its number."""
    return int(value)


# DeepSpeed's own types its ZeRO checkpoints store, each with why (deepspeed 0.19.8); torch's
# tensors, storages, torch.Size and the plain containers torch's weights-only loader allows itself
ALLOWED = (
    # the fp16 loss scaler's state (scale, dynamic): every optimizer file, LOSS_SCALER
    ("deepspeed.runtime.fp16.loss_scaler.LossScaler", _Fields),
    # the same, where fp16 training scaled dynamically (loss_scaler.py; not produced on this CPU)
    ("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", _Fields),
    # the stage: every optimizer file, ZERO_STAGE
    ("deepspeed.runtime.zero.config.ZeroStageEnum", _zero_stage),
    # (numel, start) of each parameter in a rank's partition: stage 1/2, PARAM_SLICE_MAPPINGS
    ("deepspeed.utils.tensor_fragment.fragment_address", _Fields),
)
OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def read_pt(file: Path, *, mmap: bool = False) -> dict:
    """One of DeepSpeed's ``.pt`` files, weights only, under :data:`ALLOWED`; any failure is one
    line naming the file: truncated or not written by ``torch.save``, or naming another type."""
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in ALLOWED]):
            out = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{file} does not exist") from None
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = (f"names {named.group(1)}, a type DeepSpeed's checkpoints do not store" if named else
                f"holds what DeepSpeed's checkpoints do not ({' '.join(str(e).split())[:120]})")
        raise CheckpointError(f"{file} {what}; not loaded (the types allowed: "
                              f"{', '.join(n for n, _ in ALLOWED)})") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable torch.save file (truncated, or not a "
                              f"checkpoint): {' '.join(str(e).split())[:160]}") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{file} holds a {type(out).__name__}, not a DeepSpeed checkpoint's dict")
    return out


def _need(sd: dict, key: str, file: Path, what: str):
    if key not in sd:
        raise CheckpointError(f"{file} is not a DeepSpeed {what} file: it has no {key!r} "
                              f"(it holds {sorted(map(str, sd))[:6]})")
    return sd[key]


# ====================================================================== finding the files

def tag_dir(ds_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """The folder of one save: ``ds_dir/<tag>`` (``tag``, else what ``ds_dir/latest`` names), or
    ``ds_dir`` itself if it holds the optimizer files."""
    root = Path(ds_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory: give the folder engine.save_checkpoint wrote")
    if tag is None and (root / "latest").is_file():
        tag = (root / "latest").read_text().strip()
    if tag is not None:
        if not (root / tag).is_dir():
            named_by = f"named by {root / 'latest'}" if (root / "latest").is_file() else "given"
            raise CheckpointError(f"{root / tag} does not exist (the tag {named_by})")
        return root / tag
    if any(OPTIM.match(f.name) for f in root.iterdir()):
        return root
    raise CheckpointError(f"{root} holds no DeepSpeed checkpoint: no 'latest' file and no "
                          f"zero_pp_rank_*_optim_states.pt")


def rank_files(where: Path) -> list[Path]:
    """Every rank's optimizer file, in rank order; refused: another layout's files, a gap."""
    found: dict[int, Path] = {}
    for f in sorted(where.iterdir()):
        m = OPTIM.match(f.name)
        if f.name.startswith("layer_") or "expp_rank" in f.name or (m and m.group(3) != "00"):
            raise CheckpointError(f"{f}: a pipeline-, tensor- or expert-parallel checkpoint; "
                                  f"from_deepspeed reads data-parallel ZeRO checkpoints only")
        if m:
            found[int(m.group(2))] = f
    if not found:
        stage0 = (where / "mp_rank_00_model_states.pt").exists()
        raise CheckpointError(f"{where} has no zero_pp_rank_*_optim_states.pt" + (
            ": a stage-0 checkpoint (no ZeRO partitions), which from_deepspeed does not read" if stage0 else ""))
    if 0 not in found:
        raise CheckpointError(f"missing rank file {where / 'zero_pp_rank_0_mp_rank_00_optim_states.pt'} "
                              f"(found ranks {sorted(found)})")
    return [found[r] for r in sorted(found)]


def _world_size(sd: dict, file: Path, files: list[Path]) -> int:
    counts = _need(sd, "partition_count", file, "ZeRO optimizer-state")
    counts = set(counts) if isinstance(counts, (list, tuple)) else {counts}
    if len(counts) != 1:
        raise CheckpointError(f"{file}: groups partitioned over {sorted(counts)} ranks (expert "
                              f"parallelism); from_deepspeed reads one data-parallel world")
    ws = counts.pop()
    have = {int(OPTIM.match(f.name).group(2)) for f in files}
    for r in range(ws):
        if r not in have:
            raise CheckpointError(f"missing rank file {file.parent / file.name.replace('_rank_0_', f'_rank_{r}_', 1)}: "
                                  f"DeepSpeed saved this checkpoint on {ws} ranks, and each holds a part")
    if max(have) >= ws:
        raise CheckpointError(f"{file.parent} has files of ranks {sorted(have)} but a {ws}-rank "
                              f"checkpoint (files of another save mixed in?)")
    return ws


# ====================================================================== the model's names

def _names(where: Path, stage: int, model) -> dict:
    """Each group's parameter names and shapes in flat order, the step, what else is recorded."""
    file = where / ("mp_rank_00_model_states.pt" if stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt")
    sd = read_pt(file)
    shapes = _need(sd, "param_shapes", file, "model-state")
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise CheckpointError(f"{file}: param_shapes is not a list of name -> shape per group")
    if sd.get("frozen_param_shapes"):
        raise CheckpointError(f"{file}: {len(sd['frozen_param_shapes'])} frozen parameters (e.g. "
                              f"{next(iter(sd['frozen_param_shapes']))}); minishard's checkpoint keeps "
                              f"trained parameters and their optimizer state only")
    if sd.get("buffer_names"):
        raise CheckpointError(f"{file}: buffers {sd['buffer_names'][:3]}; minishard's checkpoint keeps "
                              f"parameters and optimizer state only")
    groups = [{n: tuple(s) for n, s in g.items()} for g in shapes]
    return {"groups": groups, "step": int(_need(sd, "global_steps", file, "model-state")),
            "ds_version": sd.get("ds_version"),
            "model": _check_model(file, groups, model) if model is not None else None}


def _check_model(file: Path, groups: list[dict], model) -> dict:
    """The parameters are the named minishard model's, shape for shape: its config, as ``save``
    records it."""
    import dataclasses
    from minishard.core.model import GPT, GPTConfig, config
    cfg = config(model) if isinstance(model, str) else GPTConfig(**model) if isinstance(model, dict) else model
    want = {n: tuple(p.shape) for n, p in GPT(cfg, device="meta").named_parameters()}
    have = {n: s for g in groups for n, s in g.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))
        raise CheckpointError(f"{file}: not the parameters of the model given ({diff[:2]} differ)")
    return dataclasses.asdict(cfg)


# ====================================================================== the layouts, undone

def zero12_layout(groups: list[dict], paddings, ws: int) -> list[tuple[list, int, int]]:
    """Stage 1/2, per flat group: [(name, first element in the flat vector, numel)], the
    elements the parameters and their paddings take, and each rank's partition P."""
    out = []
    for g, shapes in enumerate(groups):
        pads = paddings[g] if paddings is not None else [0] * len(shapes)
        at, params = 0, []
        for (name, shape), pad in zip(shapes.items(), pads):
            params.append((name, at, math.prod(shape)))
            at += math.prod(shape) + pad
        align = 2 * ws                   # nccl_start_alignment_factor (2) x world size
        out.append((params, at, math.ceil(at / align) * align // ws))
    return out


def zero12_pieces(layout, r: int, masters: list) -> list[tuple[str, int, int, int, int]]:
    """What rank r holds: (name, group, first element of the parameter, numel, offset in the
    rank's saved vector). Its saved lengths checked against the layout first."""
    out = []
    for g, ((params, used, P), m) in enumerate(zip(layout, masters)):
        lo, hi = r * P, min((r + 1) * P, used)
        if m.numel() != max(0, hi - lo):
            raise CheckpointError(f"group {g} of rank {r}: {m.numel()} elements saved, the ZeRO-1/2 "
                                  f"layout of these parameters gives it {max(0, hi - lo)}")
        for name, start, n in params:
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                out.append((name, g, a - start, b - a, a - lo))
    return out


def zero3_pieces(groups: list[dict], r: int, ws: int, saved: int) -> list[tuple[str, int, int, int, int]]:
    """Stage 3: rank r's piece of each parameter, ``ceil(numel / ws)`` elements each, one after
    another in its flat groups (group index 0: the groups read as one vector)."""
    out, at = [], 0
    for name, shape in ((n, s) for g in groups for n, s in g.items()):
        n = math.prod(shape)
        c = math.ceil(n / ws)
        if r * c < n:
            out.append((name, 0, r * c, min(c, n - r * c), at))
        at += c
    if at != saved:
        raise CheckpointError(f"rank {r}: {saved} elements saved, the ZeRO-3 layout of these "
                              f"parameters gives each rank {at}")
    return out


def _optimizer(osd: dict, stage: int, file: Path) -> tuple[list, list[dict], list[dict]]:
    """The flat fp32 masters, the torch optimizer's per-flat state, its param_groups."""
    if stage == 3:
        inner = _need(osd, "optimizer_state_dict", file, "ZeRO-3 optimizer-state")
        masters = _need(osd, "fp32_flat_groups", file, "ZeRO-3 optimizer-state")
    else:
        inner = _need(osd, "base_optimizer_state", file, "ZeRO-1/2 optimizer-state")
        masters = _need(osd, "single_partition_of_fp32_groups", file, "ZeRO-1/2 optimizer-state")
    if isinstance(inner, list):          # stage 1/2's elastic form: one lean state per group
        step = osd.get("base_optimizer_state_step")
        return masters, [dict(s, **({"step": step} if step is not None else {})) for s in inner], []
    groups = inner["param_groups"]
    return masters, [inner["state"].get(i, {}) for g in groups for i in g["params"]], groups


# ====================================================================== one rank, one file

def _rank_regions(osd: dict, file: Path, stage: int, r: int, ws: int, groups, layout):
    """This rank's regions (fp32 master and per-element state of each piece) and its step."""
    masters, states, hyper = _optimizer(osd, stage, file)
    if len(states) != len(masters):
        raise CheckpointError(f"{file}: {len(masters)} flat groups but optimizer state for {len(states)}")
    kinds = {k for st in states for k in st} - {"step"}
    if kinds - set(STATE_KINDS):
        raise CheckpointError(f"{file}: optimizer state {sorted(kinds - set(STATE_KINDS))} is not "
                              f"per-element state minishard's format knows ({', '.join(STATE_KINDS)})")
    flat = [[m.detach().reshape(-1)] + [st[k].detach().reshape(-1) for k in sorted(kinds)]
            for m, st in zip(masters, states)]      # (stage 3 saves its flat groups as Parameters)
    for g, f in enumerate(flat):         # the moments may keep the partition's padding, never less
        if any(t.dtype != torch.float32 for t in f):
            raise CheckpointError(f"{file}: group {g} holds {sorted({str(t.dtype) for t in f})}; "
                                  f"DeepSpeed's masters and moments are fp32, and only those are read")
        if any(t.numel() < f[0].numel() for t in f[1:]):
            raise CheckpointError(f"{file}: group {g}'s optimizer state is shorter than its fp32 master")
    if stage == 3:                       # the groups read as one vector (a piece may cross two)
        flat = [[torch.cat([f[i] for f in flat]) if len(flat) > 1 else flat[0][i] for i in range(len(flat[0]))]]
        pieces = zero3_pieces(groups, r, ws, flat[0][0].numel())
    else:
        pieces = zero12_pieces(layout, r, [f[0] for f in flat])
    regions = [Region(f"{kind}/{name}", start, flat[g][k][at:at + n])
               for name, g, start, n, at in pieces
               for k, kind in enumerate(["param"] + sorted(kinds))]
    steps = {float(st["step"]) for st in states if "step" in st}
    if len(steps) > 1:
        raise CheckpointError(f"{file}: groups took different numbers of steps {sorted(steps)}")
    return regions, sorted(kinds), (steps.pop() if steps else None), hyper


def _optimizer_class(hyper: list[dict], kinds: list[str]) -> str | None:
    """DeepSpeed does not record the optimizer's class; its hyperparameters tell AdamW from Adam."""
    g = hyper[0] if hyper else {}
    decoupled = g.get("decoupled_weight_decay", g.get("adam_w_mode"))
    if "exp_avg" in kinds and decoupled is not None:
        return "AdamW" if decoupled else "Adam"
    return "SGD" if kinds == ["momentum_buffer"] else None


def _plain(v):
    return float(v) if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v


def _write_rank(tmp: Path, r: int, ws: int, stage: int, regions, shapes: dict, block_bytes: int) -> dict:
    """Rank r's pieces as ``rank{r}.safetensors`` (from the memory map), and its record."""
    tensors = {g.name: (shapes[g.name.split("/", 1)[1]], torch.float32) for g in regions}
    state = ShardedState(f"deepspeed_zero{stage}", r, ws, tensors, regions, None, None)
    entries, pieces, records, size = plan_file(state)
    written, sums = write_safetensors(tmp / f"rank{r}.safetensors", entries, (g.view for g in pieces), block_bytes)
    if written != size:
        raise CheckpointError(f"{tmp / f'rank{r}.safetensors'}: wrote {written} bytes, expected {size}")
    for rec, h in zip(records, sums):
        rec["checksums"] = h
    return {"rank": r, "bytes": size, "records": records}


def from_deepspeed(ds_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tag: str | None = None,
                   model=None, block_bytes: int = BLOCK_BYTES) -> dict:
    """Convert the DeepSpeed ZeRO stage 1/2/3 checkpoint in ``ds_dir`` (the folder given to
    ``engine.save_checkpoint``; ``tag`` or its ``latest``) into a minishard checkpoint at
    ``out_dir``: the fp32 masters, ``exp_avg``/``exp_avg_sq`` and step of every parameter, the
    hyperparameters, the training step (``global_steps``). ``model`` (a config name, dict or
    ``GPTConfig``): check the parameters are that model's and record it, as ``save`` does.
    Loads on any world size and strategy (:func:`load`). One process; no code from the files
    runs. Returns the step, stage, world size, the files written and their bytes."""
    where = tag_dir(ds_dir, tag)
    files = rank_files(where)
    osd = _need(read_pt(files[0], mmap=True), "optimizer_state_dict", files[0], "ZeRO optimizer-state")
    stage = _need(osd, "zero_stage", files[0], "ZeRO optimizer-state")
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{files[0]}: ZeRO stage {stage!r}; from_deepspeed reads stages 1, 2 and 3")
    ws = _world_size(osd, files[0], files)
    names = _names(where, stage, model)
    layout = zero12_layout(names["groups"], osd.get("param_alignment_paddings"), ws) if stage < 3 else None
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.saving"
    shapes = {n: list(s) for g in names["groups"] for n, s in g.items()}
    _check_target(out, tmp, 3 * 4 * sum(math.prod(s) for s in shapes.values()))
    try:
        infos = []
        for r, file in enumerate(files):         # one rank's file mapped at a time
            if r:
                osd = _need(read_pt(file, mmap=True), "optimizer_state_dict", file, "ZeRO optimizer-state")
            if osd.get("zero_stage") != stage:
                raise CheckpointError(f"{file}: ZeRO stage {osd.get('zero_stage')!r}, rank 0's is {stage}")
            infos.append(_convert_rank(osd, file, stage, r, ws, names, layout, shapes, tmp, block_bytes))
            osd = None
        steps = {i["optimizer"]["step"] for i in infos}
        if len(steps) > 1:
            raise CheckpointError(f"{where}: the ranks' optimizers took different numbers of steps {sorted(steps)}")
        meta = build_metadata(infos, step=names["step"], block_bytes=block_bytes)
        meta["source"] = {"deepspeed": names["ds_version"], "zero_stage": stage, "tag": where.name}
        _commit(meta, tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": str(out), "step": names["step"], "stage": stage, "world_size": ws,
            "ds_version": names["ds_version"], "files": sorted(meta["files"]),
            "bytes": sum(f["bytes"] for f in meta["files"].values()), "tensors": len(meta["tensors"])}


def _convert_rank(osd: dict, file: Path, stage: int, r: int, ws: int, names: dict, layout, shapes: dict,
                  tmp: Path, block_bytes: int) -> dict:
    """DeepSpeed rank r's file as minishard's ``rank{r}.safetensors``: its record for metadata.json."""
    regions, kinds, opt_step, hyper = _rank_regions(osd, file, stage, r, ws, names["groups"], layout)
    info = _write_rank(tmp, r, ws, stage, regions, shapes, block_bytes)
    tensors = {f"{k}/{n}": (s, dtype_name(torch.float32)) for n, s in shapes.items() for k in ["param"] + kinds}
    optimizer = {"class": _optimizer_class(hyper, kinds), "step": opt_step,
                 "param_groups": [{k: _plain(v) for k, v in g.items() if k != "params"} for g in hyper]}
    return {**info, "strategy": f"deepspeed_zero{stage}", "optimizer": optimizer, "model": names["model"],
            "tensors": tensors}
