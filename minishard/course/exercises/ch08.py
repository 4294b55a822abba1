"""Chapter 08 exercise: what offload moves every step.

With the sharded state offloaded (``offload="host"``), a unit's parameter shard comes in from
host memory before each of its all-gathers (host → device), and its reduced gradient shard goes
out after each reduce-scatter (device → host). Blocks are gathered twice per step (forward and
backward), the root once (it stays gathered from forward to backward); every unit's gradients
are reduced once. Write the bytes that cross, per step and rank.

The check trains the nano model with FSDP on 2 and 3 real ranks with the state in host memory
and compares your figures with the transfer bytes the ranks measured in every step.
"""
from __future__ import annotations

import math

from . import attempt, call, expect, pools


def offload_bytes(block_shard: int, root_shard: int, n_blocks: int) -> tuple[int, int]:
    """``(host_to_device, device_to_host)`` bytes per step and rank; ``block_shard`` and
    ``root_shard``: the bytes of one block's and of the root's parameter shard on one rank."""
    raise NotImplementedError("offload_bytes: your code here")


def shard_bytes(world_size: int) -> tuple[int, int, int]:
    """(one block's shard, the root's shard, number of blocks) of the nano model in fp32,
    flat layout: each unit's parameters padded to N equal chunks."""
    from minishard.core.model import GPT

    net = GPT("nano", device="meta")
    block = sum(p.numel() for p in net.blocks[0].parameters())
    root = sum(p.numel() for n, p in net.named_parameters() if not n.startswith("blocks."))
    return (4 * math.ceil(block / world_size), 4 * math.ceil(root / world_size), len(net.blocks))


@attempt
def check_offload_bytes(fn=None, ranks=None) -> None:
    from minishard.training.loop import TrainConfig, train

    fn = fn or offload_bytes
    call(fn, *shard_bytes(2))                            # not written yet? say so before any rank
    with pools(ranks) as get:
        for n in (2, 3):
            block, root, L = shard_bytes(n)
            h2d, d2h = call(fn, block, root, L)
            out = get(n).run(train, TrainConfig(strategy="fsdp_flat", model="nano", micro_batch=1, steps=2, offload="host", track_activations=False))
            for o in out:
                seen = [(s["h2d_bytes"], s["d2h_bytes"]) for s in o["transfer"]]
                print(f"N={n} rank {o['rank']}: measured per step (in, out) {seen}; you: {(h2d, d2h)}")
                expect(all(s == (h2d, d2h) for s in seen),
                       f"N={n}: the ranks moved {seen[0]} bytes (in, out) per step, you predict "
                       f"{(h2d, d2h)} — count the gathers per unit and step (blocks: 2, root: 1) "
                       f"and the reduce-scatters (1 per unit)")
