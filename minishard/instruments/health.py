"""What a rank notes for the doctor besides its collectives: facts that must agree across ranks,
or that name a cause, written into its flight dump (``FlightRecorder.facts``).

    run            the config the rank trained with (the doctor words its fixes in it)
    weights_built  a fingerprint of every parameter as this rank built it, before wrapping
    weights_start  the same for the weights it starts training from, where a rank holds them
                   whole (replicas: DDP, ZeRO-1/2); FSDP's shards differ by design.
                   ``weights_start_ranks``: the ranks that must start alike, where a watch saw
                   DDP on a process group of its own (other groups hold other weights)
    steps          per optimizer step: the gradient norm clipped by (if clipping), the dtypes
                   the optimizer steps, and — where that is not fp32 — the share of the elements
                   it stepped that came out unchanged (updates lost to rounding)

A fingerprint is a hash of the tensor's bytes: equal weights give equal fingerprints on any
machine, and one flipped bit changes it.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Iterable

import torch

from minishard.core.words import dtype_name

RUN_FIELDS = ("strategy", "model", "steps", "micro_batch", "accum", "optimizer", "lr", "precision",
              "clip", "wrap", "reshard_after_forward", "reshard_root", "prefetch",
              "accumulation", "seed", "rank_seeds")   # (a planted fault adds its own)


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """name -> the first 16 hex digits of a BLAKE2 hash of the tensor's dtype, shape and bytes,
    the elements in row-major order: a layout is not a value, so a transposed, sliced or
    channels-last view hashes as its contiguous copy."""
    out = {}
    for name, t in named:
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(row_major(name, t).numpy())
        out[name] = h.hexdigest()
    return out


def row_major(name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in row-major order, as a flat uint8 tensor on the CPU: what a
    fingerprint hashes, whatever the layout (this BLAKE2 one and the replicas' XXH3,
    ``replicas.fingerprint``, alike)."""
    if t.is_meta:
        raise ValueError(f"fingerprint: {name} is on the meta device and has no values yet; "
                         f"fingerprint the weights once they are materialized")
    t = t.detach().cpu().resolve_conj().resolve_neg()
    if not t.numel():
        return torch.empty(0, dtype=torch.uint8)
    # one dimension (a 0-d tensor has none to view as bytes); a tensor whose strides are not
    # row-major is copied into row-major order by the reshape, and a single element with a
    # stride is copied too: viewing elements as bytes needs unit stride
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def fingerprint_model(model: torch.nn.Module) -> dict[str, str]:
    """``minishard.fingerprint(model)``: every parameter's fingerprint, by name, as this rank
    holds it now — before ``fully_shard``, the whole weights it built. Give it to
    ``minishard.watch(..., built=)``: the doctor then compares them across ranks."""
    return fingerprint(model.named_parameters())


def note_run(facts: dict, config, world_size: int) -> None:
    run = dataclasses.asdict(config)
    facts["run"] = {k: run[k] for k in RUN_FIELDS} | {"world_size": world_size}


def stepped_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer updates (the inner one's, for the wrappers that shard or keep
    a master)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return [p for g in inner.param_groups for p in g["params"]]


def note_steps(optimizer, facts: dict, step_of: Callable[[], int | None],
               norm_of: Callable[[], Any] | None = None, *, on=None) -> list[Callable[[], None]]:
    """A note per optimizer step in ``facts["steps"]`` — the step (``step_of()``), what
    :class:`StepNotes` finds, and the norm the gradients were clipped by (``norm_of()``, when it
    is not None) — taken by the step hooks of ``on`` (default: the torch optimizer that does the
    stepping, inside the wrappers that shard or keep a master): the training step itself knows
    nothing of it. Returns the hooks' removers."""
    on = getattr(optimizer, "optimizer", optimizer) if on is None else on
    held: list[StepNotes] = []

    def before(o, args, kwargs) -> None:
        held[:] = [StepNotes(optimizer).__enter__()]

    def after(o, args, kwargs) -> None:
        if held:
            notes = held.pop()
            notes.__exit__(None, None, None)
            norm = norm_of() if norm_of is not None else None
            facts.setdefault("steps", []).append(
                {"step": step_of(), **notes.note, **({"grad_norm": float(norm)} if norm is not None else {})})
    return [on.register_step_pre_hook(before).remove, on.register_step_post_hook(after).remove]


class StepNotes:
    """Around one optimizer step: the dtypes it steps, and where they are not fp32 the elements
    it left unchanged (a copy of the low-precision tensors before the step: only then)."""

    def __init__(self, optimizer):
        self.tensors = stepped_tensors(optimizer)
        self.note: dict = {"param_dtypes": sorted({dtype_name(p.dtype) for p in self.tensors})}
        self._before = None

    def __enter__(self) -> "StepNotes":
        low = [p for p in self.tensors if p.dtype != torch.float32]
        if low:
            self._before = [(p, p.detach().clone()) for p in low]
        return self

    def __exit__(self, *exc) -> None:
        if self._before is None or exc[0] is not None:
            return
        unchanged = total = 0
        for p, before in self._before:
            unchanged += int((p.detach() == before).sum())
            total += p.numel()
        self.note["low_precision_elements"] = total
        self.note["unchanged"] = unchanged
        self._before = None
