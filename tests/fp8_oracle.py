"""The FP8 offer derivation as it was first written: a boolean mask per writer and tensor,
painted box by box and cut back into boxes row by row. Slow (minutes at 1T) but plainly
right; ``layout.quant_offers`` computes the same result from the boxes themselves, and
``tests/test_quant_offers.py`` checks that the two agree, field for field, on many layouts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.layout.box import Box, contiguous_strides
from weightsync.layout.quant import FP8_DTYPE, Derived, derived_names
from weightsync.layout.quant_offers import QuantSources, QuantTensor
from weightsync.layout.types import CanonicalTensor, RankLayout, Region, Shard


def tile_box(box: Box, tile: Sequence[int]) -> Box:
    lo = tuple(o // t for o, t in zip(box.offsets, tile, strict=True))
    hi = tuple(-(-e // t) for e, t in zip(box.ends, tile, strict=True))
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


def inner_tile_box(box: Box, tile: Sequence[int], shape: Sequence[int]) -> Box:
    lo = []
    hi = []
    for o, e, t, s in zip(box.offsets, box.ends, tile, shape, strict=True):
        a = -(-o // t)
        b = -(-e // t) if e == s else e // t
        lo.append(a)
        hi.append(max(a, b))
    return Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi, strict=True)))


def cut_tiles(box: Box, tile: Sequence[int], shape: Sequence[int]) -> list[Box]:
    outer = tile_box(box, tile)
    inner = inner_tile_box(box, tile, shape)
    if inner.empty:
        return [outer] if not outer.empty else []
    return [b for b in outer.subtract(inner) if not b.empty]


def grid_boxes(mask: np.ndarray) -> list[Box]:
    """Runs along the last dim, merged over consecutive rows with the same runs."""
    if mask.ndim == 0 or not mask.any():
        return []
    rows = mask.reshape(-1, mask.shape[-1])
    lead_shape = mask.shape[:-1]
    out: list[Box] = []
    open_boxes: dict[tuple[int, int], list[int]] = {}

    def flush(run: tuple[int, int], first: int, count: int) -> None:
        idx = np.unravel_index(first, lead_shape) if lead_shape else ()
        offs = (*(int(i) for i in idx), run[0])
        sizes = (*((1,) * (len(lead_shape) - 1)), count, run[1]) if lead_shape else (run[1],)
        out.append(Box(offs, sizes))

    inner = lead_shape[-1] if lead_shape else 1
    for i, row in enumerate(rows):
        padded = np.concatenate(([False], row, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        runs = {(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)}
        new_block = i % inner == 0
        for run in list(open_boxes):
            if run not in runs or new_block:
                first, count = open_boxes.pop(run)
                flush(run, first, count)
        for run in runs:
            if run in open_boxes:
                open_boxes[run][1] += 1
            else:
                open_boxes[run] = [i, 1]
    for run, (first, count) in open_boxes.items():
        flush(run, first, count)
    return sorted(out, key=lambda b: (b.offsets, b.sizes))


@dataclass
class OracleSources:
    """What the first derivation returned: every writer's twins and scale shards, by rank."""

    tensors: dict[str, QuantTensor]
    twins: dict[int, dict[str, str]]
    scales: dict[int, dict[str, str]]

    def __bool__(self) -> bool:
        return bool(self.tensors)


def quantized_sources(writers: Sequence[RankLayout], readers: Sequence[RankLayout]
                      ) -> tuple[list[RankLayout], OracleSources]:
    wanted: dict[str, Derived] = {}
    needed_plain: set[str] = set()
    for layout in readers:
        derived = derived_names(layout.canonical)
        for shard in layout.shards:
            for r in shard.regions:
                d = derived.get(r.canonical)
                if d is None:
                    needed_plain.add(r.canonical)
                elif not d.is_scale:
                    wanted[r.canonical] = d
    if not wanted:
        return list(writers), OracleSources({}, {}, {})
    by_base: dict[str, list[str]] = {}
    for fp8, d in wanted.items():
        by_base.setdefault(d.base, []).append(fp8)
    held: dict[str, list[tuple[int, Region]]] = {}
    for layout in writers:
        for shard in layout.shards:
            for r in shard.regions:
                if r.canonical in by_base:
                    held.setdefault(r.canonical, []).append((layout.rank, r))
    tensors: dict[str, QuantTensor] = {}
    canonical = dict(writers[0].canonical) if writers else {}
    for fp8, d in sorted(wanted.items()):
        shape = _shape_of(d.base, readers, writers)
        canonical[fp8] = CanonicalTensor(fp8, shape, FP8_DTYPE)
        scale = d.scheme.scale_name(d.base)
        canonical[scale] = CanonicalTensor(scale, d.scheme.grid(shape), "float32")
        tile = d.scheme.tile(shape)
        exchanged = np.zeros(d.scheme.grid(shape), dtype=bool)
        for _, r in held.get(d.base, []):
            for b in cut_tiles(r.box, tile, shape):
                exchanged[b.slices()] = True
        publishers = frozenset(rank for rank, r in held.get(d.base, [])
                               if exchanged[tile_box(r.box, tile).slices()].any())
        tensors[fp8] = QuantTensor(d.base, d.scheme, shape, exchanged, publishers)
    out = []
    twins: dict[int, dict[str, str]] = {}
    scales: dict[int, dict[str, str]] = {}
    for layout in writers:
        shards, twins[layout.rank], scales[layout.rank] = _writer_shards(layout, tensors, by_base, needed_plain)
        out.append(RankLayout(layout.rank, tuple(shards), canonical))
    return out, OracleSources(tensors, twins, scales)


