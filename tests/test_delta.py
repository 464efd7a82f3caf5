"""Delta encodings: every encoding round-trips bitwise, and the smallest one is chosen.

``diff`` compares 8-byte words in chunks and splits only changed words into elements, so it is
checked against a plain element-wise comparison on lengths that are no whole number of words,
payloads at unaligned offsets and chunks of a few words.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from weightsync.tools.codecs.delta import Kind, apply, diff, encode, encoded_sizes

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int32]


@settings(max_examples=examples(150), deadline=None)
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


@settings(max_examples=examples(200), deadline=None)
@given(unit=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 200), lead=st.integers(0, 7),
       chunk_words=st.sampled_from([1, 2, 3, 5, 64]), seed=st.integers(0, 2**31 - 1),
       density=st.sampled_from([0.0, 0.02, 0.3, 1.0]), compiled=st.booleans())
def test_diff_finds_exactly_the_changed_elements(unit: int, n: int, lead: int, chunk_words: int, seed: int,
                                                density: float, compiled: bool) -> None:
    """Word-wise detection = element-wise comparison, whatever the length, alignment or chunk size,
    with the numba kernel and with numpy."""
    gen = torch.Generator().manual_seed(seed)
    size = n * unit
    lead *= unit  # payloads start at any element offset of their buffer, not only at whole words
    old_buf = torch.randint(0, 256, (lead + size,), dtype=torch.uint8, generator=gen)
    new_buf = old_buf.clone()
    flip = torch.rand(size, generator=gen) < density
    new_buf[lead:][flip] ^= torch.randint(1, 256, (size,), dtype=torch.uint8, generator=gen)[flip]
    new, old = new_buf[lead:], old_buf[lead:]
    changes = diff(new, old.clone(), unit=unit, chunk_words=chunk_words, compiled=compiled)
    as_uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[unit]
    want = np.flatnonzero(new.numpy().view(as_uint) != old.numpy().view(as_uint))
    assert np.array_equal(changes.index, want)
    assert np.array_equal(changes.values, new.numpy().view(as_uint)[want])
    enc = changes.encode()
    dest = old.clone()
    apply(enc.kind, enc.payload, dest, unit=unit, changed=enc.changed, compiled=compiled)
    assert torch.equal(dest, new)
    again = diff(new, old, unit=unit, chunk_words=chunk_words, compiled=compiled, update_old=True)
    assert np.array_equal(again.index, want)
    # the writer's copy of what the reader holds, now the new bytes; the bytes before it untouched
    assert torch.equal(old_buf[lead:], new) and torch.equal(old_buf[:lead], new_buf[:lead])


def test_unchanged_payload_costs_an_empty_sparse_message() -> None:
    data = torch.arange(1000, dtype=torch.int16).view(torch.uint8)
    enc = encode(data, data.clone(), unit=2)
    assert (enc.kind, enc.changed, enc.nbytes) == (Kind.SPARSE, 0, 0)


@pytest.mark.parametrize("compiled", [True, False])
def test_out_of_range_index_is_refused_before_writing(compiled: bool) -> None:
    dest = torch.zeros(16, dtype=torch.uint8)
    payload = torch.cat([torch.tensor([1, 9], dtype=torch.int32).view(torch.uint8),
                         torch.tensor([5, 6], dtype=torch.int16).view(torch.uint8)])
    with pytest.raises(ValueError, match="sparse delta index out of range for 8 elements"):
        apply(Kind.SPARSE, payload, dest, unit=2, changed=2, compiled=compiled)
    assert not dest.any()


def test_compiled_kernels_leave_module_namespaces_scannable_by_vllm() -> None:
    """vLLM's CPU worker start reads ``vars(obj).get("kernel")`` for every module attribute; once
    numba had loaded, llvmlite's library handle broke that and in-process engines failed to start."""
    import sys

    from weightsync.tools.codecs import delta_jit

    if delta_jit.load() is None:
        pytest.skip("numba is not installed")
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if hasattr(value, "__dict__"):
                assert hasattr(vars(value), "get"), f"vars({value!r}) of {module.__name__} is not a mapping"
