"""The delta encodings of :mod:`weightsync.tools.codecs.delta` computed where the bytes are: torch ops only.

The host codec (numba, numpy) reads memory from the CPU, so it cannot run on GPU memory: the
NCCL transport would copy every payload to the host and back. This codec is the same
encodings, bit for bit (same kind chosen by :func:`~weightsync.tools.codecs.delta.smallest_kind`,
same SPARSE index list, same little-endian bitmap), written with tensor kernels (``ne``,
``nonzero``, ``index_select``, ``index_copy_``, shifts), so it runs on CUDA tensors in stream
order and on CPU tensors in tests. :func:`codec_for` is the one place that chooses::

    codec = codec_for(new.device)                    # host codec, or this one on GPU memory
    enc = codec.encode(new, old, unit=2)             # old becomes new; enc.parts go on the wire
    codec.apply(enc.kind, enc.payload, dest, unit=2, changed=enc.changed)

On a GPU, ``nonzero`` and the range check of a SPARSE payload read a count back to the host
(a stream synchronise each): the writer needs the count to size the payload, the reader to
refuse a malformed one before it writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from weightsync.ports import device as device_port
from weightsync.tools.codecs import delta as host
from weightsync.tools.codecs.delta import Encoded, Kind, check_payload, smallest_kind

#: Element dtypes by unit: signed where torch has no unsigned kernels (only equality and copies
#: are used, for which the sign does not matter).
_ELEMENT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaCodec(Protocol):
    """What the delta exchange needs of a codec (both work on 1-d uint8 tensors)."""

    def encode(self, new: torch.Tensor, old: torch.Tensor, *, unit: int) -> Encoded:
        """``new`` in its smallest encoding against ``old``, which then holds ``new``."""
        ...

    def apply(self, kind: Kind, payload: torch.Tensor, dest: torch.Tensor, *, unit: int, changed: int) -> None:
        """Turn ``dest`` (the old bytes) into the new bytes; ValueError (``dest`` untouched) if malformed."""
        ...


@dataclass(frozen=True)
class HostCodec:
    """:mod:`weightsync.tools.codecs.delta` (numba when installed): host memory."""

    def encode(self, new: torch.Tensor, old: torch.Tensor, *, unit: int) -> Encoded:
        return host.diff(new, old, unit=unit, update_old=True).encode()

    def apply(self, kind: Kind, payload: torch.Tensor, dest: torch.Tensor, *, unit: int, changed: int) -> None:
        host.apply(kind, payload, dest, unit=unit, changed=changed)


@dataclass(frozen=True)
class DeviceCodec:
    """The same encodings with torch ops, on the tensors' own device (module docstring)."""

    def encode(self, new: torch.Tensor, old: torch.Tensor, *, unit: int) -> Encoded:
        _check(new, old, unit)
        a, b = _elements(_aligned(new, unit), unit), _elements(old, unit)
        mask = a.ne(b)
        index = mask.nonzero().reshape(-1)
        values = a.index_select(0, index)
        b.index_copy_(0, index, values)  # old now holds new, writing only what changed
        changed = int(index.numel())
        kind = smallest_kind(a.numel(), changed, unit)
        if kind is Kind.DENSE:
            return Encoded(kind, changed, (new,))
        payload = values.view(torch.uint8)
        if kind is Kind.SPARSE:
            return Encoded(kind, changed, (index.to(torch.int32).view(torch.uint8), payload))
        return Encoded(kind, changed, (payload, _pack_bits(mask)))

    def apply(self, kind: Kind, payload: torch.Tensor, dest: torch.Tensor, *, unit: int, changed: int) -> None:
        n = check_payload(kind, payload, dest, unit=unit, changed=changed)
        if kind == Kind.DENSE:
            dest.copy_(payload)
            return
        if dest.storage_offset() % unit:  # no element view of it: apply to an aligned copy
            aligned = dest.clone()
            self.apply(kind, payload, aligned, unit=unit, changed=changed)
            dest.copy_(aligned)
            return
        if payload.device != dest.device:
            raise ValueError(f"a delta payload on {payload.device} cannot be applied to {dest.device}")
        index: torch.Tensor
        if kind == Kind.SPARSE:
            index = _aligned(payload[: 4 * changed], 4).view(torch.int32).to(torch.int64)
            if changed and not bool((index.min() >= 0) & (index.max() < n)):
                raise ValueError(f"sparse delta index out of range for {n} elements")
            values = payload[4 * changed:]
        else:
            values = payload[: changed * unit]
            index = _unpack_bits(payload[changed * unit:], n).nonzero().reshape(-1)
            if index.numel() != changed:
                raise ValueError(f"bitmap delta marks {index.numel()} elements but carries {changed} values")
        _elements(dest, unit).index_copy_(0, index, _aligned(values, unit).view(_ELEMENT[unit]))


HOST_CODEC = HostCodec()
DEVICE_CODEC = DeviceCodec()


def codec_for(device: str | torch.device) -> DeltaCodec:
    """The codec for payloads on ``device``: torch ops where the device port says the memory
    follows GPU rules (CUDA; every tensor under the test device model), else the host codec."""
    return DEVICE_CODEC if device_port.current().is_gpu(device) else HOST_CODEC


def _elements(data: torch.Tensor, unit: int) -> torch.Tensor:
    """A 1-d uint8 tensor's bytes as ``unit``-byte elements (a view: writes reach ``data``)."""
    return data.view(_ELEMENT[unit])


def _aligned(part: torch.Tensor, unit: int) -> torch.Tensor:
    """``part`` at an address a ``unit``-byte view accepts: a copy when it starts mid-element
    (payloads of several messages lie back to back in one buffer, at any byte offset)."""
    return part.clone() if part.storage_offset() % unit else part


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """``np.packbits(mask, bitorder="little")`` with torch ops: bit j of byte i is element 8i+j."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    weighted = padded.view(-1, 8) << _bit_shifts(mask.device)
    return weighted.sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bits of a little-endian bitmap, as a bool mask."""
    return ((bits.unsqueeze(1) >> _bit_shifts(bits.device)) & 1).reshape(-1)[:n].bool()


def _check(new: torch.Tensor, old: torch.Tensor, unit: int) -> None:
    if unit not in _ELEMENT:
        raise ValueError(f"unit must be 1, 2, 4 or 8 bytes, got {unit}")
    if new.dtype != torch.uint8 or old.dtype != torch.uint8 or new.dim() != 1 or old.dim() != 1:
        raise ValueError("encode takes 1-d uint8 tensors (use .view(torch.uint8))")
    if new.numel() != old.numel() or new.numel() % unit or new.device != old.device:
        raise ValueError(f"payloads of {new.numel()} bytes on {new.device} and {old.numel()} on {old.device} "
                         f"cannot be compared in {unit}-byte elements")
