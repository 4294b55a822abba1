"""ZeRO++'s quantized collectives: weights gathered and gradients reduced in int8.

ZeRO-3 moves 3·Ψ parameters' worth of bytes per step; ZeRO++ (DeepSpeed) cuts the bytes by
sending fewer bits, and pays in rounding:

* **qwZ** — the all-gather of weights in int8: each rank cuts what it sends into blocks of
  ``block`` elements, sends one fp32 scale per block (the block's largest magnitude / 127) and
  each element as the nearest int8 multiple of it; every rank dequantizes what arrives. Every
  rank, its own block included, computes with the dequantized values, so the ranks' full
  parameters stay identical.
* **qgZ** — the gradient reduction through an all-to-all in int8: each rank quantizes the slice
  meant for every rank, the slices cross once (an all-to-all: each rank sends (N − 1)/N of its
  buffer, as a reduce-scatter does), and each rank dequantizes the N contributions to its slice
  and sums them in fp32, in rank order. (DeepSpeed's qgZ does this in two hops, inside the node
  then across, with int4 across; one hop here.)

What goes on the wire per rank's part of n elements: 4·⌈n/block⌉ scale bytes and n int8 bytes
(rounded up to whole 4 bytes) — about 1/4 of fp32 and 1/2 of bf16. hpZ, ZeRO++'s third part — a
secondary copy of the weights inside the node, so that backward gathers there — is
``fully_shard(reshard_after_forward=k)``.
"""
from __future__ import annotations

import math

import torch

BLOCK = 256          # elements per scale: DeepSpeed's default quantization group is of this order


def packed_bytes(n: int, block: int) -> int:
    """Bytes of ``n`` elements quantized: one fp32 scale per block, then one int8 each (rounded
    up to whole 4 bytes, so that the next rank's scales stay aligned)."""
    return 4 * math.ceil(n / block) + 4 * math.ceil(n / 4)


def pack(x: torch.Tensor, block: int, into: torch.Tensor) -> None:
    """``x`` (any float dtype, 1-D) as fp32 block scales, then int8 values, in ``into`` (uint8,
    ``packed_bytes`` long, starting 4-byte aligned)."""
    n = x.numel()
    blocks = math.ceil(n / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    rows = padded.view(blocks, block)
    scale = rows.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))        # an all-zero block
    q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    into[:4 * blocks].copy_(scale.view(torch.uint8))
    into[4 * blocks:4 * blocks + n].copy_(q.view(-1)[:n].view(torch.uint8))


def unpack(buf: torch.Tensor, n: int, block: int, out: torch.Tensor) -> None:
    """The ``n`` values ``pack`` wrote into ``buf``, dequantized into ``out`` (its dtype)."""
    blocks = math.ceil(n / block)
    scale = buf[:4 * blocks].view(torch.float32)
    full = torch.zeros(blocks * block, dtype=torch.float32, device=buf.device)
    full[:n] = buf[4 * blocks:4 * blocks + n].view(torch.int8).to(torch.float32)
    out.view(-1).copy_((full.view(blocks, block) * scale[:, None]).view(-1)[:n])


def all_gather(comm, output: torch.Tensor, input: torch.Tensor, block: int, async_op: bool, tag: str):
    """qwZ: ``output`` (N × n, any float dtype) receives every rank's ``input`` dequantized."""
    N, n = comm.world_size, input.numel()
    per = packed_bytes(n, block)
    wire = torch.empty(N * per, dtype=torch.uint8, device=input.device)
    mine = wire.view(N, per)[comm.rank]
    pack(input, block, mine)
    release = _held(comm, wire, tag)

    def after():
        for q, row in enumerate(wire.view(N, per)):
            unpack(row, n, block, output.view(N, n)[q])
        release()
    work = comm.all_gather(wire, mine, async_op=True, tag=tag).then(after)
    return work if async_op else work.wait()


def reduce_scatter(comm, output: torch.Tensor, input: torch.Tensor, block: int, async_op: bool, tag: str):
    """qgZ: ``output`` receives slice ``rank`` of the sum over ranks of ``input`` (N slices),
    each contribution quantized on its way."""
    N, n = comm.world_size, output.numel()
    per = packed_bytes(n, block)
    send = torch.empty(N, per, dtype=torch.uint8, device=input.device)
    for q, chunk in enumerate(input.view(N, n)):
        pack(chunk, block, send[q])
    recv = torch.empty_like(send)
    release = _held(comm, send, tag, also=recv)

    def after():
        acc = torch.zeros(n, dtype=torch.float32, device=output.device)
        part = torch.empty(n, dtype=torch.float32, device=output.device)
        for row in recv:                             # in rank order, on every rank
            unpack(row, n, block, part)
            acc += part
        output.view(-1).copy_(acc)
        release()
    work = comm.all_to_all(recv.view(-1), send.view(-1), async_op=True, tag=tag).then(after)
    return work if async_op else work.wait()


def _held(comm, t: torch.Tensor, tag: str, also: torch.Tensor | None = None):
    """Enter the packed buffers in the ledger as ``comm_buffers``; returns their release."""
    if comm.ledger is None:
        return lambda: None
    name = f"quantized:{tag}:{id(t)}"
    nbytes = sum(x.numel() * x.element_size() for x in (t, also) if x is not None)
    comm.ledger.alloc("comm_buffers", nbytes, name)
    return lambda: comm.ledger.free(name)
