"""``decide(record, command, now)``: every decision of the coordinator, as one pure function.

No clock is read (``now`` is given: seconds since the Unix epoch, the coordinator's
:class:`~weightsync.clock.clock.Clock`), nothing is stored or sent, nothing is mutated: the same
record and command give the same decision on any host, which is what lets the embedded server
replay its store and an etcd backend decide inside a compare-and-put transaction.

The rules:

* **Members.** A join takes a seat ``(role, id)`` (a reader without an id gets the lowest free
  one); a join, a clean leave, a death (lease expired) or a failed try makes the next
  **generation**. A member that ends fails every undecided try it is in: a writer fails the
  try, a reader's outcome is ``failed`` (died) or ``left``, and the policy decides the rest.
* **Tries.** A writer opens the try of ``V`` in the current generation once it is ready (every
  writer live; the readers the policy needs), or joins the undecided try of ``V``; opening
  ``V`` supersedes the unpublished tries of older versions, and a version older than the newest
  complete one, or than one being written, is refused. The try is ``published`` once every
  writer said its part is out, with one fingerprint.
* **Outcomes.** Under ``all`` a try is complete when every reader (but those that left)
  applied it and failed as soon as one failed or died; under ``quorum``/``fraction`` it is
  complete once enough applied and failed once that became impossible; a try no reader holds
  is never complete. At its deadline, readers without an outcome are ``missed`` and an
  undecided try is decided by what it has. A live reader keeps reporting after completion
  (late appliers: ``missed`` becomes ``applied``); a process that ended reports nothing, so a
  dead member never completes a version.

docs/fleet.md numbers these rules and says what is not wired yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from weightsync.meta.fleet.commands import Command, Expire, Fail, Join, Leave, OpenTry, Ready, Report, Tick
from weightsync.ports.fleet import (
    KEEP_TRIES,
    FleetRecord,
    FleetWireError,
    Generation,
    Holding,
    Member,
    ReaderOutcome,
    Try,
    seats_of,
)
from weightsync.ports.fleet.policy import is_int, wire_field


class FleetConflictError(ValueError):
    """A command that contradicts the job (another shape, a seat outside it, a seat held by a
    live process): the coordinator refuses it whole, saying how to fix it."""


@dataclass(frozen=True, slots=True)
class Reply:
    """What the command's sender learns: ``kind`` is ``ok``, ``joined`` (``id``), ``try``
    (``try_number``), ``waiting`` (no try can open yet: ``why``), ``refused`` (``why``) or
    ``ignored`` (a late or repeated report)."""

    kind: str = "ok"
    why: str = ""
    id: int | None = None
    try_number: int | None = None
    restarted: bool = False
    generation: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "why": self.why, "id": self.id, "try_number": self.try_number,
                "restarted": self.restarted, "generation": self.generation}

    @classmethod
    def from_wire(cls, doc: Any) -> Reply:
        """Raises FleetWireError naming the malformed field."""
        kind, why = wire_field(doc, "kind", str, "a str"), wire_field(doc, "why", str, "a str")
        generation = wire_field(doc, "generation", int, "an int")
        restarted = wire_field(doc, "restarted", bool, "a bool")
        for name in ("id", "try_number"):
            if doc.get(name) is not None and not is_int(doc[name]):
                raise FleetWireError(f"field {name!r} must be an int or None, not {doc[name]!r:.40}")
        return cls(kind, why, doc.get("id"), doc.get("try_number"), restarted, generation)


@dataclass(frozen=True, slots=True)
class Notice:
    """What changed, for whoever waits on it: ``generation`` (``number``), ``try`` (its number) or ``members``."""

    what: str
    number: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    record: FleetRecord
    notices: tuple[Notice, ...] = ()
    reply: Reply = Reply()


def decide(record: FleetRecord, command: Command, now: float) -> Decision:
    """The coordinator's decision on ``command`` at time ``now`` (see module docstring).

    Returns the new record (``record`` itself when nothing changed), what changed and the reply.

    Raises:
        FleetConflictError: the command contradicts the job (the message says how to fix it).
    """
    step = _Step(record, now)
    if isinstance(command, Join):
        step.join(command)
    elif isinstance(command, (Leave, Expire)):
        died = isinstance(command, Expire)
        step.end(command.role, command.id, command.incarnation, "dead" if died else "left",
                 command.detail if isinstance(command, Expire) else "it left the job")
    elif isinstance(command, OpenTry):
        step.open(command)
    elif isinstance(command, Ready):
        step.ready(command)
    elif isinstance(command, Fail):
        step.fail(command)
    elif isinstance(command, Report):
        step.report(command)
    elif isinstance(command, Tick):
        step.tick()
    else:  # pragma: no cover - the Command union is closed
        raise TypeError(f"not a fleet command: {command!r}")
    return step.finish()


class _Step:
    """One decision in progress: copies of the record's maps, changed in place, frozen at the end."""

    def __init__(self, record: FleetRecord, now: float) -> None:
        self.base, self.now = record, now
        self.shape = record.shape
        self.members = dict(record.members)
        self.tries = dict(record.tries)
        self.holdings = dict(record.holdings)
        self.generation = record.generation
        self.next_try, self.latest = record.next_try, record.latest
        self.notices: list[Notice] = []
        self.reply = Reply()
        self.changed = False
        self._regenerate: str | None = None

    # -- members ------------------------------------------------------------------------------
    def join(self, c: Join) -> None:
        shape = self.shape
        if shape is None:
            self.shape, shape = c.shape, c.shape
            self.changed = True
        elif (why := c.shape.differs(shape)):
            who = f"{c.role} {c.id if c.id is not None else '(new)'}"
            raise FleetConflictError(f"{who} joins job {self.base.job!r} with another shape than its members "
                                     f"({why}): every writer and reader of a job must use the same num_writers, "
                                     "num_readers and policy")
        seat_id = self._seat(c, shape.writers if c.role == "writer" else shape.readers)
        old = self.members.get((c.role, seat_id))
        if old is not None and old.live:
            if old.incarnation == c.incarnation:
                self.reply = Reply("joined", id=seat_id, generation=self.generation.number)
                return
            raise FleetConflictError(f"{c.role} {seat_id} of job {self.base.job!r} is held by another live process "
                                f"({old.describe()}): two processes claim one seat; give each its own id, or stop "
                                "the other one first")
        if old is not None and old.incarnation == c.incarnation:
            raise FleetConflictError(f"{c.role} {seat_id}: this process ({old.describe()}) left the job or was "
                                     f"declared dead ({old.state}); a process joins again as a new incarnation")
        self.members[(c.role, seat_id)] = Member(c.role, seat_id, c.incarnation, c.host, c.pid, "live", self.now)
        if c.role == "reader":
            self.holdings.pop(seat_id, None)
            if c.holds is not None:
                self.holdings[seat_id] = Holding(c.holds, None, c.incarnation, self.now)
        self.changed = True
        self.notices.append(Notice("members"))
        self._regenerate = f"{c.role} {seat_id} {'restarted' if old is not None else 'joined'}"
        self.reply = Reply("joined", id=seat_id, restarted=old is not None)

    def _seat(self, c: Join, fixed: int | None) -> int:
        """The seat id of a join: the one asked for (checked against a fixed count), or the
        lowest id no live member holds."""
        if c.id is not None:
            if c.id < 0 or (fixed is not None and c.id >= fixed):
                raise FleetConflictError(f"{c.role} {c.id} is outside job {self.base.job!r}, which has "
                                    f"{fixed} {c.role}s (ids 0..{(fixed or 1) - 1})")
            return c.id
        if c.role == "writer":
            raise FleetConflictError("a writer joins with its rank (writers are fixed per training run)")
        taken = {m.id for m in self.members.values() if m.role == "reader" and m.live}
        free = next(i for i in range(len(taken) + 1) if i not in taken)
        if fixed is not None and free >= fixed:
            raise FleetConflictError(f"job {self.base.job!r} has {fixed} reader seats and a live process holds each: "
                                "set num_readers=None for an elastic set of readers, or stop one")
        return free

    def end(self, role: str, id_: int, incarnation: str, state: str, detail: str) -> None:
        """A member left (``state="left"``) or died (``"dead"``): see module docstring."""
        old = self.members.get((role, id_))
        if old is None or not old.live or old.incarnation != incarnation:
            self.reply = Reply("ignored", why=f"{role} {id_} ({incarnation}) is not a live member")
            return
        self.members[(role, id_)] = replace(old, state=state, since=self.now, detail=detail)
        if role == "reader":
            self.holdings.pop(id_, None)
        self.changed = True
        self.notices.append(Notice("members"))
        how = "died" if state == "dead" else "left"
        self._regenerate = f"{role} {id_} {how}"
        for t in list(self.tries.values()):
            if t.settled or not t.member(role, id_, incarnation):
                continue
            if role == "writer":
                if not t.decided:
                    self._set(self._failed(t, f"writer {id_} {how} ({old.describe()}: {detail})"))
            elif not t.outcomes[id_].final:
                outcome = ReaderOutcome("failed" if state == "dead" else "left", self.now,
                                        f"it {how} ({detail})" if state == "dead" else "it left the job")
                self._set(self._evaluate(_with_outcome(t, id_, outcome)))

    # -- tries --------------------------------------------------------------------------------
    def open(self, c: OpenTry) -> None:
        me = self.members.get(("writer", c.writer))
        if me is None or not me.live or me.incarnation != c.incarnation:
            self.reply = Reply("refused", why=f"writer {c.writer} is not a live member of job {self.base.job!r} "
                                              "(its lease expired, or it left): it joins again as a new process")
            return
        latest = self.tries.get(self.latest) if self.latest is not None else None
        if latest is not None and c.version < latest.version:
            self.reply = Reply("refused", why=f"version {c.version} is older than version {latest.version}, complete "
                                              f"in try {latest.number}: versions must increase")
            return
        undecided = sorted((t for t in self.tries.values() if not t.decided), key=lambda t: t.key)
        newer = [t for t in undecided if t.version > c.version]
        if newer:
            self.reply = Reply("refused", why=f"version {c.version} is superseded: version {newer[-1].version} is "
                                              f"being written (try {newer[-1].number})")
            return
        same = [t for t in undecided if t.version == c.version]
        if same:
            t = same[-1]
            if t.member("writer", c.writer, c.incarnation):
                self.reply = Reply("try", try_number=t.number, generation=t.generation)
            else:
                self.reply = Reply("refused", why=f"try {t.number} of version {c.version} was opened without this "
                                                  f"process of writer {c.writer}")
            return
        why = self._readiness()
        if why:
            self.reply = Reply("waiting", why=f"generation {self.generation.number}: {why}")
            return
        for t in undecided:  # older versions no writer will complete now
            if t.state == "open":
                self._set(replace(t, state="superseded", decided_at=self.now,
                                  why=f"writer {c.writer} opened version {c.version}"))
        assert self.shape is not None
        g = self.generation
        policy = replace(self.shape.policy, deadline=c.deadline)
        t = Try(self.next_try, c.version, g.number, g.writers, g.readers, policy, self.now, self.now + c.deadline,
                outcomes={r: ReaderOutcome("pending", self.now) for r, _ in g.readers})
        self.next_try += 1
        self._set(t)
        self.reply = Reply("try", try_number=t.number, generation=g.number)

    def _readiness(self) -> str:
        return FleetRecord(self.base.job, self.shape, generation=self.generation).readiness()

    def ready(self, c: Ready) -> None:
        t = self.tries.get(c.try_number)
        if t is None or not t.member("writer", c.writer, c.incarnation):
            self.reply = Reply("refused", why=f"try {c.try_number} is unknown, or writer {c.writer} is not in it")
            return
        if t.decided:
            self.reply = Reply("refused", why=f"try {t.number} of version {t.version} is {t.state}: {t.why}")
            return
        if t.fingerprint and t.fingerprint != c.fingerprint:
            why = (f"the writers planned different syncs: writer {c.writer} has fingerprint {c.fingerprint}, "
                   f"writers {list(t.ready)} {t.fingerprint} (different layouts, options or members)")
            self._set(self._failed(t, why))
            self.reply = Reply("refused", why=why)
            return
        ready = tuple(sorted({*t.ready, c.writer}))
        if ready == t.ready:
            return
        state = "published" if len(ready) == len(t.writers) else "open"
        self._set(self._evaluate(replace(t, ready=ready, fingerprint=c.fingerprint, state=state)))

    def fail(self, c: Fail) -> None:
        if c.role == "reader":
            self.report(Report(c.try_number, c.id, c.incarnation, "failed", c.error))
            return
        t = self.tries.get(c.try_number)
        if t is None or t.decided or not t.member("writer", c.id, c.incarnation):
            self.reply = Reply("ignored", why=f"try {c.try_number} is not undecided with writer {c.id} in it")
            return
        self._set(self._failed(t, f"writer {c.id}: {c.error}"))

    def report(self, c: Report) -> None:
        me = self.members.get(("reader", c.reader))
        if me is None or not me.live or me.incarnation != c.incarnation:  # a dead process completes nothing
            self.reply = Reply("ignored", why=f"reader {c.reader} ({c.incarnation}) is not a live member")
            return
        if c.outcome not in ("applied", "staged", "failed"):
            raise FleetConflictError(f"reader {c.reader}: outcome {c.outcome!r} is not applied, staged or failed")
        t = self.tries.get(c.try_number)
        if t is None or not t.member("reader", c.reader, c.incarnation):
            self.reply = Reply("ignored", why=f"try {c.try_number} does not take reports from reader {c.reader}")
            return
        if t.state in ("failed", "superseded"):
            # the try is decided, but the reader's engine changed all the same: its holding follows
            self._hold(c, t)
            self.reply = Reply("ignored", why=f"try {t.number} is {t.state}: the report changes only what reader "
                                              f"{c.reader} holds")
            return
        current = t.outcomes[c.reader]
        if current.state in ("applied", "failed", "left") or (current.state == "staged" and c.outcome == "staged"):
            self.reply = Reply("ignored", why=f"reader {c.reader} already reported {current.state} for try {t.number}")
            return
        self._set(self._evaluate(_with_outcome(t, c.reader, ReaderOutcome(c.outcome, self.now, c.detail, c.nbytes,
                                                                          c.seconds))))
        self._hold(c, t)
        if c.outcome == "failed" and t.generation == self.generation.number:  # its connections are broken
            self._regenerate = self._regenerate or f"reader {c.reader} failed try {t.number}"

    def _hold(self, c: Report, t: Try) -> None:
        """The reader's holding after its report on ``t``: the newest try it applied; none once a
        failed apply left its engine at no valid version."""
        held = self.holdings.get(c.reader)
        if c.outcome == "applied" and (held is None or held.try_number is None
                                       or (held.version, held.try_number) < t.key):
            self.holdings[c.reader] = Holding(t.version, t.number, c.incarnation, self.now)
            self.changed = True
        elif c.outcome == "failed" and held is not None:
            del self.holdings[c.reader]
            self.changed = True

    def tick(self) -> None:
        for t in list(self.tries.values()):
            if not t.settled and self.now >= t.deadline_at:
                self._set(self._evaluate(t))

    # -- deciding a try -----------------------------------------------------------------------
    def _evaluate(self, t: Try) -> Try:
        """``t`` decided, if its outcomes (or its deadline) decide it now (module docstring)."""
        late = self.now >= t.deadline_at
        if t.state in ("failed", "superseded"):
            return t
        if t.state == "open":
            if late:
                missing = [w for w, _ in t.writers if w not in t.ready]
                return self._failed(t, f"writer(s) {missing} did not publish their part of version {t.version} "
                                       "by the try's deadline")
            return t
        if t.state == "complete":
            return _missed(t, self.now) if late else t
        counted = [r for r, o in t.outcomes.items() if o.state != "left"]
        applied = [r for r in counted if t.outcomes[r].state == "applied"]
        failed = [r for r in counted if t.outcomes[r].state == "failed"]
        waiting = [r for r in counted if not t.outcomes[r].final]
        needed = max(1, t.policy.needed(len(counted)))  # a version no reader holds is not complete
        if t.policy.kind == "all" and failed:
            shown = "; ".join(f"reader {r}: {t.outcomes[r].detail}" for r in failed[:8])
            return self._failed(t, f"{len(failed)} reader(s) failed it under policy all ({shown})")
        if len(applied) >= needed and (t.policy.kind != "all" or not waiting):
            return self._complete(_missed(t, self.now) if late else t)
        if len(applied) + len(waiting) < needed or late:
            t = _missed(t, self.now) if late else t
            return self._failed(t, f"policy {t.policy.text} needs {needed} of {len(counted)} reader(s): "
                                   f"{len(applied)} applied it{', by the deadline' if late else ''} "
                                   f"(failed: {failed[:8]}, missed: {t.reader_ids('missed')[:8]})")
        return t

    def _complete(self, t: Try) -> Try:
        t = replace(t, state="complete", decided_at=self.now)
        latest = self.tries.get(self.latest) if self.latest is not None else None
        if latest is None or t.key > latest.key:
            self.latest = t.number
        return t

    def _failed(self, t: Try, why: str) -> Try:
        if t.generation == self.generation.number:  # its connections may be broken: the next try re-forms them
            self._regenerate = self._regenerate or f"try {t.number} of version {t.version} failed"
        return replace(t, state="failed", decided_at=self.now, why=why)

    def _set(self, t: Try) -> None:
        if self.tries.get(t.number) != t:
            self.tries[t.number] = t
            self.changed = True
            self.notices.append(Notice("try", t.number))

    # -- the end of a decision ----------------------------------------------------------------
    def finish(self) -> Decision:
        if not self.changed:
            return Decision(self.base, (), self.reply)
        if self._regenerate is not None:
            live = [m for m in self.members.values() if m.live]
            self.generation = Generation(self.generation.number + 1, seats_of(live, "writer"), seats_of(live, "reader"),
                                         self._regenerate, self.now)
            self.notices.append(Notice("generation", self.generation.number))
        if self.reply.kind == "joined":
            self.reply = replace(self.reply, generation=self.generation.number)
        record = FleetRecord(self.base.job, self.shape, self.members, self.generation, _pruned(self.tries, self.latest),
                             self.holdings, self.next_try, self.latest)
        return Decision(record, tuple(dict.fromkeys(self.notices)), self.reply)


