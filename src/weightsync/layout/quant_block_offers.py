"""What writers offer readers of a block format (MXFP8, MXFP4, NVFP4): values, block scales, global scales.

Writers hold only the model-dtype weight ``X``; a reader of ``quant=mxfp4`` asks for ``X``'s
values, block scales (and, for NVFP4, global scales) (:mod:`weightsync.layout.quant_block`).
Every rank derives, from the same roster, what each writer offers in addition
(:func:`block_sources`), and the planner plans it like any tensor:

* a *values twin* per writer shard and weight: a byte buffer holding, box after box, the value
  bytes of each box of the weight the shard holds (the values tensor puts the input dimension
  last and packs FP4 two a byte, so they do not share the shard's geometry);
* a *scale shard* per writer and weight (the whole block-scale tensor) declaring the blocks its
  boxes touch, and, for NVFP4, a *global-scale shard* declaring the experts (or the tensor) they touch.

A block cut by writers' boxes (an FSDP row cut inside a block, a TP split of the input
dimension that is not whole blocks) is *exchanged*: its holders publish their partial maxima
and each sender takes the maximum of all, as the FP8 tiles are
(:mod:`weightsync.layout.quant_offers`); so is an NVFP4 global scale whose weight (or expert)
no single writer holds whole. Every other block and global scale one holder computes alone.
Nothing travels twice: each byte of values or scales has one sender, picked by the planner.

    writers, blocks = block_sources(writer_roster, reader_roster)
    plan = build_local_plan(writers, reader_roster, role="writer", rank=3)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from weightsync.layout.box import Box, contiguous_strides
from weightsync.layout.columns import DTYPE_CODES
from weightsync.layout.quant_block import GLOBAL, SCALE, VALUES, BlockTensor, block_derived
from weightsync.layout.roster import Roster, ShardColumns
from weightsync.layout.tiles import exchanged_tiles, tile_bounds, writer_cuts
from weightsync.layout.types import CanonicalTensor


@dataclass(frozen=True)
class BlockOffer:
    """One weight some reader asks for in a block format, and which writers must exchange maxima."""

    tensor: BlockTensor
    #: blocks (the weight's grid) that writers' boxes cut: their maxima are exchanged
    exchanged: np.ndarray = field(repr=False, compare=False)
    #: NVFP4: global-scale cells no writer holds whole (their maxima are exchanged)
    global_exchanged: np.ndarray = field(repr=False, compare=False)
    #: writers that touch an exchanged block or global cell (each publishes its partial maxima)
    publishers: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TwinRegion:
    """A box of values bytes in a writer's twin, and the box of the weight it is made of."""

    twin: str
    offset: int  # in the twin, in bytes (elements of the values dtype)
    values_box: Box
    base_shard: str
    base_box: Box
    base_offset: int  # the weight box's strided view in the base shard
    base_strides: tuple[int, ...]


class BlockSources:
    """Every block-format weight the readers need and what each writer derives (same on every rank)."""

    def __init__(self, offers: Mapping[str, BlockOffer], writers: Roster | None = None,
                 shards: Mapping[int, Mapping[str, tuple[str, str]]] | None = None) -> None:
        self.offers = offers  # by values name
        self._writers = writers  # the writers as they hold the weights (before planning)
        self._shards = shards or {}  # rank -> planned shard name -> (what, values name)

    def __bool__(self) -> bool:
        return bool(self.offers)

    def derived_of(self, rank: int) -> Mapping[str, tuple[str, str]]:
        """Writer ``rank``'s derived shards: shard name -> (values/scale/global, values name)."""
        return self._shards.get(rank, {})

    def twin_regions(self, rank: int) -> list[TwinRegion]:
        """Writer ``rank``'s twin boxes, with the weight boxes they are made of."""
        if self._writers is None:
            return []
        layout = self._writers.layout(rank)
        out = []
        by_base = {o.tensor.base: o for o in self.offers.values()}
        for shard in layout.shards:
            for tensor_base, offer in by_base.items():
                cursor = 0
                twin = _twin_name(shard.name, offer.tensor)
                for r in shard.regions:
                    if r.canonical != tensor_base:
                        continue
                    for vbox, (k0, k1) in offer.tensor.values_boxes(r.box):
                        axis = offer.tensor.axis
                        sub = Box(tuple(k0 if d == axis else o for d, o in enumerate(r.box.offsets)),
                                  tuple(k1 - k0 if d == axis else s for d, s in enumerate(r.box.sizes)))
                        at = r.offset + sum((a - b) * st for a, b, st in zip(sub.offsets, r.box.offsets, r.strides,
                                                                              strict=True))
                        out.append(TwinRegion(twin, cursor, vbox, shard.name, sub, at, r.strides))
                        cursor += vbox.numel
        return out


