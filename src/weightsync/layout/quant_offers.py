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
(:class:`weightsync.tools.codecs.fp8.WriterQuantizer`). Every other tile lies whole inside one region
of each of its holders, which computes it alone.

Every rank runs this at job start, over every writer of the job, so its cost is linear in
the regions and never in the size of the scale grids (a 1T MoE has 62M scale tiles): tiles
are computed as boxes, and only the few tiles writers cut are painted on a grid.

    writers, quant = quantized_sources(writer_layouts, reader_layouts)
    plan = build_local_plan(writers, reader_layouts, role="writer", rank=3)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from weightsync.layout.box import Box, contiguous_strides
from weightsync.layout.columns import DTYPE_CODES
from weightsync.layout.quant import FP8_DTYPE, Derived, QuantScheme, derived_names
from weightsync.layout.roster import Roster, ShardColumns
from weightsync.layout.tiles import exchanged_tiles, grid_boxes, slices, tile_bounds, writer_cuts
from weightsync.layout.types import CanonicalTensor, RankLayout

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


#: What a planned writer shard is: the writer's own (kept), an FP8 twin, or a scale shard.
KEPT, TWIN, SCALE = 0, 1, 2


class QuantSources:
    """Every quantized weight the readers need and how writers provide it (same on every rank).

    ``tensors`` maps each FP8 canonical name (``X#scheme``) to its :class:`QuantTensor`;
    :meth:`twins` and :meth:`scales` say what one writer's planned shards are, read from the
    planned roster's columns when asked (a thousand writers' maps are never built).
    """

    def __init__(self, tensors: Mapping[str, QuantTensor], planned: Roster | None = None,
                 what: np.ndarray | None = None, source: Sequence[str] = ()) -> None:
        self.tensors = tensors
        self._planned = planned
        self._what = what  # per planned shard: KEPT, TWIN or SCALE
        self._source = source  # per planned shard: the base shard (twin) or FP8 tensor (scale) name

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def _of(self, rank: int, what: int) -> dict[str, str]:
        if self._planned is None or self._what is None:
            return {}
        shards = self._planned.shards
        lo, hi = np.searchsorted(shards.rank, [rank, rank + 1])
        return {shards.names[i]: self._source[i] for i in range(int(lo), int(hi)) if self._what[i] == what}

    def twins(self, rank: int) -> dict[str, str]:
        """Writer ``rank``'s FP8 twins: derived shard name -> the shard it quantizes."""
        return self._of(rank, TWIN)

    def scales(self, rank: int) -> dict[str, str]:
        """Writer ``rank``'s scale shards: shard name -> FP8 canonical name."""
        return self._of(rank, SCALE)


def quantized_sources(writers: Roster | Sequence[RankLayout], readers: Roster | Sequence[RankLayout]
                      ) -> tuple[Roster, QuantSources]:
    """Writers as planned when readers ask for FP8, and what each writer derives.

    Each writer gains an FP8 twin ``<shard>#<scheme>`` of every shard holding a weight the
    readers want in FP8, and a scale shard ``#<scheme>/<scale name>`` (the whole scale grid)
    declaring the tiles its regions touch. Base regions no reader needs in the model dtype
    drop out of the planned layout, and so does a shard left with nothing. Pure and
    deterministic, and columnar from end to end: every rank computes the same result from the
    roster, without an object per writer.
    """
    w, r = Roster.of(writers), Roster.of(readers)
    req = _request(w, r)
    if req is None:
        return w, QuantSources({})
    held = _held(w, [req.names.get(req.wanted[f].base, -1) for f in req.fp8s])
    tensors: dict[str, QuantTensor] = {}
    cuts = []
    for ndim in sorted({len(s) for s in req.shapes}):
        js = [j for j, s in enumerate(req.shapes) if len(s) == ndim]
        part, cut = _offers(w, req, held, js)
        tensors.update((req.fp8s[j], qt) for j, qt in zip(js, part, strict=True))
        cuts.append(cut)
    planned, what, source = _planned(w, req, held, cuts)
    return planned, QuantSources({f: tensors[f] for f in req.fp8s}, planned, what, source)


