"""Delta encodings of a byte payload against the previous version of the same payload.

RL steps change few elements of BF16 weights (about 1-3% per step, see docs/benchmarks.md),
so a writer that still holds the bytes it last sent to a reader can send only what changed.
Elements are compared as integers of ``unit`` bytes (no float arithmetic: NaN and -0.0 stay
bitwise), and each payload goes out in the smallest of three lossless encodings:

* ``DENSE``: the new bytes as they are (``n * unit``);
* ``SPARSE``: int32 indices of the changed elements, then their new values (``nnz * (4 + unit)``);
* ``BITMAP``: the changed values, then one bit per element (set = changed) (``n/8 + nnz * unit``).

Functions on 1-d uint8 tensors in host memory; which version each side holds is the
transports' business (:mod:`weightsync.transport.delta.pairs`)::

    changes = diff(new_bytes, old_bytes, unit=2, update_old=True)   # writer: old_bytes = what the reader holds
    enc = changes.encode()               # the smallest encoding; enc.parts go on the wire back to back
    apply(enc.kind, payload, dest_bytes, unit=2, changed=enc.changed)   # reader: old bytes -> new bytes

Finding the changes is the writer's whole cost, so :func:`diff` compares 8-byte words and
splits only the changed words into elements: in one compiled pass that also updates the
writer's copy (:mod:`weightsync.tools.codecs.delta_jit`, when numba is installed), else with numpy in
chunks that stay in cache. Neither writes temporaries of the payload's size (the kernel's
outputs are reserved at that size, but only the pages that changes fill are touched).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from weightsync.tools.codecs import delta_jit

_NP_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Words (8 bytes) compared per pass of :func:`diff`: 2 x 512 KiB of payload and a 64 KiB mask.
CHUNK_WORDS = 1 << 16


class Kind(IntEnum):
    """How a payload is encoded on the wire."""

    DENSE = 0
    SPARSE = 1
    BITMAP = 2


@dataclass(frozen=True)
class Encoded:
    """One encoded payload: its kind, how many elements changed, and the bytes to send (in parts)."""

    kind: Kind
    changed: int
    parts: tuple[torch.Tensor, ...]  # 1-d uint8 each, sent back to back

    @property
    def nbytes(self) -> int:
        return sum(int(p.numel()) for p in self.parts)

    @property
    def payload(self) -> torch.Tensor:
        """The parts as one tensor (a copy when there are several)."""
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


@dataclass(frozen=True)
class Changes:
    """Where ``new`` differs from ``old``: ascending element positions and the new values there."""

    new: torch.Tensor  # 1-d uint8, the whole new payload (sent as is when DENSE is smallest)
    unit: int
    index: np.ndarray  # int32 or int64, ascending
    values: np.ndarray  # uint of ``unit`` bytes, new[index]

    @property
    def changed(self) -> int:
        return int(self.index.size)

    @property
    def kind(self) -> Kind:
        """The smallest encoding (ties go to the lower kind)."""
        return smallest_kind(self.new.numel() // self.unit, self.changed, self.unit)

    def encode(self) -> Encoded:
        """The payload in its smallest encoding."""
        kind = self.kind
        if kind is Kind.DENSE:
            return Encoded(kind, self.changed, (self.new,))
        values = torch.from_numpy(self.values.view(np.uint8))
        if kind is Kind.SPARSE:
            index = self.index.astype(np.int32, copy=False)
            return Encoded(kind, self.changed, (torch.from_numpy(index.view(np.uint8)), values))
        mask = np.zeros(self.new.numel() // self.unit, dtype=np.bool_)
        mask[self.index] = True
        return Encoded(kind, self.changed, (values, torch.from_numpy(np.packbits(mask, bitorder="little"))))


def element_unit(sizes: list[int]) -> int:
    """The comparison unit for a payload whose pieces have these itemsizes, offsets and lengths."""
    unit = 8
    for size in sizes:
        unit = math.gcd(unit, size)
    return max(1, unit)


def encoded_sizes(n: int, changed: int, unit: int) -> dict[Kind, int]:
    """Bytes each encoding needs for ``n`` elements of which ``changed`` differ."""
    return {Kind.DENSE: n * unit, Kind.SPARSE: changed * (4 + unit), Kind.BITMAP: (n + 7) // 8 + changed * unit}


def smallest_kind(n: int, changed: int, unit: int) -> Kind:
    """The encoding of ``n`` elements with ``changed`` differing that takes the fewest bytes
    (ties go to the lower kind); every codec picks with it, so they put the same bytes on the wire."""
    if n >= 2**31:  # int32 indices cannot address it
        return Kind.DENSE
    sizes = encoded_sizes(n, changed, unit)
    return min(sizes, key=lambda k: (sizes[k], k))


def check_payload(kind: Kind, payload: torch.Tensor, dest: torch.Tensor, *, unit: int, changed: int) -> int:
    """The number of elements of ``dest``, once ``payload`` is known to fit its header.

    Raises:
        ValueError: ``dest`` is not whole elements, or the payload's size is not its encoding's.
    """
    n = dest.numel() // unit
    if dest.numel() % unit:
        raise ValueError(f"destination of {dest.numel()} bytes is not a whole number of {unit}-byte elements")
    expected = encoded_sizes(n, changed, unit)[Kind(kind)]
    if payload.numel() != expected:
        raise ValueError(f"{Kind(kind).name} payload of {payload.numel()} bytes for {n} elements with "
                         f"{changed} changed; expected {expected} bytes")
    return n


def encode(new: torch.Tensor, old: torch.Tensor, *, unit: int, compiled: bool = True) -> Encoded:
    """Encode ``new`` against ``old`` (1-d uint8 tensors of the same length, a multiple of ``unit``)."""
    return diff(new, old, unit=unit, compiled=compiled).encode()


def diff(new: torch.Tensor, old: torch.Tensor, *, unit: int, update_old: bool = False,
         chunk_words: int = CHUNK_WORDS, compiled: bool = True) -> Changes:
    """The elements of ``unit`` bytes where ``new`` and ``old`` (same-length 1-d uint8 tensors) differ.

    Compares 8-byte words a chunk at a time, then splits only the changed words into
    elements; the bytes after the last whole word are compared element by element.

    Args:
        update_old: also turn ``old`` into ``new`` (writing only what changed).
        chunk_words: words per pass (a knob for tests).
        compiled: use the numba kernel when numba is installed (False: numpy, for tests).
    """
    _check(new, old, unit)
    a, b = new.numpy(), old.numpy()
    words, per, el = a.size // 8, 8 // unit, _NP_OF_SIZE[unit]
    wa, wb = a[: words * 8].view(np.uint64), b[: words * 8].view(np.uint64)
    jit = delta_jit.load() if compiled else None
    if jit is not None:
        n = a.size // unit
        index = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)  # pages are touched only up to nnz
        values = np.empty(n, dtype=el)
        scratch = np.empty(max(1, min(words, chunk_words)), dtype=np.int64)
        k = jit.diff(wa, wb, a.view(el), b.view(el), per, index, values, scratch, update_old)
        return Changes(new, unit, index[:k], values[:k])
    mask = np.empty(min(words, chunk_words), dtype=np.bool_)
    index_parts, value_parts = [], []
    shift = per.bit_length() - 1
    for start in range(0, words, chunk_words):
        stop = min(words, start + chunk_words)
        ca, cb = wa[start:stop], wb[start:stop]
        changed_words = np.flatnonzero(np.not_equal(ca, cb, out=mask[: stop - start]))
        if not changed_words.size:
            continue
        sub_new, sub_old = ca[changed_words].view(el), cb[changed_words].view(el)
        lanes = np.flatnonzero(sub_new != sub_old)  # position among the changed words' elements
        index_parts.append(((changed_words[lanes >> shift] + start) << shift) | (lanes & (per - 1)))
        value_parts.append(sub_new[lanes])
        if update_old:
            cb[changed_words] = ca[changed_words]
    tail_a, tail_b = a[words * 8:].view(el), b[words * 8:].view(el)
    tail = np.flatnonzero(tail_a != tail_b)
    if tail.size:
        index_parts.append(tail + words * per)
        value_parts.append(tail_a[tail])
        if update_old:
            tail_b[tail] = tail_a[tail]
    if not index_parts:
        return Changes(new, unit, np.empty(0, dtype=np.int64), np.empty(0, dtype=el))
    return Changes(new, unit, np.concatenate(index_parts), np.concatenate(value_parts))


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache) before the first delta needs them."""
    data = torch.zeros(64, dtype=torch.uint8)
    for unit in (2, 4):  # bf16/fp16 and fp32 payloads
        enc = diff(data, data.clone(), unit=unit, update_old=True).encode()
        apply(enc.kind, enc.payload, data.clone(), unit=unit, changed=enc.changed)


