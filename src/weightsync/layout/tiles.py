"""Scale tiles as boxes: which tiles a box touches or holds whole, and disjoint cuts of tile sets.

An FP8 scale covers a tile of its weight (128x128, or a row). A writer's scale shard declares
the tiles its regions touch, as few boxes as possible; tiles a writer's region cuts are
*exchanged*. At a thousand writers these are computed from the boxes themselves, for all
writers and tensors at once: a 1T MoE has 62M tiles, and painting them costs minutes.

    lo, hi, ilo, ihi = tile_bounds(off, size, tile, shape, grid)   # per box: touched, whole
    group, offs, sizes = writer_cuts(group, lo, hi, grid_of)        # disjoint boxes per group
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence

import numpy as np

from weightsync.layout.box import Box

#: A box of a scale grid as plain tuples: ``[lo, hi)``.
_Tiles = tuple[tuple[int, ...], tuple[int, ...]]


def slices(lo: Sequence[int], hi: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))


def tile_bounds(off: np.ndarray, size: np.ndarray, tile: np.ndarray, shape: np.ndarray, grid: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For boxes given as rows ``off``, ``size`` (and each row's tensor's ``tile``, ``shape`` and
    ``grid``): the tiles each touches, ``[lo, hi)``, and the tiles it holds whole, ``[ilo, ihi)``
    (a ragged last tile is whole when the box reaches the tensor's end). Clipped to the grid,
    as indexing the grid clips them."""
    end = off + size
    lo = off // tile
    hi = -(-end // tile)
    ilo = -(-off // tile)
    ihi = np.maximum(ilo, np.where(end == shape, hi, end // tile))
    return (np.minimum(lo, grid), np.minimum(hi, grid), np.minimum(ilo, grid), np.minimum(ihi, grid))


def exchanged_tiles(grid: Sequence[int], lo: np.ndarray, hi: np.ndarray, ilo: np.ndarray, ihi: np.ndarray
               ) -> np.ndarray:
    """The tiles some box touches without holding them whole (their scale needs other
    holders too). Only the boxes that cut a tile are painted."""
    out = np.zeros(tuple(grid), dtype=bool)
    cut = (hi > lo).all(1) & ((lo != ilo) | (hi != ihi)).any(1)
    for i in np.flatnonzero(cut).tolist():
        part = np.ones(hi[i] - lo[i], dtype=bool)
        if (ihi[i] > ilo[i]).all():
            part[slices(ilo[i] - lo[i], ihi[i] - lo[i])] = False
        out[slices(lo[i], hi[i])] |= part
    return out


def _grid_runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cut of a non-empty mask within each block, as ``(n, ndim)`` offsets and sizes:
    runs along the last dim merged over consecutive rows of one block holding the same run."""
    ndim = mask.ndim
    rows = mask.reshape(-1, mask.shape[-1])
    padded = np.zeros((rows.shape[0], rows.shape[1] + 2), dtype=np.int8)
    padded[:, 1:-1] = rows
    step = np.diff(padded, axis=1)
    start_row, start_col = np.nonzero(step == 1)  # row-major: a row's runs left to right
    _, end_col = np.nonzero(step == -1)
    length = end_col - start_col
    order = np.lexsort((start_row, length, start_col))
    row, col, length = start_row[order], start_col[order], length[order]
    block = mask.shape[-2] if ndim > 1 else 1
    chained = np.zeros(len(row), dtype=bool)
    chained[1:] = ((col[1:] == col[:-1]) & (length[1:] == length[:-1]) & (row[1:] == row[:-1] + 1)
                   & (row[1:] % block != 0))
    heads = np.flatnonzero(~chained)
    count = np.diff(np.append(heads, len(row)))
    lead = np.unravel_index(row[heads], mask.shape[:-1]) if ndim > 1 else ()
    offs = np.stack([*lead, col[heads]], axis=1).astype(np.int64)
    ones = [np.ones(len(heads), dtype=np.int64)] * max(ndim - 2, 0)
    sizes = np.stack([*ones, *([count] if ndim > 1 else []), length[heads]], axis=1).astype(np.int64)
    return offs, sizes


def _join_experts(offs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Join boxes that differ only along the last of the leading dims (the expert), where
    one ends and the next begins; sorted by offsets (boxes are disjoint: offsets order them)."""
    d = offs.shape[1] - 3
    if d >= 0 and len(offs) > 1:
        rest = [c for c in range(offs.shape[1]) if c != d]
        order = np.lexsort([offs[:, d], *(sizes[:, c] for c in rest), *(offs[:, c] for c in rest)])
        offs, sizes = offs[order], sizes[order]
        joined = np.zeros(len(offs), dtype=bool)
        joined[1:] = ((offs[1:, rest] == offs[:-1, rest]).all(1) & (sizes[1:, rest] == sizes[:-1, rest]).all(1)
                      & (offs[1:, d] == offs[:-1, d] + sizes[:-1, d]))
        heads = np.flatnonzero(~joined)
        last = np.append(heads[1:], len(offs)) - 1
        ends = offs[last, d] + sizes[last, d]
        offs, sizes = offs[heads], sizes[heads]
        sizes[:, d] = ends - offs[:, d]
    by_offset = np.lexsort(offs.T[::-1])
    return offs[by_offset], sizes[by_offset]


def _boxes(offs: np.ndarray, sizes: np.ndarray) -> list[Box]:
    return [Box(tuple(o), tuple(s)) for o, s in zip(offs.tolist(), sizes.tolist(), strict=True)]


def grid_boxes(mask: np.ndarray) -> list[Box]:
    """Disjoint boxes covering the True cells of a boolean grid, sorted by offsets.

    Within each *block* (one index of the dims before the last two: one expert of a
    stack), runs along the last dim merged over consecutive rows holding the same run;
    then a box of consecutive experts where their boxes are the same. A writer's scale
    shard declares these boxes: a 1T MoE's writer holds 6 consecutive experts of each
    stack, so its scale tiles are one box, and one op per reader, rather than six.
    """
    if mask.ndim == 0 or not mask.any():
        return []
    return _boxes(*_join_experts(*_grid_runs(mask)))


def _union_boxes(boxes: Sequence[_Tiles], grid: Sequence[int]) -> list[Box]:
    """:func:`grid_boxes` of the grid cells ``boxes`` cover, without painting the grid.

    A block one box covers is cut as that box (the usual case: whole experts, whole TP
    shards); a block several different boxes cover is painted inside their bounding
    rectangle only (rows outside it are empty and end every run).
    """
    distinct = sorted({(lo, hi) for lo, hi in boxes if all(map(operator.lt, lo, hi))})
    if not grid or not distinct:
        return []
    lead = max(len(grid) - 2, 0)
    if len(distinct) == 1 and lead == 0:
        ((lo, hi),) = distinct
        return [Box(lo, tuple(map(operator.sub, hi, lo)))]
    if lead == 1 and all(b[0][0] >= a[1][0] for a, b in itertools.pairwise(distinct)):
        # No two boxes share an expert: each is its experts' cut, and joins its neighbour
        # along the experts when they hold the same rows and columns.
        runs: list[list[tuple[int, ...]]] = []
        for lo, hi in sorted(distinct, key=lambda b: (b[0][1:], b[1][1:], b[0][0])):
            if runs and runs[-1][0][1:] == lo[1:] and runs[-1][1][1:] == hi[1:] and runs[-1][1][0] == lo[0]:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
        return [Box(lo, tuple(map(operator.sub, hi, lo))) for lo, hi in sorted(runs)]
    blocks: dict[tuple[int, ...], list[_Tiles]] = {}
    for lo, hi in distinct:
        rect = (lo[lead:], hi[lead:])
        for key in itertools.product(*(range(a, b) for a, b in zip(lo[:lead], hi[:lead], strict=True))):
            blocks.setdefault(key, []).append(rect)
    offs: list[tuple[int, ...]] = []
    sizes: list[tuple[int, ...]] = []
    ones = (1,) * lead
    for key, rects in blocks.items():
        if len(rects) == 1:
            lo, hi = rects[0]
            offs.append(key + lo)
            sizes.append(ones + tuple(map(operator.sub, hi, lo)))
            continue
        corner = np.min([lo for lo, _ in rects], axis=0)
        mask = np.zeros(np.max([hi for _, hi in rects], axis=0) - corner, dtype=bool)
        for lo, hi in rects:
            mask[slices(np.subtract(lo, corner), np.subtract(hi, corner))] = True
        cut_offs, cut_sizes = _grid_runs(mask)
        offs.extend(key + tuple(o) for o in (cut_offs + corner).tolist())
        sizes.extend(ones + tuple(s) for s in cut_sizes.tolist())
    return _boxes(*_join_experts(np.array(offs, dtype=np.int64), np.array(sizes, dtype=np.int64)))


def writer_cuts(group: np.ndarray, lo: np.ndarray, hi: np.ndarray, grid_of: Callable[[int], Sequence[int]]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_union_boxes` of each group's tile boxes (a group: one writer's boxes of one
    tensor), for all groups at once: (group, offsets, sizes) rows, by group and offsets.

    The usual group is one box of a 2-d weight, or experts no other of its boxes holds:
    those cuts are joined along the experts in one pass over all groups; any other group is
    cut on its own.
    """
    ndim = lo.shape[1]
    keep = (hi > lo).all(1)
    rows = np.column_stack([group[keep], lo[keep], hi[keep]])
    rows = rows[np.lexsort(rows.T[::-1])]  # by group, then box
    rows = rows[np.append(True, (rows[1:] != rows[:-1]).any(1))] if len(rows) else rows
    group, lo, hi = rows[:, 0], rows[:, 1:1 + ndim], rows[:, 1 + ndim:]
    lead = max(ndim - 2, 0)
    same = group[1:] == group[:-1]
    # Easy: one box of a 2-d weight; boxes that touch no expert twice. Else: cut each alone.
    clash = same & (lo[1:, 0] < hi[:-1, 0]) if lead == 1 else same | (lead > 1)
    alone = np.zeros(len(rows), dtype=bool)
    alone[1:] |= clash
    alone[:-1] |= clash | (lead > 1)
    hard = np.unique(group[alone])
    easy = ~np.isin(group, hard)
    offs = np.column_stack([group[easy], lo[easy]])
    sizes = np.column_stack([np.ones(int(easy.sum()), dtype=np.int64), hi[easy] - lo[easy]])
    if lead == 1:
        offs, sizes = _join_experts(offs, sizes)  # joins along the expert column, groups apart
    parts_off, parts_size = [offs], [sizes]
    for g in hard.tolist():
        sel = group == g
        boxes = _union_boxes(list(zip(map(tuple, lo[sel].tolist()), map(tuple, hi[sel].tolist()), strict=True)),
                             grid_of(g))
        parts_off.append(np.array([(g, *b.offsets) for b in boxes], dtype=np.int64).reshape(-1, ndim + 1))
        parts_size.append(np.array([(1, *b.sizes) for b in boxes], dtype=np.int64).reshape(-1, ndim + 1))
    offs, sizes = np.concatenate(parts_off), np.concatenate(parts_size)
    order = np.lexsort(offs.T[::-1])
    return offs[order, 0], offs[order, 1:], sizes[order, 1:]


__all__ = ["exchanged_tiles", "grid_boxes", "tile_bounds", "writer_cuts"]