@dataclass(frozen=True)
class _Request:
    """What FP8 readers ask writers for, and the names the planned writers refer to."""

    fp8s: list[str]  # the FP8 tensors asked for, by name
    wanted: Mapping[str, Derived]
    shapes: list[tuple[int, ...]]  # of each FP8 tensor
    needed_plain: set[str]  # what some reader wants in the model dtype
    names: dict[str, int]  # the writers' canonical names, then the FP8 values' and scales'
    extra: dict[str, CanonicalTensor]  # the FP8 values and scales
    grids: list[tuple[int, ...]]  # the scale grid of each FP8 tensor
    schemes: list[str]  # the FP8 schemes asked for, by name

    def scale_name(self, j: int) -> str:
        d = self.wanted[self.fp8s[j]]
        return d.scheme.scale_name(d.base)


def _request(writers: Roster, readers: Roster) -> _Request | None:
    """The FP8 tensors readers ask for (None: none), from the names their regions use."""
    derived: dict[str, Derived] = {}
    for mapping in readers.canonical:
        derived.update(derived_names(mapping))
    wanted: dict[str, Derived] = {}
    needed_plain: set[str] = set()
    for name in (readers.names[i] for i in np.unique(readers.name_idx).tolist()):
        d = derived.get(name)
        if d is None:
            needed_plain.add(name)
        elif not d.is_scale:
            wanted[name] = d
    if not wanted:
        return None
    fp8s = sorted(wanted)
    shapes = [_shape_of(wanted[f].base, writers, readers) for f in fp8s]
    extra: dict[str, CanonicalTensor] = {}
    for fp8, shape in zip(fp8s, shapes, strict=True):
        d = wanted[fp8]
        extra[fp8] = CanonicalTensor(fp8, shape, FP8_DTYPE)
        extra[d.scheme.scale_name(d.base)] = CanonicalTensor(d.scheme.scale_name(d.base), d.scheme.grid(shape),
                                                             "float32")
    names = {n: i for i, n in enumerate(writers.names)}
    for n in extra:
        names.setdefault(n, len(names))
    grids = [wanted[f].scheme.grid(s) for f, s in zip(fp8s, shapes, strict=True)]
    return _Request(fp8s, wanted, shapes, needed_plain, names, extra, grids,
                    sorted({wanted[f].scheme.name for f in fp8s}))


def _shape_of(base: str, writers: Roster, readers: Roster) -> tuple[int, ...]:
    for mapping in (*writers.canonical, *readers.canonical):
        if base in mapping:
            return mapping[base].shape
    raise ValueError(f"no layout declares the shape of {base!r}")


