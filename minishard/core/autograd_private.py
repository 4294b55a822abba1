"""The private autograd and tensor functions minishard's strategies lean on, in one place.

The same ones PyTorch's own DDP and FSDP2 use, for the same reasons; each is listed in
``PRIVATE`` with why no public API serves, and ``tests/test_private_torch.py`` resolves each on
the installed torch and fails naming the one that is gone. Checked on torch ``CHECKED_ON``.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map  # noqa: F401  (FSDP2's own flattening)

CHECKED_ON = ("2.13.0",)
PRIVATE = {
    "torch.autograd.Variable._execution_engine.queue_callback": "run a function once the "
        "backward pass ends, after every gradient hook (DDP's bucket flush, FSDP's last "
        "reduce-scatter); no public hook fires then",
    "torch._C._autograd._unsafe_set_version_counter": "an unsharded buffer refilled in place "
        "keeps the version autograd saved, so backward accepts the refilled parameters",
    "torch.autograd._unsafe_preserve_version_counter": "the same, around one in-place change",
    "torch._chunk_cat": "pack gradients rank-major in one kernel, as FSDP2's reduce-scatter does",
    "torch.utils._pytree.tree_flatten": "find the tensors in a module's inputs (FSDP2's hooks)",
    "torch.utils._pytree.tree_map": "cast them (mixed precision's inputs)",
    "torch._C._disabled_torch_function_impl": "a tensor subclass whose results are plain "
        "tensors (Tensor.__torch_function__, the public path, would wrap every result)",
    "torch._foreach_norm": "one of the norms a shard's gradient refuses (clip_grad_norm_ calls it)",
}


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the backward pass that is running ends."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def set_version_counter(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    torch._C._autograd._unsafe_set_version_counter(tensors, versions)


preserve_version_counter = torch.autograd._unsafe_preserve_version_counter
chunk_cat = torch._chunk_cat
disabled_torch_function_impl = torch._C._disabled_torch_function_impl
foreach_norm = torch._foreach_norm
