"""What a reader needs from an inference engine on one worker.

Lifecycle of one update, driven by ``WeightReader.update``::

    buffers = engine.receive_buffers()   # where the transport writes
    ...transport fills every op...
    engine.apply(version)                # make the new weights live (load, repack, caches)
    # on failure instead: engine.abort(version, error)

Engines whose parameters can be written in place (HF models, vLLM on GPU without
repacking) return their parameters from ``receive_buffers`` and ``apply`` only records the
version. Engines that must run their own loader (vLLM on CPU repacks linear weights into
oneDNN handles; quantised weights) return staging buffers in a layout of their choice and
push them through the loader in ``apply``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from weightsync.layout import LayoutProvider

if TYPE_CHECKING:
    import torch


@runtime_checkable
class InferenceEngine(LayoutProvider, Protocol):
    """A :class:`~weightsync.layout.LayoutProvider` (rank = the reader rank) that can be updated."""

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        """Shard name -> tensor the transport writes into (parameters or staging)."""
        ...

    def apply(self, version: int) -> None:
        """Everything for ``version`` arrived: make it live and record the version."""
        ...

    def abort(self, version: int, error: BaseException) -> None:
        """An update failed part-way; the engine's weights are not at a valid version."""
        ...

    @property
    def weight_version(self) -> int | None:
        """The version the engine's weights are at; None before the first update or after a failure."""
        ...


@runtime_checkable
class PhasedEngine(InferenceEngine, Protocol):
    """An engine that stages a version phase by phase (``SyncConfig(layer_phases=True)``).

    Its receive buffers for different phases may share memory (one staging arena): after each
    phase arrives, the reader calls ``phase_arrived``, and the engine loads those tensors
    before the next phase lands; ``apply`` then completes the version (``abort`` if any
    phase failed).
    """

    @property
    def device(self) -> str:
        """Where the buffers will live (``"cuda:N"`` with its index), before they exist."""
        ...

    def use_phases(self, phases: tuple[tuple[str, ...], ...] | None) -> None:
        """Lay the buffers out for the job's phases (None: the whole version at once)."""
        ...

    def phase_arrived(self, version: int, phase: int, names: tuple[str, ...]) -> None:
        """Phase ``phase`` of ``version`` (canonical tensors ``names``) is in the buffers."""
        ...