def _held(w: Roster, base_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The writer rows holding each FP8 tensor's base: (FP8 index, row), by FP8 index, rows in order."""
    order = np.argsort(w.name_idx, kind="stable")
    sorted_names = w.name_idx[order]
    ids = np.array(base_ids, dtype=np.int64)
    lo = np.searchsorted(sorted_names, ids, side="left")
    hi = np.searchsorted(sorted_names, ids, side="right")
    counts = np.where(ids >= 0, hi - lo, 0)
    starts = np.cumsum(counts) - counts
    at = np.repeat(lo - starts, counts) + np.arange(int(counts.sum()))
    return np.repeat(np.arange(len(ids)), counts), order[at]


def _offers(w: Roster, req: _Request, held: tuple[np.ndarray, np.ndarray], js: list[int]
            ) -> tuple[list[QuantTensor], tuple[np.ndarray, ...]]:
    """The :class:`QuantTensor` of FP8 tensors ``js`` (all of one ndim), and the cut of the
    scale tiles each writer touches: (FP8 index, writer rank, offsets, sizes) rows."""
    derived, shapes = [req.wanted[req.fp8s[j]] for j in js], [req.shapes[j] for j in js]
    ndim = len(shapes[0])
    which, rows = held
    sel = np.isin(which, js)
    which, rows = which[sel], rows[sel]
    bad = np.flatnonzero(w.ndim[rows] != ndim)
    if bad.size:
        row, j = int(rows[bad[0]]), js.index(int(which[bad[0]]))
        nd = int(w.ndim[row])
        box = Box(tuple(w.off[row, :nd].tolist()), tuple(w.size[row, :nd].tolist()))
        raise ValueError(f"writer rank {int(w.rank[row])} holds a {nd}-d box {box} of {derived[j].base!r}, "
                         f"whose shape is {shapes[j]}")
    slot = np.full(max(js) + 1, -1, dtype=np.int64)
    slot[js] = np.arange(len(js))
    k = slot[which]
    tiles = np.array([d.scheme.tile(s) for d, s in zip(derived, shapes, strict=True)], dtype=np.int64)
    grids = [d.scheme.grid(s) for d, s in zip(derived, shapes, strict=True)]
    off, size = _widen(w.off[rows], ndim, 0)[:, :ndim], _widen(w.size[rows], ndim, 1)[:, :ndim]
    lo, hi, ilo, ihi = tile_bounds(off, size, tiles[k], np.array(shapes, dtype=np.int64)[k],
                                   np.array(grids, dtype=np.int64).reshape(len(js), ndim)[k])
    cut = (hi > lo).all(1) & ((lo != ilo) | (hi != ihi)).any(1)
    ranks = w.rank[rows]
    out = []
    for i, (d, shape, grid) in enumerate(zip(derived, shapes, grids, strict=True)):
        mine = np.flatnonzero(k == i) if cut.any() else None
        if mine is None or not cut[mine].any():
            out.append(QuantTensor(d.base, d.scheme, shape, np.zeros(grid, dtype=bool)))
            continue
        exchanged = exchanged_tiles(grid, lo[mine], hi[mine], ilo[mine], ihi[mine])
        publishers = frozenset(int(ranks[m]) for m, a, b in zip(mine.tolist(), lo[mine].tolist(), hi[mine].tolist(),
                                                                strict=True) if exchanged[slices(a, b)].any())
        out.append(QuantTensor(d.base, d.scheme, shape, exchanged, publishers))
    span = int(ranks.max()) + 1 if len(ranks) else 1
    group, c_off, c_size = writer_cuts(k * span + ranks, lo, hi, lambda g: grids[g // span])
    return out, (np.array(js, dtype=np.int64)[group // span], group % span, c_off, c_size)


def _planned(w: Roster, req: _Request, held: tuple[np.ndarray, np.ndarray], cuts: list[tuple[np.ndarray, ...]]
             ) -> tuple[Roster, np.ndarray, list[str]]:
    """The writers' planned roster: per writer shard, what it keeps in the model dtype and its
    FP8 twins (one per scheme), then the writer's scale shards by FP8 name; with what each
    planned shard is (:data:`KEPT`, :data:`TWIN`, :data:`SCALE`) and its source's name."""
    which, rows = held
    mine = len(w.names)  # the names writers hold come first in ``names``
    plain = np.ones(mine, dtype=bool)  # no FP8 reader asks for it, or some reader wants it plain
    plain[[i for f in req.fp8s if (i := req.names.get(req.wanted[f].base, mine)) < mine]] = False
    plain[[i for n in req.needed_plain if (i := req.names.get(n, mine)) < mine]] = True
    kept = np.flatnonzero(plain[w.name_idx])
    # Candidate shards: (writer shard, slot), slot 0 what it keeps, 1 + s its twin of scheme s.
    slots = 1 + len(req.schemes)
    scheme_of = np.array([req.schemes.index(req.wanted[f].scheme.name) for f in req.fp8s], dtype=np.int64)
    used, cand_of = np.unique(np.concatenate([w.shard[kept] * slots, w.shard[rows] * slots + 1 + scheme_of[which]]),
                              return_inverse=True)
    width = max([w.width, *(len(g) for g in req.grids)])
    c_fp8, c_rank, c_off, c_size = (np.concatenate(x) for x in zip(*[
        (c[0], c[1], _widen(c[2], width, 0), _widen(c[3], width, 1)) for c in cuts], strict=True))
    # Scale shards: one per writer and FP8 tensor it holds, after the writer's own shards.
    touched, scale_of_cut = np.unique(np.column_stack([c_rank, c_fp8]), axis=0, return_inverse=True)
    shards, what, source, position = _planned_shards(w, req, used // slots, used % slots, touched.reshape(-1, 2))
    # per FP8 tensor once, then gathered per cut (tens of thousands of cuts, hundreds of tensors)
    strides = np.array([s + (0,) * (width - len(s)) for s in map(contiguous_strides, req.grids)],
                       dtype=np.int64).reshape(-1, width)
    c_stride = strides[c_fp8]
    grid_ndim = np.array([len(g) for g in req.grids], dtype=np.int64)
    fp8_code, f32_code = DTYPE_CODES.index(FP8_DTYPE), DTYPE_CODES.index("float32")
    src_rows = np.concatenate([kept, rows])
    shard = position[np.concatenate([cand_of, len(used) + scale_of_cut.reshape(-1)])]
    order = np.lexsort((np.concatenate([src_rows, len(w) + np.arange(len(c_fp8))]), shard))
    fp8_id = np.array([req.names[f] for f in req.fp8s], dtype=np.int64)
    scale_id = np.array([req.names[req.scale_name(j)] for j in range(len(req.fp8s))], dtype=np.int64)
    planned = Roster(
        ranks=w.ranks, canonical=tuple({**m, **req.extra} for m in w.canonical), rank_canonical=w.rank_canonical,
        names=tuple(req.names), rank=np.concatenate([w.rank[src_rows], c_rank])[order], shard=shard[order],
        name_idx=np.concatenate([w.name_idx[kept], fp8_id[which], scale_id[c_fp8]])[order],
        off=np.concatenate([_widen(w.off[src_rows], width, 0), c_off])[order],
        size=np.concatenate([_widen(w.size[src_rows], width, 1), c_size])[order],
        loff=np.concatenate([w.loff[src_rows], (c_off * c_stride).sum(1)])[order],
        stride=np.concatenate([_widen(w.stride[src_rows], width, 0), c_stride])[order],
        ndim=np.concatenate([w.ndim[src_rows], grid_ndim[c_fp8]]).astype(np.int64)[order],
        dtype=np.concatenate([w.dtype[kept], np.full(len(rows), fp8_code), np.full(len(c_fp8), f32_code)])[order],
        shards=shards,
    )
    return planned, what, source


def _planned_shards(w: Roster, req: _Request, src: np.ndarray, slot: np.ndarray, touched: np.ndarray
                    ) -> tuple[ShardColumns, np.ndarray, list[str], np.ndarray]:
    """The planned shards in order: writer shard ``src`` kept (``slot`` 0) or twinned (1 + its
    scheme), and the scale shards of ``touched`` (writer rank, FP8 index); what each is, its
    source, and the position of each candidate (then each scale shard) in that order."""
    order = np.lexsort((np.concatenate([slot, touched[:, 1]]),
                        np.concatenate([src, np.full(len(touched), len(w.shards))]),
                        np.concatenate([w.shards.rank[src], touched[:, 0]])))
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    schemes, t_fp8 = req.schemes, touched[:, 1].tolist()
    names = [w.shards.names[i] if k == 0 else f"{w.shards.names[i]}#{schemes[k - 1]}"
             for i, k in zip(src.tolist(), slot.tolist(), strict=True)]
    # per FP8 tensor once, then gathered per scale shard (one per writer and FP8 tensor it holds)
    labels = [f"#{req.wanted[f].scheme.name}/{req.scale_name(j)}" for j, f in enumerate(req.fp8s)]
    names += [labels[j] for j in t_fp8]
    width = max([w.shards.shape.shape[1], *(len(g) for g in req.grids)])
    grids = np.array([g + (1,) * (width - len(g)) for g in req.grids], dtype=np.int64).reshape(-1, width)
    grid_ndim = np.array([len(g) for g in req.grids], dtype=np.int64)
    grid_shapes = grids[touched[:, 1]]
    fp8_code, f32_code = DTYPE_CODES.index(FP8_DTYPE), DTYPE_CODES.index("float32")
    shards = ShardColumns(
        np.concatenate([w.shards.rank[src], touched[:, 0]]), names,
        np.concatenate([np.where(slot == 0, w.shards.dtype[src], fp8_code), np.full(len(touched), f32_code)]),
        np.concatenate([_widen(w.shards.shape[src], width, 1), grid_shapes]),
        np.concatenate([w.shards.ndim[src], grid_ndim[touched[:, 1]]]).astype(np.int64),
    ).take(order)
    what = np.concatenate([np.where(slot == 0, KEPT, TWIN), np.full(len(touched), SCALE)])[order]
    source = [w.shards.names[i] if k else "" for i, k in zip(src.tolist(), slot.tolist(), strict=True)]
    source += [req.fp8s[j] for j in t_fp8]
    return shards, what, [source[i] for i in order.tolist()], position


def _widen(a: np.ndarray, width: int, fill: int) -> np.ndarray:
    if a.ndim == 1:
        a = a[:, None]
    extra = width - a.shape[1]
    return a if extra <= 0 else np.hstack([a, np.full((len(a), extra), fill, dtype=np.int64)])


__all__ = ["KEPT", "SCALE", "TWIN", "QuantSources", "QuantTensor", "grid_boxes", "quantized_sources"]
