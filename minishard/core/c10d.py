"""The private c10d — PyTorch's process groups — minishard leans on, in one place.

Every name here that is not PyTorch's public API is listed in ``PRIVATE`` with why no public one
serves; ``tests/test_private_torch.py`` resolves each on the installed torch and fails naming the
one that is gone. Checked on torch ``CHECKED_ON``. What public API does the job is used instead:
``dist.group.WORLD`` is the default group, ``ProcessGroup.set_timeout`` sets its collective timeout.

It also holds the one thing ``import minishard`` does to torch: resetting the default arguments
that captured a process group (:func:`release_captured_groups`), without which a rank's exit is not
clean (see :func:`init_group`; ``tests/test_clean_exit.py``).
"""
from __future__ import annotations

import importlib
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist

CHECKED_ON = ("2.13.0",)
DYNAMO = "torch._dynamo"
PRIVATE = {
    "torch._dynamo": "a private module, imported before the first group (init_group): the first "
                     "optimizer imports it, and with it a module that captures the live group",
    "torch.distributed.ProcessGroup._get_backend": "a group's backend, whose options hold its "
                     "collective timeout: no public getter of a group's timeout exists",
    "torch._C._distributed_c10d.ProcessGroupGloo._Options._timeout": "that timeout, on gloo",
    "torch._C._distributed_c10d._dump_fr_trace": "PyTorch's own flight recorder as bytes: NCCL "
                     "writes it on a timeout by itself; on gloo no public call writes it",
}


def init_group(backend: str, **kwargs) -> None:
    """``dist.init_process_group``, so that ``dist.destroy_process_group`` really ends the group.

    Destroying a group frees it only if nothing else holds it; while something does, gloo's
    worker threads live on, and when the interpreter shuts down a worker still releasing the
    tensors of the last collectives aborts the process ("terminate called without an active
    exception", exit code -6: 1 to 13 ``torchrun`` runs in 100 of a 2-rank DDP script). What
    holds it is the default arguments of ``torch.distributed.nn.functional`` (``all_reduce(...,
    group=group.WORLD)`` and nine more): evaluated once, at import, they are ``None`` before any
    group exists and the live group after. torch.optim imports ``torch._dynamo``, which imports
    that module, the first time an optimizer is built — usually after the group exists.
    ``import minishard`` therefore imports the module up front and resets defaults already
    captured (:func:`release_captured_groups`), whoever makes the group and whether minishard is
    imported before or after it; here ``torch._dynamo`` is also imported before the group, so
    that the first optimizer does not pay for it mid-run. ``tests/test_clean_exit.py`` checks the
    exit codes; ``tests/test_engine_apart.py`` that no thread outlives the group."""
    importlib.import_module(DYNAMO)
    release_captured_groups()
    dist.init_process_group(backend, **kwargs)


# torch's Python modules that declare ``group=group.WORLD`` (or ``dist.group.WORLD``) defaults;
# torch.distributed.distributed_c10d has some too, but it is imported with torch.distributed,
# before any group can exist
GROUP_DEFAULT_MODULES = ("torch.distributed.nn.functional",
                         "torch.distributed.optim.zero_redundancy_optimizer",
                         "torch.distributed.fsdp.sharded_grad_scaler")


def release_captured_groups() -> int:
    """Reset to ``None`` the process groups that torch's modules captured as default arguments
    (the modules in ``GROUP_DEFAULT_MODULES`` that are imported); return how many functions
    changed.

    ``def f(..., group=group.WORLD)`` stores the default group *of the moment the module is
    imported*; a module imported while a group exists (``torch.distributed.nn.functional``, via
    the first optimizer's import of ``torch._dynamo``) keeps that group alive after
    ``destroy_process_group`` (see :func:`init_group`). ``None`` is what those defaults are when
    the module is imported before any group, and every such function hands its ``group`` to a
    ``torch.distributed`` call that reads ``None`` as "the default group": nothing changes but
    the lifetime of the group. ``import minishard`` calls it once, having imported
    ``torch.distributed.nn`` (a few ms), so that a later import captures nothing; one of the other
    modules imported later, while a group exists, is not covered: call it again then."""
    if not dist.is_available():
        return 0
    importlib.import_module("torch.distributed.nn.functional")
    changed = 0
    for name in GROUP_DEFAULT_MODULES:
        module = sys.modules.get(name)
        for obj in list(vars(module).values()) if module is not None else ():
            if issubclass(type(obj), type) and obj.__module__ == name:     # a class: its methods
                changed += sum(_reset_group_defaults(getattr(m, "__func__", m))
                               for m in list(vars(obj).values()))
            else:
                changed += _reset_group_defaults(obj)
    return changed


def _reset_group_defaults(fn) -> int:
    """1 if ``fn`` (or a function it decorates) had a process group as a default, now ``None``."""
    changed = 0
    for _ in range(8):                                  # through decorators, to the function
        if type(fn) is not types.FunctionType:
            break
        pg = dist.ProcessGroup
        defaults, kwdefaults = fn.__defaults__ or (), fn.__kwdefaults__ or {}
        if any(isinstance(v, pg) for v in (*defaults, *kwdefaults.values())):
            if defaults:
                fn.__defaults__ = tuple(None if isinstance(v, pg) else v for v in defaults)
            if kwdefaults:
                fn.__kwdefaults__ = {k: None if isinstance(v, pg) else v
                                     for k, v in kwdefaults.items()}
            changed = 1
        fn = getattr(fn, "__wrapped__", None)
    return changed


def group_timeout(group) -> timedelta | None:
    """The collective timeout of ``group`` (the default group if None) on gloo, else None (the
    backend's default): groups split from it wait as long as it does."""
    group = group or dist.group.WORLD
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (RuntimeError, AttributeError):
        return None


def dump_flight_recorder() -> bytes:
    """c10d's own flight recorder of this process, as the pickle it writes for NCCL."""
    from torch._C import _distributed_c10d
    return _distributed_c10d._dump_fr_trace()
