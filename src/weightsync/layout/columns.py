"""Columnar (numpy) form of shards and rank layouts, computed and validated once.

A thousand-rank job has hundreds of thousands of regions. Turning them into arrays once
per shard (and sharing the result between ranks that hold identical shards, such as
inference replicas) is what keeps planning under a second per rank. Validation happens
here, vectorised: every region must lie inside its local tensor and inside its canonical
tensor; errors name the rank, shard, region and the fix.

    cols = layout_columns(rank_layout)   # cached on the RankLayout
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np

from weightsync.layout.types import DTYPE_ITEMSIZE, RankLayout, Shard, itemsize

#: Stable numbering of dtypes for the ``dtype`` column.
DTYPE_CODES: tuple[str, ...] = tuple(sorted(DTYPE_ITEMSIZE))


@dataclass(frozen=True, eq=False)
class RegionColumns:
    """Regions as arrays. ``names`` are the distinct canonical names, ``name_idx`` per row."""

    names: tuple[str, ...]
    name_idx: np.ndarray
    shard_idx: np.ndarray
    off: np.ndarray
    size: np.ndarray
    loff: np.ndarray
    stride: np.ndarray
    itemsize: np.ndarray
    ndim: np.ndarray
    #: Index of each row's local dtype in ``DTYPE_CODES``.
    dtype: np.ndarray
    #: Hash of the shard names, shapes and dtypes these rows belong to.
    digest: str = ""

    @property
    def width(self) -> int:
        return int(self.off.shape[1])

    def __len__(self) -> int:
        return int(self.name_idx.shape[0])

    def padded(self, width: int) -> RegionColumns:
        """The same rows with unit trailing dims added up to ``width`` dims."""
        extra = width - self.width
        if extra == 0:
            return self
        if extra < 0:
            raise ValueError(f"cannot narrow {self.width}-d regions to {width} dims")
        n = len(self)
        pad0 = np.zeros((n, extra), dtype=np.int64)
        return RegionColumns(self.names, self.name_idx, self.shard_idx,
                             np.hstack([self.off, pad0]), np.hstack([self.size, pad0 + 1]),
                             self.loff, np.hstack([self.stride, pad0]), self.itemsize, self.ndim,
                             self.dtype, self.digest)


def _empty(width: int) -> RegionColumns:
    z = np.zeros(0, dtype=np.int64)
    z2 = np.zeros((0, width), dtype=np.int64)
    return RegionColumns((), z, z, z2, z2, z, z2, z, z, z)


#: One region as plain Python values: (canonical name, offsets, sizes, local offset, strides).
_Row = tuple[str, tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]


def shard_rows(shard: Shard) -> tuple[_Row, ...]:
    """The non-empty regions of a shard as plain tuples, bounds-checked once (cached)."""
    cached = shard._columns
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    numel = 1
    for dim in shard.shape:
        numel *= dim
    rows = []
    for r in shard.regions:
        sizes = r.box.sizes
        if 0 in sizes:
            continue
        last = r.offset
        for size, stride in zip(sizes, r.strides, strict=True):
            last += (size - 1) * stride
        if r.offset < 0 or last >= numel:
            raise ValueError(
                f"shard {shard.name!r} {shard.shape}: region for {r.canonical!r} {r.box} "
                f"(offset {r.offset}, strides {r.strides}) reaches outside the local tensor"
            )
        rows.append((r.canonical, r.box.offsets, sizes, r.offset, r.strides))
    out = tuple(rows)
    object.__setattr__(shard, "_columns", out)
    return out


def layout_columns(layout: RankLayout) -> RegionColumns:
    """All regions of a rank as arrays (cached on it), checked against canonical shapes."""
    cached = layout._columns
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    names: dict[str, int] = {}
    name_idx: list[int] = []
    shard_idx: list[int] = []
    ndims: list[int] = []
    offs: list[tuple[int, ...]] = []
    sizes: list[tuple[int, ...]] = []
    strides: list[tuple[int, ...]] = []
    loffs: list[int] = []
    items: list[int] = []
    codes: list[int] = []
    for i, shard in enumerate(layout.shards):
        rows = shard_rows(shard)
        if not rows:
            continue
        isz = itemsize(shard.dtype)
        code = DTYPE_CODES.index(shard.dtype)
        for name, off, size, loff, stride in rows:
            name_idx.append(names.setdefault(name, len(names)))
            ndims.append(len(off))
            offs.append(off)
            sizes.append(size)
            strides.append(stride)
            loffs.append(loff)
            shard_idx.append(i)
            items.append(isz)
            codes.append(code)
    width = max(max(ndims, default=1), 1)
    if not offs:
        cols = dataclasses.replace(_empty(width), digest=_shards_digest(layout))
    else:
        if min(ndims) != width:
            pads = {n: ((0,) * (width - n), (1,) * (width - n)) for n in set(ndims)}
            offs = [o + pads[len(o)][0] for o in offs]
            sizes = [s + pads[len(s)][1] for s in sizes]
            strides = [s + pads[len(s)][0] for s in strides]
        cols = RegionColumns(
            tuple(names),
            np.array(name_idx, dtype=np.int64),
            np.array(shard_idx, dtype=np.int64),
            np.array(offs, dtype=np.int64).reshape(-1, width),
            np.array(sizes, dtype=np.int64).reshape(-1, width),
            np.array(loffs, dtype=np.int64),
            np.array(strides, dtype=np.int64).reshape(-1, width),
            np.array(items, dtype=np.int64),
            np.array(ndims, dtype=np.int64),
            np.array(codes, dtype=np.int64),
            _shards_digest(layout),
        )
        _check_canonical_bounds(layout, cols)
    object.__setattr__(layout, "_columns", cols)
    return cols


def _shards_digest(layout: RankLayout) -> str:
    text = "\n".join(f"{s.name}\0{s.shape}\0{s.dtype}" for s in layout.shards)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _check_canonical_bounds(layout: RankLayout, cols: RegionColumns) -> None:
    shapes = np.ones((len(cols.names), cols.width), dtype=np.int64)
    ndims = np.zeros(len(cols.names), dtype=np.int64)
    for i, name in enumerate(cols.names):
        tensor = layout.canonical.get(name)
        if tensor is None:
            shard = next(s for s in layout.shards if any(r.canonical == name for r in s.regions))
            raise ValueError(
                f"rank {layout.rank}: shard {shard.name!r} refers to canonical tensor {name!r}, "
                "which the layout does not declare"
            )
        if len(tensor.shape) > cols.width:
            shapes = np.hstack([shapes, np.ones((len(shapes), len(tensor.shape) - cols.width), np.int64)])
        shapes[i, : len(tensor.shape)] = tensor.shape
        ndims[i] = len(tensor.shape)
    end = cols.off + cols.size
    limit = shapes[cols.name_idx][:, : cols.width]
    bad = np.flatnonzero((end > limit).any(1) | (cols.ndim != ndims[cols.name_idx]))
    if bad.size:
        row = int(bad[0])
        name = cols.names[int(cols.name_idx[row])]
        shard = layout.shards[int(cols.shard_idx[row])]
        raise ValueError(
            f"rank {layout.rank}: shard {shard.name!r} maps box offsets {cols.off[row].tolist()} "
            f"sizes {cols.size[row].tolist()} ({int(cols.ndim[row])}-d) outside {name!r} of shape "
            f"{layout.canonical[name].shape}"
        )
