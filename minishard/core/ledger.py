"""The measured memory ledger: where a training step's bytes live, entry by entry.

Every tensor a strategy allocates is entered in a :class:`LiveLedger` by category (and freed
again); activations are counted as autograd saves them for backward. Every entry is an
``alloc``/``free`` event in the rank's trace. Its prediction, the analytic ledger (bytes per
rank from a parameter count, a world size, a strategy and a precision policy), is
``minishard/planner/analytic.py``: the two share these categories, and each chapter checks one against
the other.

Categories: ``params`` (working weights), ``grads``, ``main_grads`` (the optimizer's fp32 copy of
16-bit gradients, Megatron's "main grads"), ``master`` (fp32 master weights), ``exp_avg`` / ``exp_avg_sq`` (Adam
moments), ``momentum`` (SGD), ``activations``, ``unsharded`` (a unit's temporarily gathered
parameters), ``comm_buffers``.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from .trace import Tracer

CATEGORIES = ("params", "grads", "main_grads", "master", "exp_avg", "exp_avg_sq", "momentum",
              "activations", "unsharded", "comm_buffers")
STATE_CATEGORIES = ("params", "grads", "main_grads", "master", "exp_avg", "exp_avg_sq", "momentum")

# --------------------------------------------------------------------------- the live ledger

def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class DeviceOutOfMemory(MemoryError):
    """An allocation would take the device past the ledger's budget (a stand-in for CUDA's
    OOM on machines whose "device" is the CPU).

    What a real out-of-memory report tells you, as fields: the allocation that failed
    (``category``, ``tag``, ``nbytes``), the ``budget``, what the device ``held`` by category
    (bytes) and the total it ``would_be`` at. The message says the same in MiB."""

    def __init__(self, category: str, tag: str, nbytes: int, budget: int, held: dict[str, int],
                 would_be: int):
        self.category, self.tag, self.nbytes = category, tag, nbytes
        self.budget, self.held, self.would_be = budget, dict(held), would_be
        held_mib = ", ".join(f"{c} {b / 2**20:.1f}" for c, b in sorted(self.held.items()))
        super().__init__(
            f"allocating {nbytes / 2**20:.1f} MiB of {category} ({tag}) would take the device to "
            f"{would_be / 2**20:.1f} MiB, over its budget of {budget / 2**20:.1f} MiB; "
            f"held now (MiB): {held_mib}")

    def __reduce__(self):              # pickles with its fields (a rank may send it whole)
        return type(self), (self.category, self.tag, self.nbytes, self.budget, self.held,
                            self.would_be)


class LiveLedger:
    """Measured per-rank memory: strategies enter what they allocate and free, by category.

    ``alloc``/``free`` are keyed by a tag (unique while alive). ``track(category, tensor, tag)``
    enters a tensor's storage. ``activations()`` is a context manager that counts what autograd
    saves for backward (freed again when backward releases it). Peaks are kept overall and per
    phase, and every change is an event in the tracer.
    """

    def __init__(self, tracer: Tracer | None = None, device: str = "device",
                 budget: int | None = None):
        if budget is not None and budget <= 0:
            raise ValueError(f"a device memory budget must be positive, got {budget}")
        self.tracer = tracer
        self.device = device
        self.budget = budget
        self._live: dict[str, tuple[str, int, str]] = {}          # tag -> (category, bytes, device)
        self._by_cat: dict[tuple[str, str], int] = {}              # (category, device) -> bytes
        self.category_peaks: dict[tuple[str, str], int] = {}       # the most each ever held
        self._storages: dict[int, str] = {}                        # data_ptr -> tag (tracked tensors)
        self._tag_ptr: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self.peak_snapshot: dict[str, int] = {}
        self._phase_peaks: dict[str, int] = {}
        self._phase: str | None = None
        self._act_seq = 0

    # ---- entering bytes
    def alloc(self, category: str, nbytes: int, tag: str, device: str | None = None) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown ledger category {category!r}; expected one of {CATEGORIES}")
        if tag in self._live:
            raise KeyError(f"ledger tag {tag!r} is already live; free it first")
        device = device or self.device
        nbytes = int(nbytes)
        if self.budget is not None and device == self.device and self.total + nbytes > self.budget:
            raise DeviceOutOfMemory(category, tag, nbytes, self.budget, self.current(),
                                    self.total + nbytes)
        self._live[tag] = (category, nbytes, device)
        key = (category, device)
        self._by_cat[key] = self._by_cat.get(key, 0) + nbytes
        if self._by_cat[key] > self.category_peaks.get(key, 0):
            self.category_peaks[key] = self._by_cat[key]
        if device == self.device:
            self.total += nbytes
            if self.total > self.peak:
                self.peak = self.total
                self.peak_snapshot = self.current()
            if self._phase is not None:
                self._phase_peaks[self._phase] = max(self._phase_peaks.get(self._phase, 0), self.total)
        if self.tracer is not None:
            self.tracer.emit("alloc", category=category, bytes=nbytes, tag=tag, device=device)

    def free(self, tag: str) -> None:
        if tag not in self._live:
            raise KeyError(f"ledger tag {tag!r} is not live")
        category, nbytes, device = self._live.pop(tag)
        ptr = self._tag_ptr.pop(tag, None)
        if ptr is not None and self._storages.get(ptr) == tag:
            del self._storages[ptr]
        self._by_cat[(category, device)] -= nbytes
        if device == self.device:
            self.total -= nbytes
        if self.tracer is not None:
            self.tracer.emit("free", category=category, bytes=nbytes, tag=tag, device=device)

    def track(self, category: str, tensor: torch.Tensor, tag: str, device: str | None = None) -> None:
        """Enter a tensor's whole storage (what it really occupies, padding included); ``free``
        releases it. Tracked storages are never counted again as activations."""
        self.alloc(category, storage_nbytes(tensor), tag, device)
        ptr = tensor.untyped_storage().data_ptr()
        self._storages[ptr] = tag
        self._tag_ptr[tag] = ptr

    def track_parameters(self, module: torch.nn.Module, prefix: str = "param") -> None:
        """Enter every parameter of ``module`` as ``params``, tagged ``{prefix}:{name}``."""
        for name, p in module.named_parameters():
            self.track("params", p, f"{prefix}:{name}")

    def is_live(self, tag: str) -> bool:
        return tag in self._live

    # ---- reading
    def current(self, device: str | None = None) -> dict[str, int]:
        device = device or self.device
        return {c: b for (c, d), b in self._by_cat.items() if d == device and b}

    def by_device(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (c, d), b in self._by_cat.items():
            if b:
                out.setdefault(d, {})[c] = b
        return out

    @property
    def phase_peaks(self) -> dict[str, int]:
        return dict(self._phase_peaks)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute peaks to a phase (forward/backward/optimizer), and trace the phase."""
        prev, self._phase = self._phase, name
        self._phase_peaks[name] = max(self._phase_peaks.get(name, 0), self.total)
        ctx = self.tracer.phase(name) if self.tracer is not None else contextlib.nullcontext()
        try:
            with ctx:
                yield
        finally:
            self._phase = prev

    # ---- activations, measured as autograd saves them
    @contextlib.contextmanager
    def activations(self) -> Iterator[None]:
        """Count every tensor autograd saves for backward (once per storage) as ``activations``.

        Storages already in the ledger (parameters, gathered units) are not activations and are
        skipped. The bytes are freed when autograd releases the saved tensor after its backward.
        Not seen: what activation checkpointing recomputes during backward (one block at a time)
        lives in ``torch.utils.checkpoint``'s own storage, outside these hooks.
        """
        ledger = self
        refs: dict[int, list] = {}      # storage ptr -> [count, tag]

        def release(ptr: int) -> None:
            entry = refs.get(ptr)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del refs[ptr]
                ledger.free(entry[1])

        def pack(t: torch.Tensor):
            if t.device.type == "meta":
                return t
            ptr = t.untyped_storage().data_ptr()
            if ptr in ledger._storages or ptr == 0:
                return t
            if ptr in refs:
                refs[ptr][0] += 1
            else:
                ledger._act_seq += 1
                tag = f"act{ledger._act_seq}"
                refs[ptr] = [1, tag]
                ledger.alloc("activations", storage_nbytes(t), tag)
            box = _Saved(t)
            weakref.finalize(box, release, ptr)
            return box

        def unpack(obj):
            return obj.t if isinstance(obj, _Saved) else obj

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


