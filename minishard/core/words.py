"""How a number of bytes and a dtype are written — one way, for every part that prints them.

The doctor, the viewers, the chapters and the checkpoints' metadata all stand on this; none of
them borrows another's helper (the doctor does not import a viewer to print a size). It imports
nothing, so that reading a dump or a trace needs no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def fmt_bytes(n: float) -> str:
    """Binary units, as the demo and the chapters print memory, three significant digits:
    ``870656 -> '850 KiB'`` — or the whole number where three would need an exponent
    (``1023 KiB``, ``5120 GiB``)."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if abs(v) >= 999.5 else f"{v:.3g} {unit}"
    return f"{int(n)} B"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32 -> 'float32'``: the name traces, dumps and checkpoints record."""
    return str(dtype).removeprefix("torch.")
