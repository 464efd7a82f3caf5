"""FP8 in the canonical name space: which tensors an FP8 engine quantizes, and how.

An FP8 reader asks for *derived* canonical tensors: ``X#fp8_block`` (the float8_e4m3fn
values of linear weight ``X``) and its scale tensor (``...weight_scale_inv`` for 128x128
blocks, DeepSeek-V3 style; ``...weight_scale`` ``[N, 1]`` for compressed-tensors
per-channel FP8). This module names them and lays them out on the reader's side
(:func:`quantize_shards`). Writers hold only ``X``: what each of them offers in addition
(an FP8 twin of its shards, the scale tiles it can compute) is derived from the roster in
:mod:`weightsync.layout.quant_offers`, and quantized on send by
:mod:`weightsync.tools.codecs.fp8`, bit for bit the reference quantizer applied to the full tensor.

    layout = parse_layout("vllm:tp=2,quant=fp8_block")       # a reader asking for FP8
    writers, quant = quantized_sources(writer_layouts, reader_layouts)   # layout.quant_offers

Which tensors stay unquantized follows the engines' FP8 checkpoints (DeepSeek-V3,
vLLM's ``Fp8Config``, compressed-tensors' ``ignore: [lm_head]``): only the linear weights
of attention and MLP (experts included) are FP8; embeddings, ``lm_head``, norms, routers
and biases stay in the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

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

def tile_box(box: Box, tile: Sequence[int], shape: Sequence[int] = ()) -> Box:
    """The tiles a box touches (a box of the scale grid)."""
    lo = tuple(o // t for o, t in zip(box.offsets, tile, strict=True))
    hi = tuple(-(-e // t) for e, t in zip(box.ends, tile, strict=True))
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


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
    "derived_names",
    "quantize_shards",
    "quantized_canonical",
    "quantized_layout",
    "quantized_tensors",
    "scheme_named",
    "tile_box",
]
