"""The fleet's records: members, generations, tries and the job's :class:`FleetRecord`.

Frozen dataclasses, each with a msgpack wire form checked field by field on receipt
(:class:`~weightsync.ports.fleet.policy.FleetWireError` names the field): the same record is
stored by the embedded meta server, can live in an etcd key, and is decided on by any host.
Only :func:`weightsync.meta.fleet.decide.decide` makes a new record; clients read them.

    record = FleetRecord.empty("grpo")
    assert FleetRecord.from_bytes(record.to_bytes()) == record     # msgpack, never pickle
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import msgpack

from weightsync.ports.fleet.policy import (
    OUTCOMES,
    ROLES,
    TRY_STATES,
    FleetWireError,
    JobShape,
    Policy,
    Seat,
    is_int,
    is_number,
    wire_field,
    wire_seats,
)

# -- members and generations -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Member:
    """One process of the job (``state``: ``live``, ``left`` or ``dead``; ``detail``: how it ended)."""

    role: str
    id: int
    incarnation: str
    host: str = ""
    pid: int = 0
    state: str = "live"
    since: float = 0.0
    detail: str = ""

    @property
    def live(self) -> bool:
        return self.state == "live"

    @property
    def who(self) -> str:
        return f"{self.role} {self.id}"

    def describe(self) -> str:
        """``pid 41 on n0`` (and how it ended), for peers' error messages."""
        where = f"pid {self.pid} on {self.host or 'an unnamed host'}"
        return f"{where}: {self.detail}" if self.detail else where

    def to_wire(self) -> list[Any]:
        return [self.role, self.id, self.incarnation, self.host, self.pid, self.state, self.since, self.detail]

    @classmethod
    def from_wire(cls, row: Any) -> Member:
        if not isinstance(row, (list, tuple)) or len(row) != 8:
            raise FleetWireError(f"a member must be a list of 8 fields, not {row!r:.60}")
        role, id_, inc, host, pid, state, since, detail = row
        if role not in ROLES or state not in ("live", "left", "dead") or not is_int(id_) \
                or not isinstance(inc, str) or not isinstance(host, str) or not is_int(pid) \
                or not is_number(since) or not isinstance(detail, str):
            raise FleetWireError(f"malformed member {row!r:.80}")
        return cls(role, id_, inc, host, pid, state, float(since), detail)


@dataclass(frozen=True, slots=True)
class Generation:
    """A numbered list of live members (writers and readers as ``(id, incarnation)``, by id)."""

    number: int = 0
    writers: tuple[Seat, ...] = ()
    readers: tuple[Seat, ...] = ()
    cause: str = "the job started"
    at: float = 0.0

    def seats(self, role: str) -> tuple[Seat, ...]:
        return self.writers if role == "writer" else self.readers

    def holds(self, role: str, id_: int, incarnation: str) -> bool:
        return (id_, incarnation) in self.seats(role)

    def to_wire(self) -> dict[str, Any]:
        return {"number": self.number, "writers": [list(s) for s in self.writers],
                "readers": [list(s) for s in self.readers], "cause": self.cause, "at": self.at}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> Generation:
        return cls(wire_field(doc, "number", int, "an int"),
                   wire_seats(wire_field(doc, "writers", list, "a list"), "writers"),
                   wire_seats(wire_field(doc, "readers", list, "a list"), "readers"),
                   wire_field(doc, "cause", str, "a str"), float(wire_field(doc, "at", (int, float), "a number")))


# -- tries ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ReaderOutcome:
    """One reader's outcome in one try (``state`` in :data:`OUTCOMES`)."""

    state: str = "pending"
    at: float = 0.0
    detail: str = ""
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def final(self) -> bool:
        return self.state not in ("pending", "staged")

    def to_wire(self) -> list[Any]:
        return [self.state, self.at, self.detail, self.nbytes, self.seconds]

    @classmethod
    def from_wire(cls, row: Any) -> ReaderOutcome:
        if not isinstance(row, (list, tuple)) or len(row) != 5 or row[0] not in OUTCOMES \
                or not is_number(row[1]) or not isinstance(row[2], str) \
                or not is_int(row[3]) or not is_number(row[4]):
            raise FleetWireError(f"malformed reader outcome {row!r:.80}")
        return cls(row[0], float(row[1]), row[2], row[3], float(row[4]))


