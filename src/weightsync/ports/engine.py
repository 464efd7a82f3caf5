"""The ports: what the roles need from a training framework and from an inference engine.

A writer sends what a :class:`TrainingSource` holds; a reader receives into an
:class:`InferenceEngine`. Adapters (``sources/``, ``engines/``, the integrations) implement
these Protocols, and the roles (``roles/writer.py``, ``reader.py``, ``inflight.py``) import only
this module, never an adapter. What an engine can do it declares in class attributes, as
transports do, and the roles read them instead of testing the engine's class.

Lifecycle of one update, driven by ``WeightReader.update``::

    buffers = engine.receive_buffers()   # where the transport writes
    engine.receiving(version)            # the transport may write from now on
    ...transport fills every op...
    engine.apply(version)                # make the new weights live (load, repack, caches)
    # on failure instead: engine.abort(version, error)

**Valid or invalid.** A failed update never leaves an engine claiming a version while it
serves a mix of two: once a byte of version V reached memory the engine serves from (its live
weights as receive buffers, or its own loader), a failure makes it *invalid*
(``weight_version`` None, ``invalid`` says since when and why) until a later version is applied
in full. A failure before that (a refused plan, a dead writer, a transfer into staging)
leaves it valid at the version it had. :class:`Validity` keeps this bookkeeping for adapters.

Engines whose parameters can be written in place (HF models, vLLM on GPU without
repacking) return their parameters from ``receive_buffers`` and ``apply`` only records the
version. Engines that must run their own loader (vLLM on CPU repacks linear weights into
oneDNN handles; quantised weights) return staging buffers in a layout of their choice and
push them through the loader in ``apply``. A training source is built once; the writer calls
``tensors()`` before every version (a framework may re-allocate parameters between steps,
and the writer notices when their storage moved).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

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

    @property
    def in_place_names(self) -> tuple[str, ...] | None:
        """The shards the engine receives straight into the weights it serves; ``()`` when every
        receive buffer is staging, so that receiving while the engine serves is safe (what
        :class:`~weightsync.roles.prefetch.Prefetch` needs). None: the receive buffers are the live
        weights, or the engine does not tell them apart."""
        ...

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        """Shard name -> tensor the transport writes into (parameters or staging)."""
        ...

    def receiving(self, version: int) -> None:
        """The transport is about to write ``version`` into the receive buffers (once per version,
        before its first byte; nothing before it wrote into them). Receive buffers that are the
        weights the engine serves are touched from here on."""
        ...

    def apply(self, version: int) -> None:
        """Everything for ``version`` arrived: make it live and record the version."""
        ...

    def abort(self, version: int, error: BaseException) -> None:
        """The update of ``version`` failed: if any of it reached the weights the engine serves,
        the engine becomes invalid; otherwise it stays at the version it had."""
        ...

    @property
    def weight_version(self) -> int | None:
        """The version the engine's weights are at; None before the first update, and while invalid."""
        ...

    @property
    def invalid(self) -> Invalid | None:
        """Why the engine serves no valid version (None: it does, or serves what it started with)."""
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


@dataclass(frozen=True, slots=True)
class Invalid:
    """An engine serving a mix of versions: the update of ``version`` failed (``error``) after
    its first byte reached the engine's weights; invalid since ``since`` (``time.time()``; a
    later failure keeps the first time and names its own version and error)."""

    version: int
    error: str
    since: float


class Validity:
    """The version an engine's weights are at, and whether a failed update left them mixed.

    The bookkeeping every engine adapter shares::

        validity.touch(V)           # bytes of V reach what the engine serves (a receive in place, a load)
        validity.applied(V)         # V is live, whole
        validity.failed(V, error)   # invalid if V touched the engine, else unchanged; True if invalid

    ``version`` is None while a version is being written into the engine and while it is
    invalid: an engine never claims a version it does not hold whole.
    """

    def __init__(self, version: int | None = None) -> None:
        self._version = version
        self._touching: int | None = None
        self.invalid: Invalid | None = None

    @property
    def version(self) -> int | None:
        return None if self._touching is not None or self.invalid is not None else self._version

    @property
    def touched(self) -> bool:
        """Bytes of an update that has not ended reached the engine's weights."""
        return self._touching is not None

    def touch(self, version: int) -> None:
        self._touching = version

    def applied(self, version: int) -> None:
        self._version, self._touching, self.invalid = version, None, None

    def failed(self, version: int, error: BaseException | str) -> bool:
        """The update of ``version`` failed; returns whether the engine is now invalid."""
        if self._touching is not None:
            self._touching = None
            self._version = None
            since = self.invalid.since if self.invalid is not None else time.time()
            self.invalid = Invalid(version, str(error) or type(error).__name__, since)
        return self.invalid is not None


