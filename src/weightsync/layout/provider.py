"""``LayoutProvider``: what sources (training side) and engines (inference side) both are.

A sync job only needs two things from either side to plan: which slices of which canonical
tensors a rank holds (:meth:`LayoutProvider.layout`), and, when those slices follow a
registered layout kind, the short descriptor that lets thousands of ranks publish one shared
blob instead of a shard list each (:meth:`LayoutProvider.descriptor`).
:class:`~weightsync.ports.engine.TrainingSource` adds the live tensors to send;
:class:`~weightsync.ports.engine.InferenceEngine` adds buffers to receive into, the apply/abort
lifecycle and its capabilities.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from weightsync.layout.types import RankLayout


@runtime_checkable
class LayoutProvider(Protocol):
    def layout(self) -> RankLayout:
        """This rank's shards as canonical regions (rank = the writer or reader rank)."""
        ...

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        """(layout string, HF config) when the layout is a registered kind, else None."""
        ...
