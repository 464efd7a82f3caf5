"""The fleet coordinator on etcd: the same :func:`~weightsync.meta.fleet.decide.decide` that the
embedded meta server applies, with no process playing the coordinator.

Every client decides for itself: it reads the record, decides on what it read, and puts the new
record in one transaction that compares the record's key with the revision it read; when
another client got there first, the transaction fails and the client reads and decides again.
So each change is decided exactly once, on the record it changes, as under the server's lock,
and a coordinator host that dies takes nothing with it: the record is etcd's, replicated.

Keys (under the job's root; :mod:`~weightsync.meta.etcd.schema`):

- ``fleet/record``: ``{"revision": n, "record": FleetRecord}`` (msgpack). ``revision`` counts the
  changes, as the server's does; one record per job, so a change is one small put (a fleet of
  hundreds of members is tens of kB, far below etcd's 1.5 MiB request limit).
- ``fleet/alive/<role>/<id>``: ``{"incarnation", "ttl"}``, attached to the member's own etcd lease
  (TTL: the member's lease period, whole seconds, at least etcd's minimum). Its join puts it in the
  transaction that seats the member, so no one ever sees a seated member without one.

Leases are etcd's: a member's heartbeat (:meth:`Fleet.fleet_beat`) and each of its commands keep
its etcd lease alive; etcd deletes the alive key once no keep-alive came for the TTL.
:meth:`Fleet.fleet_tick`, which any client may call at any time (as the server's timer does),
declares dead (:class:`~weightsync.meta.fleet.commands.Expire`) every live member of the record
whose alive key is gone or names another incarnation, then decides the tries whose deadline
came. A dead member is so named within its TTL plus one tick period of someone who ticks.

Time: ``now`` (deadlines, ``since``) is the deciding client's clock (a :class:`~weightsync.clock.clock.Clock`;
tests pass a ``ManualClock``). Hosts' clocks should agree within a small part of a deadline
(NTP does); a try's deadline is decided by the first client that ticks past it.

    meta = EtcdMetaClient("etcd://n1:2379", job="grpo")
    answer = meta.fleet_join(Join("reader", None, "3fa2", "n4", 41, shape), ttl=5.0)
    meta.fleet_beat("reader", answer.reply.id, "3fa2")       # every second or so
    meta.fleet_tick()                                       # any member, now and then

Each call is written once, as steps (:mod:`weightsync.meta.etcd.steps`: transactions, watches
and the three lease calls), which the sync client (:class:`Fleet`) and the asyncio one
(:class:`~weightsync.meta.etcd.async_client.AsyncEtcdMetaClient`) drive alike: a member that
joined through either is the same member to the other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.clock.clock import Clock
from weightsync.meta import calls, wire
from weightsync.meta.etcd import ops, steps
from weightsync.meta.etcd.base import EtcdBase
from weightsync.meta.etcd.ops import Row
from weightsync.meta.etcd.schema import JobKeys
from weightsync.meta.etcd.steps import Grant, KeepAlive, Steps, Txn
from weightsync.meta.fleet.answers import FleetAnswer, FleetTicked, FleetView
from weightsync.meta.fleet.commands import Command, Expire, Join, Leave, Tick
from weightsync.meta.fleet.decide import Decision, deadline_due, decide, renewed_member
from weightsync.meta.fleet.leases import DEFAULT_TTL, check_ttl
from weightsync.ports.fleet import FleetRecord, FleetWireError


@dataclass(frozen=True, slots=True)
class _Read:
    """The record as one read found it: the row's revision to compare with (0: no record yet)."""

    record: FleetRecord
    revision: int
    mod_revision: int
    read_revision: int


class Fleet(EtcdBase):
    """The fleet calls of :class:`~weightsync.meta.etcd.client.EtcdMetaClient` (see module docstring):
    the same calls and answers as :class:`~weightsync.meta.client.MetaClient`'s."""

    def fleet_join(self, join: Join, *, ttl: float | None = None) -> FleetAnswer:
        """Join the fleet (``reply.id``: the seat; ``ttl``: this member's lease period, seconds).

        Raises:
            ValueError: the join contradicts the job (``FleetConflictError``), or ``ttl`` is out of bounds.
        """
        return self.run(fleet_join(self.keys, self.clock, join, ttl))

    def fleet_command(self, command: Command) -> FleetAnswer:
        """A member's command (``Leave``, ``OpenTry``, ``Ready``, ``Fail``, ``Report``); it renews the
        sender's lease unless it was refused or ignored.

        Raises:
            ValueError: the command is the coordinator's own (``Tick``, ``Expire``), or contradicts
                the job (``FleetConflictError``).
        """
        return self.run(fleet_command(self.keys, self.clock, command))

    def fleet_beat(self, role: str, id_: int, incarnation: str) -> bool:
        """A member's heartbeat; False: it is not a live member (it was declared dead, or it left)."""
        return self.run(fleet_beat(self.keys, role, id_, incarnation))

    def fleet_tick(self) -> FleetTicked:
        """Declare dead the live members whose etcd lease expired, then decide the tries whose
        deadline came, in one transaction (see module docstring). Returns who was declared dead."""
        return self.run(fleet_tick(self.keys, self.clock))

    def fleet_record(self, *, after: int = -1, wait: float = 0.0) -> FleetView:
        """The fleet record; with ``wait``, watched until its revision is past ``after``."""
        return self.run(fleet_record(self.keys, after=after, wait=wait))


