"""One side of a job (every writer, or every reader) as arrays: the roster's layouts, columnar.

Every rank plans from every rank's layout at job start. At a thousand ranks those layouts hold
a few hundred thousand regions, and building a :class:`RankLayout` of Python objects for each
rank costs seconds on every rank. A :class:`Roster` holds them as numpy columns from the layout
kinds to the planner (:meth:`LayoutKind.roster` builds every rank of a kind at once); objects
are built for one rank's own shards only (:meth:`Roster.layout`).

Rows are regions, sorted by rank, then by shard in the rank's own order, then in the shard's
region order: exactly the order of the rank layouts' objects. Regions with an empty box are
not rows (they move nothing).

    side = kind.roster(spec)                  # every rank of a layout kind, without objects
    side = Roster.from_layouts(layouts)       # explicit shard lists (objects)
    side = Roster.concat([side, other])       # ranks of both, in rank order
    mine = side.layout(3)                     # rank 3's RankLayout
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.layout.box import Box
from weightsync.layout.columns import DTYPE_CODES, RegionColumns, layout_columns
from weightsync.layout.types import DTYPE_ITEMSIZE, CanonicalTensor, RankLayout, Region, Shard

_ITEMSIZE = np.array([DTYPE_ITEMSIZE[d] for d in DTYPE_CODES], dtype=np.int64)


def _pad(a: np.ndarray, width: int, fill: int) -> np.ndarray:
    extra = width - a.shape[1]
    return a if extra <= 0 else np.hstack([a, np.full((a.shape[0], extra), fill, dtype=np.int64)])


@dataclass(frozen=True, eq=False)
class ShardColumns:
    """Shards of many ranks: rank, name, dtype (index in ``DTYPE_CODES``), shape padded with 1s."""

    rank: np.ndarray
    names: Sequence[str]
    dtype: np.ndarray
    shape: np.ndarray
    ndim: np.ndarray

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    def shape_of(self, i: int) -> tuple[int, ...]:
        return tuple(int(x) for x in self.shape[i, : int(self.ndim[i])])

    def dtype_of(self, i: int) -> str:
        return DTYPE_CODES[int(self.dtype[i])]

    def take(self, index: np.ndarray) -> ShardColumns:
        names = self.names
        return ShardColumns(self.rank[index], [names[i] for i in index.tolist()], self.dtype[index],
                            self.shape[index], self.ndim[index])

    @staticmethod
    def empty() -> ShardColumns:
        z = np.zeros(0, dtype=np.int64)
        return ShardColumns(z, [], z, np.zeros((0, 1), dtype=np.int64), z)

    @staticmethod
    def concat(parts: Sequence[ShardColumns]) -> ShardColumns:
        width = max((p.shape.shape[1] for p in parts), default=1)
        return ShardColumns(np.concatenate([p.rank for p in parts]), [n for p in parts for n in p.names],
                            np.concatenate([p.dtype for p in parts]),
                            np.concatenate([_pad(p.shape, width, 1) for p in parts]),
                            np.concatenate([p.ndim for p in parts]))

    def digest_update(self, hasher: object) -> None:
        """Feed ranks, names, dtypes and shapes into a hashlib object (for plan fingerprints)."""
        for arr in (self.rank, self.dtype, self.ndim):
            hasher.update(np.ascontiguousarray(arr).tobytes())  # type: ignore[attr-defined]
        shape = np.where(np.arange(self.shape.shape[1]) < self.ndim[:, None], self.shape, 0)
        hasher.update(np.ascontiguousarray(shape).tobytes())  # type: ignore[attr-defined]
        hasher.update("\n".join(self.names).encode())  # type: ignore[attr-defined]


@dataclass(frozen=True, eq=False)
class Roster:
    """Every rank of one side as columns (see module docstring).

    ``ranks`` lists the side's ranks, ascending (a rank may hold no shard); ``canonical[
    rank_canonical[i]]`` is the canonical tensors of ``ranks[i]``. Region rows: ``rank``,
    ``shard`` (index in ``shards``), ``name_idx`` (in ``names``), the canonical box ``off`` /
    ``size`` and the local strided view ``loff`` / ``stride`` (2-d arrays padded with unit
    dims to a common width; ``ndim`` is each row's own), ``itemsize`` and ``dtype`` (of the
    shard).
    """

    ranks: np.ndarray
    canonical: tuple[Mapping[str, CanonicalTensor], ...]
    rank_canonical: np.ndarray
    names: tuple[str, ...]
    rank: np.ndarray
    shard: np.ndarray
    name_idx: np.ndarray
    off: np.ndarray
    size: np.ndarray
    loff: np.ndarray
    stride: np.ndarray
    ndim: np.ndarray
    dtype: np.ndarray
    shards: ShardColumns

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    @property
    def width(self) -> int:
        return int(self.off.shape[1])

    @property
    def itemsize(self) -> np.ndarray:
        return _ITEMSIZE[self.dtype]

    @property
    def num_ranks(self) -> int:
        return int(self.ranks.shape[0])

    def canonical_tensors(self) -> Mapping[str, CanonicalTensor]:
        """The canonical tensors of every rank (one mapping when the side shares one)."""
        if len(self.canonical) == 1:
            return self.canonical[0]
        merged: dict[str, CanonicalTensor] = {}
        for mapping in self.canonical:
            merged.update(mapping)
        return merged

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def of(cls, side: Roster | Sequence[RankLayout]) -> Roster:
        """A side given as rank layouts, in columns (a roster is returned as it is)."""
        return side if isinstance(side, Roster) else cls.from_layouts(side)

    @classmethod
    def from_layouts(cls, layouts: Sequence[RankLayout]) -> Roster:
        """The columns of explicit rank layouts (validated once per shared template)."""
        layouts = sorted(layouts, key=lambda lay: lay.rank)
        names: dict[str, int] = {}
        canon: dict[int, int] = {}
        canonical: list[Mapping[str, CanonicalTensor]] = []
        templates: dict[int, tuple[RegionColumns, np.ndarray, ShardColumns]] = {}
        rows: list[tuple[RegionColumns, np.ndarray, int, int]] = []
        shard_parts: list[ShardColumns] = []
        base = 0
        for layout in layouts:
            cols = layout_columns(layout)  # cached on the layout, shared by replicas
            known = templates.get(id(cols))
            if known is None:
                ids = np.array([names.setdefault(n, len(names)) for n in cols.names], dtype=np.int64)
                shards = layout.shards
                known = templates[id(cols)] = (cols, ids[cols.name_idx] if len(ids) else cols.name_idx, ShardColumns(
                    np.zeros(len(shards), dtype=np.int64), [s.name for s in shards],
                    np.array([DTYPE_CODES.index(s.dtype) for s in shards], dtype=np.int64),
                    shape_array([s.shape for s in shards]), np.array([len(s.shape) for s in shards], dtype=np.int64)))
            cols, name_idx, shard_cols = known
            rows.append((cols, name_idx, layout.rank, base))
            shard_parts.append(ShardColumns(np.full(len(shard_cols), layout.rank, dtype=np.int64), shard_cols.names,
                                            shard_cols.dtype, shard_cols.shape, shard_cols.ndim))
            base += len(shard_cols)
            if id(layout.canonical) not in canon:
                canon[id(layout.canonical)] = len(canonical)
                canonical.append(layout.canonical)
        width = max((c.width for c, _, _, _ in rows), default=1)
        padded = {id(c): c.padded(width) for c, _, _, _ in rows}
        z = np.zeros(0, dtype=np.int64)
        z2 = np.zeros((0, width), dtype=np.int64)

        def cat(arrays: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
            return np.concatenate(arrays) if arrays else empty

        return cls(
            ranks=np.array([lay.rank for lay in layouts], dtype=np.int64),
            canonical=tuple(canonical),
            rank_canonical=np.array([canon[id(lay.canonical)] for lay in layouts], dtype=np.int64),
            names=tuple(names),
            rank=cat([np.full(len(c), r, dtype=np.int64) for c, _, r, _ in rows], z),
            shard=cat([c.shard_idx + b for c, _, _, b in rows], z),
            name_idx=cat([i for _, i, _, _ in rows], z),
            off=cat([padded[id(c)].off for c, _, _, _ in rows], z2),
            size=cat([padded[id(c)].size for c, _, _, _ in rows], z2),
            loff=cat([c.loff for c, _, _, _ in rows], z),
            stride=cat([padded[id(c)].stride for c, _, _, _ in rows], z2),
            ndim=cat([c.ndim for c, _, _, _ in rows], z),
            dtype=cat([c.dtype for c, _, _, _ in rows], z),
            shards=ShardColumns.concat(shard_parts) if shard_parts else ShardColumns.empty(),
        )

    @classmethod
    def concat(cls, parts: Sequence[Roster]) -> Roster:
        """The ranks of all ``parts`` in one roster, in rank order."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            raise ValueError("a roster needs at least one part")
        names: dict[str, int] = {}
        maps = [np.array([names.setdefault(n, len(names)) for n in p.names], dtype=np.int64) for p in parts]
        width = max(p.width for p in parts)
        shard_base = np.cumsum([0] + [len(p.shards) for p in parts])
        canonical: list[Mapping[str, CanonicalTensor]] = []
        rank_canonical = []
        for p in parts:
            ids = {id(m): i for i, m in enumerate(canonical)}
            local = []
            for m in p.canonical:
                if id(m) not in ids:
                    ids[id(m)] = len(canonical)
                    canonical.append(m)
                local.append(ids[id(m)])
            rank_canonical.append(np.array(local, dtype=np.int64)[p.rank_canonical])
        merged = cls(
            ranks=np.concatenate([p.ranks for p in parts]),
            canonical=tuple(canonical),
            rank_canonical=np.concatenate(rank_canonical),
            names=tuple(names),
            rank=np.concatenate([p.rank for p in parts]),
            shard=np.concatenate([p.shard + b for p, b in zip(parts, shard_base.tolist(), strict=False)]),
            name_idx=np.concatenate([m[p.name_idx] if len(m) else p.name_idx for p, m in zip(parts, maps,
                                                                                           strict=True)]),
            off=np.concatenate([_pad(p.off, width, 0) for p in parts]),
            size=np.concatenate([_pad(p.size, width, 1) for p in parts]),
            loff=np.concatenate([p.loff for p in parts]),
            stride=np.concatenate([_pad(p.stride, width, 0) for p in parts]),
            ndim=np.concatenate([p.ndim for p in parts]),
            dtype=np.concatenate([p.dtype for p in parts]),
            shards=ShardColumns.concat([p.shards for p in parts]),
        )
        return merged.sorted_by_rank()

    def sorted_by_rank(self) -> Roster:
        """The same roster with ranks, shards and rows in rank order (stable within a rank)."""
        if np.all(self.ranks[1:] >= self.ranks[:-1]) and np.all(self.shards.rank[1:] >= self.shards.rank[:-1]) \
                and np.all(self.rank[1:] >= self.rank[:-1]):
            return self
        by_rank = np.argsort(self.ranks, kind="stable")
        shard_order = np.argsort(self.shards.rank, kind="stable")
        new_index = np.empty(len(shard_order), dtype=np.int64)
        new_index[shard_order] = np.arange(len(shard_order))
        rows = np.argsort(self.rank, kind="stable")
        return self._rows(rows, self.shards.take(shard_order), new_index[self.shard[rows]],
                          self.ranks[by_rank], self.rank_canonical[by_rank])

    def select(self, ranks: Sequence[int] | np.ndarray) -> Roster:
        """The roster of ``ranks`` only (each must be one of this roster's ranks)."""
        want = np.asarray(ranks, dtype=np.int64)
        if len(want) == len(self.ranks) and np.array_equal(np.sort(want), self.ranks):
            return self
        missing = np.setdiff1d(want, self.ranks)
        if missing.size:
            raise ValueError(f"rank(s) {missing[:8].tolist()} are not in this roster (ranks "
                             f"{int(self.ranks.min())}..{int(self.ranks.max())})")
        keep_shards = np.flatnonzero(np.isin(self.shards.rank, want))
        new_index = np.full(len(self.shards), -1, dtype=np.int64)
        new_index[keep_shards] = np.arange(len(keep_shards))
        rows = np.flatnonzero(np.isin(self.rank, want))
        keep_ranks = np.flatnonzero(np.isin(self.ranks, want))
        return self._rows(rows, self.shards.take(keep_shards), new_index[self.shard[rows]],
                          self.ranks[keep_ranks], self.rank_canonical[keep_ranks])

    def _rows(self, rows: np.ndarray, shards: ShardColumns, shard: np.ndarray, ranks: np.ndarray,
              rank_canonical: np.ndarray) -> Roster:
        return Roster(ranks, self.canonical, rank_canonical, self.names, self.rank[rows], shard,
                      self.name_idx[rows], self.off[rows], self.size[rows], self.loff[rows], self.stride[rows],
                      self.ndim[rows], self.dtype[rows], shards)

    # -- objects for a rank ---------------------------------------------------------------
    def layout(self, rank: int) -> RankLayout:
        """Rank ``rank``'s layout as objects (its regions with an empty box left out)."""
        at = np.searchsorted(self.ranks, rank)
        if at >= len(self.ranks) or self.ranks[at] != rank:
            raise KeyError(f"rank {rank} is not in this roster")
        s_lo, s_hi = np.searchsorted(self.shards.rank, [rank, rank + 1])
        r_lo, r_hi = np.searchsorted(self.rank, [rank, rank + 1])
        regions: list[list[Region]] = [[] for _ in range(s_hi - s_lo)]
        names = self.names
        for shard, name, nd, off, size, loff, stride in zip(
                (self.shard[r_lo:r_hi] - s_lo).tolist(), self.name_idx[r_lo:r_hi].tolist(),
                self.ndim[r_lo:r_hi].tolist(), self.off[r_lo:r_hi].tolist(), self.size[r_lo:r_hi].tolist(),
                self.loff[r_lo:r_hi].tolist(), self.stride[r_lo:r_hi].tolist(), strict=True):
            regions[shard].append(Region(names[name], Box(tuple(off[:nd]), tuple(size[:nd])), loff,
                                         tuple(stride[:nd])))
        cols = self.shards
        shards = tuple(Shard(cols.names[i], cols.shape_of(i), cols.dtype_of(i), tuple(regions[i - s_lo]))
                       for i in range(s_lo, s_hi))
        return RankLayout(rank, shards, self.canonical[int(self.rank_canonical[at])])

    def layouts(self) -> list[RankLayout]:
        """Every rank's layout as objects (for tests and small jobs: this is what rosters avoid)."""
        return [self.layout(int(r)) for r in self.ranks]

    def digest_update(self, hasher: object) -> None:
        """Feed the ranks and shards into a hashlib object (the rows are the planner's to hash)."""
        hasher.update(np.ascontiguousarray(self.ranks).tobytes())  # type: ignore[attr-defined]
        self.shards.digest_update(hasher)


def shape_array(shapes: Sequence[tuple[int, ...]]) -> np.ndarray:
    """Shapes as rows, padded with 1s to the longest."""
    width = max((len(s) for s in shapes), default=1) or 1
    return np.array([(*s, *(1,) * (width - len(s))) for s in shapes], dtype=np.int64).reshape(len(shapes), width)


__all__ = ["Roster", "ShardColumns", "shape_array"]
