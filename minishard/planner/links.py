"""Which links a collective's bytes cross: inside a node, or across nodes.

A cluster's links are not equal: the ranks of one node talk over fast links (NVLink), nodes over a
slower network. Hybrid sharding and ``reshard_after_forward=k`` exist to keep collectives inside
a node, and the way to see that they do is to sort every byte a rank sends by the link it takes.

The model is the ring every byte count of minishard already uses (``comm.ring_wire_bytes``): the
members of a collective's group form a ring in rank order, and each member sends its wire bytes to
the next one. Ranks are numbered node by node (``node_size`` consecutive ranks per node), so a
byte crosses nodes exactly when a member and the next one sit on different nodes. On N ranks in
nodes of n, a collective over all N sends 1 byte in n across nodes (the last member of each node
sends to the next node); one over a node's n ranks sends none.
"""
from __future__ import annotations

from collections.abc import Iterable


def next_in_ring(rank: int, members: list[int]) -> int:
    """The rank ``rank`` sends to in a ring over ``members`` (in rank order)."""
    ring = sorted(members)
    return ring[(ring.index(rank) + 1) % len(ring)]


def link_bytes(events: Iterable[dict], node_size: int, world_size: int) -> dict[str, int]:
    """Wire bytes of the traced collectives, summed over every rank, by link: ``inside`` a node
    or ``across`` nodes. A collective's group is its ``members`` (every rank when the event names
    none: the world)."""
    if node_size < 1 or world_size % node_size:
        raise ValueError(f"nodes of {node_size} ranks do not divide {world_size} ranks")
    out = {"inside": 0, "across": 0}
    for ev in events:
        if ev.get("kind") != "collective" or not ev.get("wire"):
            continue
        members = ev.get("members") or list(range(world_size))
        to = next_in_ring(ev["rank"], members)
        out["inside" if ev["rank"] // node_size == to // node_size else "across"] += ev["wire"]
    return out
