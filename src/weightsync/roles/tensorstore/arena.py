"""A store writer's memory: append-only mapped arena files, and the index readers map them by.

``put`` copies each tensor into the writer's arena for the open version (the copy is the
snapshot); ``complete`` seals the version and publishes its :class:`StoreIndex` through the
job channel. A reader decodes the index, maps the files and views each shard in place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import msgpack
import torch

from weightsync.layout import CanonicalTensor, RankLayout, Region, Shard
from weightsync.layout.box import contiguous_strides
from weightsync.layout.wire import decode_layout, encode_explicit
from weightsync.roles.tensorstore.slices import TensorSlice
from weightsync.tools.torch_layout import TORCH_DTYPES, dtype_name
from weightsync.transport.shm.files import create_shared, remove_shared

ALIGN = 64


class GoneError(Exception):
    """A version's files or index disappeared while being opened (it was retired)."""


class Arena:
    """Append-only memory-mapped files holding the tensors put for one version."""

    def __init__(self, directory: str, prefix: str, chunk_bytes: int) -> None:
        self.directory = directory
        self.prefix = prefix
        self.chunk_bytes = chunk_bytes
        self.names: list[str] = []
        self._maps: list[torch.Tensor] = []
        self._used = 0

    def append(self, tensor: torch.Tensor) -> tuple[int, int]:
        """Copy ``tensor`` in; returns (file index, byte offset)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self._maps or self._used + nbytes > self._maps[-1].numel():
            size = max(self.chunk_bytes, -(-nbytes // ALIGN) * ALIGN, ALIGN)
            name = f"{self.prefix}-{len(self.names)}"
            self._maps.append(create_shared(os.path.join(self.directory, name), size))
            self.names.append(name)
            self._used = 0
        at = self._used
        if nbytes:
            self._maps[-1][at: at + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self._used = at + -(-nbytes // ALIGN) * ALIGN
        return len(self._maps) - 1, at

    def unlink(self) -> None:
        self._maps.clear()
        for name in self.names:
            remove_shared(os.path.join(self.directory, name))
        self.names.clear()


@dataclass
class OpenVersion:
    """What one writer has put since its last ``complete``."""

    arena: Arena
    shards: list[Shard] = field(default_factory=list)
    canonical: dict[str, CanonicalTensor] = field(default_factory=dict)
    at: list[tuple[int, int]] = field(default_factory=list)

    def add(self, name: str, tensor: torch.Tensor, where: TensorSlice) -> None:
        if name in self.canonical:
            raise ValueError(f"tensor {name!r} was already put for this version; put each name once per version")
        if tuple(tensor.shape) != where.box.sizes:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but its slice {where.box} has "
                             f"sizes {where.box.sizes}")
        dtype = dtype_name(tensor.dtype)
        shape = where.box.sizes
        region = Region(name, where.box, 0, contiguous_strides(shape))
        self.at.append(self.arena.append(tensor.detach().contiguous()))
        self.shards.append(Shard(name, shape, dtype, (region,)))
        self.canonical[name] = CanonicalTensor(name, where.shape, dtype)




    def index(self, rank: int, num_writers: int, directory: str) -> StoreIndex:
        """The index of what was put: readers map the arena files by it."""
        layout = RankLayout(rank, tuple(self.shards), self.canonical)
        return StoreIndex(num_writers, directory, tuple(self.arena.names), tuple(self.at), encode_explicit(layout))


@dataclass(frozen=True, slots=True)
class StoreIndex:
    """One writer's part of a version: its arena files and where each shard lies in them."""

    num_writers: int
    directory: str
    files: tuple[str, ...]
    at: tuple[tuple[int, int], ...]  # per shard: (file index, byte offset)
    layout: bytes  # the writer's RankLayout, wire-encoded

    FORMAT = 1

    def encode(self) -> bytes:
        return msgpack.packb({"v": self.FORMAT, "writers": self.num_writers, "dir": self.directory,
                              "files": list(self.files), "at": [list(x) for x in self.at], "layout": self.layout})

    @classmethod
    def decode(cls, blob: bytes, writer: int) -> StoreIndex:
        try:
            obj = msgpack.unpackb(blob, raw=False)
            if not isinstance(obj, dict) or obj.get("v") != cls.FORMAT:
                raise ValueError("unsupported format")
            return cls(int(obj["writers"]), str(obj["dir"]), tuple(map(str, obj["files"])),
                       tuple((int(f), int(a)) for f, a in obj["at"]), bytes(obj["layout"]))
        except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise ValueError(f"store index of writer {writer} is malformed: {exc}") from None

    def rank_layout(self, writer: int) -> RankLayout:
        return decode_layout(self.layout, rank=writer, load_model=lambda digest: {})

    def map_sources(self, layout: RankLayout, writer: int) -> dict[tuple[int, str], torch.Tensor]:
        """(writer, shard) -> the shard's flat tensor, mapped from the writer's arena files."""
        files = []
        for name in self.files:
            path = os.path.join(self.directory, name)
            try:
                files.append(torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8))
            except (FileNotFoundError, RuntimeError) as exc:
                raise GoneError(str(exc)) from exc
        out = {}
        for shard, (file_index, at) in zip(layout.shards, self.at, strict=True):
            out[(writer, shard.name)] = files[file_index][at: at + shard.nbytes].view(TORCH_DTYPES[shard.dtype])
        return out
