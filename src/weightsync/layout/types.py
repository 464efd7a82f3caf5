"""Metadata types of the layout layer: canonical tensors, regions, shards, rank layouts.

The model: every tensor an engine or trainer holds (a *shard*) is described as a set of
*regions*. A region says "this strided view of my local tensor holds exactly this box of
that canonical tensor". Canonical tensors use Hugging Face names and global shapes.

A region's local side is an ``as_strided`` view of the shard's flattened storage
(``offset`` + ``strides``, sizes equal to the canonical box sizes). That one form covers
plain slices, fused concatenations, stacked experts, 1-D flat partitions (ZeRO-3, FSDP1)
and even transposed storage, so the planner and transports never special-case an engine:

    shard = Shard("model.layers.0.self_attn.qkv_proj.weight", (96, 64), "float32", (
        Region("model.layers.0.self_attn.q_proj.weight", Box((0, 0), (64, 64)), 0, (64, 1)),
        Region("model.layers.0.self_attn.k_proj.weight", Box((0, 0), (16, 64)), 4096, (64, 1)),
        Region("model.layers.0.self_attn.v_proj.weight", Box((0, 0), (16, 64)), 5120, (64, 1)),
    ))

Canonical names containing a ``*`` path segment are expert *stacks*: dimension 0 indexes
the expert, and ``name.replace("*", str(e))`` is the Hugging Face name of expert ``e``.
Stacking keeps the metadata of a 384-expert model small (one region per rank per matrix
instead of one per expert) without losing the per-expert checkpoint names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.layout.box import Box, contiguous_strides

#: Bytes per element of every dtype weightsync moves (torch names without ``torch.``).
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``; a ValueError lists the supported names."""
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype!r}; use one of {sorted(DTYPE_ITEMSIZE)}"
        ) from None


def expert_name(stack_name: str, expert: int) -> str:
    """The Hugging Face name of one expert of a canonical expert stack."""
    return stack_name.replace("*", str(expert))


def is_expert_stack(name: str) -> bool:
    return ".*." in name


@dataclass(frozen=True, slots=True)
class CanonicalTensor:
    """A tensor in the canonical (Hugging Face) name space, with its global shape.

    ``dtype`` is the nominal (checkpoint) dtype; the bytes a rank holds may be another
    dtype (fp32 master weights, say), which is declared on its shards.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        itemsize(self.dtype)
        if any(s < 0 for s in self.shape):
            raise ValueError(f"canonical tensor {self.name!r} has a negative dim: {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class Region:
    """A strided view of a shard's storage that holds one box of one canonical tensor.

    Element ``i`` (a multi-index within ``box.sizes``) of the canonical box lives at flat
    position ``offset + sum(i[d] * strides[d])`` of the shard's contiguous storage.
    """

    canonical: str
    box: Box
    offset: int
    strides: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.strides) != self.box.ndim:
            raise ValueError(
                f"region of {self.canonical!r}: {len(self.strides)} strides for a "
                f"{self.box.ndim}-d box"
            )

    @property
    def numel(self) -> int:
        return self.box.numel



@dataclass(frozen=True, slots=True)
class Shard:
    """One engine-local tensor: its own name, local shape and dtype, and what it holds.

    Elements of the local tensor not covered by any region (vocabulary padding, say) are
    not part of any transfer and are never written.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    regions: tuple[Region, ...]

    #: Columnar form of ``regions``, computed (and validated) once; see ``layout.columns``.
    _columns: Any = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


def box_region(
    canonical: str,
    canonical_box: Box,
    local_shape: Sequence[int],
    local_offsets: Sequence[int] | None = None,
    *,
    drop_leading: int = 0,
) -> Region:
    """A region where a box of a contiguous local tensor holds ``canonical_box``.

    ``local_offsets`` is the corner of the local box (default: origin); its sizes are
    ``canonical_box.sizes[drop_leading:]``. ``drop_leading`` unit dims of the canonical box
    have no local counterpart: a per-expert ``[I, H]`` tensor holding box ``[e:e+1, :, :]``
    of an expert stack uses ``drop_leading=1``.
    """
    if any(s != 1 for s in canonical_box.sizes[:drop_leading]):
        raise ValueError(f"{canonical}: dropped leading dims of {canonical_box} must have size 1")
    if len(local_shape) != canonical_box.ndim - drop_leading:
        raise ValueError(
            f"{canonical}: a {canonical_box.ndim}-d box {canonical_box.sizes} (dropping "
            f"{drop_leading}) cannot be viewed from a local tensor of shape {tuple(local_shape)}"
        )
    local_strides = contiguous_strides(local_shape)
    offs = tuple(local_offsets) if local_offsets is not None else (0,) * len(local_shape)
    offset = sum(o * s for o, s in zip(offs, local_strides, strict=True))
    return Region(canonical, canonical_box, offset, (0,) * drop_leading + local_strides)


