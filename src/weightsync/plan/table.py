"""Columnar (numpy) view of many ranks' regions, the planner's working representation.

A thousand ranks hold a few hundred thousand regions; the planner joins, intersects and
balances them with vectorised numpy instead of Python objects. Every region becomes one
row: its rank, shard, canonical tensor id, box (padded with unit trailing dims to a common
rank ``ndim``), and its local strided view.

    table = RegionTable.build(layouts, tensor_ids, ndim)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.layout.columns import layout_columns
from weightsync.layout.types import RankLayout


@dataclass(frozen=True, slots=True)
class ShardRef:
    """Which rank's which local tensor a row's region lives in."""

    rank: int
    name: str
    dtype: str


class ShardIndex(Sequence[ShardRef]):
    """All shards of many ranks, numbered consecutively; refs are made on demand.

    A thousand ranks hold hundreds of thousands of shards: creating an object per shard
    for every plan would cost more than planning itself.
    """

    def __init__(self, layouts: Sequence[RankLayout]) -> None:
        self.layouts = tuple(layouts)
        counts = [len(lay.shards) for lay in self.layouts]
        self.base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.base[-1])

    def __getitem__(self, index):  # type: ignore[no-untyped-def, override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        k = int(np.searchsorted(self.base, index, side="right")) - 1
        layout = self.layouts[k]
        shard = layout.shards[index - int(self.base[k])]
        return ShardRef(layout.rank, shard.name, shard.dtype)

    def digest_update(self, hasher: object) -> None:
        for layout in self.layouts:
            cols = layout_columns(layout)
            hasher.update(f"{layout.rank}:{cols.digest}\n".encode())  # type: ignore[attr-defined]


@dataclass(frozen=True, eq=False)
class RegionTable:
    """One row per region. All arrays have the same length; 2-d ones are ``(n, ndim)``."""

    rank: np.ndarray
    shard: np.ndarray
    tensor: np.ndarray
    off: np.ndarray
    size: np.ndarray
    loff: np.ndarray
    lstride: np.ndarray
    itemsize: np.ndarray
    dtype: np.ndarray
    shards: ShardIndex

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    @property
    def volume(self) -> np.ndarray:
        return np.prod(self.size, axis=1)

    def take(self, index: np.ndarray) -> RegionTable:
        """Rows ``index`` (shard references are kept whole)."""
        return RegionTable(self.rank[index], self.shard[index], self.tensor[index], self.off[index],
                           self.size[index], self.loff[index], self.lstride[index],
                           self.itemsize[index], self.dtype[index], self.shards)

    @classmethod
    def build(cls, layouts: Sequence[RankLayout], tensor_ids: Mapping[str, int], ndim: int) -> RegionTable:
        """Concatenate the ranks' cached columnar regions; ``tensor_ids`` numbers the names."""
        index = ShardIndex(layouts)
        parts = []
        for k, layout in enumerate(index.layouts):
            cols = layout_columns(layout).padded(ndim)
            ids = np.array([tensor_ids[n] for n in cols.names], dtype=np.int64)
            parts.append((np.full(len(cols), layout.rank, dtype=np.int64),
                          cols.shard_idx + index.base[k], ids[cols.name_idx] if len(ids) else cols.name_idx,
                          cols))
        if not parts:
            z = np.zeros(0, dtype=np.int64)
            z2 = np.zeros((0, ndim), dtype=np.int64)
            return cls(z, z, z, z2, z2, z, z2, z, z, index)
        return cls(
            rank=np.concatenate([p[0] for p in parts]),
            shard=np.concatenate([p[1] for p in parts]),
            tensor=np.concatenate([p[2] for p in parts]),
            off=np.concatenate([p[3].off for p in parts]),
            size=np.concatenate([p[3].size for p in parts]),
            loff=np.concatenate([p[3].loff for p in parts]),
            lstride=np.concatenate([p[3].stride for p in parts]),
            itemsize=np.concatenate([p[3].itemsize for p in parts]),
            dtype=np.concatenate([p[3].dtype for p in parts]),
            shards=index,
        )

    def digest_update(self, hasher: object) -> None:
        """Feed every column into a hashlib object (for plan fingerprints)."""
        for arr in (self.rank, self.shard, self.tensor, self.off, self.size, self.loff,
                    self.lstride, self.itemsize, self.dtype):
            hasher.update(np.ascontiguousarray(arr).tobytes())  # type: ignore[attr-defined]
        self.shards.digest_update(hasher)
