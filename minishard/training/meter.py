"""``Meter``: what a training run measures, step by step, in one place.

Around each optimizer step it reads the counters the run's pieces keep — bytes every
communicator recorded (payload and wire), bytes the operating system saw this process write
(``/proc/self/io``), collective calls, the seconds compute waited on FSDP's collectives
(*exposed* communication), the offload tier's transfers and the page faults this process took
(minor faults: first touches of freshly mapped memory — on a CPU, the cost of a buffer the
allocator handed back to the OS and maps again) — and keeps the per-step differences.
"""
from __future__ import annotations

import contextlib
import resource
import time
from typing import Iterator

from minishard.core.comm import bytes_written


class Meter:
    def __init__(self, comms, units=()):
        self.comms, self.units = tuple(comms), list(units)
        for c in self.comms:
            c.reset_counters()                  # count training traffic, not the set-up
        self.steps: dict[str, list] = {k: [] for k in ("losses", "step_times", "wire", "payload",
                                                        "wchar", "calls", "exposed_comm", "transfer",
                                                        "page_faults")}

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Measure one optimizer step (put its loss in with :meth:`loss`)."""
        w0, c0, e0, x0 = bytes_written(), self._totals(), self._exposed(), self._transfers()
        f0 = _minor_faults()
        t0 = time.perf_counter()
        yield
        self.steps["step_times"].append(time.perf_counter() - t0)
        self.steps["page_faults"].append(_minor_faults() - f0)
        w1, c1, x1 = bytes_written(), self._totals(), self._transfers()
        self.steps["wchar"].append(None if w0 is None else w1 - w0)
        for k in ("wire", "payload", "calls"):
            self.steps[k].append(c1[k] - c0[k])
        self.steps["exposed_comm"].append(self._exposed() - e0)
        self.steps["transfer"].append({k: x1[k] - x0[k] for k in x1})

    def loss(self, value: float) -> None:
        self.steps["losses"].append(value)

    def by_op(self) -> dict[str, dict[str, int]]:
        """Bytes and calls per collective over the whole run, every group's communicator summed."""
        out: dict[str, dict[str, int]] = {}
        for c in self.comms:
            for op, v in c.by_op.items():
                acc = out.setdefault(op, {"payload": 0, "wire": 0, "calls": 0})
                for k in acc:
                    acc[k] += v[k]
        return out

    # ---- the counters
    def _totals(self) -> dict[str, int]:
        return {k: sum(c.totals[k] for c in self.comms) for k in ("payload", "wire", "calls")}

    def _exposed(self) -> float:
        return sum(u.exposed_s for u in self.units)

    def _transfers(self) -> dict:
        """Offload traffic so far, summed over units: bytes and seconds each way."""
        out = {"h2d_bytes": 0, "d2h_bytes": 0, "h2d_s": 0.0, "d2h_s": 0.0}
        for u in self.units:
            for d in ("h2d", "d2h"):
                out[f"{d}_bytes"] += u.transfers.bytes[d]
                out[f"{d}_s"] += u.transfers.seconds[d]
        return out


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
