"""Offload: keep the sharded training state off the device, and pay for it in transfers.

FSDP already cut the state to 16Ψ/N per rank. Offload moves what remains — the sharded fp32
parameters, their gradients and the optimizer state — to a slower, larger tier, named as
PyTorch's FSDP2 names it:

* ``OffloadPolicy()``: no offload (FSDP2's base class means the same);
* ``CPUOffloadPolicy()``: host memory (``pin_memory=True`` by default, as FSDP2's; pinned only
  when a CUDA device exists — without one there is nothing to pin for);
* ``DiskOffloadPolicy(directory)``: memory-mapped files, standing in for NVMe (DeepSpeed's
  ZeRO-Infinity idea; FSDP2 has no disk tier, so the name is minishard's own).

Given to ``fully_shard(offload_policy=...)`` they move together: the optimizer step runs where the
state lives (``fsdp.ShardedOptimizer`` creates the moments in the tier). What must still cross
over each step:

    before each all-gather   the unit's parameter shard      tier -> device   (h2d)
    after each reduce-scatter the reduced gradient shard     device -> tier   (d2h)

so the *transfer* bytes per step are exactly: shard bytes x (number of unshards) in, and
gradient-shard bytes out. A capacity problem becomes a bandwidth problem: PCIe moves tens of
GB/s, HBM several TB/s. On a CPU-only machine "device" and "host" are the same RAM, so the
measured seconds are memcpy (and page-cache) times; the chapter labels them as such and models
PCIe separately.

Given to ``ShardedOptimizer(offload_policy=...)`` instead, only the optimizer's side goes
(:class:`OptimizerOffload`, ZeRO-Offload's choice): the parameters and gradients stay on the
device, the tier holds the moments and a master copy of the shards, and the step runs there —
the gradient shards go out and the updated shards come back, once per step.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

TIERS = ("host", "disk")


class OffloadError(RuntimeError):
    """The offload tier cannot hold the state (unwritable directory, not enough space)."""


@dataclass(frozen=True, init=False)
class OffloadPolicy:
    """No offload: FSDP2's ``OffloadPolicy()``, the base class of the policies that do offload
    (:class:`CPUOffloadPolicy`, :class:`DiskOffloadPolicy`), and ``fully_shard``'s default. A
    policy names where the sharded state — parameters, gradients, optimizer moments, always
    together — lives (``tier``); each unit then makes its own :class:`Tier` from it.
    (Activations and gathered parameters are needed on the device at once: to save activation
    memory, recompute activations instead.)"""
    tier: ClassVar[str | None] = None

    def __init__(self, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"OffloadPolicy() is FSDP2's no-offload policy and takes no arguments "
                            f"(got {', '.join([*map(repr, args), *kwargs])}): for host memory use "
                            f"CPUOffloadPolicy(), for memory-mapped files DiskOffloadPolicy(directory)")


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Host memory, as FSDP2's ``CPUOffloadPolicy``: ``pin_memory`` (default True, as there) pins
    the host copies so that copies to a GPU run asynchronously — where a CUDA device exists;
    on a CPU-only machine there is nothing to pin for, and minishard leaves them unpinned
    (FSDP2 raises there: pass ``pin_memory=False`` to it)."""
    tier: ClassVar[str] = "host"
    pin_memory: bool = True

    def __post_init__(self):
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy(pin_memory={self.pin_memory!r}): must be True or False")


@dataclass(frozen=True)
class DiskOffloadPolicy(OffloadPolicy):
    """Memory-mapped files in ``directory`` (a folder per unit and rank is made in it): the
    stand-in for an NVMe drive. FSDP2 has no such tier; the name is minishard's own."""
    tier: ClassVar[str] = "disk"
    directory: str

    def __post_init__(self):
        if not isinstance(self.directory, (str, os.PathLike)) or not os.fspath(self.directory):
            raise ValueError(f"DiskOffloadPolicy(directory={self.directory!r}): needs the folder "
                             f"its memory-mapped files go in")
        object.__setattr__(self, "directory", os.fspath(self.directory))