def flat_range_regions(
    canonical: CanonicalTensor | tuple[str, Sequence[int]],
    start: int,
    stop: int,
    local_offset: int = 0,
) -> list[Region]:
    """Regions for a 1-D local run holding flat elements ``[start, stop)`` of a tensor.

    The run is decomposed into at most ``2 * ndim - 1`` row-major boxes (a partial row, a
    block of whole rows, a partial row, recursively). ZeRO-3 ``ds_tensor`` partitions and
    FSDP1 flat parameters are described this way; each box is contiguous in the run.
    """
    name, shape = (canonical.name, canonical.shape) if isinstance(canonical, CanonicalTensor) else canonical
    shape = tuple(int(s) for s in shape)
    out: list[Region] = []

    def rows_region(prefix: tuple[int, ...], dims: tuple[int, ...], lo: int, hi: int, local: int) -> None:
        inner = math.prod(dims[1:])
        box = Box(prefix + (lo // inner,) + (0,) * (len(dims) - 1),
                  (1,) * len(prefix) + ((hi - lo) // inner,) + dims[1:])
        out.append(Region(name, box, local, contiguous_strides(box.sizes)))

    def emit(prefix: tuple[int, ...], dims: tuple[int, ...], lo: int, hi: int, local: int) -> None:
        # ``prefix`` fixes the leading indices; [lo, hi) is a flat range within ``dims``.
        if lo >= hi:
            return
        if len(dims) == 1:
            box = Box(prefix + (lo,), (1,) * len(prefix) + (hi - lo,))
            out.append(Region(name, box, local, contiguous_strides(box.sizes)))
            return
        inner = math.prod(dims[1:])
        if lo % inner:  # partial head row
            row = lo // inner
            end = min(hi, (row + 1) * inner)
            emit(prefix + (row,), dims[1:], lo - row * inner, end - row * inner, local)
            local += end - lo
            lo = end
        whole_end = (hi // inner) * inner
        if whole_end > lo:  # block of whole rows
            rows_region(prefix, dims, lo, whole_end, local)
            local += whole_end - lo
            lo = whole_end
        if hi > lo:  # partial tail row
            row = lo // inner
            emit(prefix + (row,), dims[1:], 0, hi - lo, local)

    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"{name}: flat range [{start}, {stop}) outside a tensor of {total} elements")
    if not shape:
        if stop > start:
            out.append(Region(name, Box((), ()), local_offset, ()))
        return out
    emit((), shape, start, stop, local_offset)
    return out


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Everything one writer or reader rank holds, as canonical regions.

    ``canonical`` maps each canonical name referenced by a region to its global shape;
    it is usually shared by every rank of a model (one dict object).
    """

    rank: int
    shards: tuple[Shard, ...]
    canonical: Mapping[str, CanonicalTensor] = field(hash=False, compare=False)

    _columns: Any = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        names = [shard.name for shard in self.shards]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"rank {self.rank}: shard name(s) {dup[:5]} appear more than once")

    def with_rank(self, rank: int) -> RankLayout:
        """The same shards on another rank (shares the validated columnar form)."""
        other = RankLayout(rank, self.shards, self.canonical)
        object.__setattr__(other, "_columns", self._columns)
        return other

    def shard(self, name: str) -> Shard:
        for shard in self.shards:
            if shard.name == name:
                return shard
        raise KeyError(f"rank {self.rank} has no shard named {name!r}")

    def regions(self) -> Iterable[tuple[Shard, Region]]:
        for shard in self.shards:
            for region in shard.regions:
                yield shard, region

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)
