"""N-dimensional boxes: the unit in which every slice of every tensor is described.

A :class:`Box` is a half-open hyper-rectangle ``[offsets, offsets + sizes)`` inside a tensor.
Everything the planner reasons about (what a rank holds, what a rank needs, what one
transfer moves) is a box of a canonical tensor, so the few operations here (intersection,
difference, splitting) are the whole geometry of weightsync.

    >>> a = Box((0, 0), (4, 8))
    >>> b = Box((2, 4), (4, 8))
    >>> a.intersect(b)
    Box(offsets=(2, 4), sizes=(2, 4))
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Box:
    """A half-open box ``[offsets, offsets + sizes)`` of an n-dimensional tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(
                f"Box offsets {self.offsets} and sizes {self.sizes} have different ranks"
            )
        if self.offsets and (min(self.offsets) < 0 or min(self.sizes) < 0):
            raise ValueError(f"Box offsets and sizes must be non-negative, got {self}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def slices(self) -> tuple[slice, ...]:
        """Python slices selecting this box, for numpy/torch indexing."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or ``None`` when they do not overlap."""
        offs = []
        sizes = []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True):
            lo = max(o1, o2)
            hi = min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def contains(self, other: Box) -> bool:
        return all(
            o1 <= o2 and o2 + s2 <= o1 + s1
            for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        )

    def relative_to(self, outer: Box) -> tuple[int, ...]:
        """Offsets of this box measured from the corner of ``outer``."""
        return tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True))

    def subtract(self, other: Box) -> list[Box]:
        """``self`` minus ``other`` as at most ``2 * ndim`` disjoint boxes."""
        inter = self.intersect(other)
        if inter is None:
            return [self]
        pieces: list[Box] = []
        offs = list(self.offsets)
        sizes = list(self.sizes)
        for d in range(self.ndim):
            lo, hi = offs[d], offs[d] + sizes[d]
            ilo, ihi = inter.offsets[d], inter.ends[d]
            if ilo > lo:
                pieces.append(Box(tuple(offs[:d] + [lo] + offs[d + 1 :]),
                                  tuple(sizes[:d] + [ilo - lo] + sizes[d + 1 :])))
            if ihi < hi:
                pieces.append(Box(tuple(offs[:d] + [ihi] + offs[d + 1 :]),
                                  tuple(sizes[:d] + [hi - ihi] + sizes[d + 1 :])))
            offs[d], sizes[d] = ilo, ihi - ilo
        return pieces

    def split(self, dim: int, bounds: Sequence[int]) -> Iterator[Box]:
        """Cut along ``dim`` at the relative positions ``bounds`` (0 < b < size, ascending)."""
        cuts = [0, *bounds, self.sizes[dim]]
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            if hi > lo:
                offs = list(self.offsets)
                sizes = list(self.sizes)
                offs[dim] += lo
                sizes[dim] = hi - lo
                yield Box(tuple(offs), tuple(sizes))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of a contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(shape[d + 1]), 1)
    return tuple(strides)


def is_contiguous_view(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a strided view with these sizes/strides is one dense row-major run."""
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` boundaries: chunks of ``ceil(size/parts)``, trailing ones short or empty.

    This is how FSDP2 ``Shard(dim)`` splits uneven dimensions, so layouts built from it
    agree with DTensor element for element.
    """
    if parts <= 0:
        raise ValueError(f"cannot split a dimension into {parts} parts")
    step = -(-size // parts) if size else 0
    out = []
    for i in range(parts):
        lo = min(i * step, size)
        hi = min(lo + step, size)
        out.append((lo, hi))
    return out


def even_bounds(size: int, parts: int, *, what: str = "dimension") -> list[tuple[int, int]]:
    """Equal parts; raises a ValueError naming ``what`` when ``size`` is not divisible."""
    if parts <= 0 or size % parts:
        raise ValueError(f"{what} of size {size} is not divisible by {parts}")
    step = size // parts
    return [(i * step, (i + 1) * step) for i in range(parts)]
