"""Delta encodings: every encoding round-trips bitwise, and the smallest one is chosen."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.delta import Kind, apply, encode, encoded_sizes

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int32]


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 300), seed=st.integers(0, 2**31 - 1),
       density=st.sampled_from([0.0, 0.005, 0.05, 0.3, 1.0]))
def test_round_trip_is_bitwise(dtype: torch.dtype, n: int, seed: int, density: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    old_bits = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    old = old_bits.view(dtype)
    changed = torch.rand(n, generator=gen) < density
    fresh = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen).view(dtype)
    new = torch.where(changed, fresh, old)
    new_bytes, unit = new.view(torch.uint8).clone(), dtype.itemsize
    enc = encode(new_bytes, old_bits.clone(), unit=unit)
    sizes = encoded_sizes(n, enc.changed, unit)
    assert enc.nbytes == min(sizes.values())
    dest = old_bits.clone()
    apply(enc.kind, enc.payload, dest, unit=unit, changed=enc.changed)
    assert torch.equal(dest, new_bytes)


@pytest.mark.parametrize("kind", [Kind.SPARSE, Kind.BITMAP])
def test_nan_and_negative_zero_survive(kind: Kind) -> None:
    old = torch.zeros(64, dtype=torch.bfloat16)
    new = old.clone()
    new[3], new[10] = float("nan"), -0.0
    if kind is Kind.BITMAP:
        new[20:30] = 1.5
    enc = encode(new.view(torch.uint8), old.view(torch.uint8), unit=2)
    assert enc.kind is kind and enc.changed == (2 if kind is Kind.SPARSE else 12)
    dest = old.clone()
    apply(enc.kind, enc.payload, dest.view(torch.uint8), unit=2, changed=enc.changed)
    assert torch.equal(dest.view(torch.int16), new.view(torch.int16))


def test_bad_payload_is_refused_before_writing() -> None:
    old = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="SPARSE payload of 3 bytes for 8 elements with 1 changed; expected 6"):
        apply(Kind.SPARSE, torch.zeros(3, dtype=torch.uint8), old, unit=2, changed=1)
    with pytest.raises(ValueError, match="cannot be compared in 4-byte elements"):
        encode(torch.zeros(6, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8), unit=4)
