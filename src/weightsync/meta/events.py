"""The meta server's state changes as data: one frozen dataclass per kind of change.

Every change the server accepts is a list of these *events*; :func:`weightsync.meta.reducer.apply`
turns each into state, and the durable store keeps them (their wire form: one msgpack map with
an ``"op"``) until a snapshot replaces them. Events *set* values rather than add to them, so a
state rebuilt from a snapshot plus the events after it equals the live one.

Live events are what requests cause (:class:`Registered`, :class:`VersionReported`, ...).
Snapshot events restore a whole piece of state at once (:class:`VersionPublished`,
:class:`ReaderRestored`, :class:`JobRestored`): a snapshot is the list of events that rebuilds
the state it was taken from, exactly.

    events = [DocumentPut("job", "model/x", b"{}", at=time.time())]
    wire = [event_to_wire(e) for e in events]        # msgpack-ready maps
    assert [event_from_wire(w) for w in wire] == events

The counter that numbers the tries of a version is the job's transport **epoch**: writers that
failed a version write it again in a later epoch. Journals written before it was called that
name the field ``"attempt"``; :func:`event_from_wire` reads both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias

import msgpack

__all__ = ["BlobStored", "CounterSet", "DocumentPut", "Event", "EventError", "FleetCommanded", "FleetRestored",
           "JobDropped", "JobRestored",
           "ReaderApplied", "ReaderFailed", "ReaderRestored", "Registered", "VersionPublished", "VersionReported",
           "encode_events", "event_from_wire", "event_to_wire"]


class EventError(ValueError):
    """A stored event that is not one this release can read (names the op and the field)."""


@dataclass(frozen=True, slots=True)
class BlobStored:
    """A layout blob, stored once per job under its content address."""

    op: ClassVar[str] = "blob"
    job: str
    hash: str
    data: bytes
    at: float


@dataclass(frozen=True, slots=True)
class Registered:
    """A new participant of a job (``layout``: the hash of its :class:`BlobStored`)."""

    op: ClassVar[str] = "register"
    job: str
    role: str
    rank: int
    group: str
    host: str
    endpoints: Mapping[str, str] = field(hash=False)
    layout: str
    at: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoints", MappingProxyType(dict(self.endpoints)))


@dataclass(frozen=True, slots=True)
class DocumentPut:
    op: ClassVar[str] = "document"
    job: str
    key: str
    value: bytes
    at: float


@dataclass(frozen=True, slots=True)
class CounterSet:
    op: ClassVar[str] = "counter"
    job: str
    name: str
    value: int
    at: float


@dataclass(frozen=True, slots=True)
class VersionReported:
    """One writer's "version ``version`` is ready, in ``epoch``"; published once all reported it."""

    op: ClassVar[str] = "report"
    job: str
    version: int
    fingerprint: str
    epoch: int
    writer_rank: int
    num_writers: int
    at: float


@dataclass(frozen=True, slots=True)
class VersionPublished:
    """Snapshot: the job's latest published version."""

    op: ClassVar[str] = "version"
    job: str
    version: int
    fingerprint: str
    epoch: int
    at: float


@dataclass(frozen=True, slots=True)
class ReaderApplied:
    op: ClassVar[str] = "applied"
    job: str
    rank: int
    version: int
    nbytes: int
    seconds: float
    at: float


@dataclass(frozen=True, slots=True)
class ReaderFailed:
    """Reader ``rank`` failed ``version``: its engine is ``invalid`` (a mix of versions), or it
    still serves ``holds`` (None: what it started with) because the failure never touched it."""

    op: ClassVar[str] = "failed"
    job: str
    rank: int
    version: int
    error: str
    nbytes: int
    seconds: float
    at: float
    invalid: bool = True
    holds: int | None = None


@dataclass(frozen=True, slots=True)
class ReaderRestored:
    """Snapshot: everything known of one reader (``version`` None: it holds no valid version)."""

    op: ClassVar[str] = "reader"
    job: str
    rank: int
    version: int | None
    failed_version: int | None
    error: str | None
    nbytes: int
    seconds: float
    at: float | None
    applied_at: float | None
    invalid_since: float | None = None  # a failed update left its engine invalid, since then


@dataclass(frozen=True, slots=True)
class JobRestored:
    """Snapshot, after the job's other events: its times and roster revision, exactly."""

    op: ClassVar[str] = "job"
    job: str
    created_at: float
    updated_at: float
    roster_revision: int


@dataclass(frozen=True, slots=True)
class FleetCommanded:
    """A fleet command the coordinator applied at ``at`` (``command``: its msgpack wire form,
    :func:`weightsync.meta.fleet.commands.command_to_wire`); replaying it runs the same
    :func:`~weightsync.meta.fleet.decide.decide` at the same time, so the record comes back."""

    op: ClassVar[str] = "fleet"
    job: str
    command: bytes
    at: float