# -- the calls, as steps ------------------------------------------------------------------------------

def fleet_join(keys: JobKeys, clock: Clock, join: Join, ttl: float | None) -> Steps[FleetAnswer]:
    """:meth:`Fleet.fleet_join`: the member's etcd lease is granted first and put with its alive key
    in the transaction that seats it; revoked when the join seated no one (refused, or a retry of a
    member already seated, whose lease stands). A lease granted for a join whose transaction never
    reached etcd expires on its own, within the member's lease period."""
    period = check_ttl(ttl)
    calls.fleet_command(keys.job, join, ttl=period)  # checks the command as the server's client does
    lease = yield from steps.lease_call(Grant(_etcd_ttl(period if period is not None else DEFAULT_TTL)))
    try:
        answer, _, seated = yield from _decide_and_put(keys, clock, join, lease=lease, ttl=period or DEFAULT_TTL)
    except Exception:
        yield from steps.revoke(lease)
        raise
    if not seated:
        yield from steps.revoke(lease)
    return answer


def fleet_command(keys: JobKeys, clock: Clock, command: Command) -> Steps[FleetAnswer]:
    """:meth:`Fleet.fleet_command`."""
    if isinstance(command, Join):
        return (yield from fleet_join(keys, clock, command, None))
    calls.fleet_command(keys.job, command)  # refuses Tick and Expire, naming them
    answer, decision, _ = yield from _decide_and_put(keys, clock, command)
    member = renewed_member(command, decision)
    if member is not None:
        yield from _renew(keys, *member)
    return answer


def fleet_beat(keys: JobKeys, role: str, id_: int, incarnation: str) -> Steps[bool]:
    """:meth:`Fleet.fleet_beat`."""
    calls.fleet_beat(keys.job, role, id_, incarnation)  # checks the arguments
    return (yield from _renew(keys, role, id_, incarnation))


def fleet_tick(keys: JobKeys, clock: Clock) -> Steps[FleetTicked]:
    """:meth:`Fleet.fleet_tick`."""
    while True:
        rows, read_revision = yield from steps.rows(ops.read(keys.fleet_record), ops.read(keys.fleet_alive(),
                                                                                          prefix=True))
        current = _parse(keys, rows, read_revision)
        beats = {row.key: row for row in rows if row.key != keys.fleet_record}
        now = clock.now()
        expired = [Expire(m.role, m.id, m.incarnation,
                          "its etcd lease expired: no heartbeat of it reached etcd within its lease period")
                   for m in current.record.members.values()
                   if m.live and _incarnation(beats.get(keys.fleet_alive(m.role, m.id))) != m.incarnation]
        record, changes = current.record, 0
        for command in expired:
            decided = decide(record, command, now)
            changes += decided.record is not record
            record = decided.record
        if deadline_due(record, now):  # after the deaths, which may have decided some tries already
            decided = decide(record, Tick(), now)
            changes += decided.record is not record
            record = decided.record
        if changes == 0:
            return FleetTicked((), record.generation.number, current.revision)
        # a death stands only if its alive key is still as read (a renewal since then re-decides)
        unchanged = tuple(ops.unchanged(key, beats[key].mod_revision if key in beats else 0)
                          for key in (keys.fleet_alive(e.role, e.id) for e in expired))
        if (yield from _put(keys, current, record, current.revision + changes, compare=unchanged,
                            what="decide the fleet's leases and deadlines")):
            return FleetTicked(tuple((e.role, e.id, e.incarnation) for e in expired), record.generation.number,
                               current.revision + changes)


def fleet_record(keys: JobKeys, *, after: int, wait: float) -> Steps[FleetView]:
    """:meth:`Fleet.fleet_record`."""
    calls.fleet_record(keys.job, after=after, wait=wait)  # checks the arguments

    def read() -> Steps[tuple[_Read, int]]:
        current = yield from _read(keys)
        return current, current.read_revision

    current = yield from steps.watched(keys.fleet_record, read, lambda c: c.revision > after, wait)
    return FleetView(current.revision, current.record)


# -- the record ---------------------------------------------------------------------------------------

def _read(keys: JobKeys) -> Steps[_Read]:
    rows, read_revision = yield from steps.rows(ops.read(keys.fleet_record))
    return _parse(keys, rows, read_revision)


