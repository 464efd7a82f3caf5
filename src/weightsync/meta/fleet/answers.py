"""What the meta server's fleet routes answer, typed (msgpack on the wire, checked on receipt).

    answer = client.fleet_command(OpenTry(7, writer=0, incarnation="3fa2", deadline=30.0))
    answer.reply.kind, answer.reply.try_number         # "try", 4
    view = client.fleet_record(after=answer.revision, wait=10.0)   # the record once it changed
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.meta.fleet.decide import Reply
from weightsync.ports.fleet import FleetRecord, FleetWireError
from weightsync.ports.fleet.policy import ROLES, is_int, wire_field


@dataclass(frozen=True, slots=True)
class FleetAnswer:
    """The coordinator's reply to one command, the generation after it and the record's revision."""

    reply: Reply
    generation: int
    revision: int

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> FleetAnswer:
        return cls(Reply.from_wire(wire_field(doc, "reply", Mapping, "a map")),
                   wire_field(doc, "generation", int, "an int"), wire_field(doc, "revision", int, "an int"))


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet record at ``revision`` (the number of changes that made it)."""

    revision: int
    record: FleetRecord

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> FleetView:
        return cls(wire_field(doc, "revision", int, "an int"),
                   FleetRecord.from_wire(wire_field(doc, "record", Mapping, "a map")))


@dataclass(frozen=True, slots=True)
class FleetTicked:
    """What a tick did: the members it declared dead ``(role, id, incarnation)``, the generation after."""

    expired: tuple[tuple[str, int, str], ...]
    generation: int
    revision: int

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> FleetTicked:
        rows = wire_field(doc, "expired", list, "a list")
        if not all(isinstance(r, (list, tuple)) and len(r) == 3 and r[0] in ROLES and is_int(r[1])
                   and isinstance(r[2], str) for r in rows):
            raise FleetWireError(f"field 'expired' must be a list of [role, id, incarnation], not {rows!r:.60}")
        return cls(tuple((str(r[0]), int(r[1]), str(r[2])) for r in rows),
                   wire_field(doc, "generation", int, "an int"), wire_field(doc, "revision", int, "an int"))


__all__ = ["FleetAnswer", "FleetTicked", "FleetView"]