@dataclass(frozen=True, slots=True)
class Try:
    """One attempt at ``version`` in generation ``generation`` (see module docstring).

    ``ready`` lists the writers whose part is out (``published`` once all are); ``fingerprint``
    is the sync fingerprint every writer planned (the plan of this try's members, its transport
    and settings); ``why`` says why it failed or was superseded.
    """

    number: int
    version: int
    generation: int
    writers: tuple[Seat, ...]
    readers: tuple[Seat, ...]
    policy: Policy
    opened_at: float
    deadline_at: float
    state: str = "open"
    fingerprint: str = ""
    ready: tuple[int, ...] = ()
    outcomes: Mapping[int, ReaderOutcome] = field(default_factory=dict)
    decided_at: float | None = None
    why: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcomes", MappingProxyType(dict(self.outcomes)))

    @property
    def key(self) -> tuple[int, int]:
        """Tries order by (version, number): a version written again is newer than its earlier try."""
        return (self.version, self.number)

    @property
    def decided(self) -> bool:
        return self.state in ("complete", "failed", "superseded")

    @property
    def settled(self) -> bool:
        """Decided, and no reader's outcome can change any more (writers may reuse its memory)."""
        return self.state in ("failed", "superseded") or (
            self.state == "complete" and all(o.final for o in self.outcomes.values()))

    def reader_ids(self, *states: str) -> list[int]:
        """Readers whose outcome is one of ``states`` (all readers without)."""
        return sorted(r for r, o in self.outcomes.items() if not states or o.state in states)

    def member(self, role: str, id_: int, incarnation: str) -> bool:
        return (id_, incarnation) in (self.writers if role == "writer" else self.readers)

    def to_wire(self) -> dict[str, Any]:
        return {"number": self.number, "version": self.version, "generation": self.generation,
                "writers": [list(s) for s in self.writers], "readers": [list(s) for s in self.readers],
                "policy": self.policy.to_wire(), "opened_at": self.opened_at, "deadline_at": self.deadline_at,
                "state": self.state, "fingerprint": self.fingerprint, "ready": list(self.ready),
                "outcomes": [[r, *o.to_wire()] for r, o in sorted(self.outcomes.items())],
                "decided_at": self.decided_at, "why": self.why}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> Try:
        state = wire_field(doc, "state", str, "a str")
        if state not in TRY_STATES:
            raise FleetWireError(f"field 'state' must be one of {TRY_STATES}, not {state!r}")
        outcomes = {}
        for row in wire_field(doc, "outcomes", list, "a list"):
            if not isinstance(row, (list, tuple)) or not row or not is_int(row[0]):
                raise FleetWireError(f"malformed outcome row {row!r:.60}")
            outcomes[row[0]] = ReaderOutcome.from_wire(row[1:])
        ready = wire_field(doc, "ready", list, "a list")
        if not all(is_int(w) for w in ready):
            raise FleetWireError(f"field 'ready' must be a list of writer ids, not {ready!r:.60}")
        decided = doc.get("decided_at")
        if decided is not None and not is_number(decided):
            raise FleetWireError(f"field 'decided_at' must be a number or None, not {decided!r:.40}")
        return cls(wire_field(doc, "number", int, "an int"), wire_field(doc, "version", int, "an int"),
                   wire_field(doc, "generation", int, "an int"),
                   wire_seats(wire_field(doc, "writers", list, "a list"), "writers"),
                   wire_seats(wire_field(doc, "readers", list, "a list"), "readers"),
                   Policy.from_wire(wire_field(doc, "policy", Mapping, "a map")),
                   float(wire_field(doc, "opened_at", (int, float), "a number")),
                   float(wire_field(doc, "deadline_at", (int, float), "a number")), state,
                   wire_field(doc, "fingerprint", str, "a str"), tuple(int(w) for w in ready), outcomes,
                   None if decided is None else float(decided), wire_field(doc, "why", str, "a str"))


@dataclass(frozen=True, slots=True)
class Holding:
    """What one reader applied last (``try_number`` None: it said so when it joined)."""

    version: int
    try_number: int | None
    incarnation: str
    at: float = 0.0

    def to_wire(self) -> list[Any]:
        return [self.version, self.try_number, self.incarnation, self.at]

    @classmethod
    def from_wire(cls, row: Any) -> Holding:
        if not isinstance(row, (list, tuple)) or len(row) != 4 or not is_int(row[0]) \
                or not (row[1] is None or is_int(row[1])) or not isinstance(row[2], str) \
                or not is_number(row[3]):
            raise FleetWireError(f"malformed holding {row!r:.60}")
        return cls(row[0], row[1], row[2], float(row[3]))


