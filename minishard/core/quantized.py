"""ZeRO++'s quantized collectives: weights gathered and gradients reduced in int8 or int4.

ZeRO-3 moves 3·Ψ parameters' worth of bytes per step; ZeRO++ (DeepSpeed) cuts the bytes by
sending fewer bits, and pays in rounding:

* **qwZ** — the all-gather of weights quantized: each rank cuts what it sends into blocks of
  ``block`` elements, sends one fp32 scale per block (the block's largest magnitude / 127 in
  int8, / 7 in int4) and each element as the nearest integer multiple of it; every rank
  dequantizes what arrives. Every rank, its own block included, computes with the dequantized
  values, so the ranks' full parameters stay identical.
* **qgZ** — the gradient reduction through an all-to-all: each rank quantizes the chunk meant
  for every rank, the chunks cross once (an all-to-all: each rank sends (N − 1)/N of its
  buffer, as a reduce-scatter does), and each rank dequantizes the N contributions to its chunk
  and sums them in fp32, in rank order. (DeepSpeed's qgZ does this in two hops, int8 inside the
  node then int4 across; one hop here, in the bits asked for.)

What goes on the wire per rank's part of n elements: 4·⌈n/block⌉ scale bytes and n·bits/8
value bytes (rounded up to whole 4 bytes, so that the next rank's scales stay aligned): int8
is about 1/4 of fp32 and 1/2 of bf16, int4 half that again. An int4 element is one of 15
levels, so its rounding is 127/7 ≈ 18 times int8's. hpZ, ZeRO++'s third part — a secondary
copy of the weights inside the node, so that backward gathers there — is
``fully_shard(reshard_after_forward=k)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 256          # elements per scale: DeepSpeed's default quantization group is of this order


@dataclass(frozen=True)
class Scheme:
    """How a collective's payload is quantized: ``bits`` per element (8 or 4), one fp32 scale per
    ``block`` elements."""
    bits: int = 8
    block: int = BLOCK

    def __post_init__(self):
        if self.bits not in (8, 4):
            raise ValueError(f"quantized collectives send 8 or 4 bits an element, not {self.bits!r}")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"a quantization block is an even number of elements, not {self.block!r}")

    @property
    def levels(self) -> int:
        """The largest magnitude an element takes: 127 (int8) or 7 (int4)."""
        return 2 ** (self.bits - 1) - 1


def scheme_of(value, what: str) -> Scheme | None:
    """``quantized_weights`` / ``quantized_gradients`` as a Scheme: False → none, True or 8 →
    int8, 4 → int4."""
    if value is False or value is None:
        return None
    if value is True or (type(value) is int and value in (8, 4)):
        return Scheme(8 if value is True else value)
    if type(value) is int:
        raise ValueError(f"{what}={value}: ZeRO++ quantizes to 8 or 4 bits an element, not {value}; "
                         f"use True or 8 (int8), or 4 (int4); False sends full precision")
    raise ValueError(f"{what}={value!r}: the bits an element, the int 8 or 4 (True: 8), not a "
                     f"{type(value).__name__}; False sends full precision")


def packed_bytes(n: int, scheme: Scheme) -> int:
    """Bytes of ``n`` elements quantized: one fp32 scale per block, then the values (rounded up
    to whole 4 bytes, so that the next rank's scales stay aligned)."""
    return 4 * math.ceil(n / scheme.block) + 4 * math.ceil(n * scheme.bits / 32)


def pack(x: torch.Tensor, scheme: Scheme, into: torch.Tensor) -> None:
    """``x`` (any float dtype, 1-D) as fp32 block scales, then the values — int8, or int4 two to
    a byte (the even element in the low half) — in ``into`` (uint8, ``packed_bytes`` long,
    starting 4-byte aligned)."""
    n, block, levels = x.numel(), scheme.block, scheme.levels
    blocks = math.ceil(n / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    rows = padded.view(blocks, block)
    scale = rows.abs().amax(dim=1) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))        # an all-zero block
    q = torch.round(rows / scale[:, None]).clamp_(-levels, levels).view(-1)
    into[:4 * blocks].copy_(scale.view(torch.uint8))
    if scheme.bits == 8:
        into[4 * blocks:4 * blocks + n].copy_(q[:n].to(torch.int8).view(torch.uint8))
        return
    nibbles = (q + 8).to(torch.uint8).view(-1, 2)                        # 1..15, two a byte
    into[4 * blocks:4 * blocks + (n + 1) // 2].copy_((nibbles[:, 0] | (nibbles[:, 1] << 4))[:(n + 1) // 2])


@torch.no_grad()
def unpack(buf: torch.Tensor, n: int, scheme: Scheme, out: torch.Tensor) -> None:
    """The ``n`` values ``pack`` wrote into ``buf``, dequantized into ``out`` (its dtype) — as
    data, outside autograd, as every collective writes its output: the flat layout gathers in
    place into its flat parameter, a leaf that requires grad."""
    block = scheme.block
    blocks = math.ceil(n / block)
    scale = buf[:4 * blocks].view(torch.float32)
    full = torch.zeros(blocks * block, dtype=torch.float32, device=buf.device)
    if scheme.bits == 8:
        full[:n] = buf[4 * blocks:4 * blocks + n].view(torch.int8).to(torch.float32)
    else:
        packed = buf[4 * blocks:4 * blocks + (n + 1) // 2]
        pairs = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:n]
        full[:n] = pairs.to(torch.float32) - 8
    out.view(-1).copy_((full.view(blocks, block) * scale[:, None]).view(-1)[:n])


def all_gather(comm, output: torch.Tensor, input: torch.Tensor, scheme: Scheme, async_op: bool, tag: str):
    """qwZ: ``output`` (N × n, any float dtype) receives every rank's ``input`` dequantized."""
    N, n = comm.world_size, input.numel()
    per = packed_bytes(n, scheme)
    wire = torch.empty(N * per, dtype=torch.uint8, device=input.device)
    mine = wire.view(N, per)[comm.rank]
    pack(input, scheme, mine)
    release = _held(comm, wire, tag)

    def after():
        for q, row in enumerate(wire.view(N, per)):
            unpack(row, n, scheme, output.view(N, n)[q])
        release()
    work = comm.all_gather(wire, mine, async_op=True, tag=tag).then(after)
    return work if async_op else work.wait()


def reduce_scatter(comm, output: torch.Tensor, input: torch.Tensor, scheme: Scheme, async_op: bool,
                   tag: str):
    """qgZ: ``output`` receives chunk ``rank`` of the sum over ranks of ``input`` (N chunks),
    each contribution quantized on its way."""
    N, n = comm.world_size, output.numel()
    per = packed_bytes(n, scheme)
    send = torch.empty(N, per, dtype=torch.uint8, device=input.device)
    for q, chunk in enumerate(input.view(N, n)):
        pack(chunk, scheme, send[q])
    recv = torch.empty_like(send)
    release = _held(comm, send, tag, also=recv)

    def after():
        acc = torch.zeros(n, dtype=torch.float32, device=output.device)
        part = torch.empty(n, dtype=torch.float32, device=output.device)
        for row in recv:                             # in rank order, on every rank
            unpack(row, n, scheme, part)
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