@dataclass(frozen=True, slots=True)
class ServingVersion:
    """Which version an engine serves, since when, and whether it is valid: the one answer every
    readback gives (a reader, vLLM's worker backend and its drivers, ``vllm serve``'s
    ``GET /weightsync/version``, SGLang's adapter), on the wire as :meth:`to_wire` (JSON/msgpack).

    Attributes:
        version: the version whose weights the engine serves whole; None while it serves its
            start-up weights (no version applied yet) or while it is invalid.
        since: ``time.time()`` when it began serving that (invalid: when it became invalid); None
            for start-up weights.
        valid: False when a failed update left its weights a mix of two versions, or when the
            workers of one engine serve different versions (an update under way).
        reason: why it is invalid (the failed version and its error); empty when valid.
        failed: the version whose failure left it invalid (vLLM stamps ``invalid:<failed>``).
    """

    version: int | None
    since: float | None
    valid: bool
    reason: str = ""
    failed: int | None = None

    @classmethod
    def of(cls, engine: InferenceEngine, *, since: float | None) -> ServingVersion:
        """What ``engine`` serves, given when its current version went live (``since``)."""
        invalid = engine.invalid
        if invalid is not None:
            return cls(None, invalid.since, False, f"version {invalid.version} failed: {invalid.error}",
                       invalid.version)
        version = engine.weight_version
        return cls(version, since if version is not None else None, True)

    @classmethod
    def combine(cls, answers: Sequence[ServingVersion]) -> ServingVersion:
        """One engine's answer from its workers' (a TP/DP engine: one reader per worker): invalid if
        any worker is, or if they serve different versions; else their version, since the last switched.

        Raises:
            ValueError: no answers (an engine has at least one worker).
        """
        if not answers:
            raise ValueError("ServingVersion.combine: no worker answered; an engine has at least one worker")
        broken = [a for a in answers if not a.valid]
        if broken:
            first = min(broken, key=lambda a: a.since if a.since is not None else float("inf"))
            failed = [a.failed for a in broken if a.failed is not None]
            return cls(None, first.since, False, first.reason or "a worker is invalid", max(failed, default=None))
        versions = {a.version for a in answers}
        if len(versions) > 1:
            shown = sorted(versions, key=lambda v: -1 if v is None else v)
            return cls(None, None, False, f"its workers serve different versions {shown} (an update is under way)")
        times = [a.since for a in answers if a.since is not None]
        return cls(versions.pop(), max(times) if times else None, True)

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "since": self.since, "valid": self.valid, "reason": self.reason,
                "failed": self.failed}

    @classmethod
    def from_wire(cls, obj: Any) -> ServingVersion:
        """Read :meth:`to_wire`'s form back.

        Raises:
            ValueError: ``obj`` is not that form, naming the field.
        """
        if not isinstance(obj, dict):
            raise ValueError(f"a serving version is a mapping with version, since, valid, got {type(obj).__name__}")
        checks = {"version": (int, type(None)), "since": (int, float, type(None)), "valid": (bool,),
                  "reason": (str,), "failed": (int, type(None))}
        for name, kinds in checks.items():
            value = obj.get(name, "" if name == "reason" else None)
            if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
                raise ValueError(f"serving version field {name!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                                 f"got {value!r}")
        since = obj.get("since")
        return cls(obj.get("version"), float(since) if since is not None else None, obj["valid"],
                   obj.get("reason", ""), obj.get("failed"))


__all__ = ["InferenceEngine", "Invalid", "PhasedEngine", "ServingVersion", "TrainingSource", "Validity"]