def policy_of(tier: str | None, directory: str | None = None) -> OffloadPolicy:
    """The policy a tier's name stands for (``TrainConfig(offload=...)``, ``--offload``):
    None -> ``OffloadPolicy()``, ``"host"`` -> ``CPUOffloadPolicy()``, ``"disk"`` ->
    ``DiskOffloadPolicy(directory)``."""
    if tier is None:
        return OffloadPolicy()
    if tier == "host":
        return CPUOffloadPolicy()
    if tier == "disk":
        if not directory:
            raise ValueError("offload tier 'disk' needs a directory for its memory-mapped files")
        return DiskOffloadPolicy(directory)
    raise ValueError(f"unknown offload tier {tier!r}; expected one of {TIERS} (or None)")


def checked_policy(policy, who: str) -> OffloadPolicy:
    """``policy`` if it is an offload policy (None reads as ``OffloadPolicy()``); else a clear
    error naming what was given and what is taken."""
    if policy is None:
        return OffloadPolicy()
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"{who}: offload_policy={policy!r} is not an offload policy; give "
                        f"OffloadPolicy() (none), CPUOffloadPolicy() (host memory) or "
                        f"DiskOffloadPolicy(directory) (memory-mapped files)")
    return policy


class Tier:
    """One unit's place in a tier: allocates its tensors there (for the disk tier, in a folder
    of its own, ``rank{r}-{unit}-...``, so that units never share a file)."""

    def __init__(self, policy: OffloadPolicy, rank: int = 0, needed_bytes: int = 0, unit: str = "unit"):
        if policy.tier is None:
            raise ValueError("OffloadPolicy() offloads nothing: a tier needs CPUOffloadPolicy() or "
                             "DiskOffloadPolicy(directory)")
        self.policy = policy
        self.name = policy.tier
        self.pin = getattr(policy, "pin_memory", False) and torch.cuda.is_available()
        self.directory: Path | None = None
        self._files = 0
        if policy.tier == "disk":
            check_room(policy, needed_bytes)
            self.directory = Path(tempfile.mkdtemp(prefix=f"rank{rank}-{unit}-", dir=policy.directory))

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        if self.name == "host":
            return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        self._files += 1
        path = self.directory / f"t{self._files}.bin"
        try:
            m = torch.from_file(str(path), shared=True, size=t.numel(), dtype=t.dtype)
        except RuntimeError as e:
            self.cleanup()
            raise OffloadError(f"cannot create {path}: {e}") from None
        return m.view(t.shape)

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        out = self.empty_like(t)
        out.copy_(t)
        return out

    def zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        out = self.empty_like(t)
        out.zero_()
        return out

    def cleanup(self) -> None:
        if self.directory is not None and self.directory.exists():
            shutil.rmtree(self.directory, ignore_errors=True)


def state_bytes(numel: int) -> int:
    """What the tier holds for ``numel`` elements of shard: the fp32 shard, its gradient and
    Adam's two moments, 4 bytes each (the room a run and each unit ask for)."""
    return 16 * numel


