"""Chapter 00 exercise: predict what every rank of ``hello`` reports, then run it.

``minishard.course.ch00.hello`` has every rank fill a buffer of ``payload_mb`` MiB (fp32) with the
value ``rank + 1`` and all-reduce it. Write down, before running anything, what each rank will
see and how many bytes each will send — the ring all-reduce sends 2(N−1)/N of the buffer.
The check runs ``hello`` on 2 and on 3 real ranks and compares.
"""
from __future__ import annotations

from . import attempt, call, expect, pools


def predict_hello(world_size: int, payload_mb: float) -> tuple[float, int]:
    """Return ``(value, wire)``: the value every rank holds after ``hello``'s all-reduce, and the
    bytes each rank sends for it (whole bytes, rounded down)."""
    raise NotImplementedError("predict_hello: your code here")


@attempt
def check_predict_hello(fn=None, ranks=None, payload_mb: float = 1.0) -> None:
    """Run ``hello`` on 2 and 3 ranks (``ranks``: a warm pool, or a dict of them, to reuse) and
    compare each rank's report with ``fn(world_size, payload_mb)``."""
    from minishard.course.ch00 import hello

    fn = fn or predict_hello
    for n in (1, 2, 3):                                  # cheap first: no ranks needed for N=1
        value, wire = call(fn, n, payload_mb)
        expect(isinstance(wire, int), f"wire must be a whole number of bytes, got {wire!r}")
        if n == 1:
            expect(wire == 0, f"one rank sends nothing to anyone; you predict {wire} bytes")
    with pools(ranks) as get:
        for n in (2, 3):
            value, wire = call(fn, n, payload_mb)
            out = get(n).run(hello, payload_mb=payload_mb)
            for r in out:
                print(f"N={n} rank {r['rank']}: value {r['value']:g} (you: {value:g}), "
                      f"sent {r['wire']:,} bytes (you: {wire:,})")
                expect(r["value"] == value, f"N={n}: the ranks hold {r['value']:g}, you predicted "
                       f"{value:g}. Every rank contributes rank+1; the all-reduce sums them.")
                expect(r["wire"] == wire, f"N={n}: each rank sent {r['wire']:,} bytes, you predicted "
                       f"{wire:,}. The buffer is payload_mb MiB = payload_mb * 2**20 bytes; a ring "
                       f"all-reduce sends 2(N-1)/N of it.")
