"""``TensorSlice``: where a local tensor sits in its global tensor (the store's unit of put and get)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.layout import Box


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Where a local tensor sits in its global tensor: the global shape and the box it holds."""

    shape: tuple[int, ...]
    box: Box

    def __post_init__(self) -> None:
        if self.box.ndim != len(self.shape) or any(e > s for e, s in zip(self.box.ends, self.shape, strict=True)):
            raise ValueError(f"box {self.box} does not fit in a tensor of shape {self.shape}")

    @classmethod
    def whole(cls, shape: tuple[int, ...] | torch.Size) -> TensorSlice:
        shape = tuple(int(s) for s in shape)
        return cls(shape, Box.full(shape))

    @classmethod
    def part(cls, shape: tuple[int, ...] | torch.Size, *, index: int, count: int, dim: int = 0) -> TensorSlice:
        """Part ``index`` of ``count`` along ``dim``, split like ``torch.tensor_split`` (sizes differ by <= 1)."""
        shape = tuple(int(s) for s in shape)
        if not 0 <= index < count:
            raise ValueError(f"part index {index} is outside 0..{count - 1}")
        n = shape[dim]
        lo = index * (n // count) + min(index, n % count)
        size = n // count + (1 if index < n % count else 0)
        offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(size if d == dim else s for d, s in enumerate(shape))
        return cls(shape, Box(offsets, sizes))



def slice_of(tensor: torch.Tensor, where: TensorSlice) -> torch.Tensor:
    """The view of a global ``tensor`` that ``where`` describes (for tests and callers holding the whole)."""
    return tensor[where.box.slices()] if where.box.ndim else tensor
