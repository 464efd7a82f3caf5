"""Block-scaled formats in the canonical name space: MXFP8, MXFP4, NVFP4 (beside ``layout.quant``'s FP8).

A reader asking for ``quant=mxfp4`` (``mxfp8``, ``nvfp4``) asks, for each quantized weight
``X``, for its *values*, its *block scales* and, for NVFP4, its *global scale*, each a canonical
tensor of its own. Blocks run along the weight's input dimension: the last of a linear
weight ``[out, in]`` or of an expert stack ``[E, out, in]``, dimension 1 of gpt-oss's whole
experts (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``, stored ``[E, in, out]``). The
derived tensors put that dimension last (``perm``), as checkpoints store them:

| scheme | block | values | block scale | global scale |
| --- | --- | --- | --- | --- |
| ``mxfp8`` | 32 | float8_e4m3fn ``[.., out, in]`` | E8M0 (uint8) ``[.., out, in/32]`` | - |
| ``mxfp4`` | 32 | two E2M1 codes a byte ``[.., out, in/2]`` | E8M0 (uint8) | - |
| ``nvfp4`` | 16 | two E2M1 codes a byte | float8_e4m3fn ``[.., out, in/16]`` | float32 ``[E]`` or ``[1]`` |

Names: values ``X#<scheme>``; scales ``...weight_scale`` (``...weight_global_scale``), the
names compressed-tensors and vLLM use. gpt-oss's experts in MXFP4 take its own checkpoint's
names and layout: ``gate_up_proj_blocks [E, 2I, H/32, 16]`` and ``gate_up_proj_scales [E, 2I,
H/32]`` (``down_proj_*`` likewise); which weights are quantized follows each family's
checkpoints (gpt-oss: its experts only; others: every linear weight but ``lm_head``).

The arithmetic is :mod:`weightsync.tools.codecs.mx_math`; what writers offer is
:mod:`weightsync.layout.quant_block_offers`; readers' shards come from :func:`block_shards`.

    layout = parse_layout("vllm:tp=2,quant=mxfp4")        # gpt-oss: vLLM's w13_weight [E, 2I, H/2] uint8
    tensor = BlockTensor.of("model.layers.0.mlp.experts.gate_up_proj", (E, H, 2 * I), scheme)
    tensor.values_boxes(Box(...))                          # the value bytes a box of the weight becomes
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from weightsync.layout.box import Box, contiguous_strides
from weightsync.layout.model import ModelSpec
from weightsync.layout.quant import FP8_DTYPE, QUANTIZED_ROLES
from weightsync.layout.types import CanonicalTensor, Region, Shard

#: gpt-oss's whole experts, stored [E, in, out]: blocks run along dimension 1
WHOLE_EXPERT_ROLES = frozenset({"experts_gate_up", "experts_down"})


@dataclass(frozen=True, slots=True)
class BlockScheme:
    """One block-scaled format: elements per block, element and scale formats."""

    name: str
    block: int
    elements: str  # "e2m1" (FP4, two a byte) or "e4m3" (FP8)
    scale_dtype: str  # "uint8" (E8M0) or float8_e4m3fn
    global_scale: bool = False

    @property
    def pack(self) -> int:
        """Elements per byte of the values."""
        return 2 if self.elements == "e2m1" else 1

    @property
    def values_dtype(self) -> str:
        return "uint8" if self.elements == "e2m1" else FP8_DTYPE


BLOCK_SCHEMES: Mapping[str, BlockScheme] = {
    "mxfp8": BlockScheme("mxfp8", 32, "e4m3", "uint8"),
    "mxfp4": BlockScheme("mxfp4", 32, "e2m1", "uint8"),
    "nvfp4": BlockScheme("nvfp4", 16, "e2m1", FP8_DTYPE, global_scale=True),
}

VALUES, SCALE, GLOBAL = "values", "scale", "global"


@dataclass(frozen=True, slots=True)
class BlockTensor:
    """One weight in a block format: its derived tensors and how their boxes follow the weight's."""

    base: str
    shape: tuple[int, ...]
    scheme: BlockScheme
    #: gpt-oss's whole experts ``[E, in, out]`` (else ``[..., out, in]``)
    whole_experts: bool = False

    @classmethod
    def of(cls, base: str, shape: Sequence[int], scheme: BlockScheme) -> BlockTensor:
        out = cls(base, tuple(int(s) for s in shape), scheme, not base.endswith("weight"))
        k = out.shape[out.axis]
        if k % scheme.block:
            raise ValueError(f"{base}: its input dimension ({k}) is not a multiple of {scheme.name}'s "
                             f"{scheme.block}-element blocks")
        return out

    # -- geometry ---------------------------------------------------------------------------
    @property
    def axis(self) -> int:
        """The block axis of the weight (its input dimension)."""
        return 1 if self.whole_experts else len(self.shape) - 1

    @property
    def perm(self) -> tuple[int, ...]:
        """The weight's dims in the derived tensors' order (the block axis last)."""
        return tuple(d for d in range(len(self.shape)) if d != self.axis) + (self.axis,)

    @property
    def lead(self) -> int:
        """Expert dims (one global scale per expert)."""
        return len(self.shape) - 2

    @property
    def split(self) -> bool:
        """Values in blocks form ``[.., in/32, 16]`` (gpt-oss's ``*_blocks``), else ``[.., in/pack]``."""
        return self.whole_experts and self.scheme.name == "mxfp4"

    @property
    def tile(self) -> tuple[int, ...]:
        """A block in the weight's coordinates."""
        return tuple(self.scheme.block if d == self.axis else 1 for d in range(len(self.shape)))

    @property
    def grid(self) -> tuple[int, ...]:
        """Blocks per dimension, in the weight's coordinates."""
        return tuple(s // t for s, t in zip(self.shape, self.tile, strict=True))

    # -- names and shapes -------------------------------------------------------------------
    @property
    def values_name(self) -> str:
        return self.base + "_blocks" if self.split else f"{self.base}#{self.scheme.name}"

    @property
    def scale_name(self) -> str:
        return self.base[: -len("weight")] + "weight_scale" if not self.whole_experts else self.base + "_scales"

    @property
    def global_name(self) -> str:
        return (self.base[: -len("weight")] + "weight_global_scale" if not self.whole_experts
                else self.base + "_global_scale")

    def _permuted(self, values: Sequence[int]) -> tuple[int, ...]:
        return tuple(values[d] for d in self.perm)

    @property
    def values_shape(self) -> tuple[int, ...]:
        t = self._permuted(self.shape)
        k, b, p = t[-1], self.scheme.block, self.scheme.pack
        return (*t[:-1], k // b, b // p) if self.split else (*t[:-1], k // p)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return self._permuted(self.grid)

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.shape[: self.lead] or (1,)

    def derived(self) -> dict[str, CanonicalTensor]:
        """The derived canonical tensors, by name."""
        out = {self.values_name: CanonicalTensor(self.values_name, self.values_shape, self.scheme.values_dtype),
               self.scale_name: CanonicalTensor(self.scale_name, self.scale_shape, self.scheme.scale_dtype)}
        if self.scheme.global_scale:
            out[self.global_name] = CanonicalTensor(self.global_name, self.global_shape, "float32")
        return out

    # -- boxes ------------------------------------------------------------------------------
    def values_boxes(self, box: Box) -> list[tuple[Box, tuple[int, int]]]:
        """The boxes of the values tensor that hold ``box`` of the weight, each with its input
        range ``[k0, k1)`` (a box's input range cut at a block boundary is up to three boxes in
        blocks form).

        Raises:
            ValueError: ``box`` cuts a byte of packed FP4 codes (an odd input range edge).
        """
        off, size = self._permuted(box.offsets), self._permuted(box.sizes)
        k0, k1 = off[-1], off[-1] + size[-1]
        p, b = self.scheme.pack, self.scheme.block
        if (k0 % p or k1 % p) and size[-1]:
            raise ValueError(f"{self.base}: a box {box} cuts the input dimension at an odd position "
                             f"({k0}..{k1}); {self.scheme.name} packs two elements a byte, so every part must "
                             "hold whole pairs (choose a parallelism that cuts it at even positions)")
        head, tail = off[:-1], size[:-1]
        if not self.split:
            return [(Box((*head, k0 // p), (*tail, (k1 - k0) // p)), (k0, k1))]
        out = []
        lo = k0
        while lo < k1:
            block = lo // b
            if lo % b == 0 and k1 - lo >= b:  # whole blocks
                n = (k1 - lo) // b
                out.append((Box((*head, block, 0), (*tail, n, b // p)), (lo, lo + n * b)))
                lo += n * b
            else:
                hi = min(k1, (block + 1) * b)
                out.append((Box((*head, block, (lo % b) // p), (*tail, 1, (hi - lo) // p)), (lo, hi)))
                lo = hi
        return out

    def base_box(self, values_box: Box) -> Box:
        """The box of the weight that a box of the values tensor holds.

        Raises:
            ValueError: a box of several blocks' partial bytes (no box of the weight).
        """
        p, b = self.scheme.pack, self.scheme.block
        if self.split:
            *head, blocks, within = range(len(values_box.sizes))
            boff, bsize = values_box.offsets[blocks], values_box.sizes[blocks]
            joff, jsize = values_box.offsets[within], values_box.sizes[within]
            if jsize != b // p and bsize != 1:
                raise ValueError(f"{self.values_name}: {values_box} holds parts of several blocks")
            k0 = boff * b + joff * p
            k1 = k0 + (bsize * b if jsize == b // p else jsize * p)
            off = [values_box.offsets[d] for d in head] + [k0]
            size = [values_box.sizes[d] for d in head] + [k1 - k0]
        else:
            off = [*values_box.offsets[:-1], values_box.offsets[-1] * p]
            size = [*values_box.sizes[:-1], values_box.sizes[-1] * p]
        base_off, base_size = [0] * len(self.shape), [0] * len(self.shape)
        for i, d in enumerate(self.perm):
            base_off[d], base_size[d] = off[i], size[i]
        return Box(tuple(base_off), tuple(base_size))

    def scale_box(self, grid_box: Box) -> Box:
        """A box of the block grid (the weight's coordinates) in the scale tensor's coordinates."""
        return Box(self._permuted(grid_box.offsets), self._permuted(grid_box.sizes))

    def global_box(self, box: Box) -> Box:
        """The global-scale cells a box of the weight touches."""
        return Box(box.offsets[: self.lead], box.sizes[: self.lead]) if self.lead else Box((0,), (1,))


def scheme_of(name: str) -> BlockScheme:
    try:
        return BLOCK_SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown block format {name!r}; known: {sorted(BLOCK_SCHEMES)}") from None


def block_roles(spec: ModelSpec, scheme: BlockScheme) -> frozenset[str]:
    """The roles a checkpoint of ``spec`` stores in ``scheme``: gpt-oss's MXFP4 checkpoints
    quantize its experts only; others every linear weight but ``lm_head``."""
    if spec.family == "gpt_oss" and scheme.name == "mxfp4":
        return WHOLE_EXPERT_ROLES
    return QUANTIZED_ROLES | WHOLE_EXPERT_ROLES


def block_tensors(spec: ModelSpec, scheme: BlockScheme) -> list[BlockTensor]:
    """Every weight of ``spec`` a ``scheme`` checkpoint quantizes (cached on the spec)."""
    key = f"block_tensors={scheme.name}"
    cached = spec._cache.get(key)
    if cached is None:
        roles, tensors = spec.roles(), spec.canonical_tensors()
        wanted = block_roles(spec, scheme)
        cached = [BlockTensor.of(n, t.shape, scheme) for n, t in tensors.items() if roles[n][0] in wanted]
        spec._cache[key] = cached
    return cached  # type: ignore[no-any-return]


def block_canonical(spec: ModelSpec, scheme: BlockScheme) -> dict[str, CanonicalTensor]:
    """The canonical tensors of ``spec`` plus each quantized weight's derived tensors (cached)."""
    key = f"block_canonical={scheme.name}"
    cached = spec._cache.get(key)
    if cached is None:
        cached = dict(spec.canonical_tensors())
        for tensor in block_tensors(spec, scheme):
            cached.update(tensor.derived())
        spec._cache[key] = cached
    return cached  # type: ignore[no-any-return]


def block_derived(canonical: Mapping[str, CanonicalTensor]) -> dict[str, tuple[BlockTensor, str]]:
    """Every derived tensor of a block format among ``canonical``: name -> (its weight, which one)."""
    out: dict[str, tuple[BlockTensor, str]] = {}
    for name in canonical:
        base, sep, tag = name.rpartition("#")
        if not (sep and tag in BLOCK_SCHEMES) and name.endswith("_blocks"):
            base, tag = name[: -len("_blocks")], "mxfp4"
        elif not (sep and tag in BLOCK_SCHEMES):
            continue
        if base not in canonical:
            continue
        tensor = BlockTensor.of(base, canonical[base].shape, BLOCK_SCHEMES[tag])
        out[tensor.values_name] = (tensor, VALUES)
        out[tensor.scale_name] = (tensor, SCALE)
        if tensor.scheme.global_scale:
            out[tensor.global_name] = (tensor, GLOBAL)
    return out


# -- reader layouts --------------------------------------------------------------------

def block_shards(shards: Iterable[Shard], spec: ModelSpec, scheme: BlockScheme) -> list[Shard]:
    """A reader's shards with each quantized weight in ``scheme``: its values (the weight's shard
    name, the input dimension ``pack`` times shorter), its block scales (``..._scale``) and, for
    NVFP4, its global scales (``..._global_scale``), laid out as the weight's shard is.

    Raises:
        ValueError: a shard mixes quantized and other tensors, holds a weight's input dimension
            other than contiguously, or cuts it inside a block.
    """
    wanted = {t.base: t for t in block_tensors(spec, scheme)}
    out: list[Shard] = []
    for shard in shards:
        mine = [r for r in shard.regions if r.canonical in wanted]
        if not mine:
            out.append(shard)
            continue
        if len(mine) != len(shard.regions):
            raise ValueError(f"{shard.name}: mixes quantized and unquantized tensors; it cannot be {scheme.name}")
        out.extend(_block_group(shard, [wanted[r.canonical] for r in mine], scheme))
    return out


def _whole(t: BlockTensor) -> list[Shard]:
    """The derived tensors of a weight a shard holds whole in checkpoint order, as themselves
    (gpt-oss's ``*_blocks`` and ``*_scales`` for the ``hf`` kind)."""
    return [Shard(name, d.shape, d.dtype, (Region(name, Box.full(d.shape), 0, contiguous_strides(d.shape)),))
            for name, d in t.derived().items()]


def _block_group(shard: Shard, tensors: list[BlockTensor], scheme: BlockScheme) -> list[Shard]:
    b, p = scheme.block, scheme.pack
    only = shard.regions[0] if len(shard.regions) == 1 else None
    if only is not None and only.strides[tensors[0].axis] != 1 and only.offset == 0 \
            and only.box == Box.full(tensors[0].shape) and only.strides == contiguous_strides(tensors[0].shape):
        return _whole(tensors[0])
    if shard.shape[-1] % b:
        raise ValueError(f"{shard.name}: its last dimension ({shard.shape[-1]}) is not whole {b}-element blocks")
    values, scales, globals_ = [], [], []
    parts = len(shard.regions)
    for j, (r, t) in enumerate(zip(shard.regions, tensors, strict=True)):
        strides = r.strides  # one per canonical dim (0 where the local tensor has none)
        k0, k1 = r.box.offsets[t.axis], r.box.ends[t.axis]
        others = [strides[d] for d in t.perm[:-1]]
        if strides[t.axis] != 1 or k0 % b or (k1 % b and k1 != t.shape[t.axis]) or r.offset % b \
                or any(s % b for s in others if s):
            raise ValueError(f"{shard.name}: holds [{k0}, {k1}) of {r.canonical}'s input dimension other than in "
                             f"whole contiguous {b}-element blocks; this layout cannot hold {scheme.name}")
        ((vbox, _),) = t.values_boxes(r.box)
        vstrides = tuple(s // p for s in others) + ((b // p, 1) if t.split else (1,))
        values.append(Region(t.values_name, vbox, r.offset // p, vstrides))
        grid = Box(tuple(o // tt for o, tt in zip(r.box.offsets, t.tile, strict=True)),
                   tuple(-(-s // tt) for s, tt in zip(r.box.sizes, t.tile, strict=True)))
        scales.append(Region(t.scale_name, t.scale_box(grid), r.offset // b, tuple(s // b for s in others) + (1,)))
        if scheme.global_scale:
            slot = r.offset // strides[0] if t.lead and strides[0] else 0
            globals_.append(Region(t.global_name, t.global_box(r.box), slot * parts + j, (parts,) * (t.lead or 1)))
    out = [Shard(shard.name, (*shard.shape[:-1], shard.shape[-1] // p), scheme.values_dtype, tuple(values)),
           Shard(_suffixed(shard.name, "scale"), (*shard.shape[:-1], shard.shape[-1] // b), scheme.scale_dtype,
                 tuple(scales))]
    if scheme.global_scale:
        lead = shard.shape[: tensors[0].lead] if tensors[0].lead else ()
        out.append(Shard(_suffixed(shard.name, "global_scale"), (*lead, parts) if lead else (parts,), "float32",
                         tuple(globals_)))
    return out


def _suffixed(name: str, what: str) -> str:
    """``w13_weight`` -> ``w13_weight_scale``; ``...weight`` -> ``...weight_<what>``."""
    return f"{name}_{what}"


def block_bytes_saved(canonical: Mapping[str, CanonicalTensor]) -> int:
    """Bytes a block-format reader saves over the model dtype: each weight's bytes less its
    values' and scales' (for reports)."""
    saved = 0
    for tensor, what in block_derived(canonical).values():
        if what == VALUES and tensor.base in canonical:
            derived = tensor.derived()
            saved += canonical[tensor.base].nbytes - sum(t.nbytes for t in derived.values())
    return saved


# -- one entry for both families of formats -------------------------------------------------

def derived_bases(names: Iterable[str], spec: ModelSpec) -> dict[str, tuple[str, str]]:
    """Every derived tensor among ``names`` (FP8 values and scales, block formats' values, scales
    and global scales): name -> (its weight, a tag naming what it is, the same for every layer)."""
    from weightsync.layout.quant import derived_names

    names = list(names)
    out = {n: (d.base, f"{'scale' if d.is_scale else 'values'}:{d.scheme.name}")
           for n, d in derived_names(dict.fromkeys(names)).items()}  # type: ignore[arg-type]
    canonical = spec.canonical_tensors()
    known = {n: canonical[n] for n in names if n in canonical}
    candidates = {n: None for n in names if n not in known}
    for name, (tensor, what) in block_derived({**known, **candidates}).items():  # type: ignore[dict-item]
        out[name] = (tensor.base, f"{what}:{tensor.scheme.name}")
    return out


def quant_names() -> list[str]:
    """Every ``quant=`` a reader layout takes: the FP8 schemes and the block formats."""
    from weightsync.layout.quant import SCHEMES

    return sorted([*SCHEMES, *BLOCK_SCHEMES])


def check_quant(name: str) -> None:
    """Raise ValueError listing the known formats if ``name`` is none of them."""
    if name not in quant_names():
        raise ValueError(f"unknown quantization {name!r}; known: {quant_names()}")


def reader_canonical(spec: ModelSpec, name: str) -> dict[str, CanonicalTensor]:
    """The canonical tensors a reader asking for ``quant=name`` names."""
    from weightsync.layout.quant import quantized_canonical, scheme_named

    return block_canonical(spec, BLOCK_SCHEMES[name]) if name in BLOCK_SCHEMES else \
        quantized_canonical(spec, scheme_named(name))


def reader_shards(shards: Iterable[Shard], spec: ModelSpec, name: str) -> list[Shard]:
    """A reader's shards with its weights in ``quant=name``."""
    from weightsync.layout.quant import quantize_shards, scheme_named

    return block_shards(shards, spec, BLOCK_SCHEMES[name]) if name in BLOCK_SCHEMES else \
        quantize_shards(shards, spec, scheme_named(name))


__all__ = ["BLOCK_SCHEMES", "GLOBAL", "SCALE", "VALUES", "WHOLE_EXPERT_ROLES", "BlockScheme", "BlockTensor",
           "block_bytes_saved", "block_canonical", "block_derived", "block_roles", "block_shards", "block_tensors",
           "check_quant", "quant_names", "reader_canonical", "reader_shards", "scheme_of"]
