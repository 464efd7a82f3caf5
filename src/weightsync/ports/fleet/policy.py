"""The fleet's vocabulary and its completion policy: what every member of a job agrees on.

:class:`Policy` says when a try of a version is complete, :class:`JobShape` is the job every
member joins with (a member with another shape is refused, naming what differs). The wire
helpers here check each field of a record from the coordinator's store, so that a malformed
or foreign record is refused with the field named, never half-read.

    policy = Policy.parse("quorum=3", deadline=30.0)
    shape = JobShape(writers=2, readers=None, policy=policy)   # an elastic set of readers
    assert JobShape.from_wire(shape.to_wire()) == shape
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ROLES = ("writer", "reader")
COMPLETION_STATES = ("complete", "failed", "waiting")
#: The meta-server document where writer 0 keeps the newest completions (a msgpack list of
#: :meth:`Completion.to_wire` maps, oldest first), which the status page and /metrics show
COMPLETIONS_KEY = "completions"
#: how many versions that document keeps
KEEP_COMPLETIONS = 16
CompletionState = Literal["complete", "failed", "waiting"]
POLICIES = ("all", "quorum", "fraction")
TRY_STATES = ("open", "published", "complete", "failed", "superseded")
OUTCOMES = ("pending", "staged", "applied", "failed", "missed", "left")
#: how many decided and settled tries a record keeps (beyond those still undecided)
KEEP_TRIES = 8

Seat = tuple[int, str]  # (id, incarnation) of one member of a generation or try


class FleetWireError(ValueError):
    """A fleet record from the coordinator (or its store) that is not what this release writes."""


def is_int(value: Any) -> bool:
    """An int on the wire (a bool is not one, though Python says it is)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float: a NaN time would make a record unequal to itself."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def wire_field(doc: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``doc[name]``, checked to be of ``kind`` (``int``: not a bool; ``(int, float)``: finite)."""
    if not isinstance(doc, Mapping) or name not in doc:
        raise FleetWireError(f"field {name!r} is missing")
    value = doc[name]
    if not isinstance(value, kind) or (kind is int and not is_int(value)) \
            or (kind == (int, float) and not is_number(value)):
        raise FleetWireError(f"field {name!r} must be {what}, not {value!r:.60}")
    return value


def wire_seats(value: Any, name: str) -> tuple[Seat, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(s, (list, tuple)) and len(s) == 2 and is_int(s[0]) and isinstance(s[1], str)
            for s in value):
        raise FleetWireError(f"field {name!r} must be a list of [id, incarnation], not {value!r:.60}")
    return tuple((int(i), str(inc)) for i, inc in value)


# -- the completion policy ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Policy:
    """When a try of a version is complete (see module docstring).

    Attributes:
        kind: ``"all"``: every reader of the try applied it; ``"quorum"``: ``count`` of them;
            ``"fraction"``: at least ``fraction`` of them (rounded up, at least one).
        deadline: seconds from the try's opening to its decision: readers that did not apply it
            by then are ``missed``, and a try whose policy is not met by then failed.
    """

    kind: str = "all"
    count: int = 0
    fraction: float = 0.0
    deadline: float = 60.0

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"policy must be 'all', 'quorum=K' or 'fraction=F', not {self.kind!r}")
        if self.kind == "quorum" and self.count < 1:
            raise ValueError(f"quorum=K needs K >= 1, got {self.count}")
        if self.kind == "fraction" and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction=F needs 0 < F <= 1, got {self.fraction}")
        if not (self.deadline > 0 and math.isfinite(self.deadline)):
            raise ValueError(f"a policy's deadline must be a positive number of seconds, got {self.deadline}")

    @classmethod
    def parse(cls, text: str, *, deadline: float) -> Policy:
        """``"all"``, ``"quorum=3"`` or ``"fraction=0.75"``.

        Raises:
            ValueError: naming the text and the forms accepted.
        """
        kind, _, value = text.strip().partition("=")
        try:
            if kind == "all" and not value:
                return cls("all", deadline=deadline)
            if kind == "quorum":
                return cls("quorum", count=int(value), deadline=deadline)
            if kind == "fraction":
                return cls("fraction", fraction=float(value), deadline=deadline)
        except ValueError as exc:
            raise ValueError(f"policy {text!r}: {exc}") from None
        raise ValueError(f"policy {text!r} is not one of 'all', 'quorum=K' (K readers) or 'fraction=F' "
                         "(0 < F <= 1 of the readers)")

    @property
    def text(self) -> str:
        return {"all": "all", "quorum": f"quorum={self.count}", "fraction": f"fraction={self.fraction:g}"}[self.kind]

    def needed(self, readers: int) -> int:
        """Readers that must apply a try of ``readers`` readers for it to be complete."""
        if self.kind == "all":
            return readers
        if self.kind == "quorum":
            return self.count
        return max(1, math.ceil(self.fraction * readers - 1e-9)) if readers else 1

    def min_readers(self, fixed: int | None) -> int:
        """Readers a generation needs before a try opens in it (``fixed``: the job's fixed count)."""
        if self.kind == "all":
            return fixed if fixed is not None else 1
        return self.count if self.kind == "quorum" else 1

    def same_rule(self, other: Policy) -> bool:
        """Whether two policies decide alike (the deadline is each writer's own)."""
        return (self.kind, self.count, self.fraction) == (other.kind, other.count, other.fraction)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": self.count, "fraction": self.fraction, "deadline": self.deadline}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> Policy:
        try:
            return cls(wire_field(doc, "kind", str, "a str"), wire_field(doc, "count", int, "an int"),
                       float(wire_field(doc, "fraction", (int, float), "a number")),
                       float(wire_field(doc, "deadline", (int, float), "a number")))
        except ValueError as exc:
            raise FleetWireError(f"policy: {exc}") from None


