"""Chapter 07 exercise: the prefetch schedule.

With prefetch depth d, when a unit starts computing, FSDP starts the all-gathers of the next d
units of the pass, so they travel while this one computes. Forward runs the root first (it owns
the embeddings), then the blocks in order; backward also starts with the root (it owns the head)
and runs the blocks in reverse. Write which units a unit prefetches.

The check trains the nano model on 2 real ranks with depth 0, 1, 2 and 3, reads from rank 0's
trace which all-gathers were in flight when each unit started computing, in the order they were
issued, and compares them with your schedule — order included: the unit needed next must be
gathered first.
"""
from __future__ import annotations

from . import attempt, call, expect, pools


def prefetch_targets(blocks: list[str], unit: str, depth: int, forward: bool) -> list[str]:
    """The units whose all-gathers ``unit`` starts when it begins computing, in order.
    ``blocks``: the block units in forward order (e.g. ["blocks.0", "blocks.1", "blocks.2"]);
    ``unit``: "root" or one of ``blocks``; ``forward``: the pass (False: backward)."""
    raise NotImplementedError("prefetch_targets: your code here")


@attempt
def check_prefetch_targets(fn=None, ranks=None) -> None:
    from minishard.course.ch07 import who_is_gathered
    from minishard.core.model import config
    from minishard.training.loop import TrainConfig, train

    fn = fn or prefetch_targets
    blocks = [f"blocks.{i}" for i in range(config("nano").n_layer)]
    call(fn, blocks, "root", 1, True)                    # not written yet? say so before any rank
    with pools(ranks) as get:
        for k in (0, 1, 2, 3):
            # (activations tracked: the trace then shows when each unit's compute begins)
            get(2).run(train, TrainConfig(strategy="fsdp_flat", model="nano", micro_batch=1, steps=2, prefetch=k))
            rows = who_is_gathered(get(2).last_events, rank=0, step=1)
            for r in rows:
                mine = list(call(fn, blocks, r["unit"], k, r["pass"] == "forward"))
                expect(sorted(mine) == sorted(r["in_flight"]),
                       f"depth {k}, {r['pass']}: when {r['unit']} started computing, the all-gathers "
                       f"in flight were {r['in_flight'] or 'none'}; your schedule prefetches "
                       f"{mine or 'none'}")
                expect(mine == r["in_flight"],
                       f"depth {k}, {r['pass']}: the right units in the wrong order — the trace "
                       f"issued {r['in_flight']}, you {mine}. Gather first the unit the pass "
                       f"reaches first (in backward, the blocks run in reverse)")
            line = "  ".join(f"{r['unit']}[{','.join(r['in_flight'])}]" for r in rows
                             if r["pass"] == "forward")
            print(f"depth {k}: matches the trace in forward and backward; forward: {line}")