def _with_outcome(t: Try, reader: int, outcome: ReaderOutcome) -> Try:
    return replace(t, outcomes={**t.outcomes, reader: outcome})


def _missed(t: Try, now: float) -> Try:
    """Readers without a final outcome at the deadline missed the try."""
    if all(o.final for o in t.outcomes.values()):
        return t
    return replace(t, outcomes={r: o if o.final else ReaderOutcome("missed", now, "no outcome by the deadline")
                                for r, o in t.outcomes.items()})


def _pruned(tries: dict[int, Try], latest: int | None) -> dict[int, Try]:
    """The undecided and unsettled tries, the newest complete one and the newest KEEP_TRIES others."""
    done = sorted((n for n, t in tries.items() if t.settled and n != latest), reverse=True)
    drop = set(done[KEEP_TRIES:])
    return {n: t for n, t in tries.items() if n not in drop} if drop else tries


def summary(record: FleetRecord) -> dict[str, Any]:
    """A short text form of a record for logs and test failures."""
    return {"generation": record.generation.number, "members": sorted(
        f"{m.role[0]}{m.id}:{m.incarnation[:4]}:{m.state}" for m in record.members.values()),
        "tries": {n: f"v{t.version}/g{t.generation}/{t.state}" for n, t in sorted(record.tries.items())}}


def renewed_member(command: Command, decision: Decision) -> tuple[str, int, str] | None:
    """The member whose lease ``command`` renews once decided, as (role, id, incarnation): a
    member's own command shows it alive. None for a leave, an expiry or a tick, and for a
    command the coordinator refused or ignored (a stale process proves nothing of the seat's)."""
    if decision.reply.kind in ("refused", "ignored"):
        return None
    if isinstance(command, Join):
        return (command.role, decision.reply.id, command.incarnation) if decision.reply.id is not None else None
    if isinstance(command, (OpenTry, Ready)):
        return "writer", command.writer, command.incarnation
    if isinstance(command, Report):
        return "reader", command.reader, command.incarnation
    if isinstance(command, Fail):
        return command.role, command.id, command.incarnation
    return None


def deadline_due(record: FleetRecord, now: float) -> bool:
    """Whether a :class:`Tick` at ``now`` has a try to decide (an unsettled try whose deadline came)."""
    return any(not t.settled and now >= t.deadline_at for t in record.tries.values())


__all__ = ["Decision", "FleetConflictError", "Notice", "Reply", "deadline_due", "decide", "renewed_member",
           "summary"]