@dataclass(frozen=True, slots=True)
class JobShape:
    """What every member of a job agrees on: the writers (fixed), the readers (a fixed count, or
    ``None``: elastic, ids given by the coordinator) and the completion policy."""

    writers: int
    readers: int | None
    policy: Policy = field(default_factory=Policy)

    def __post_init__(self) -> None:
        if self.writers < 1:
            raise ValueError(f"a job needs at least one writer, got {self.writers}")
        if self.readers is not None and self.readers < 1:
            raise ValueError(f"num_readers must be >= 1, or None for an elastic set of readers; got {self.readers}")
        if self.readers is not None and self.policy.kind == "quorum" and self.policy.count > self.readers:
            raise ValueError(f"policy quorum={self.policy.count} can never be met by {self.readers} readers")

    def differs(self, other: JobShape) -> str:
        """What differs from ``other`` (``""``: nothing), worded for an error message."""
        out = []
        if self.writers != other.writers:
            out.append(f"num_writers {self.writers} here, {other.writers} there")
        if self.readers != other.readers:
            out.append(f"num_readers {self.readers} here, {other.readers} there")
        if not self.policy.same_rule(other.policy):
            out.append(f"policy {self.policy.text} here, {other.policy.text} there")
        return "; ".join(out)

    def to_wire(self) -> dict[str, Any]:
        return {"writers": self.writers, "readers": self.readers, "policy": self.policy.to_wire()}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> JobShape:
        readers = doc.get("readers") if isinstance(doc, Mapping) else None
        if readers is not None and (not isinstance(readers, int) or isinstance(readers, bool)):
            raise FleetWireError(f"field 'readers' must be an int or None, not {readers!r:.40}")
        try:
            return cls(wire_field(doc, "writers", int, "an int"), readers,
                       Policy.from_wire(wire_field(doc, "policy", Mapping, "a map")))
        except ValueError as exc:
            raise FleetWireError(f"job shape: {exc}") from None


# -- what a writer's wait decided (while the fleet record does not decide it: docs/fleet.md) ----------

@dataclass(frozen=True, slots=True)
class Completion:
    """What became of one version under the job's completion policy, as a writer saw it.

    Attributes:
        version: the version waited for.
        policy: the policy's text (``all``, ``quorum=K``, ``fraction=F``).
        needed: readers that must apply it.
        applied: reader ranks that applied it (or newer).
        missed: reader ranks that did not, with why: the error one reported, how it died, or
            ``"still applying"`` (a live reader the quorum did not wait for).
        state: ``complete`` (the policy is met), ``failed`` (it can no longer be met, or the
            deadline came), ``waiting``.
    """

    version: int
    policy: str
    needed: int
    applied: tuple[int, ...]
    missed: Mapping[int, str] = field(default_factory=dict)
    state: CompletionState = "waiting"

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "policy": self.policy, "needed": self.needed, "applied": list(self.applied),
                "missed": {str(r): why for r, why in sorted(self.missed.items())}, "state": self.state}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> Completion:
        """A completion from its wire form, each field checked (:class:`FleetWireError` names it)."""
        applied = wire_field(doc, "applied", list, "a list of reader ranks")
        missed = wire_field(doc, "missed", Mapping, "a map of reader rank to why")
        state = wire_field(doc, "state", str, "a str")
        if not all(is_int(r) for r in applied):
            raise FleetWireError(f"field 'applied' must be a list of reader ranks, not {applied!r:.60}")
        if not all(isinstance(r, str) and r.isdigit() and isinstance(why, str) for r, why in missed.items()):
            raise FleetWireError(f"field 'missed' must map reader ranks to why, not {missed!r:.60}")
        if state not in COMPLETION_STATES:
            raise FleetWireError(f"field 'state' must be one of {list(COMPLETION_STATES)}, not {state!r:.40}")
        return cls(wire_field(doc, "version", int, "an int"), wire_field(doc, "policy", str, "a str"),
                   wire_field(doc, "needed", int, "an int"), tuple(applied),
                   {int(r): why for r, why in missed.items()}, state)

    def summary(self) -> str:
        """One line naming who applied and who missed the version, and why."""
        missed = "; ".join(f"reader {r}: {why}" for r, why in sorted(self.missed.items())[:8])
        more = f" (+{len(self.missed) - 8} more)" if len(self.missed) > 8 else ""
        return (f"version {self.version} under completion={self.policy}: {len(self.applied)} of the {self.needed} "
                f"reader(s) needed applied it" + (f"; missed: {missed}{more}" if missed else ""))


__all__ = ["COMPLETIONS_KEY", "COMPLETION_STATES", "KEEP_COMPLETIONS", "KEEP_TRIES", "OUTCOMES", "POLICIES", "ROLES",
           "TRY_STATES", "Completion", "CompletionState", "FleetWireError", "JobShape", "Policy", "Seat", "is_int",
           "is_number", "wire_field", "wire_seats"]
