"""What the watch's session and its recorders (``calls``, ``ddp``, ``fsdp2``) share: the error a
watch raises, and a tensor's dtype and bytes as the trace writes them. (Kept apart from the
session, which imports the recorders, so that none of them imports it back.)"""
from __future__ import annotations

import torch

from minishard.core.words import dtype_name


class WatchError(RuntimeError):
    """``watch`` cannot watch this job (unsupported wrapper, no process group, no trace file)."""


def _dtype(t: torch.Tensor) -> str:
    return dtype_name(t.dtype)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
