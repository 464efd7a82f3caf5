"""What writers offer FP8 readers: an FP8 twin of each shard, and the scale tiles they can compute.

Writers hold only the model-dtype weight ``X``; an FP8 reader asks for ``X#<scheme>`` and its
scale tensor (:mod:`weightsync.layout.quant`). Every rank derives, from the same roster,
what each writer offers in addition (:func:`quantized_sources`): an FP8 twin of each of its
shards with quantized regions (same geometry, so the planner's offsets address both), and a
scale shard declaring the tiles its regions touch. The planner then plans FP8 like any other
dtype.

A scale depends on a whole tile; a tile cut by any writer's region boundary (an FSDP row
cut, a ZeRO-3 flat partition, a K-split row for per-channel scales) is *exchanged*: every
holder publishes its partial maximum and each sender takes the maximum of all
(:class:`weightsync.codecs.fp8.WriterQuantizer`). Every other tile lies whole inside one region
of each of its holders, which computes it alone.

Every rank runs this at job start, over every writer of the job, so its cost is linear in
the regions and never in the size of the scale grids (a 1T MoE has 62M scale tiles): tiles
are computed as boxes, and only the few tiles writers cut are painted on a grid.

    writers, quant = quantized_sources(writer_layouts, reader_layouts)
    plan = build_local_plan(writers, reader_layouts, role="writer", rank=3)
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from weightsync.layout.box import Box, contiguous_strides
from weightsync.layout.quant import FP8_DTYPE, Derived, QuantScheme, derived_names
from weightsync.layout.types import CanonicalTensor, RankLayout, Region, Shard

#: A box of a scale grid as plain tuples: ``[lo, hi)``.
_Tiles = tuple[tuple[int, ...], tuple[int, ...]]


# -- tile geometry ------------------------------------------------------------------------

def _slices(lo: Sequence[int], hi: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))


def _tile_bounds(off: np.ndarray, size: np.ndarray, tile: Sequence[int], shape: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For boxes given as rows ``off``, ``size``: the tiles each touches, ``[lo, hi)``, and
    the tiles it holds whole, ``[ilo, ihi)`` (a ragged last tile is whole when the box
    reaches the tensor's end). Clipped to the grid, as indexing the grid clips them."""
    t = np.array(tile, dtype=np.int64)
    s = np.array(shape, dtype=np.int64)
    grid = np.array([-(-x // y) if x else 0 for x, y in zip(shape, tile, strict=True)], dtype=np.int64)
    end = off + size
    lo = off // t
    hi = -(-end // t)
    ilo = -(-off // t)
    ihi = np.maximum(ilo, np.where(end == s, hi, end // t))
    return (np.minimum(lo, grid), np.minimum(hi, grid), np.minimum(ilo, grid), np.minimum(ihi, grid))


def _exchanged(grid: Sequence[int], lo: np.ndarray, hi: np.ndarray, ilo: np.ndarray, ihi: np.ndarray
               ) -> tuple[np.ndarray, bool]:
    """The tiles some box touches without holding them whole (their scale needs other
    holders too), and whether there are any. Only the boxes that cut a tile are painted."""
    out = np.zeros(tuple(grid), dtype=bool)
    cut = (hi > lo).all(1) & ((lo != ilo) | (hi != ihi)).any(1)
    for i in np.flatnonzero(cut).tolist():
        part = np.ones(hi[i] - lo[i], dtype=bool)
        if (ihi[i] > ilo[i]).all():
            part[_slices(ilo[i] - lo[i], ihi[i] - lo[i])] = False
        out[_slices(lo[i], hi[i])] |= part
    return out, bool(cut.any())


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
            mask[_slices(np.subtract(lo, corner), np.subtract(hi, corner))] = True
        cut_offs, cut_sizes = _grid_runs(mask)
        offs.extend(key + tuple(o) for o in (cut_offs + corner).tolist())
        sizes.extend(ones + tuple(s) for s in cut_sizes.tolist())
    return _boxes(*_join_experts(np.array(offs, dtype=np.int64), np.array(sizes, dtype=np.int64)))


# -- what writers offer -------------------------------------------------------------------

@dataclass(frozen=True)
class QuantTensor:
    """One quantized weight some reader needs: its scheme and who must exchange which tiles."""

    base: str
    scheme: QuantScheme
    shape: tuple[int, ...]
    #: tiles cut by some writer's region: their maxima are exchanged between holders
    exchanged: np.ndarray = field(repr=False, compare=False)
    #: writer ranks that touch an exchanged tile (each publishes its partial maxima)
    publishers: frozenset[int] = frozenset()

    @property
    def tile(self) -> tuple[int, ...]:
        return self.scheme.tile(self.shape)

    @property
    def grid(self) -> tuple[int, ...]:
        return self.scheme.grid(self.shape)


@dataclass(frozen=True)
class QuantSources:
    """Every quantized weight the readers need and how writers provide it (same on every rank)."""

    tensors: Mapping[str, QuantTensor]  # by FP8 canonical name (``X#scheme``)
    #: writer rank -> {derived shard name: base shard name} (FP8 twins of its shards)
    twins: Mapping[int, Mapping[str, str]]
    #: writer rank -> {scale shard name: FP8 canonical name}
    scales: Mapping[int, Mapping[str, str]]

    def __bool__(self) -> bool:
        return bool(self.tensors)


def quantized_sources(writers: Sequence[RankLayout], readers: Sequence[RankLayout]
                      ) -> tuple[list[RankLayout], QuantSources]:
    """Writer layouts as planned when readers ask for FP8, and what each writer derives.

    Each writer gains an FP8 twin ``<shard>#<scheme>`` of every shard holding a weight the
    readers want in FP8, and a scale shard ``#<scheme>/<scale name>`` (the whole scale grid)
    declaring the tiles its regions touch. Base regions no reader needs in the model dtype
    drop out of the planned layout. Pure and deterministic: every rank computes the same
    result from the roster.
    """
    wanted, needed_plain = _requests(readers)
    if not wanted:
        return list(writers), QuantSources({}, {}, {})
    by_base: dict[str, list[str]] = {}
    for fp8, d in wanted.items():
        by_base.setdefault(d.base, []).append(fp8)
    held: dict[str, list[tuple[int, Region]]] = {}  # base -> [(writer index, region)]
    for k, layout in enumerate(writers):
        for shard in layout.shards:
            for r in shard.regions:
                if r.canonical in by_base:
                    held.setdefault(r.canonical, []).append((k, r))
    ranks = [layout.rank for layout in writers]
    canonical = dict(writers[0].canonical) if writers else {}
    tensors: dict[str, QuantTensor] = {}
    derive = _Derivation(by_base, needed_plain)
    for fp8, d in sorted(wanted.items()):
        shape = _shape_of(d.base, readers, writers)
        grid = d.scheme.grid(shape)
        canonical[fp8] = CanonicalTensor(fp8, shape, FP8_DTYPE)
        scale = d.scheme.scale_name(d.base)
        canonical[scale] = CanonicalTensor(scale, grid, "float32")
        tensors[fp8], derive.cuts[fp8] = _quant_tensor(d, shape, held.get(d.base, []), ranks)
        derive.scale_of[fp8] = (d.scheme.name, scale, grid, contiguous_strides(grid))
    out = []
    twins: dict[int, dict[str, str]] = {}
    scales: dict[int, dict[str, str]] = {}
    done: dict[int, tuple[tuple[Shard, ...], dict[str, str], dict[str, str]]] = {}
    for k, layout in enumerate(writers):
        # Replicas share their shards tuple (``RankLayout.with_rank``): derive theirs once.
        if id(layout.shards) not in done:
            done[id(layout.shards)] = derive.writer(k, layout)
        shards, twins[layout.rank], scales[layout.rank] = done[id(layout.shards)]
        out.append(RankLayout(layout.rank, shards, canonical))
    return out, QuantSources(tensors, twins, scales)


def _requests(readers: Sequence[RankLayout]) -> tuple[dict[str, Derived], set[str]]:
    """The FP8 tensors readers ask for, and the tensors some reader wants in the model dtype."""
    wanted: dict[str, Derived] = {}
    needed_plain: set[str] = set()
    seen: set[int] = set()
    derived_of: dict[int, dict[str, Derived]] = {}
    for layout in readers:
        if id(layout.shards) in seen:  # replicas ask for the same
            continue
        seen.add(id(layout.shards))
        derived = derived_of.get(id(layout.canonical))
        if derived is None:
            derived = derived_of[id(layout.canonical)] = derived_names(layout.canonical)
        for shard in layout.shards:
            for r in shard.regions:
                d = derived.get(r.canonical)
                if d is None:
                    needed_plain.add(r.canonical)
                elif not d.is_scale:
                    wanted[r.canonical] = d
    return wanted, needed_plain


def _shape_of(base: str, readers: Sequence[RankLayout], writers: Sequence[RankLayout]) -> tuple[int, ...]:
    for layout in (*writers, *readers):
        if base in layout.canonical:
            return layout.canonical[base].shape
    raise ValueError(f"no layout declares the shape of {base!r}")


def _quant_tensor(d: Derived, shape: tuple[int, ...], held: Sequence[tuple[int, Region]], ranks: Sequence[int]
                  ) -> tuple[QuantTensor, dict[int, list[Box]]]:
    """Which tiles of one FP8 tensor writers share and who publishes their partial maxima,
    and the cut of the tiles each writer (by index) touches, for its scale shard."""
    ndim = len(shape)
    bad = next(((k, r) for k, r in held if r.box.ndim != ndim), None)
    if bad is not None:
        raise ValueError(f"writer rank {ranks[bad[0]]} holds a {bad[1].box.ndim}-d box {bad[1].box} of "
                         f"{d.base!r}, whose shape is {shape}")
    writer = np.array([k for k, _ in held], dtype=np.int64)
    off = np.array([r.box.offsets for _, r in held], dtype=np.int64).reshape(len(held), ndim)
    size = np.array([r.box.sizes for _, r in held], dtype=np.int64).reshape(len(held), ndim)
    grid = d.scheme.grid(shape)
    lo, hi, ilo, ihi = _tile_bounds(off, size, d.scheme.tile(shape), shape)
    exchanged, any_cut = _exchanged(grid, lo, hi, ilo, ihi)
    publishers: frozenset[int] = frozenset()
    if any_cut:
        publishers = frozenset(ranks[k] for k, a, b in zip(writer.tolist(), lo.tolist(), hi.tolist(), strict=True)
                               if exchanged[_slices(a, b)].any())
    return QuantTensor(d.base, d.scheme, shape, exchanged, publishers), _writer_cuts(writer, lo, hi, grid)


def _writer_cuts(writer: np.ndarray, lo: np.ndarray, hi: np.ndarray, grid: Sequence[int]) -> dict[int, list[Box]]:
    """:func:`_union_boxes` of each writer's tile boxes, for every writer at once.

    The usual writer holds one box of a 2-d weight, or experts no other of its boxes holds:
    those cuts are joined along the experts in one pass over all writers; any other writer
    is cut on its own.
    """
    keep = (hi > lo).all(1)
    if not keep.any():
        return {}
    ndim = lo.shape[1]
    rows = np.column_stack([writer[keep], lo[keep], hi[keep]])
    rows = rows[np.lexsort(rows.T[::-1])]  # by writer, then box
    rows = rows[np.append(True, (rows[1:] != rows[:-1]).any(1))]
    writer, lo, hi = rows[:, 0], rows[:, 1:1 + ndim], rows[:, 1 + ndim:]
    lead = max(ndim - 2, 0)
    same = writer[1:] == writer[:-1]
    # Easy: one box of a 2-d weight; boxes that touch no expert twice. Else: cut each alone.
    clash = same & (lo[1:, 0] < hi[:-1, 0]) if lead == 1 else same | (lead > 1)
    alone = np.zeros(len(rows), dtype=bool)
    alone[1:] |= clash
    alone[:-1] |= clash | (lead > 1)
    hard = np.unique(writer[alone])
    hard_rows = np.isin(writer, hard)
    out: dict[int, list[Box]] = {}
    for k in hard.tolist():
        sel = writer == k
        out[k] = _union_boxes(list(zip(map(tuple, lo[sel].tolist()), map(tuple, hi[sel].tolist()), strict=True)),
                              grid)
    easy = ~hard_rows
    offs = np.column_stack([writer[easy], lo[easy]])
    sizes = np.column_stack([np.ones(int(easy.sum()), dtype=np.int64), hi[easy] - lo[easy]])
    if lead == 1:
        offs, sizes = _join_experts(offs, sizes)  # joins along the expert column, writers apart
    for (k, *o), (_, *s) in zip(offs.tolist(), sizes.tolist(), strict=True):
        out.setdefault(k, []).append(Box(tuple(o), tuple(s)))
    return out


class _Derivation:
    """Derives writers' planned shards, sharing what writers share (one call's worth).

    Layout kinds hand out the same :class:`Shard` object to every rank holding it (a
    Megatron layer's attention on each DP rank), so a shard's twin, and a scale shard for
    the same tiles, are built once and shared too: their columnar form is then cached once.
    """

    def __init__(self, by_base: Mapping[str, list[str]], needed_plain: set[str]) -> None:
        self.by_base = by_base
        self.needed_plain = needed_plain
        #: fp8 name -> {writer index: the cut of the scale tiles it touches}
        self.cuts: dict[str, dict[int, list[Box]]] = {}
        #: fp8 name -> (scheme name, scale name, grid, grid strides)
        self.scale_of: dict[str, tuple[str, str, tuple[int, ...], tuple[int, ...]]] = {}
        self._derived: dict[int, tuple[tuple[Shard, ...], dict[str, str], frozenset[str]]] = {}
        self._scales: dict[tuple[object, ...], Shard] = {}

    def writer(self, k: int, layout: RankLayout) -> tuple[tuple[Shard, ...], dict[str, str], dict[str, str]]:
        """Writer ``k``'s planned shards, twins (name -> base name), scale shards (name -> fp8)."""
        shards: list[Shard] = []
        twins: dict[str, str] = {}
        touched: set[str] = set()
        for shard in layout.shards:
            derived = self._derived.get(id(shard))
            if derived is None:
                derived = self._derived[id(shard)] = self._derive(shard)
            planned, names, fp8s = derived
            shards.extend(planned)
            twins.update(names)
            touched.update(fp8s)
        scales: dict[str, str] = {}
        for fp8 in sorted(touched):
            scale = self._scale_shard(fp8, self.cuts[fp8].get(k, []))
            shards.append(scale)
            scales[scale.name] = fp8
        return tuple(shards), twins, scales

    def _derive(self, shard: Shard) -> tuple[tuple[Shard, ...], dict[str, str], frozenset[str]]:
        """A shard as planned: what it keeps in the model dtype (if a reader needs it) and
        its FP8 twins; the twins' base names; the FP8 tensors it holds."""
        by_base = self.by_base
        fp8s = frozenset(fp8 for r in shard.regions for fp8 in by_base.get(r.canonical, ()))
        if not fp8s:  # a shard holding nothing (an FSDP rank past the rows) is not planned
            return ((shard,) if shard.regions else ()), {}, fp8s
        plain = tuple(r for r in shard.regions if r.canonical not in by_base or r.canonical in self.needed_plain)
        kept = () if not plain else (shard,) if len(plain) == len(shard.regions) else \
            (Shard(shard.name, shard.shape, shard.dtype, plain),)
        by_scheme: dict[str, list[Region]] = {}  # one FP8 twin per shard and scheme
        for r in shard.regions:
            for fp8 in by_base.get(r.canonical, ()):
                by_scheme.setdefault(self.scale_of[fp8][0], []).append(Region(fp8, r.box, r.offset, r.strides))
        twins = tuple(Shard(f"{shard.name}#{scheme}", shard.shape, FP8_DTYPE, tuple(regions))
                      for scheme, regions in sorted(by_scheme.items()))
        return kept + twins, {t.name: shard.name for t in twins}, fp8s

    def _scale_shard(self, fp8: str, boxes: list[Box]) -> Shard:
        # Writers holding the same tiles (a layer's attention on each DP rank) share one shard.
        key = (fp8, *(x for b in boxes for x in (b.offsets, b.sizes)))
        shard = self._scales.get(key)
        if shard is None:
            scheme, scale, grid, strides = self.scale_of[fp8]
            tiles = tuple(Region(scale, b, sum(map(operator.mul, b.offsets, strides)), strides) for b in boxes)
            shard = self._scales[key] = Shard(f"#{scheme}/{scale}", grid, "float32", tiles)
        return shard


__all__ = ["QuantSources", "QuantTensor", "grid_boxes", "quantized_sources"]
