"""Torch helpers shared by transports: strided views of shards and ops, pack and scatter.

Every shard tensor must be contiguous; an op's bytes are the ``as_strided`` view its plan
entry describes. Packing copies (and converts dtype) from source views into a byte
buffer; scattering copies from a buffer into destination views. Both are a single
``copy_`` per piece, so they run at memcpy speed on CPU and as kernels on GPU.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from weightsync.tools.torch_layout import TORCH_DTYPES, strided_view
from weightsync.transport.schedule import Message, Piece

if TYPE_CHECKING:
    from weightsync.plan import TransferOp


def flat_views(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """1-d views over each tensor's elements; non-contiguous tensors are rejected."""
    out = {}
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(
                f"tensor {name!r} (shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous; "
                "weightsync addresses shards through their flat storage: pass a contiguous tensor"
            )
        out[name] = t.detach().view(-1)
    return out


def op_src_view(flats: Mapping[str, torch.Tensor], op: TransferOp) -> torch.Tensor:
    """The source box of a plan op, viewed in the writer's shard."""
    return strided_view(flats[op.src_shard], op.box.sizes, op.src_strides, op.src_offset)


def op_dst_view(flats: Mapping[str, torch.Tensor], op: TransferOp) -> torch.Tensor:
    """The destination box of a plan op, viewed in the reader's shard."""
    return strided_view(flats[op.dst_shard], op.box.sizes, op.dst_strides, op.dst_offset)


def piece_view(flat: torch.Tensor, offset: int, piece: Piece, strides: tuple[int, ...]) -> torch.Tensor:
    return strided_view(flat, piece.box.sizes, strides, offset)


def src_view(flats: Mapping[str, torch.Tensor], piece: Piece) -> torch.Tensor:
    return piece_view(flats[piece.op.src_shard], piece.src_offset, piece, piece.op.src_strides)


def dst_view(flats: Mapping[str, torch.Tensor], piece: Piece) -> torch.Tensor:
    return piece_view(flats[piece.op.dst_shard], piece.dst_offset, piece, piece.op.dst_strides)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a 1-d uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


#: How a piece is copied: ``dst.copy_(src)`` on host memory, the device port's queued copy on a
#: GPU (:meth:`weightsync.ports.device.DevicePort.copy`).
Copy = Callable[[torch.Tensor, torch.Tensor], object]


def _copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def pack(message: Message, src_flats: Mapping[str, torch.Tensor], buffer: torch.Tensor, *,
         copy: Copy = _copy_now) -> torch.Tensor:
    """Copy every piece (converted to the destination dtype) into ``buffer``; returns the payload."""
    for piece in message.pieces:
        out = buffer[piece.at: piece.at + piece.nbytes].view(TORCH_DTYPES[piece.op.dst_dtype])
        copy(out.view(piece.box.sizes), src_view(src_flats, piece))
    return buffer[: message.nbytes]


def scatter(message: Message, dst_flats: Mapping[str, torch.Tensor], payload: torch.Tensor, *,
            copy: Copy = _copy_now) -> None:
    """Copy each piece of a received payload into its destination view."""
    for piece in message.pieces:
        data = payload[piece.at: piece.at + piece.nbytes].view(TORCH_DTYPES[piece.op.dst_dtype])
        copy(dst_view(dst_flats, piece), data.view(piece.box.sizes))


def direct_source(message: Message, src_flats: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The source bytes of a direct message when they can be sent without packing."""
    (piece,) = message.pieces
    if piece.op.converts or not piece.src_contiguous:
        return None
    return as_bytes(src_view(src_flats, piece).contiguous())


def checksum(payload: torch.Tensor) -> int:
    """CRC32 of a byte payload (copied to host memory when it lives on a GPU)."""
    data = payload.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return zlib.crc32(data.contiguous().numpy())  # type: ignore[arg-type]  # ndarray is a buffer
