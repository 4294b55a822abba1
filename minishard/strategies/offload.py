"""Offload: keep the sharded training state off the device, and pay for it in transfers.

FSDP already cut the state to 16Ψ/N per rank. Offload moves what remains — the sharded fp32
parameters, their gradients and the optimizer state — to a slower, larger tier:

* ``host``: CPU memory (pinned when CUDA is present, so copies can run asynchronously);
* ``disk``: memory-mapped files, standing in for NVMe (DeepSpeed's ZeRO-Infinity idea).

They move together: the optimizer step runs where the state lives (``fsdp.ShardedOptimizer``
creates the moments in the tier), so parameters, gradients and moments must all be there — with
only the moments off the device, every step would bring them in and send them back. What must
still cross over each step:

    before each all-gather   the unit's parameter shard      tier -> device   (h2d)
    after each reduce-scatter the reduced gradient shard     device -> tier   (d2h)

so the *transfer* bytes per step are exactly: shard bytes x (number of unshards) in, and
gradient-shard bytes out. A capacity problem becomes a bandwidth problem: PCIe moves tens of
GB/s, HBM several TB/s. On a CPU-only machine "device" and "host" are the same RAM, so the
measured seconds are memcpy (and page-cache) times; the chapter labels them as such and models
PCIe separately.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

TIERS = ("host", "disk")


class OffloadError(RuntimeError):
    """The offload tier cannot hold the state (unwritable directory, not enough space)."""


@dataclass(frozen=True)
class OffloadPolicy:
    """Which tier the sharded state — parameters, gradients, optimizer moments, always
    together — lives in: what ``fully_shard(offload_policy=...)`` takes, as FSDP2's does
    (its ``CPUOffloadPolicy`` is ``OffloadPolicy("host")`` here). Each unit then makes its own
    :class:`Tier` from it. (Activations and gathered parameters are needed on the device at
    once: to save activation memory, recompute activations instead.)"""
    tier: str = "host"
    directory: str | None = None                 # for tier="disk"
    pin_memory: bool | None = None               # default: when CUDA is available

    def __post_init__(self):
        if self.tier not in TIERS:
            raise ValueError(f"unknown offload tier {self.tier!r}; expected one of {TIERS}")
        if self.tier == "disk" and not self.directory:
            raise ValueError("tier='disk' needs a directory for its memory-mapped files")


class Tier:
    """One unit's place in a tier: allocates its tensors there (for the disk tier, in a folder
    of its own, ``rank{r}-{unit}-...``, so that units never share a file)."""

    def __init__(self, policy: OffloadPolicy, rank: int = 0, needed_bytes: int = 0, unit: str = "unit"):
        self.policy = policy
        self.name = policy.tier
        self.pin = torch.cuda.is_available() if policy.pin_memory is None else policy.pin_memory
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