def _shape_of(base: str, readers: Sequence[RankLayout], writers: Sequence[RankLayout]) -> tuple[int, ...]:
    for layout in (*writers, *readers):
        if base in layout.canonical:
            return layout.canonical[base].shape
    raise ValueError(f"no layout declares the shape of {base!r}")


def _writer_shards(layout: RankLayout, tensors: Mapping[str, QuantTensor], by_base: Mapping[str, list[str]],
                   needed_plain: set[str]) -> tuple[list[Shard], dict[str, str], dict[str, str]]:
    shards: list[Shard] = []
    twins: dict[str, str] = {}
    touched: dict[str, np.ndarray] = {}
    for shard in layout.shards:
        plain = tuple(r for r in shard.regions if r.canonical not in by_base or r.canonical in needed_plain)
        if plain:
            shards.append(shard if len(plain) == len(shard.regions) else
                          Shard(shard.name, shard.shape, shard.dtype, plain))
        by_scheme: dict[str, list[Region]] = {}
        for r in shard.regions:
            for fp8 in by_base.get(r.canonical, ()):
                qt = tensors[fp8]
                by_scheme.setdefault(qt.scheme.name, []).append(Region(fp8, r.box, r.offset, r.strides))
                mask = touched.setdefault(fp8, np.zeros(qt.grid, dtype=bool))
                mask[tile_box(r.box, qt.tile).slices()] = True
        for scheme_name, regions in sorted(by_scheme.items()):
            name = f"{shard.name}#{scheme_name}"
            shards.append(Shard(name, shard.shape, FP8_DTYPE, tuple(regions)))
            twins[name] = shard.name
    scales: dict[str, str] = {}
    for fp8, mask in sorted(touched.items()):
        qt = tensors[fp8]
        scale = qt.scheme.scale_name(qt.base)
        strides = contiguous_strides(qt.grid)
        tiles = tuple(Region(scale, b, sum(o * s for o, s in zip(b.offsets, strides, strict=True)), strides)
                      for b in grid_boxes(mask))
        name = f"#{qt.scheme.name}/{scale}"
        shards.append(Shard(name, qt.grid, "float32", tiles))
        scales[name] = fp8
    return shards, twins, scales


def quantizer_needs(sources: QuantSources, layout: RankLayout, plan) -> dict:  # type: ignore[no-untyped-def]
    """What ``WriterQuantizer`` first derived from a plan, from its op objects: the tensors
    whose tiles the writer's ops need, those among them with exchanged tiles, whom to hear
    from, what it publishes, and its value ops."""
    rank = layout.rank
    twins = sources.twins(rank)
    scale_shards = sources.scales(rank)
    shards = {s.name: s for s in layout.shards}
    held: dict[str, list] = {}
    for twin in twins:
        for r in shards[twin].regions:
            held.setdefault(r.canonical, []).append(r)
    value_ops = [op for op in plan.ops if op.src_rank == rank and op.src_shard in twins]
    scale_ops = [op for op in plan.ops if op.src_rank == rank and op.src_shard in scale_shards]
    needed: dict[str, np.ndarray] = {}
    for op in value_ops:
        qt = sources.tensors[op.canonical]
        mask = needed.setdefault(op.canonical, np.zeros(qt.grid, dtype=bool))
        mask[tile_box(op.box, qt.tile).slices()] = True
    for op in scale_ops:
        fp8 = scale_shards[op.src_shard]
        mask = needed.setdefault(fp8, np.zeros(sources.tensors[fp8].grid, dtype=bool))
        mask[op.box.slices()] = True
    exchanged = sorted(n for n, m in needed.items() if (m & sources.tensors[n].exchanged).any())
    publishes = sorted(n for n, qt in sources.tensors.items() if rank in qt.publishers and n in held)
    return {"needed": sorted(needed), "exchanged": exchanged,
            "listen": sorted({w for n in exchanged for w in sources.tensors[n].publishers}),
            "publishes": publishes, "value_ops": value_ops,
            "active": bool(value_ops or scale_ops or publishes)}