def check_room(policy: OffloadPolicy, needed_bytes: int) -> None:
    """The disk tier's folder exists, is writable and has ``needed_bytes`` free — or a clear
    error before any file is written, so a failure leaves nothing half-made. (A memory-mapped
    file is sparse: a full disk would only show when a page is written, as a crash.) A
    strategy asks it once for the whole state before any unit is made; each unit asks again
    for its own part."""
    if policy.tier != "disk":
        return
    directory = Path(policy.directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OffloadError(f"offload directory {directory} cannot be created: {e}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OffloadError(f"offload directory {directory} is not writable")
    free = shutil.disk_usage(directory).free
    if needed_bytes > free:
        raise OffloadError(f"offload directory {directory} has {free / 2**20:.1f} MiB free; the "
                           f"offloaded state needs {needed_bytes / 2**20:.1f} MiB")


@dataclass
class TransferLog:
    """Bytes and seconds that crossed between the device and the tier, by direction."""
    bytes: dict = field(default_factory=lambda: {"h2d": 0, "d2h": 0})
    seconds: dict = field(default_factory=lambda: {"h2d": 0.0, "d2h": 0.0})

    def add(self, direction: str, nbytes: int, seconds: float, tracer=None, tag: str = "") -> None:
        self.bytes[direction] += nbytes
        self.seconds[direction] += seconds
        if tracer is not None:
            tracer.emit("transfer", t=tracer.now() - seconds, direction=direction, bytes=nbytes,
                        seconds=round(seconds, 7), tag=tag)


class OptimizerOffload:
    """Only the optimizer's side in a tier — ZeRO-Offload's choice (Ren et al., 2021), made
    by ``ShardedOptimizer(..., offload_policy=CPUOffloadPolicy())``. The parameter shards and
    their gradients stay on the device, where forward and backward use them; the tier holds a
    master copy of each shard, a gradient buffer beside it and the moments, and the step runs
    there. Per step, once (not per gather): every gradient shard goes out (d2h) and every
    updated shard comes back (h2d), 4 bytes an fp32 element each way. The device keeps
    parameters and gradients, 8 of the 16 bytes an element; the tier holds 16 (master 4,
    gradients 4, moments 8), as with everything offloaded. The device's shards and the master
    copies agree after every step; a checkpoint loaded into the shards is not copied to the
    master (an engine run does not offer this mode: the course measures it, chapter 08)."""

    def __init__(self, policy: OffloadPolicy, params: list[torch.Tensor], rank: int = 0, tracer=None):
        self.params = [p for p in params if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        self.tier = Tier(policy, rank, needed_bytes=state_bytes(numel), unit="optimizer")
        self.master = {p: self.tier.copy_of(p.detach()) for p in self.params}
        self.grads = {p: self.tier.zeros_like(p) for p in self.params}
        self.transfers, self.tracer = TransferLog(), tracer

    def account(self, ledger, where: str | None = None) -> None:
        """Enter the tier's master copies and gradient buffers in ``ledger`` (the moments are
        the optimizer's state: ``track_optimizer_state(..., device=tier)``)."""
        for i, p in enumerate(self.params):
            ledger.track("master", self.master[p], f"optimizer:master{i}", where or self.tier.name)
            ledger.track("grads", self.grads[p], f"optimizer:grad{i}", where or self.tier.name)

    @contextlib.contextmanager
    def stepping(self):
        """Around the wrapped optimizer's step: each gradient shard out to the tier, each
        parameter pointed at its master copy (with the tier's gradient) while the step runs
        there, then the updated copy back into the device's shard."""
        t0, moved, out = time.perf_counter(), [], 0
        for p in self.params:
            if p.grad is None:          # no gradient, no update (torch skips it too)
                continue
            self.grads[p].copy_(p.grad)
            out += p.grad.numel() * p.grad.element_size()
            moved.append((p, p.data, p.grad))
            p.grad = None
            p.data = self.master[p]
            p.grad = self.grads[p]
        self.transfers.add("d2h", out, time.perf_counter() - t0, self.tracer, "optimizer")
        try:
            yield
        finally:
            t0, back = time.perf_counter(), 0
            for p, data, grad in moved:
                p.grad = None
                p.data = data
                p.grad = grad
                data.copy_(self.master[p])
                back += data.numel() * data.element_size()
            self.transfers.add("h2d", back, time.perf_counter() - t0, self.tracer, "optimizer")

    def release(self) -> None:
        """Remove what a disk tier wrote (its folder of memory-mapped files)."""
        self.tier.cleanup()