def _twin_name(shard: str, tensor: BlockTensor) -> str:
    return f"{shard}#{tensor.scheme.name}/{tensor.base}"


def block_sources(writers: Roster | Sequence, readers: Roster | Sequence) -> tuple[Roster, BlockSources]:
    """Writers as planned when readers ask for a block format, and what each writer derives
    (see module docstring). Pure and deterministic: every rank computes the same from the roster.

    Raises:
        ValueError: a writer's box cuts a byte of packed FP4 codes, or a weight is asked for in
            two formats.
    """
    w, r = Roster.of(writers), Roster.of(readers)
    wanted: dict[str, BlockTensor] = {}
    used = {r.names[i] for i in np.unique(r.name_idx).tolist()}
    needed_plain: set[str] = set()
    derived: dict[str, tuple[BlockTensor, str]] = {}
    for mapping in r.canonical:
        derived.update(block_derived(mapping))
    for name in used:
        found = derived.get(name)
        if found is None:
            needed_plain.add(name)
            continue
        tensor = found[0]
        other = wanted.get(tensor.base)
        if other is not None and other != tensor:
            raise ValueError(f"readers ask for {tensor.base!r} in {other.scheme.name} and {tensor.scheme.name}: "
                             "one format per weight")
        wanted[tensor.base] = tensor
    if not wanted:
        return w, BlockSources({})
    return _planned(w, wanted, needed_plain)


@dataclass
class _New:
    """The derived shards and rows being built: shards (rank, name, dtype, shape); rows (shard
    index, canonical name, offsets, sizes, local offset, strides); per rank, what each shard is."""

    shards: list[tuple[int, str, str, tuple[int, ...]]] = field(default_factory=list)
    rows: list[tuple[int, str, tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]] = field(default_factory=list)
    owners: dict[int, dict[str, tuple[str, str]]] = field(default_factory=dict)

    def shard(self, rank: int, name: str, dtype: str, shape: tuple[int, ...], *, what: str, values: str) -> int:
        self.shards.append((rank, name, dtype, shape))
        self.owners.setdefault(rank, {})[name] = (what, values)
        return len(self.shards) - 1


def _planned(w: Roster, wanted: Mapping[str, BlockTensor], needed_plain: set[str]) -> tuple[Roster, BlockSources]:
    ids = {n: i for i, n in enumerate(w.names)}
    names = list(w.names)
    extra: dict[str, CanonicalTensor] = {}
    for tensor in wanted.values():
        for name, t in tensor.derived().items():
            extra[name] = t
            if name not in ids:
                ids[name] = len(names)
                names.append(name)
    keep_name = np.array([n not in wanted or n in needed_plain for n in w.names], dtype=bool)
    kept_rows = np.flatnonzero(keep_name[w.name_idx]) if len(w) else np.zeros(0, dtype=np.int64)
    new = _New()
    offers: dict[str, BlockOffer] = {}
    for base, tensor in sorted(wanted.items()):
        rows = np.flatnonzero(w.name_idx == ids[base]) if base in ids else np.zeros(0, dtype=np.int64)
        offers[tensor.values_name] = _offer(w, tensor, rows)
        _twins(w, tensor, rows, new)
        _grids(w, tensor, rows, new)
    planned = _roster(w, names, extra, kept_rows, new)
    return planned, BlockSources(offers, w, new.owners)


def _box(w: Roster, row: int) -> Box:
    nd = int(w.ndim[row])
    return Box(tuple(w.off[row, :nd].tolist()), tuple(w.size[row, :nd].tolist()))


