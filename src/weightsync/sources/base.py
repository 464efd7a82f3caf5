"""What a writer needs from a training framework on one rank.

A training source says which slices of which canonical tensors this rank holds (its
:class:`RankLayout`) and hands over the local tensors themselves, without copying or
gathering. Adapters for FSDP2/DTensor, DeepSpeed ZeRO-3 and Megatron-core read shards and
their global positions straight out of the framework's parameters.

Lifecycle: build the source once; the writer calls ``tensors()`` before every version
(parameters may be re-allocated by a framework between steps, and the writer notices
when their storage moved).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from weightsync.layout import LayoutProvider

if TYPE_CHECKING:
    import torch


@runtime_checkable
class TrainingSource(LayoutProvider, Protocol):
    """A :class:`~weightsync.layout.LayoutProvider` (rank = the writer rank) with live tensors."""

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Shard name -> the live local tensor (contiguous) holding the current weights."""
        ...
