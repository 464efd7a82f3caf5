"""The ports: what the roles need from a training framework and from an inference engine.

A writer sends what a :class:`TrainingSource` holds; a reader receives into an
:class:`InferenceEngine`. Adapters (``sources/``, ``engines/``, the integrations) implement
these Protocols, and the roles (``roles/writer.py``, ``reader.py``, ``inflight.py``) import only
this module, never an adapter. What an engine can do it declares in class attributes, as
transports do, and the roles read them instead of testing the engine's class.

Lifecycle of one update, driven by ``WeightReader.update``::

    buffers = engine.receive_buffers()   # where the transport writes
    ...transport fills every op...
    engine.apply(version)                # make the new weights live (load, repack, caches)
    # on failure instead: engine.abort(version, error)

Engines whose parameters can be written in place (HF models, vLLM on GPU without
repacking) return their parameters from ``receive_buffers`` and ``apply`` only records the
version. Engines that must run their own loader (vLLM on CPU repacks linear weights into
oneDNN handles; quantised weights) return staging buffers in a layout of their choice and
push them through the loader in ``apply``. A training source is built once; the writer calls
``tensors()`` before every version (a framework may re-allocate parameters between steps,
and the writer notices when their storage moved).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from weightsync.layout import LayoutProvider

if TYPE_CHECKING:
    import torch


@runtime_checkable
class TrainingSource(LayoutProvider, Protocol):
    """A :class:`~weightsync.layout.LayoutProvider` (rank = the writer rank) with live tensors.

    It says which slices of which canonical tensors this rank holds (its layout) and hands
    over the local tensors themselves, without copying or gathering.
    """

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Shard name -> the live local tensor (contiguous) holding the current weights."""
        ...


@runtime_checkable
class InferenceEngine(LayoutProvider, Protocol):
    """A :class:`~weightsync.layout.LayoutProvider` (rank = the reader rank) that can be updated.

    Its capabilities are the class attributes below, which the roles read.
    """

    #: The engine stages a version phase by phase (``SyncConfig(layer_phases=True)``) and
    #: implements :class:`PhasedEngine`'s hooks: the reader lays its buffers out for the job's
    #: phases and reports each phase as it arrives.
    stages_in_phases: ClassVar[bool]
    #: Each receive buffer holds the bytes a transport wrote into it until the next receive
    #: writes into it again (neither the engine's loader nor anything else changes them), so
    #: a reader may vouch for the version they hold and receive only what changed (delta
    #: sync). Buffers that several phases share (a staging arena) hold only the last phase's:
    #: with more than one phase, transports assume nothing is kept.
    keeps_received_bytes: ClassVar[bool]

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


class PhasedEngine(InferenceEngine, Protocol):
    """The hooks of an engine that declares ``stages_in_phases``.

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


__all__ = ["InferenceEngine", "PhasedEngine", "TrainingSource"]
