"""Delta encodings of a byte payload against the previous version of the same payload.

RL steps change few elements of BF16 weights (about 1-3% per step, see docs/benchmarks.md),
so a writer that still holds the bytes it last sent to a reader can send only what changed.
Elements are compared as integers of ``unit`` bytes (no float arithmetic: NaN and -0.0 stay
bitwise), and each payload goes out in the smallest of three lossless encodings:

* ``DENSE``: the new bytes as they are (``n * unit``);
* ``SPARSE``: int32 indices of the changed elements, then their new values (``nnz * (4 + unit)``);
* ``BITMAP``: the changed values, then one bit per element (set = changed) (``n/8 + nnz * unit``).

Pure functions on 1-d uint8 tensors; the torch transport does the bookkeeping of versions::

    enc = encode(new_bytes, old_bytes, unit=2)     # writer: old_bytes = what the reader holds
    send(enc.header()); send(enc.payload)
    apply(kind, payload, dest_bytes, unit=2)       # reader: dest_bytes held old, now holds new
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class Kind(IntEnum):
    """How a payload is encoded on the wire."""

    DENSE = 0
    SPARSE = 1
    BITMAP = 2


@dataclass(frozen=True)
class Encoded:
    """One encoded payload: its kind, how many elements changed, and the bytes to send."""

    kind: Kind
    changed: int
    payload: torch.Tensor  # 1-d uint8

    @property
    def nbytes(self) -> int:
        return int(self.payload.numel())


def element_unit(sizes: list[int]) -> int:
    """The comparison unit for a payload whose pieces have these itemsizes, offsets and lengths."""
    unit = 8
    for size in sizes:
        unit = math.gcd(unit, size)
    return max(1, unit)


def encoded_sizes(n: int, changed: int, unit: int) -> dict[Kind, int]:
    """Bytes each encoding needs for ``n`` elements of which ``changed`` differ."""
    return {Kind.DENSE: n * unit, Kind.SPARSE: changed * (4 + unit), Kind.BITMAP: (n + 7) // 8 + changed * unit}


def encode(new: torch.Tensor, old: torch.Tensor, *, unit: int) -> Encoded:
    """Encode ``new`` against ``old`` (1-d uint8 tensors of the same length, a multiple of ``unit``)."""
    _check(new, old, unit)
    n = new.numel() // unit
    as_int = _INT_OF_SIZE[unit]
    new_el = new.view(as_int)
    index = changed_index(new_el, old.view(as_int))
    changed = int(index.numel())
    sizes = encoded_sizes(n, changed, unit)
    if n >= 2**31:  # int32 indices cannot address it
        sizes = {Kind.DENSE: sizes[Kind.DENSE]}
    kind = min(sizes, key=lambda k: (sizes[k], k))
    if kind is Kind.DENSE:
        return Encoded(kind, changed, new)
    values = new_el[index].view(torch.uint8)
    if kind is Kind.SPARSE:
        return Encoded(kind, changed, torch.cat([index.to(torch.int32).view(torch.uint8), values]))
    mask = torch.zeros(n, dtype=torch.bool, device=new.device)
    mask[index] = True
    return Encoded(kind, changed, torch.cat([values, _pack_bits(mask)]))


def changed_index(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Ascending int64 positions where two same-shape 1-d tensors differ (numpy on the host: 3-5x faster)."""
    if new.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(new.numpy() != old.numpy()))
    return torch.nonzero(new != old).reshape(-1)


def apply(kind: Kind, payload: torch.Tensor, dest: torch.Tensor, *, unit: int, changed: int) -> None:
    """Turn ``dest`` (1-d uint8, holding the old bytes) into the new bytes, in place."""
    n = dest.numel() // unit
    if dest.numel() % unit:
        raise ValueError(f"destination of {dest.numel()} bytes is not a whole number of {unit}-byte elements")
    expected = encoded_sizes(n, changed, unit)[Kind(kind)]
    if payload.numel() != expected:
        raise ValueError(f"{Kind(kind).name} payload of {payload.numel()} bytes for {n} elements with "
                         f"{changed} changed; expected {expected} bytes")
    if kind == Kind.DENSE:
        dest.copy_(payload)
        return
    as_int = _INT_OF_SIZE[unit]
    dest_el = dest.view(as_int)
    if kind == Kind.SPARSE:
        index = _view(payload[: 4 * changed], torch.int32).to(torch.int64)
        values = _view(payload[4 * changed:], as_int)
        if changed and (int(index.min()) < 0 or int(index.max()) >= n):
            raise ValueError(f"sparse delta index out of range for {n} elements")
        dest_el[index] = values
        return
    values_end = changed * unit
    mask = _unpack_bits(payload[values_end:], n)
    marked = int(torch.count_nonzero(mask))
    if marked != changed:
        raise ValueError(f"bitmap delta marks {marked} elements but carries {changed} values")
    dest_el[mask] = _view(payload[:values_end], as_int)


def _check(new: torch.Tensor, old: torch.Tensor, unit: int) -> None:
    if unit not in _INT_OF_SIZE:
        raise ValueError(f"unit must be 1, 2, 4 or 8 bytes, got {unit}")
    if new.dtype != torch.uint8 or old.dtype != torch.uint8 or new.dim() != 1 or old.dim() != 1:
        raise ValueError("encode takes 1-d uint8 tensors (use .view(torch.uint8))")
    if new.numel() != old.numel() or new.numel() % unit:
        raise ValueError(f"payloads of {new.numel()} and {old.numel()} bytes cannot be compared in "
                         f"{unit}-byte elements")


def _view(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data`` (uint8) viewed as ``dtype``, copied first when its offset is not aligned for it."""
    if data.storage_offset() % dtype.itemsize:
        data = data.clone()
    return data.view(dtype)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    pad = (-mask.numel()) % 8
    bits = torch.cat([mask.to(torch.uint8), torch.zeros(pad, dtype=torch.uint8, device=mask.device)])
    return (bits.view(-1, 8) * _BIT_WEIGHTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(np.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n].bool()
