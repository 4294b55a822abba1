"""How close two trainings ended: the one measure behind every parity claim of the course.

A strategy on N ranks must train like one process on the same global batch. "Like" needs a
tolerance, and the obvious one — the largest element-wise difference of the parameters — is
the wrong one for AdamW: Adam divides each update by sqrt(v), so where a gradient is nearly zero
the summation-order noise of another rank count, another CPU kernel or another reduction order
flips an update of size ~lr either way. A per-element bound loose enough for that is blind to
real bugs (a model that never trained moves each weight by only steps·lr).

So each tensor is compared with *how far the reference moved it*:

    ‖ours − ref‖ ≤ rtol · ‖ref − init‖ + atol · sqrt(numel)        for every parameter tensor

Noise stays near 1e-4 of the movement (AdamW, fp32, a few steps); a frozen model scores 1.0, a
model trained at the wrong learning rate or with a wrong gradient scale under SGD scores far
above 1e-2. ``atol`` (a root-mean-square floor) only matters for tensors the reference did not
move at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Params = dict[str, torch.Tensor]


def max_diff(a: Params, b: Params) -> float:
    """The largest element-wise |a − b| over all tensors (0.0 means bit-identical values)."""
    if a.keys() != b.keys():
        raise KeyError(f"different parameter names: {sorted(a.keys() ^ b.keys())[:4]} ...")
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def bitwise_equal(a: Params, b: Params) -> bool:
    """Every tensor holds the same bits."""
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@dataclass(frozen=True)
class Drift:
    """``ours`` against ``ref``, relative to how far ``ref`` moved from ``init``."""
    worst: float          # max over tensors of ‖ours − ref‖ / (‖ref − init‖ + atol·sqrt(numel))
    worst_tensor: str
    overall: float        # the same over the whole model at once: ‖ours − ref‖ / ‖ref − init‖
    max_abs: float        # largest element-wise |ours − ref|
    moved: float          # smallest ‖ref − init‖ / sqrt(numel) over the tensors that moved

    def within(self, rtol: float) -> bool:
        """Every tensor within ``rtol`` of its own movement (the strict check: one wrong
        tensor, e.g. a bucket skipped, fails it)."""
        return self.worst <= rtol


def drift(ours: Params, ref: Params, init: Params, atol: float = 1e-7) -> Drift:
    """How far ``ours`` is from ``ref``, per tensor and overall, as a fraction of ``ref``'s own
    movement. A tensor that barely moved is limited by the float resolution of its values
    (e.g. a layer norm's weight of 1.0 moved by 1e-5), so its ratio is noisier than the whole
    model's: ``overall`` is the steadier figure to compare two optimizers with."""
    if not (ours.keys() == ref.keys() == init.keys()):
        raise KeyError("ours, ref and init must name the same parameters")
    worst, worst_name, max_abs, moved = 0.0, "", 0.0, float("inf")
    gap2 = move2 = 0.0
    for name in ref:
        o, r, i = ours[name].float(), ref[name].float(), init[name].float()
        gap, scale = (o - r).norm().item(), (r - i).norm().item()
        gap2, move2 = gap2 + gap * gap, move2 + scale * scale
        if scale > 0:
            moved = min(moved, scale / r.numel() ** 0.5)
        rel = gap / (scale + atol * r.numel() ** 0.5)
        if rel > worst:
            worst, worst_name = rel, name
        max_abs = max(max_abs, (o - r).abs().max().item())
    overall = gap2 ** 0.5 / move2 ** 0.5 if move2 > 0 else (0.0 if gap2 == 0 else float("inf"))
    return Drift(worst, worst_name, overall, max_abs, moved)


def params_of(model: torch.nn.Module) -> Params:
    """A detached fp32 copy of a model's parameters, by name (e.g. the ``init`` of :func:`drift`)."""
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}
