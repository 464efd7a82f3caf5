"""Torch helpers shared by transports: dtypes, strided views of shards, pack and scatter.

Every shard tensor must be contiguous; an op's bytes are the ``as_strided`` view its plan
entry describes. Packing copies (and converts dtype) from source views into a byte
buffer; scattering copies from a buffer into destination views. Both are a single
``copy_`` per piece, so they run at memcpy speed on CPU and as kernels on GPU.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

from weightsync.transport.schedule import Message, Piece

TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES: Mapping[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {dtype}; supported: {sorted(TORCH_DTYPES)}") from None


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


def check_tensors(tensors: Mapping[str, torch.Tensor], shards: Mapping[str, tuple[tuple[int, ...], str]],
                  *, side: str) -> None:
    """Every shard the plan names exists with its declared shape and dtype."""
    missing = sorted(set(shards) - set(tensors))
    if missing:
        raise ValueError(f"{side}: the plan uses tensor(s) {missing[:5]} that were not provided")
    for name, (shape, dtype) in shards.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape) or dtype_name(t.dtype) != dtype:
            raise ValueError(
                f"{side}: tensor {name!r} is {tuple(t.shape)} {dtype_name(t.dtype)}, but its layout "
                f"declares {tuple(shape)} {dtype}"
            )


def piece_view(flat: torch.Tensor, offset: int, piece: Piece, strides: tuple[int, ...]) -> torch.Tensor:
    return flat.as_strided(piece.box.sizes, strides, flat.storage_offset() + offset)


def src_view(flats: Mapping[str, torch.Tensor], piece: Piece) -> torch.Tensor:
    return piece_view(flats[piece.op.src_shard], piece.src_offset, piece, piece.op.src_strides)


def dst_view(flats: Mapping[str, torch.Tensor], piece: Piece) -> torch.Tensor:
    return piece_view(flats[piece.op.dst_shard], piece.dst_offset, piece, piece.op.dst_strides)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a 1-d uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def pack(message: Message, src_flats: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """Copy every piece (converted to the destination dtype) into ``buffer``; returns the payload."""
    for piece in message.pieces:
        out = buffer[piece.at: piece.at + piece.nbytes].view(TORCH_DTYPES[piece.op.dst_dtype])
        out.view(piece.box.sizes).copy_(src_view(src_flats, piece))
    return buffer[: message.nbytes]


def scatter(message: Message, dst_flats: Mapping[str, torch.Tensor], payload: torch.Tensor) -> None:
    """Copy each piece of a received payload into its destination view."""
    for piece in message.pieces:
        data = payload[piece.at: piece.at + piece.nbytes].view(TORCH_DTYPES[piece.op.dst_dtype])
        dst_view(dst_flats, piece).copy_(data.view(piece.box.sizes))


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