def _parse(keys: JobKeys, rows: list[Row], read_revision: int) -> _Read:
    row = next((r for r in rows if r.key == keys.fleet_record), None)
    if row is None:
        return _Read(FleetRecord.empty(keys.job), 0, 0, read_revision)
    try:
        doc = wire.unpack(row.value)
        if not isinstance(doc, Mapping) or not isinstance(doc.get("revision"), int):
            raise FleetWireError("it is not a map with an int 'revision'")
        return _Read(FleetRecord.from_wire(doc["record"]), doc["revision"], row.mod_revision, read_revision)
    except (FleetWireError, KeyError, ValueError) as exc:
        raise ValueError(f"etcd key {row.key!r} holds a malformed fleet record ({exc}); only weightsync may "
                         f"write under {keys.root}") from None


def _put(keys: JobKeys, current: _Read, record: FleetRecord, revision: int, *, what: str,
         more: tuple[dict[str, Any], ...] = (), compare: tuple[dict[str, Any], ...] = ()) -> Steps[bool]:
    """Put ``record`` (and ``more``) if the record is still the one ``current`` read (and
    ``compare`` holds); whether it was put."""
    value = wire.pack({"revision": revision, "record": record.to_wire()})
    answer = yield from steps.commit(Txn((ops.unchanged(keys.fleet_record, current.mod_revision), *compare),
                                         (ops.put(keys.fleet_record, value), *more), (), what))
    return answer.ok


def _decide_and_put(keys: JobKeys, clock: Clock, command: Command, *, lease: int = 0,
                    ttl: float = DEFAULT_TTL) -> Steps[tuple[FleetAnswer, Decision, bool]]:
    """Decide ``command`` on the stored record and put the result (again on a newer record
    until the put applies). A join puts the member's alive key with ``lease`` in the same
    transaction; a leave deletes it. The flag: whether a join put its alive key."""
    while True:
        current = yield from _read(keys)
        decision = decide(current.record, command, clock.now())  # FleetConflictError: nothing stored
        if decision.record is current.record:
            return FleetAnswer(decision.reply, current.record.generation.number, current.revision), decision, False
        more: tuple[dict[str, Any], ...] = ()
        if isinstance(command, Join) and decision.reply.kind == "joined" and decision.reply.id is not None:
            more = (ops.put(keys.fleet_alive(command.role, decision.reply.id),
                            _pack_alive(command.incarnation, ttl), lease),)
        elif isinstance(command, Leave):
            more = (ops.delete(keys.fleet_alive(command.role, command.id)),)
        if (yield from _put(keys, current, decision.record, current.revision + 1, more=more,
                            what=f"fleet {command.op}")):
            answer = FleetAnswer(decision.reply, decision.record.generation.number, current.revision + 1)
            return answer, decision, bool(more) and isinstance(command, Join)


# -- leases -------------------------------------------------------------------------------------------

def _renew(keys: JobKeys, role: str, id_: int, incarnation: str) -> Steps[bool]:
    """Keep the member's etcd lease alive; if etcd already let it expire while the record still
    holds the member live (no tick came yet), give it a new one, as the server's renewal does.
    False if the record holds no such live member."""
    while True:
        rows, _ = yield from steps.rows(ops.read(keys.fleet_record), ops.read(keys.fleet_alive(role, id_)))
        member = _parse(keys, rows, 0).record.member(role, id_)
        if member is None or not member.live or member.incarnation != incarnation:
            return False
        beat = next((r for r in rows if r.key != keys.fleet_record), None)
        held = _alive_of(beat) if beat is not None else None
        if beat is not None and held is not None and held[0] == incarnation \
                and (yield from steps.lease_call(KeepAlive(beat.lease))) > 0:
            return True
        ttl = held[1] if held is not None else DEFAULT_TTL
        lease = yield from steps.lease_call(Grant(_etcd_ttl(ttl)))
        answer = yield from steps.commit(Txn(
            (ops.unchanged(keys.fleet_alive(role, id_), beat.mod_revision if beat else 0),),
            (ops.put(keys.fleet_alive(role, id_), _pack_alive(incarnation, ttl), lease),), (),
            f"renew the fleet lease of {role} {id_}"))
        if answer.ok:
            return True
        yield from steps.revoke(lease)


def _etcd_ttl(seconds: float) -> int:
    """etcd's TTLs are whole seconds (it raises them to its minimum itself)."""
    return max(1, math.ceil(seconds))


def _pack_alive(incarnation: str, ttl: float) -> bytes:
    return wire.pack({"incarnation": incarnation, "ttl": float(ttl)})


def _alive_of(row: Row) -> tuple[str, float]:
    """(incarnation, lease period) of an alive key.

    Raises:
        ValueError: the key holds something weightsync did not write (named).
    """
    try:
        doc = wire.unpack(row.value)
        return str(doc["incarnation"]), float(doc["ttl"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"etcd key {row.key!r} holds a malformed fleet lease ({exc!r}); only weightsync may write "
                         "there") from None


def _incarnation(row: Row | None) -> str:
    """Whose etcd lease an alive key is ("" once etcd deleted it)."""
    return "" if row is None else _alive_of(row)[0]


__all__ = ["Fleet", "fleet_beat", "fleet_command", "fleet_join", "fleet_record", "fleet_tick"]
