"""Rank tasks for ``test_zeropp.py``."""
import hashlib


def gathered_weights_digest(rank):
    """A block sharded with qwZ, unsharded by hand: the digest of the full parameters this rank
    computes with (every rank must hold the same ones, its own part dequantized too)."""
    from minishard.strategies import fsdp
    from minishard.core.comm import Comm
    from minishard.core.model import GPT
    block = GPT("nano", seed=0).blocks[0]
    fsdp.fully_shard(block, comm=Comm(rank.tracer), manual=True, quantized_weights=True)
    unit = block._fsdp_unit
    unit.unshard()
    h = hashlib.sha256()
    for t in unit.layout.full_values():
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def quantized_reduce_scatter(rank, dtype_name: str) -> dict:
    """qgZ by hand on known inputs (every rank can make every rank's): the output must be, bit for
    bit, the fp32 sum over ranks — its own included — of each contribution quantized and
    dequantized, cast to the output's dtype once; and the ledger must hold the send and the
    receive buffers while it runs."""
    import torch
    from minishard.core import quantized
    from minishard.core.comm import Comm
    from minishard.core.ledger import LiveLedger
    N, n, scheme = rank.world_size, 700, quantized.Scheme(4)
    dtype = getattr(torch, dtype_name)
    inputs = [torch.randn(N * n, generator=torch.Generator().manual_seed(q)).to(dtype) for q in range(N)]
    ledger = LiveLedger()
    comm = Comm(rank.tracer, ledger=ledger)
    out = torch.empty(n, dtype=dtype)
    quantized.reduce_scatter(comm, out, inputs[rank.rank], scheme, async_op=False, tag="t")
    want = torch.zeros(n)
    buf = torch.empty(quantized.packed_bytes(n, scheme), dtype=torch.uint8)
    for x in inputs:
        quantized.pack(x.view(N, n)[rank.rank], scheme, buf)
        quantized.unpack(buf, n, scheme, part := torch.empty(n))
        want += part
    return {"exact": torch.equal(out, want.to(dtype)),
            "held": ledger.category_peaks.get(("comm_buffers", "device")),
            "want_held": 2 * N * quantized.packed_bytes(n, scheme),
            "left": ledger.current().get("comm_buffers", 0)}