def _offer(w: Roster, tensor: BlockTensor, rows: np.ndarray) -> BlockOffer:
    nd = len(tensor.shape)
    off, size = w.off[rows][:, :nd], w.size[rows][:, :nd]
    tile = np.array(tensor.tile, dtype=np.int64)
    shape, grid = np.array(tensor.shape, dtype=np.int64), np.array(tensor.grid, dtype=np.int64)
    lo, hi, ilo, ihi = tile_bounds(off, size, tile, shape, grid)
    exchanged = exchanged_tiles(tensor.grid, lo, hi, ilo, ihi)
    ranks = w.rank[rows]
    cut = (hi > lo).all(1) & ((lo != ilo) | (hi != ihi)).any(1)
    publishers = {int(ranks[i]) for i in np.flatnonzero(cut).tolist()
                  if exchanged[tuple(slice(a, b) for a, b in zip(lo[i], hi[i], strict=True))].any()}
    glob = np.zeros(tensor.global_shape, dtype=bool)
    if tensor.scheme.global_scale:
        lead = tensor.lead
        whole = (off[:, lead:] == 0).all(1) & (size[:, lead:] == shape[lead:]).all(1)
        for i in np.flatnonzero(~whole).tolist():
            cell = tensor.global_box(_box(w, int(rows[i])))
            glob[cell.slices()] = True
            publishers.add(int(ranks[i]))
    return BlockOffer(tensor, exchanged, glob, frozenset(publishers))


def _twins(w: Roster, tensor: BlockTensor, rows: np.ndarray, new: _New) -> None:
    """One values twin per writer shard holding ``tensor``: its boxes' value bytes, box after box."""
    by_shard: dict[int, list[int]] = {}
    for row in rows.tolist():
        by_shard.setdefault(int(w.shard[row]), []).append(row)
    for shard, its_rows in by_shard.items():
        boxes = [vbox for row in its_rows for vbox, _ in tensor.values_boxes(_box(w, row))]
        index = new.shard(int(w.shards.rank[shard]), _twin_name(w.shards.names[shard], tensor),
                          tensor.scheme.values_dtype, (sum(b.numel for b in boxes),), what=VALUES,
                          values=tensor.values_name)
        cursor = 0
        for vbox in boxes:
            new.rows.append((index, tensor.values_name, vbox.offsets, vbox.sizes, cursor,
                             contiguous_strides(vbox.sizes)))
            cursor += vbox.numel


