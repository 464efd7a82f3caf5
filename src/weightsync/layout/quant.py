"""FP8 in the canonical name space: which tensors an FP8 engine quantizes, and how.

An FP8 reader asks for *derived* canonical tensors: ``X#fp8_block`` (the float8_e4m3fn
values of linear weight ``X``) and its scale tensor (``...weight_scale_inv`` for 128x128
blocks, DeepSeek-V3 style; ``...weight_scale`` ``[N, 1]`` for compressed-tensors
per-channel FP8). Writers hold only ``X``; every rank derives, from the same metadata, what
each writer offers in addition (:func:`quantized_sources`): an FP8 twin of each of its
shards with quantizable regions, and the scale tiles its regions touch. The planner then
plans FP8 like any other dtype, so the bytes on the wire are FP8 and each destination
element still arrives exactly once.

A scale depends on a whole tile; a tile cut by any writer's region boundary (an FSDP row
cut, a ZeRO-3 flat partition, a K-split row for per-channel scales) is *exchanged*: every
holder publishes its partial maximum and each sender takes the maximum of all
(:class:`QuantSources.exchange`). Every other tile lies whole inside one region of each of
its holders, which computes it alone. Either way the result equals the reference
quantizer applied to the full tensor, bit for bit (``weightsync.quantize``).

    layout = parse_layout("vllm:tp=2,quant=fp8_block")       # a reader asking for FP8
    writers, quant = quantized_sources(writer_layouts, reader_layouts)

Which tensors stay unquantized follows the engines' FP8 checkpoints (DeepSeek-V3,
vLLM's ``Fp8Config``, compressed-tensors' ``ignore: [lm_head]``): only the linear weights
of attention and MLP (experts included) are FP8; embeddings, ``lm_head``, norms, routers
and biases stay in the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from weightsync.layout.box import Box, contiguous_strides
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import CanonicalTensor, RankLayout, Region, Shard

FP8_DTYPE = "float8_e4m3fn"
#: Roles whose weights FP8 checkpoints store in FP8 (everything else stays in the model dtype).
QUANTIZED_ROLES = frozenset({"q", "k", "v", "o", "gate", "up", "down", "expert_gate", "expert_up", "expert_down",
                             "q_a", "q_b", "kv_a", "kv_b", "shared_gate", "shared_up", "shared_down"})
BLOCK = 128


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How one FP8 format cuts a weight into tiles that share a scale, and names the scale."""

    name: str
    scale_suffix: str  # replaces the weight name's trailing ``weight``
    per_channel: bool  # a tile is a whole row (compressed-tensors ``strategy: channel``)

    def tile(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Tile sizes of a weight of ``shape`` (leading expert dims: one expert per tile)."""
        lead = (1,) * (len(shape) - 2)
        if self.per_channel:
            return (*lead, 1, max(int(shape[-1]), 1))
        return (*lead, BLOCK, BLOCK)

    def grid(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the scale tensor: tiles per dimension (a ragged last tile counts)."""
        return tuple(-(-int(s) // t) if s else 0 for s, t in zip(shape, self.tile(shape), strict=True))

    def weight_name(self, canonical: str) -> str:
        return f"{canonical}#{self.name}"

    def scale_name(self, canonical: str) -> str:
        if not canonical.endswith("weight"):
            raise ValueError(f"{canonical!r}: only weights are quantized")
        return canonical[: -len("weight")] + self.scale_suffix


SCHEMES: Mapping[str, QuantScheme] = {
    "fp8_block": QuantScheme("fp8_block", "weight_scale_inv", per_channel=False),
    "fp8_channel": QuantScheme("fp8_channel", "weight_scale", per_channel=True),
}


def scheme_named(name: str) -> QuantScheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown quantization {name!r}; known: {sorted(SCHEMES)}") from None


def quantized_tensors(spec: ModelSpec) -> list[str]:
    """Canonical names of the weights an FP8 checkpoint of ``spec`` stores in FP8."""
    roles = spec.roles()
    return [n for n in spec.canonical_tensors() if roles[n][0] in QUANTIZED_ROLES]


def quantized_canonical(spec: ModelSpec, scheme: QuantScheme) -> dict[str, CanonicalTensor]:
    """The canonical tensors of ``spec`` plus each quantized weight's FP8 values and scale."""
    key = f"quantized_canonical={scheme.name}"
    cached = spec._cache.get(key)
    if cached is None:
        cached = dict(spec.canonical_tensors())
        for name in quantized_tensors(spec):
            shape = cached[name].shape
            fp8 = scheme.weight_name(name)
            cached[fp8] = CanonicalTensor(fp8, shape, FP8_DTYPE)
            scale = scheme.scale_name(name)
            cached[scale] = CanonicalTensor(scale, scheme.grid(shape), "float32")
        spec._cache[key] = cached
    return cached


@dataclass(frozen=True, slots=True)
class Derived:
    """What a derived canonical name is: the FP8 values or the scale of base weight ``base``."""

    base: str
    scheme: QuantScheme
    is_scale: bool


def derived_names(canonical: Mapping[str, CanonicalTensor]) -> dict[str, Derived]:
    """Every FP8 value and scale tensor among ``canonical``, by name."""
    out: dict[str, Derived] = {}
    for name in canonical:
        base, sep, scheme_name = name.rpartition("#")
        if sep and scheme_name in SCHEMES:
            scheme = SCHEMES[scheme_name]
            out[name] = Derived(base, scheme, False)
            out[scheme.scale_name(base)] = Derived(base, scheme, True)
    return out


# -- reader layouts --------------------------------------------------------------------

def _local_corner(shard: Shard, region: Region) -> tuple[int, ...] | None:
    """The local multi-index where a row-major region starts (None for other storage)."""
    local = contiguous_strides(shard.shape)
    kept = [s for s in region.strides if s]
    if tuple(kept) != local[len(local) - len(kept):] or len(kept) != len(local):
        return None
    corner = []
    rest = region.offset
    for stride in local:
        corner.append(rest // stride)
        rest %= stride
    return tuple(corner)


def quantize_shards(shards: Iterable[Shard], spec: ModelSpec, scheme: QuantScheme) -> list[Shard]:
    """A reader's shards with each quantized weight in FP8 and a scale shard beside it.

    The scale shard (``...weight_scale_inv`` / ``...weight_scale``) lays the tiles of each
    region out as the engine does: the tiles of fused parts one after another (vLLM's
    ``qkv_proj.weight_scale_inv`` is ``[q; k; v]`` tiles). A part that does not start and end
    on a tile boundary cannot be scaled on its own (vLLM refuses such models too): an error
    names it.
    """
    quantized = set(quantized_tensors(spec))
    out: list[Shard] = []
    for shard in shards:
        mine = [r for r in shard.regions if r.canonical in quantized]
        if not mine:
            out.append(shard)
            continue
        if len(mine) != len(shard.regions):
            raise ValueError(f"{shard.name}: mixes quantized and unquantized tensors; it cannot be FP8")
        out.extend(_fp8_pair(shard, spec, scheme))
    return out


def _fp8_pair(shard: Shard, spec: ModelSpec, scheme: QuantScheme) -> tuple[Shard, Shard]:
    values = Shard(shard.name, shard.shape, FP8_DTYPE,
                   tuple(Region(scheme.weight_name(r.canonical), r.box, r.offset, r.strides) for r in shard.regions))
    canonical = spec.canonical_tensors()
    lead = len(shard.shape) - 2
    tile_local = scheme.tile(shard.shape)
    scale_shape = tuple(1 if scheme.per_channel and d == len(shard.shape) - 1 else -(-s // t)
                        for d, (s, t) in enumerate(zip(shard.shape, tile_local, strict=True)))
    scale_strides = contiguous_strides(scale_shape)
    regions = []
    for r in shard.regions:
        shape = canonical[r.canonical].shape
        tile = scheme.tile(shape)
        corner = _local_corner(shard, r)
        drop = len(shape) - len(shard.shape)
        tiles = tile_box(r.box, tile, shape)
        if corner is None:
            raise ValueError(f"{shard.name}: {r.canonical} is not held row-major; it cannot be FP8")
        for d in range(lead, len(shard.shape)):
            size, off, loc, t = shape[d + drop], r.box.offsets[d + drop], corner[d], tile[d + drop]
            if scheme.per_channel and d == len(shard.shape) - 1:
                continue  # a row's scale covers every column, whichever columns this rank holds
            end = off + r.box.sizes[d + drop]
            if loc % t or (t < size and (off % t or (end % t and end != size))):
                raise ValueError(
                    f"{shard.name}: rows/columns [{off}, {end}) of {r.canonical} do not start and end on "
                    f"{t}-element {scheme.name} tiles (local position {loc}); this layout cannot hold "
                    "FP8 blocks (choose a parallelism whose shards divide into whole blocks)")
        scale_corner = [c // t if t < s else 0 for c, t, s in
                        zip(corner, tile_local, shard.shape, strict=True)]
        offset = sum(c * st for c, st in zip(scale_corner, scale_strides, strict=True))
        regions.append(Region(scheme.scale_name(r.canonical), tiles, offset, (0,) * drop + scale_strides))
    scale_name = shard.name[: -len("weight")] + scheme.scale_suffix if shard.name.endswith("weight") \
        else f"{shard.name}.{scheme.scale_suffix}"
    return values, Shard(scale_name, scale_shape, "float32", tuple(regions))


def quantized_layout(layout: RankLayout, spec: ModelSpec, scheme: QuantScheme) -> RankLayout:
    """``layout`` with its quantized weights in FP8 (see :func:`quantize_shards`)."""
    return RankLayout(layout.rank, tuple(quantize_shards(layout.shards, spec, scheme)),
                      quantized_canonical(spec, scheme))


# -- tiles ------------------------------------------------------------------------------

def tile_box(box: Box, tile: Sequence[int], shape: Sequence[int]) -> Box:
    """The tiles a box touches (a box of the scale grid)."""
    lo = tuple(o // t for o, t in zip(box.offsets, tile, strict=True))
    hi = tuple(-(-e // t) for e, t in zip(box.ends, tile, strict=True))
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


def inner_tile_box(box: Box, tile: Sequence[int], shape: Sequence[int]) -> Box:
    """The tiles lying whole inside ``box`` (a ragged last tile counts when the box reaches the end)."""
    lo = []
    hi = []
    for o, e, t, s in zip(box.offsets, box.ends, tile, shape, strict=True):
        a = -(-o // t)
        b = -(-e // t) if e == s else e // t
        lo.append(a)
        hi.append(max(a, b))
    return Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi, strict=True)))


def cut_tiles(box: Box, tile: Sequence[int], shape: Sequence[int]) -> list[Box]:
    """Tiles ``box`` touches without holding them whole: their scale needs other holders too."""
    outer = tile_box(box, tile, shape)
    inner = inner_tile_box(box, tile, shape)
    if inner.empty:
        return [outer] if not outer.empty else []
    return [b for b in outer.subtract(inner) if not b.empty]


def grid_boxes(mask: np.ndarray) -> list[Box]:
    """Disjoint boxes covering the True cells of a boolean grid (runs along the last dim,
    merged over consecutive rows with the same runs)."""
    if mask.ndim == 0 or not mask.any():
        return []
    rows = mask.reshape(-1, mask.shape[-1])
    lead_shape = mask.shape[:-1]
    out: list[Box] = []
    open_boxes: dict[tuple[int, int], list[int]] = {}  # run -> [first row, rows]

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
        new_block = i % inner == 0  # rows of another expert never merge
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


# -- writers: what they offer an FP8 reader --------------------------------------------

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
    readers want in FP8 (same geometry, so the planner's offsets address both), and a scale
    shard ``#<scheme>/<scale name>`` (the whole scale grid) declaring the tiles its regions
    touch. Base regions no reader needs in the model dtype drop out of the planned layout.
    Pure and deterministic: every rank computes the same result from the roster.
    """
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
        return list(writers), QuantSources({}, {}, {})
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
                               if exchanged[tile_box(r.box, tile, shape).slices()].any())
        tensors[fp8] = QuantTensor(d.base, d.scheme, shape, exchanged, publishers)
    out = []
    twins: dict[int, dict[str, str]] = {}
    scales: dict[int, dict[str, str]] = {}
    for layout in writers:
        shards, twins[layout.rank], scales[layout.rank] = _writer_shards(layout, tensors, by_base, needed_plain)
        out.append(RankLayout(layout.rank, tuple(shards), canonical))
    return out, QuantSources(tensors, twins, scales)


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
        by_scheme: dict[str, list[Region]] = {}  # one FP8 twin per shard and scheme
        for r in shard.regions:
            for fp8 in by_base.get(r.canonical, ()):
                qt = tensors[fp8]
                by_scheme.setdefault(qt.scheme.name, []).append(Region(fp8, r.box, r.offset, r.strides))
                mask = touched.setdefault(fp8, np.zeros(qt.grid, dtype=bool))
                mask[tile_box(r.box, qt.tile, qt.shape).slices()] = True
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


def fp8_bytes_saved(canonical: Mapping[str, CanonicalTensor]) -> int:
    """Bytes an FP8 reader saves over the model dtype (for reports)."""
    derived = derived_names(canonical)
    saved = 0
    for d in derived.values():
        if not d.is_scale and d.base in canonical:
            base = canonical[d.base]
            saved += base.nbytes - math.prod(base.shape)
    return saved


__all__ = [
    "FP8_DTYPE",
    "QUANTIZED_ROLES",
    "SCHEMES",
    "Derived",
    "QuantScheme",
    "QuantSources",
    "QuantTensor",
    "cut_tiles",
    "derived_names",
    "grid_boxes",
    "inner_tile_box",
    "quantize_shards",
    "quantized_canonical",
    "quantized_layout",
    "quantized_sources",
    "quantized_tensors",
    "scheme_named",
    "tile_box",
]
