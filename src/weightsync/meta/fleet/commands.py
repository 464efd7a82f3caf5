"""What can happen to a fleet, as data: the commands :func:`~weightsync.meta.fleet.decide.decide` takes.

Each command is a frozen dataclass with a msgpack wire form (a map with an ``"op"``), checked
field by field on receipt: the embedded server stores them (and replays them after a restart),
and a backend on another host could ship them. Requests cause most of them (a process joins,
a writer opens a try, a reader reports); the coordinator's own timers cause the others: a
lease that expired (:class:`Expire`) and time passing (:class:`Tick`, for deadlines).

    wire = command_to_wire(OpenTry(7, writer=0, incarnation="3fa2", deadline=60.0))
    assert command_from_wire(wire) == OpenTry(7, 0, "3fa2", 60.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeAlias

from weightsync.ports.fleet import FleetWireError, JobShape


@dataclass(frozen=True, slots=True)
class Join:
    """A process joins as ``role`` ``id`` (``None``: a reader the coordinator gives an id), with
    the job shape it runs with and, for a reader, the version its engine holds (``holds``)."""

    op: ClassVar[str] = "join"
    role: str
    id: int | None
    incarnation: str
    host: str
    pid: int
    shape: JobShape
    holds: int | None = None


@dataclass(frozen=True, slots=True)
class Leave:
    """A process leaves cleanly (it released its lease)."""

    op: ClassVar[str] = "leave"
    role: str
    id: int
    incarnation: str


@dataclass(frozen=True, slots=True)
class Expire:
    """A process's lease expired (``detail``: what the lease table knows of it)."""

    op: ClassVar[str] = "expire"
    role: str
    id: int
    incarnation: str
    detail: str


@dataclass(frozen=True, slots=True)
class OpenTry:
    """A writer starts ``version``: it joins the version's undecided try, or opens one in the
    current generation (``deadline``: seconds until the try is decided)."""

    op: ClassVar[str] = "open"
    version: int
    writer: int
    incarnation: str
    deadline: float

    def __post_init__(self) -> None:
        if not (self.deadline > 0 and math.isfinite(self.deadline)):  # a NaN deadline would never come
            raise ValueError(f"a try's deadline must be a positive number of seconds, got {self.deadline}")


@dataclass(frozen=True, slots=True)
class Ready:
    """A writer's part of a try is out (or, for transports whose readers wait for the bytes
    themselves, about to be): ``fingerprint`` is the sync it planned."""

    op: ClassVar[str] = "ready"
    try_number: int
    writer: int
    incarnation: str
    fingerprint: str


@dataclass(frozen=True, slots=True)
class Fail:
    """A member's transfer of a try failed (``error`` says how); a reader's is its outcome."""

    op: ClassVar[str] = "fail"
    try_number: int
    role: str
    id: int
    incarnation: str
    error: str


@dataclass(frozen=True, slots=True)
class Report:
    """A reader's outcome of a try: ``applied``, ``staged`` (received, not applied yet) or ``failed``."""

    op: ClassVar[str] = "report"
    try_number: int
    reader: int
    incarnation: str
    outcome: str
    detail: str = ""
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: tries whose deadline came are decided."""

    op: ClassVar[str] = "tick"


Command: TypeAlias = Join | Leave | Expire | OpenTry | Ready | Fail | Report | Tick
#: the commands a member sends (Expire and Tick are the coordinator's own)
MEMBER_OPS = ("join", "leave", "open", "ready", "fail", "report")
_KINDS: dict[str, type[Any]] = {c.op: c for c in (Join, Leave, Expire, OpenTry, Ready, Fail, Report, Tick)}
_PLAIN: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float),
                                               "int | None": (int, type(None))}


def command_to_wire(command: Command) -> dict[str, Any]:
    """The msgpack-ready map of ``command``."""
    out: dict[str, Any] = {"op": command.op}
    for f in fields(command):
        value = getattr(command, f.name)
        out[f.name] = value.to_wire() if isinstance(value, JobShape) else value
    return out


def command_from_wire(doc: Any) -> Command:
    """Decode one command, checking every field.

    Raises:
        FleetWireError: naming the op and the field that is missing or of the wrong type.
    """
    if not isinstance(doc, Mapping) or not isinstance(doc.get("op"), str):
        raise FleetWireError(f"a fleet command must be a map with an 'op', not {doc!r:.60}")
    kind = _KINDS.get(doc["op"])
    if kind is None:
        raise FleetWireError(f"unknown fleet command {doc['op']!r}")
    values: dict[str, Any] = {}
    for f in fields(kind):
        if f.name not in doc:
            raise FleetWireError(f"fleet command {kind.op!r} lacks field {f.name!r}")
        value: Any = doc[f.name]
        annotation = str(f.type)
        if annotation == "JobShape":
            value = JobShape.from_wire(value)
        else:
            want = _PLAIN[annotation]
            if not isinstance(value, want) or isinstance(value, bool):
                raise FleetWireError(f"fleet command {kind.op!r}: field {f.name!r} must be {annotation}, "
                                     f"not {value!r:.40}")
            if annotation == "float":
                value = float(doc[f.name])
        values[f.name] = value
    if "role" in values and values["role"] not in ("writer", "reader"):
        raise FleetWireError(f"fleet command {kind.op!r}: role must be 'writer' or 'reader', not {values['role']!r}")
    try:
        command: Command = kind(**values)
    except ValueError as exc:
        raise FleetWireError(f"fleet command {kind.op!r}: {exc}") from None
    return command


__all__ = ["MEMBER_OPS", "Command", "Expire", "Fail", "Join", "Leave", "OpenTry", "Ready", "Report", "Tick",
           "command_from_wire", "command_to_wire"]
