"""The fleet's records: members, generations, tries of a version and their outcomes, typed.

The coordinator (the meta server, or the etcd backend) owns one :class:`FleetRecord` per job and
changes it only through one pure function (:func:`weightsync.meta.fleet.decide.decide`). Clients
read these records; they never rebuild a try's outcome from several documents. The names
(docs/faults.md has them in a table):

* **member**: ``(role, id, incarnation)``: a writer or reader process holding a lease. A restart
  is a new incarnation of the same id.
* **generation**: a numbered list of the live members. A join, a clean leave, a death (the
  lease expired) or a failed try makes the next one. Transport connections belong to one.
* **try**: one attempt at version ``V`` in generation ``g``: its members, its state
  (``open`` -> ``published`` -> ``complete`` | ``failed`` | ``superseded``) and each reader's
  outcome (``pending``, ``staged``, ``applied``, ``failed``, ``missed``, ``left``).
* **policy**: when a try is complete: ``all`` of its readers, a ``quorum=k`` or a
  ``fraction=f`` of them, each with a deadline.

    policy = Policy.parse("quorum=3", deadline=30.0)
    record = FleetRecord.empty("grpo")
    assert FleetRecord.from_bytes(record.to_bytes()) == record     # msgpack, never pickle

The records are frozen; every field has a wire form checked on receipt (:class:`FleetWireError`
names the field), so the same record can live in an etcd key and be decided on by any host.
"""

from __future__ import annotations

from weightsync.ports.fleet.policy import (
    KEEP_TRIES,
    OUTCOMES,
    POLICIES,
    ROLES,
    TRY_STATES,
    FleetWireError,
    JobShape,
    Policy,
    Seat,
)
from weightsync.ports.fleet.records import FleetRecord, Generation, Holding, Member, ReaderOutcome, Try, seats_of

__all__ = ["KEEP_TRIES", "OUTCOMES", "POLICIES", "ROLES", "TRY_STATES", "FleetRecord", "FleetWireError",
           "Generation", "Holding", "JobShape", "Member", "Policy", "ReaderOutcome", "Seat", "Try", "seats_of"]
