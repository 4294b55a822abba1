"""A fingerprint (``health.fingerprint``: what the doctor compares across ranks) is a function of
a tensor's dtype, shape and elements — never of its layout. Drawn (``hypothesis``): tensors of
0 to 4 dimensions (0-element and 0-d ones included) in every dtype a parameter may have, each
also held non-contiguously — dimensions permuted in memory (a transposed weight; a size-1
dimension with a stride that is not 1), sliced with a step out of a larger buffer, channels-last,
a negative or conjugate view. Equal elements (bit for bit) give the fingerprint of the bytes
drawn, in any layout; one flipped bit, another shape or another dtype give another."""
from __future__ import annotations

import hashlib

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

import xxhash  # noqa: E402

from minishard.instruments import health, replicas  # noqa: E402
from test_properties import bounded  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8,
          torch.bool, torch.complex64)


def expected(dtype: torch.dtype, shape: tuple, raw: bytes) -> str:
    """The fingerprint as health.py defines it, of the row-major bytes drawn."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{dtype}{shape}".encode() + raw)
    return h.hexdigest()


@st.composite
def drawn_tensor(draw):
    """(dtype, shape, raw bytes, the tensor they make): any bit pattern (NaNs with payloads, -0.0),
    a bool 0 or 1."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = bytearray(draw(st.binary(min_size=n, max_size=n)))
    if dtype is torch.bool:
        raw = bytearray(b & 1 for b in raw)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if n else \
        torch.empty(shape, dtype=dtype)
    return dtype, shape, bytes(raw), t


def held_otherwise(draw, t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in another layout: a view whose strides are not row-major."""
    d = t.dim()
    perm = draw(st.permutations(range(d)))
    inverse = [perm.index(i) for i in range(d)]
    out = t.permute(perm).contiguous().permute(inverse)       # a transposed weight's strides
    if d and draw(st.booleans()):                             # every other row of a larger buffer
        k, step = draw(st.integers(0, d - 1)), draw(st.integers(2, 3))
        size = list(t.shape)
        size[k] = size[k] * step + 1
        big = torch.zeros(size, dtype=t.dtype)
        index = [slice(None)] * d
        index[k] = slice(1, None, step)
        big[tuple(index)] = out
        out = big[tuple(index)]
    if d == 0 and draw(st.booleans()):                        # a 0-d element of a larger buffer
        out = torch.stack([torch.zeros_like(t), t])[1]
    if d == 4 and draw(st.booleans()):
        out = out.contiguous(memory_format=torch.channels_last)
    if t.is_floating_point() and draw(st.booleans()):
        out = torch._neg_view(-out)                            # -(-x): the bits of x, a neg bit set
    if t.is_complex() and draw(st.booleans()):
        out = out.conj_physical().conj()
    return out


@bounded(150)
@given(data=st.data(), drawn=drawn_tensor())
def test_equal_elements_give_the_fingerprint_of_their_bytes_in_any_layout(data, drawn):
    dtype, shape, raw, t = drawn
    view = held_otherwise(data.draw, t)
    assert view.shape == t.shape and view.dtype == t.dtype
    want = expected(dtype, shape, raw)
    assert health.fingerprint([("w", t)])["w"] == want
    assert health.fingerprint([("w", view)])["w"] == want, (view.stride(), view.storage_offset())
    # the replicas' fingerprint, taken every few steps (replicas.py), hashes the same bytes
    fast = xxhash.xxh3_64_hexdigest(f"{dtype}{shape}".encode() + raw)
    assert replicas.fingerprint([("w", t), ("v", view)]) == {"w": fast, "v": fast}


@bounded(100)
@given(data=st.data(), drawn=drawn_tensor())
def test_one_flipped_bit_another_shape_or_dtype_give_another_fingerprint(data, drawn):
    dtype, shape, raw, t = drawn
    base = health.fingerprint([("w", t)])["w"]
    if raw:
        flipped = bytearray(raw)
        at = data.draw(st.integers(0, len(raw) - 1))
        flipped[at] ^= 1 if dtype is torch.bool else 1 << data.draw(st.integers(0, 7))
        other = torch.frombuffer(flipped, dtype=torch.uint8).view(dtype).reshape(shape)
        assert health.fingerprint([("w", held_otherwise(data.draw, other))])["w"] != base
    if len(shape) and shape[-1] != 1:
        assert health.fingerprint([("w", t.reshape(*shape, 1))])["w"] != base
    if dtype is torch.float32:
        assert health.fingerprint([("w", t.view(torch.int32))])["w"] != base


def test_a_tensor_without_values_is_refused_by_name():
    with pytest.raises(ValueError, match="blocks.0.weight is on the meta device"):
        health.fingerprint([("blocks.0.weight", torch.empty(3, device="meta"))])
