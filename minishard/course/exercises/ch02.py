"""Chapter 02 exercise: the ring's bytes on the wire.

A ring collective on N ranks cuts a buffer of S bytes into N chunks and runs rounds in which
every rank sends one chunk to its neighbour. Write how many bytes *one rank* sends for each
collective. The check compares your formula with minishard's (``ring_wire_bytes``), then with
the operating system's count of the bytes each DDP rank process really wrote during one
training step on 2 and on 3 ranks.
"""
from __future__ import annotations

from . import attempt, call, expect, pools

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def ring_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for ``op`` ("all_reduce", "reduce_scatter" or "all_gather") on a
    buffer of ``nbytes`` bytes over ``world_size`` ranks, with the ring algorithm (round down
    to whole bytes)."""
    raise NotImplementedError("ring_bytes: your code here")


@attempt
def check_ring_bytes(fn=None, ranks=None) -> None:
    from minishard import GPT, ring_wire_bytes
    from minishard.training.loop import TrainConfig, train

    fn = fn or ring_bytes
    for op in OPS:
        for n in (1, 2, 3, 4, 8, 64):
            for nbytes in (0, 1000, 4 * 217_664, 2**30):
                got, want = call(fn, op, nbytes, n), ring_wire_bytes(op, nbytes, n)
                expect(abs(got - want) <= 1, f"{op}, {nbytes:,} bytes on {n} ranks: you say "
                       f"{got:,}, the ring sends {want:,}")
    print("formula: agrees with minishard.ring_wire_bytes for all-reduce, reduce-scatter, all-gather")
    psi = 4 * GPT("nano", device="meta").num_params()          # fp32 gradient bytes
    with pools(ranks) as get:
        for n in (2, 3):
            out = get(n).run(train, TrainConfig(strategy="ddp", steps=1, model="nano", micro_batch=1, track_activations=False))
            predicted = call(fn, "all_reduce", psi, n)
            for o in out:
                os_count = o["wchar"][0]
                print(f"N={n} rank {o['rank']}: the OS counted {os_count:,} bytes written in the "
                      f"step; you predict {predicted:,} for the gradient all-reduce")
                expect(0 <= os_count - predicted < 16 * 1024,
                       f"N={n}: the process wrote {os_count:,} bytes, your all-reduce formula says "
                       f"{predicted:,} (gloo adds a few KB of headers, never less than the data)")