def _grids(w: Roster, tensor: BlockTensor, rows: np.ndarray, new: _New) -> None:
    """Per writer holding ``tensor``: the block-scale tensor declaring the blocks its boxes touch,
    and (NVFP4) the global-scale tensor declaring the experts (or the tensor) they touch."""
    if not len(rows):
        return
    nd = len(tensor.shape)
    tile = np.array(tensor.tile, dtype=np.int64)
    lo, hi, _, _ = tile_bounds(w.off[rows][:, :nd], w.size[rows][:, :nd], tile, np.array(tensor.shape),
                               np.array(tensor.grid))
    group, c_off, c_size = writer_cuts(w.rank[rows], lo, hi, lambda _: tensor.grid)
    scale_strides = contiguous_strides(tensor.scale_shape)
    for rank in np.unique(group).tolist():
        index = new.shard(rank, f"#{tensor.scheme.name}/{tensor.scale_name}", tensor.scheme.scale_dtype,
                          tensor.scale_shape, what=SCALE, values=tensor.values_name)
        for i in np.flatnonzero(group == rank).tolist():
            box = tensor.scale_box(Box(tuple(c_off[i].tolist()), tuple(c_size[i].tolist())))
            loff = sum(o * s for o, s in zip(box.offsets, scale_strides, strict=True))
            new.rows.append((index, tensor.scale_name, box.offsets, box.sizes, loff, scale_strides))
    if not tensor.scheme.global_scale:
        return
    global_strides = contiguous_strides(tensor.global_shape)
    cells: dict[int, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for row in rows.tolist():
        cell = tensor.global_box(_box(w, row))
        cells.setdefault(int(w.rank[row]), set()).add((cell.offsets, cell.sizes))
    for rank, boxes in sorted(cells.items()):
        index = new.shard(rank, f"#{tensor.scheme.name}/{tensor.global_name}", "float32", tensor.global_shape,
                          what=GLOBAL, values=tensor.values_name)
        mask = np.zeros(tensor.global_shape, dtype=bool)
        for offsets, sizes in boxes:
            mask[Box(offsets, sizes).slices()] = True
        for start, stop in _runs(mask.reshape(-1)):
            box = _flat_box(tensor.global_shape, start, stop)
            loff = sum(o * s for o, s in zip(box.offsets, global_strides, strict=True))
            new.rows.append((index, tensor.global_name, box.offsets, box.sizes, loff, global_strides))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    padded = np.concatenate([[False], mask, [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def _flat_box(shape: tuple[int, ...], start: int, stop: int) -> Box:
    """A run of a 1-d global-scale tensor as a box (global scales are [E] or [1])."""
    assert len(shape) == 1, shape
    return Box((start,), (stop - start,))


def _roster(w: Roster, names: list[str], extra: Mapping[str, CanonicalTensor], kept_rows: np.ndarray,
            new: _New) -> Roster:
    """The planned roster: each writer's kept shards (those with kept rows), then its derived shards."""
    new_shards, new_rows = new.shards, new.rows
    kept_shards = np.unique(w.shard[kept_rows]) if len(kept_rows) else np.zeros(0, dtype=np.int64)
    ranks = np.concatenate([w.shards.rank[kept_shards], np.array([s[0] for s in new_shards], dtype=np.int64)])
    group = np.concatenate([np.zeros(len(kept_shards), dtype=np.int64), np.ones(len(new_shards), dtype=np.int64)])
    seq = np.concatenate([kept_shards, np.arange(len(new_shards), dtype=np.int64)])
    order = np.lexsort((seq, group, ranks))
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    kept_pos = np.full(len(w.shards), -1, dtype=np.int64)
    kept_pos[kept_shards] = position[: len(kept_shards)]
    width = max([w.width, *(len(r[2]) for r in new_rows)])
    shard_width = max([w.shards.shape.shape[1], *(len(s[3]) for s in new_shards)])

    def widen(a: np.ndarray, fill: int, to: int) -> np.ndarray:
        return a if a.shape[1] >= to else np.hstack([a, np.full((len(a), to - a.shape[1]), fill, dtype=np.int64)])

    def pad(t: tuple[int, ...], fill: int, to: int) -> tuple[int, ...]:
        return tuple(t) + (fill,) * (to - len(t))

    n_new = len(new_rows)
    ids = {n: i for i, n in enumerate(names)}
    row_shard = np.concatenate([kept_pos[w.shard[kept_rows]],
                                position[len(kept_shards) + np.array([r[0] for r in new_rows], dtype=np.int64)]
                                if n_new else np.zeros(0, dtype=np.int64)])
    row_order = np.lexsort((np.arange(len(row_shard)), row_shard))
    codes = {d: DTYPE_CODES.index(d) for d in {s[2] for s in new_shards}}
    shard_dtype = {len(kept_shards) + i: codes[s[2]] for i, s in enumerate(new_shards)}

    def cat(old: np.ndarray, new: list, fill: int | None = None) -> np.ndarray:
        if fill is None:
            return np.concatenate([old[kept_rows], np.array(new, dtype=np.int64).reshape(n_new)])[row_order]
        part = np.array(new, dtype=np.int64).reshape(n_new, width)
        return np.concatenate([widen(old[kept_rows], fill, width), part])[row_order]

    def name_of(k: int) -> str:
        return w.shards.names[int(seq[k])] if group[k] == 0 else new_shards[int(seq[k])][1]

    def shape_of(k: int) -> tuple[int, ...]:
        return w.shards.shape_of(int(seq[k])) if group[k] == 0 else tuple(new_shards[int(seq[k])][3])

    picked = order.tolist()
    shards = ShardColumns(
        ranks[order], [name_of(k) for k in picked],
        np.array([int(w.shards.dtype[seq[k]]) if group[k] == 0 else shard_dtype[len(kept_shards) + int(seq[k])]
                  for k in picked], dtype=np.int64),
        np.array([pad(shape_of(k), 1, shard_width) for k in picked], dtype=np.int64).reshape(len(order), shard_width),
        np.array([len(shape_of(k)) for k in picked], dtype=np.int64),
    )
    new_dtype = [shard_dtype[len(kept_shards) + r[0]] for r in new_rows]
    return Roster(
        ranks=w.ranks, canonical=tuple({**m, **extra} for m in w.canonical), rank_canonical=w.rank_canonical,
        names=tuple(names), rank=shards.rank[row_shard[row_order]], shard=row_shard[row_order],
        name_idx=cat(w.name_idx, [ids[r[1]] for r in new_rows]),
        off=cat(w.off, [pad(r[2], 0, width) for r in new_rows], 0),
        size=cat(w.size, [pad(r[3], 1, width) for r in new_rows], 1),
        loff=cat(w.loff, [r[4] for r in new_rows]),
        stride=cat(w.stride, [pad(r[5], 0, width) for r in new_rows], 0),
        ndim=cat(w.ndim, [len(r[2]) for r in new_rows]),
        dtype=cat(w.dtype, new_dtype),
        shards=shards,
    )


__all__ = ["BlockOffer", "BlockSources", "TwinRegion", "block_sources"]
