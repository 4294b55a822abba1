"""Rank tasks for ``test_zeropp.py``."""
import hashlib


def gathered_weights_digest(rank):
    """A block sharded with qwZ, unsharded by hand: the digest of the full parameters this rank
    computes with (every rank must hold the same ones, its own part dequantized too)."""
    from minishard import fsdp
    from minishard.comm import Comm
    from minishard.model import GPT
    block = GPT("nano", seed=0).blocks[0]
    fsdp.fully_shard(block, comm=Comm(rank.tracer), manual=True, quantized_weights=True)
    unit = block._fsdp_unit
    unit.unshard()
    h = hashlib.sha256()
    for t in unit.layout.full_values():
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
