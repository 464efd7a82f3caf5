"""Columnar (numpy) view of many ranks' regions, the planner's working representation.

A thousand ranks hold a few hundred thousand regions; the planner joins, intersects and
balances them with vectorised numpy instead of Python objects. Every region becomes one
row: its rank, shard, canonical tensor id, box (padded with unit trailing dims to a common
rank ``ndim``), and its local strided view.

    table = RegionTable.build(roster, tensor_ids, ndim)   # roster: layout.roster.Roster
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from weightsync.layout.roster import Roster, ShardColumns


@dataclass(frozen=True, slots=True)
class ShardRef:
    """Which rank's which local tensor a row's region lives in."""

    rank: int
    name: str
    dtype: str


class ShardIndex(Sequence[ShardRef]):
    """All shards of a side's ranks, numbered as the roster numbers them; refs are made on demand.

    A thousand ranks hold hundreds of thousands of shards: creating an object per shard
    for every plan would cost more than planning itself.
    """

    def __init__(self, shards: ShardColumns) -> None:
        self.columns = shards

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, index):  # type: ignore[no-untyped-def, override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        cols = self.columns
        return ShardRef(int(cols.rank[index]), cols.names[index], cols.dtype_of(index))


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
    roster: Roster

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    @cached_property
    def volume(self) -> np.ndarray:
        return np.prod(self.size, axis=1)

    def take(self, index: np.ndarray) -> RegionTable:
        """Rows ``index`` (shard references are kept whole)."""
        return RegionTable(self.rank[index], self.shard[index], self.tensor[index], self.off[index],
                           self.size[index], self.loff[index], self.lstride[index],
                           self.itemsize[index], self.dtype[index], self.shards, self.roster)

    @classmethod
    def build(cls, roster: Roster, tensor_ids: Mapping[str, int], ndim: int) -> RegionTable:
        """A side's rows with canonical names numbered by ``tensor_ids``, boxes padded to ``ndim`` dims."""
        ids = np.array([tensor_ids[n] for n in roster.names], dtype=np.int64)
        extra = ndim - roster.width
        pad0 = np.zeros((len(roster), max(extra, 0)), dtype=np.int64)
        return cls(
            rank=roster.rank,
            shard=roster.shard,
            tensor=ids[roster.name_idx] if len(ids) else roster.name_idx,
            off=np.hstack([roster.off, pad0]) if extra > 0 else roster.off,
            size=np.hstack([roster.size, pad0 + 1]) if extra > 0 else roster.size,
            loff=roster.loff,
            lstride=np.hstack([roster.stride, pad0]) if extra > 0 else roster.stride,
            itemsize=roster.itemsize,
            dtype=roster.dtype,
            shards=ShardIndex(roster.shards),
            roster=roster,
        )

    def digest_update(self, hasher: object) -> None:
        """Feed every column into a hashlib object (for plan fingerprints)."""
        for arr in (self.rank, self.shard, self.tensor, self.off, self.size, self.loff,
                    self.lstride, self.itemsize, self.dtype):
            hasher.update(np.ascontiguousarray(arr).tobytes())  # type: ignore[attr-defined]
        self.roster.digest_update(hasher)