# -- the job's record -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class FleetRecord:
    """Everything the coordinator decides for one job (see module docstring).

    ``members`` holds the latest process of every seat ``(role, id)``, live or not; ``tries``
    the undecided tries and the newest :data:`KEEP_TRIES` others; ``holdings`` what each live
    reader applied last; ``latest`` the number of the newest complete try.
    """

    job: str
    shape: JobShape | None = None
    members: Mapping[tuple[str, int], Member] = field(default_factory=dict)
    generation: Generation = field(default_factory=Generation)
    tries: Mapping[int, Try] = field(default_factory=dict)
    holdings: Mapping[int, Holding] = field(default_factory=dict)
    next_try: int = 1
    latest: int | None = None

    def __post_init__(self) -> None:
        for name in ("members", "tries", "holdings"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @classmethod
    def empty(cls, job: str) -> FleetRecord:
        return cls(job)

    def evolve(self, **changes: Any) -> FleetRecord:
        return replace(self, **changes)

    # -- queries (pure: the coordinator and its clients ask the same) --------------------------
    def member(self, role: str, id_: int) -> Member | None:
        return self.members.get((role, id_))

    def live(self, role: str) -> list[Member]:
        return sorted((m for m in self.members.values() if m.role == role and m.live), key=lambda m: m.id)

    def latest_try(self) -> Try | None:
        return self.tries.get(self.latest) if self.latest is not None else None

    def undecided(self) -> list[Try]:
        return sorted((t for t in self.tries.values() if not t.decided), key=lambda t: t.key)

    def readiness(self) -> str:
        """Why no try can open in the current generation (``""``: one can)."""
        if self.shape is None:
            return "no member joined yet"
        writers = {i for i, _ in self.generation.writers}
        missing = [w for w in range(self.shape.writers) if w not in writers]
        if missing:
            return f"writer(s) {missing[:8]} have no live process"
        need = self.shape.policy.min_readers(self.shape.readers)
        have = len(self.generation.readers)
        if self.shape.readers is not None and self.shape.policy.kind == "all":
            ids = {i for i, _ in self.generation.readers}
            absent = [r for r in range(self.shape.readers) if r not in ids]
            if absent:
                return f"reader(s) {absent[:8]} have no live process (policy all of {self.shape.readers})"
        if have < need:
            return f"{have} live reader(s), policy {self.shape.policy.text} needs {need}"
        return ""

    def next_for(self, reader: int, incarnation: str, *, after: tuple[int, int] | None = None,
                 at_least: int | None = None) -> Try | None:
        """The try reader ``reader`` (this ``incarnation``) should take next: the newest one it is a
        member of, published, neither failed nor superseded, that it has not applied or failed,
        newer than ``after`` ((version, try number) it holds) and of at least version ``at_least``."""
        best: Try | None = None
        for t in self.tries.values():
            if t.state not in ("published", "complete") or not t.member("reader", reader, incarnation):
                continue
            if t.outcomes.get(reader, ReaderOutcome()).state not in ("pending", "staged", "missed"):
                continue
            if (after is not None and t.key <= after) or (at_least is not None and t.version < at_least):
                continue
            if best is None or t.key > best.key:
                best = t
        return best

    # -- wire -----------------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {"job": self.job, "shape": None if self.shape is None else self.shape.to_wire(),
                "members": [m.to_wire() for _, m in sorted(self.members.items())],
                "generation": self.generation.to_wire(),
                "tries": [t.to_wire() for _, t in sorted(self.tries.items())],
                "holdings": [[r, *h.to_wire()] for r, h in sorted(self.holdings.items())],
                "next_try": self.next_try, "latest": self.latest}

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> FleetRecord:
        """Raises FleetWireError naming the malformed field."""
        shape = doc.get("shape") if isinstance(doc, Mapping) else None
        members = [Member.from_wire(row) for row in wire_field(doc, "members", list, "a list")]
        tries = [Try.from_wire(t) for t in wire_field(doc, "tries", list, "a list")]
        holdings = {}
        for row in wire_field(doc, "holdings", list, "a list"):
            if not isinstance(row, (list, tuple)) or not row or not is_int(row[0]):
                raise FleetWireError(f"malformed holding row {row!r:.60}")
            holdings[row[0]] = Holding.from_wire(row[1:])
        latest = doc.get("latest")
        if latest is not None and not is_int(latest):
            raise FleetWireError(f"field 'latest' must be an int or None, not {latest!r:.40}")
        return cls(wire_field(doc, "job", str, "a str"), None if shape is None else JobShape.from_wire(shape),
                   {(m.role, m.id): m for m in members},
                   Generation.from_wire(wire_field(doc, "generation", Mapping, "a map")),
                   {t.number: t for t in tries}, holdings, wire_field(doc, "next_try", int, "an int"), latest)

    @classmethod
    def from_bytes(cls, raw: bytes) -> FleetRecord:
        try:
            doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise FleetWireError(f"a fleet record that is not msgpack ({exc})") from None
        return cls.from_wire(doc)


def seats_of(members: Iterable[Member], role: str) -> tuple[Seat, ...]:
    """The ``(id, incarnation)`` of the live members of ``role``, by id."""
    return tuple(sorted((m.id, m.incarnation) for m in members if m.role == role and m.live))


__all__ = ["FleetRecord", "Generation", "Holding", "Member", "ReaderOutcome", "Try", "seats_of"]