@dataclass(frozen=True, slots=True)
class FleetRestored:
    """Snapshot: a job's fleet record (its msgpack form) and how many changes made it."""

    op: ClassVar[str] = "fleet_record"
    job: str
    record: bytes
    revision: int
    at: float


@dataclass(frozen=True, slots=True)
class JobDropped:
    op: ClassVar[str] = "drop"
    job: str


Event: TypeAlias = (BlobStored | Registered | DocumentPut | CounterSet | VersionReported | VersionPublished
                    | ReaderApplied | ReaderFailed | ReaderRestored | JobRestored | JobDropped | FleetCommanded
                    | FleetRestored)
_KINDS: dict[str, type[Any]] = {cls.op: cls for cls in (
    BlobStored, Registered, DocumentPut, CounterSet, VersionReported, VersionPublished, ReaderApplied, ReaderFailed,
    ReaderRestored, JobRestored, JobDropped, FleetCommanded, FleetRestored)}


def event_to_wire(event: Event) -> dict[str, Any]:
    """The msgpack-ready map of ``event``: ``{"op": ..., <its fields>}``."""
    out: dict[str, Any] = {"op": event.op}
    for f in fields(event):
        value = getattr(event, f.name)
        out[f.name] = dict(value) if isinstance(value, MappingProxyType) else value
    return out


def encode_events(events: list[Event]) -> bytes:
    """The events' wire maps, msgpack-packed one after the other.

    Raises:
        EventError: a value msgpack cannot carry (an int beyond 64 bits): nothing is stored.
    """
    try:
        return b"".join(msgpack.packb(event_to_wire(e), use_bin_type=True) for e in events)
    except (OverflowError, ValueError, TypeError) as exc:
        raise EventError(f"the change cannot be stored ({exc})") from None


# -- reading stored events: every field checked against its declared type -------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_endpoints(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


#: the field annotations used above -> (check, what the message calls it)
_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "a str"), "bytes": (lambda v: isinstance(v, bytes), "bytes"),
    "int": (_is_int, "an int"), "float": (_is_number, "a number"), "bool": (lambda v: isinstance(v, bool), "a bool"),
    "Mapping[str, str]": (_is_endpoints, "a map of str to str"),
}


def _field(op: str, name: str, annotation: str, value: Any) -> Any:
    optional = annotation.endswith(" | None")
    check, what = _TYPES[annotation.removesuffix(" | None")]
    if value is None and optional:
        return None
    if not check(value):
        raise EventError(f"stored {op!r} event: field {name!r} must be {what}{' or None' if optional else ''}, "
                         f"not {value!r:.60}")
    return float(value) if annotation.startswith("float") else value


def _legacy(obj: dict[str, Any]) -> dict[str, Any]:
    """The map an earlier release wrote, as this release writes it."""
    op = obj["op"]
    if op in ("report", "version") and "epoch" not in obj:
        obj = {**obj, "epoch": obj.get("attempt", 0)}
    if op in ("applied", "failed") and "applied_at" in obj:  # a reader in an earlier release's snapshot
        failed = op == "failed"
        obj = {"op": "reader", "job": obj.get("job"), "rank": obj.get("rank"),
               "version": None if failed else obj.get("version"),
               "failed_version": obj.get("version") if failed else None,
               "error": obj.get("error") if failed else None, "nbytes": obj.get("nbytes", 0),
               "seconds": obj.get("seconds", 0.0), "at": obj.get("at"), "applied_at": obj.get("applied_at")}
    elif op in ("applied", "failed"):
        obj = {"nbytes": 0, "seconds": 0.0, **obj}
    if obj["op"] == "failed":  # before engines said whether a failure left them invalid: it did
        obj = {"invalid": True, "holds": None, **obj}
    elif obj["op"] == "reader" and "invalid_since" not in obj:
        failed = obj.get("version") is None and obj.get("error") is not None
        obj = {**obj, "invalid_since": obj.get("at") if failed else None}
    return obj


def event_from_wire(obj: Any) -> Event:
    """Decode one stored event, checking every field against its declared type.

    Reads the maps this release writes and those of earlier releases (``"attempt"`` for the
    epoch, readers in a snapshot as ``"applied"``/``"failed"`` with ``"applied_at"``, failures
    without ``"invalid"``: the engine was invalid).

    Raises:
        EventError: naming the op and the field that is missing or of the wrong type.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise EventError(f"stored event {obj!r:.80} is not a map with an 'op'")
    obj = _legacy(obj)
    op = obj["op"]
    kind = _KINDS.get(op)
    if kind is None:
        raise EventError(f"stored event has an unknown op {op!r}")
    values = {}
    for f in fields(kind):
        if f.name not in obj:
            raise EventError(f"stored {op!r} event lacks field {f.name!r}")
        values[f.name] = _field(op, f.name, str(f.type), obj[f.name])
    if kind is Registered and values["role"] not in ("writer", "reader"):
        raise EventError(f"stored 'register' event: field 'role' must be 'writer' or 'reader', not {values['role']!r}")
    event: Event = kind(**values)
    return event