class _Saved:
    """A saved-for-backward tensor; when autograd drops it, the ledger frees its bytes."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


OPTIMIZER_STATE_CATEGORY = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                            "momentum_buffer": "momentum"}


def track_optimizer_state(ledger: LiveLedger, optimizer: torch.optim.Optimizer,
                          module: torch.nn.Module | None = None, prefix: str = "",
                          device: str | None = None) -> None:
    """Enter a torch optimizer's state tensors (created lazily at its first step) by category.

    Idempotent: only states not yet in the ledger are added. The per-parameter ``step``
    counters (one scalar each) are not model-sized state and are left out.
    """
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    # unnamed, a parameter is its place among all groups': per group, the second group's i-th
    # would take the first's tag and be skipped as already live
    every = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(every):
        for key, value in optimizer.state.get(p, {}).items():
            cat = OPTIMIZER_STATE_CATEGORY.get(key)
            if cat is None or not torch.is_tensor(value):
                continue
            tag = f"{prefix}{key}:{names.get(id(p), i)}"
            if not ledger.is_live(tag):
                ledger.track(cat, value, tag, device)


def check_cuda(ledger: LiveLedger, tolerance: float = 0.02) -> tuple[int, int]:
    """On CUDA: the live ledger's device total against ``torch.cuda.memory_allocated``."""
    if not torch.cuda.is_available():
        raise RuntimeError("check_cuda needs a CUDA device; on CPU the ledger is the only count")
    allocated = torch.cuda.memory_allocated()
    if abs(allocated - ledger.total) > tolerance * max(allocated, 1):
        raise AssertionError(f"ledger says {ledger.total} bytes, CUDA allocator {allocated}")
    return ledger.total, allocated