def apply(kind: Kind, payload: torch.Tensor, dest: torch.Tensor, *, unit: int, changed: int,
          compiled: bool = True) -> None:
    """Turn ``dest`` (1-d uint8, holding the old bytes) into the new bytes, in place.

    Raises:
        ValueError: the payload does not fit its header (size, index range, bitmap count);
            ``dest`` is untouched then.
    """
    n = check_payload(kind, payload, dest, unit=unit, changed=changed)
    if kind == Kind.DENSE:
        dest.copy_(payload)
        return
    if dest.device.type != "cpu" or payload.device.type != "cpu":
        raise ValueError("delta payloads are applied in host memory (the gloo transport's); got "
                         f"{payload.device} -> {dest.device}")
    data = payload.numpy()
    jit = delta_jit.load() if compiled else None
    values_at = 4 * changed if kind == Kind.SPARSE else 0
    values = data[values_at: values_at + changed * unit].view(_NP_OF_SIZE[unit])
    index: np.ndarray
    if kind == Kind.SPARSE:
        index = data[: 4 * changed].view(np.int32)
        if jit is not None:
            in_range = jit.in_range(index, n)
        else:
            in_range = not changed or (int(index.min()) >= 0 and int(index.max()) < n)
        if not in_range:
            raise ValueError(f"sparse delta index out of range for {n} elements")
    else:
        index = np.flatnonzero(np.unpackbits(data[changed * unit:], count=n, bitorder="little"))
        if index.size != changed:
            raise ValueError(f"bitmap delta marks {index.size} elements but carries {changed} values")
    target = _numpy_elements(dest, unit)
    if jit is not None:
        jit.scatter(target, index, values)
    else:
        target[index] = values


def _numpy_elements(data: torch.Tensor, unit: int) -> np.ndarray:
    """A CPU uint8 tensor's bytes as a writable numpy array of ``unit``-byte unsigned integers (no copy)."""
    return data.numpy().view(_NP_OF_SIZE[unit])


def _check(new: torch.Tensor, old: torch.Tensor, unit: int) -> None:
    if unit not in _NP_OF_SIZE:
        raise ValueError(f"unit must be 1, 2, 4 or 8 bytes, got {unit}")
    if new.dtype != torch.uint8 or old.dtype != torch.uint8 or new.dim() != 1 or old.dim() != 1:
        raise ValueError("encode takes 1-d uint8 tensors (use .view(torch.uint8))")
    if new.numel() != old.numel() or new.numel() % unit:
        raise ValueError(f"payloads of {new.numel()} and {old.numel()} bytes cannot be compared in "
                         f"{unit}-byte elements")
    if new.device.type != "cpu" or old.device.type != "cpu":
        raise ValueError(f"delta encodings compare host memory (the gloo transport's); got {new.device}, "
                         f"{old.device}")
