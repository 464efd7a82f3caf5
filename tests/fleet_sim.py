"""A one-process simulator of the fleet protocol around the real coordinator decision (issue 36).

Writers, readers and the coordinator are small state machines; the coordinator applies the
real :func:`weightsync.meta.fleet.decide.decide` to its stored :class:`FleetRecord`, keeps
leases in memory and reads time from the simulation's clock (a :class:`ManualClock`: nothing
sleeps). A schedule is a list of steps; each step moves the clock, lets the coordinator expire
leases and decide deadlines, then lets every running process act once. Faults are injected
between steps: joins, clean leaves, kills, restarts (a new incarnation), pauses (a slow or
stopped process: no heartbeats, no actions) and coordinator restarts (the record survives, the
leases and the heartbeats of its downtime do not).

What the processes model:

* a **writer** runs ``write(V)`` in a loop: open (or join) the try of V with what is left of its
  deadline, send its part (a few steps), say ``Ready``, then wait for the try's decision; it
  returns ``ok`` only for a complete try and gives up at its deadline;
* a **reader** runs ``update()`` in a loop: take ``record.next_for(...)``, receive it (a few
  steps; it fails if a writer of the try died meanwhile), apply it and report; its engine holds
  the version it applied last (``None``: empty, or invalid after a failed transfer);
* the **coordinator** decides nothing itself: ``decide`` does; its leases are the meta server's
  (:class:`~weightsync.meta.fleet.leases.FleetLeases` on the simulation's clock).

:meth:`Sim.check` states the invariants checked after every step (see its docstring);
:func:`run_schedule` runs one seeded schedule and then a quiet phase in which churn stops and
every live reader must converge to the newest version within :data:`CONVERGE_STEPS` steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from weightsync.clock.clock import ManualClock
from weightsync.meta.fleet.commands import Command, Fail, Join, Leave, OpenTry, Ready, Report, Tick
from weightsync.meta.fleet.decide import FleetConflictError, Reply, decide
from weightsync.meta.fleet.leases import FleetLeases
from weightsync.ports.fleet import FleetRecord, JobShape, Policy, Try

#: the lease period (seconds) and each write's deadline
TTL = 3.0
DEADLINE = 5.0
#: steps a quiet phase may take before every live reader holds the newest version
CONVERGE_STEPS = 40
QUIET_DT = 1.0
#: how far one step moves the clock (a process looks at its deadline once per step)
STEP_DTS = (0.0, 0.2, 0.5, 0.5, 1.0, 1.0, 2.0, 4.0)
MAX_DT = max(STEP_DTS)


class InvariantError(AssertionError):
    """An invariant of the protocol broke (the message names it and the step)."""


# -- the coordinator ------------------------------------------------------------------------------

class Coordinator:
    """The record (stored: it survives a restart), the leases (in memory: they do not), as the
    embedded meta server keeps them."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.record = FleetRecord.empty("sim")
        self.leases = FleetLeases(clock)  # the meta server's lease rules
        self.down_until: float | None = None
        self.calls = 0
        self._deadline: tuple[FleetRecord | None, float] = (None, 0.0)

    @property
    def up(self) -> bool:
        return self.down_until is None

    def call(self, command: Command) -> Reply | None:
        """Apply ``command`` (``None``: the coordinator is down; the caller asks again later)."""
        if not self.up:
            return None
        self.calls += 1
        try:
            decision = decide(self.record, command, self.clock.now())
        except FleetConflictError as exc:
            return Reply("conflict", why=str(exc))
        self.record = decision.record
        if isinstance(command, Join) and decision.reply.kind == "joined":
            assert decision.reply.id is not None
            self.leases.renew("sim", command.role, decision.reply.id, command.incarnation, ttl=TTL)
        return decision.reply

    def beat(self, role: str, id_: int, incarnation: str) -> bool | None:
        """A heartbeat; False: the process is not a live member any more (None: down)."""
        if not self.up:
            return None
        m = self.record.member(role, id_)
        if m is None or not m.live or m.incarnation != incarnation:
            return False
        self.leases.renew("sim", role, id_, incarnation)
        return True

    def tick(self) -> None:
        """Expire the leases that ran out, then decide the tries whose deadline came."""
        now = self.clock.monotonic()
        if self.down_until is not None:
            if now < self.down_until:
                return
            self.down_until = None
        for expire in self.leases.expired("sim", self.record):
            self.call(expire)
        if now >= self.next_deadline():
            self.call(Tick())

    def next_deadline(self) -> float:
        """The earliest deadline of a try that is not settled (what the server's timer waits for)."""
        if self._deadline[0] is not self.record:
            self._deadline = (self.record, min((t.deadline_at for t in self.record.tries.values() if not t.settled),
                                               default=float("inf")))
        return self._deadline[1]

    def restart(self, down_for: float) -> None:
        self.leases.forget()
        self.down_until = self.clock.monotonic() + down_for


# -- the processes --------------------------------------------------------------------------------

@dataclass
class Write:
    version: int
    started: float
    deadline: float
    try_number: int | None = None
    send_steps: int = 0
    ready: bool = False
    quiet: bool = False


@dataclass
class Proc:
    role: str
    id: int | None
    incarnation: str
    running: bool = True
    joined: bool = False
    paused_until: float = 0.0
    left: bool = False
    replaced: bool = False


@dataclass
class WriterProc(Proc):
    version: int = 1
    write: Write | None = None


@dataclass
class Transfer:
    try_number: int
    version: int
    key: tuple[int, int]
    writers: tuple[tuple[int, str], ...]
    steps: int


@dataclass
class ReaderProc(Proc):
    engine: int | None = None
    key: tuple[int, int] | None = None
    transfer: Transfer | None = None
    report: Report | None = None
    holds_at_join: int | None = None


@dataclass
class Outcome:
    """What one ``write()`` returned."""

    writer: int
    version: int
    kind: str  # ok | readers_failed | not_met | failed | timeout | refused | evicted
    try_number: int | None
    at: float
    quiet: bool = False


@dataclass
class Sim:
    """One fleet on one clock (see module docstring)."""

    shape: JobShape
    rng: random.Random
    clock: ManualClock = field(default_factory=lambda: ManualClock(1_000.0))
    coordinator: Coordinator = field(init=False)
    procs: list[Proc] = field(default_factory=list)
    #: (incarnation, try number) -> version: every try a reader process really applied
    applied: dict[tuple[str, int], int] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    steps: int = 0
    quiet: bool = False
    fault_rate: float = 0.05
    _count: int = 0
    _before: float = 0.0
    _checked: FleetRecord | None = None
    _quiet_from: int = 0  # the first outcome of the current quiet phase
    #: steps the last quiet phase took until every live reader held the newest version
    quiet_steps: int = 0

    def __post_init__(self) -> None:
        self.coordinator = Coordinator(self.clock)
        for w in range(self.shape.writers):
            self.spawn("writer", w)
        for r in range(self.shape.readers if self.shape.readers is not None else self.rng.randint(1, 3)):
            self.spawn("reader", r if self.shape.readers is not None else None)

    # -- faults -------------------------------------------------------------------------------
    def spawn(self, role: str, id_: int | None, engine: int | None = None) -> Proc:
        self._count += 1
        inc = f"{role[0]}{id_ if id_ is not None else 'x'}.{self._count}"
        proc: Proc
        if role == "writer":  # a restarted trainer rank resumes at its peers' step
            peers = [p.version for p in self.running("writer") if isinstance(p, WriterProc)]
            newest = max((t.version for t in self.coordinator.record.tries.values()), default=0)
            proc = WriterProc(role, id_, inc, version=max(peers) if peers else newest + 1)
        else:
            proc = ReaderProc(role, id_, inc, engine=engine)
        self.procs.append(proc)
        return proc

    def running(self, role: str | None = None) -> list[Proc]:
        return [p for p in self.procs if p.running and (role is None or p.role == role)]

    def kill(self, proc: Proc) -> None:
        proc.running = False
        if isinstance(proc, ReaderProc) and proc.transfer is not None:
            proc.engine, proc.key, proc.transfer = None, None, None  # killed mid-apply: invalid
        if isinstance(proc, WriterProc) and proc.write is not None:
            proc.write = None  # the call never returns

    def leave(self, proc: Proc) -> None:
        """A clean leave: the process says so, then exits (a down coordinator: it just exits)."""
        if proc.joined and proc.id is not None:
            self.coordinator.call(Leave(proc.role, proc.id, proc.incarnation))
        proc.left = True
        self.kill(proc)
        self.procs.remove(proc)  # gone for good: nothing restarts it

    def restart(self, proc: Proc) -> Proc:
        """A new process in the seat of ``proc`` (a reader's engine survives half the time)."""
        if proc.running:
            self.kill(proc)
        proc.replaced = True
        self.procs.remove(proc)
        engine = proc.engine if isinstance(proc, ReaderProc) and self.rng.random() < 0.5 else None
        elastic = proc.role == "reader" and self.shape.readers is None
        return self.spawn(proc.role, None if elastic else proc.id, engine)

    def pause(self, proc: Proc, seconds: float) -> None:
        proc.paused_until = max(proc.paused_until, self.clock.monotonic() + seconds)

    def inject(self) -> None:
        """One random fault (or none)."""
        rng = self.rng
        roll = rng.random()
        running = self.running()
        dead = [p for p in self.procs if not p.running and not p.left and not p.replaced]
        if roll < 0.2 and running:
            self.kill(rng.choice(running))
        elif roll < 0.4 and dead:
            self.restart(rng.choice(dead))
        elif roll < 0.55 and running:
            self.pause(rng.choice(running), rng.choice([0.5, 1.0, 2.0, 4.0, 8.0]))
        elif roll < 0.65:
            readers = self.running("reader")
            if readers:
                self.leave(rng.choice(readers))
        elif roll < 0.8 and self.shape.readers is None:
            self.spawn("reader", None)
        elif roll < 0.9:
            self.coordinator.restart(rng.choice([0.0, 0.5, 2.0, 4.0]))
        else:
            writers = self.running("writer")
            if writers:
                self.leave(rng.choice(writers))

    # -- one step -----------------------------------------------------------------------------
    def step(self, dt: float) -> None:
        before = self._before = self.clock.monotonic()
        self.clock.advance(dt)
        now = self.clock.monotonic()
        coord = self.coordinator
        awake = [p for p in self.running() if p.paused_until <= now]
        for p in awake:  # processes that ran the whole step renewed their leases all along
            if p.paused_until <= before and p.joined and p.id is not None:
                self._beat(p)
        coord.tick()
        for p in awake:
            if p.running and p.joined and p.id is not None and p.paused_until > before:
                self._beat(p)  # it just woke up: its first heartbeat
        self.rng.shuffle(awake)
        for p in awake:
            if p.running:
                self._act(p)
        self.steps += 1
        self.check()

    def _beat(self, p: Proc) -> None:
        assert p.id is not None
        if self.coordinator.beat(p.role, p.id, p.incarnation) is False:
            self._evicted(p)

    def _evicted(self, p: Proc) -> None:
        """The coordinator ended this process (its lease expired while it was stopped): its
        session fails and the process joins again as a new incarnation."""
        if isinstance(p, WriterProc) and p.write is not None:
            self._returned(p, "evicted")
        p.running = False
        p.replaced = True  # this process is gone; its successor takes the seat
        self.procs.remove(p)
        engine = p.engine if isinstance(p, ReaderProc) and p.transfer is None else None
        elastic = p.role == "reader" and self.shape.readers is None
        self.spawn(p.role, None if elastic else p.id, engine)

    def _act(self, p: Proc) -> None:
        if not p.joined:
            self._join(p)
            return
        if isinstance(p, WriterProc):
            self._write(p)
        elif isinstance(p, ReaderProc):
            self._update(p)

    def _join(self, p: Proc) -> None:
        holds = p.engine if isinstance(p, ReaderProc) else None
        reply = self.coordinator.call(Join(p.role, p.id, p.incarnation, "sim", 1, self.shape, holds))
        if reply is None or reply.kind != "joined":
            return  # down, or the seat's earlier process is still live: ask again next step
        p.joined, p.id = True, reply.id
        if isinstance(p, ReaderProc):
            p.holds_at_join = holds

    # -- a writer's write() ---------------------------------------------------------------------
    def _write(self, w: WriterProc) -> None:
        now = self.clock.monotonic()
        coord = self.coordinator
        if w.write is None:
            if self.quiet and self._caught_up():
                return  # the run paused: its last version reached every reader
            w.write = Write(w.version, now, now + DEADLINE, quiet=self.quiet)
        wr = w.write
        if not coord.up:
            if now >= wr.deadline:
                self._returned(w, "timeout")
            return
        assert w.id is not None
        if wr.try_number is None:
            if now >= wr.deadline:
                self._returned(w, "timeout")
                return
            record = coord.record
            if record.readiness() and not any(t.version == wr.version for t in record.undecided()):
                return  # it watches the record until the generation is ready (no request)
            reply = coord.call(OpenTry(wr.version, w.id, w.incarnation, wr.deadline - now))
            assert reply is not None
            if reply.kind == "try":
                wr.try_number, wr.send_steps = reply.try_number, self.rng.choice([0, 0, 1, 2])
            elif reply.kind == "refused":
                self._returned(w, "refused")
                return
            else:
                return  # waiting for the generation to be ready
        t = coord.record.tries.get(wr.try_number)
        assert t is not None, f"try {wr.try_number} of a running write was pruned"
        if t.decided:
            self._returned(w, _kind(t))
            return
        if not wr.ready:
            if wr.send_steps > 0:
                wr.send_steps -= 1
            elif not self.quiet and self.rng.random() < self.fault_rate / 2:
                coord.call(Fail(t.number, "writer", w.id, w.incarnation, "its transfer broke"))
                wr.ready = True
            else:
                coord.call(Ready(t.number, w.id, w.incarnation, "fp"))
                wr.ready = True
            t = coord.record.tries[t.number]
            if t.decided:
                self._returned(w, _kind(t))
                return
        if now >= wr.deadline:
            self._returned(w, "timeout")

    def _returned(self, w: WriterProc, kind: str) -> None:
        """``write()`` returns ``kind``: checks that a success met its policy, and that only
        ``all`` raises the readers-failed error."""
        wr = w.write
        assert wr is not None and w.id is not None
        now = self.clock.monotonic()
        t = self.coordinator.record.tries.get(wr.try_number) if wr.try_number is not None else None
        where = f"step {self.steps}: writer {w.id} write({wr.version}) returned {kind}"
        if kind == "ok":
            if t is None or t.state != "complete" or not met(t):
                raise InvariantError(f"{where}, but its try does not meet policy {self.shape.policy.text}: {t}")
        if kind == "readers_failed" and self.shape.policy.kind != "all":
            raise InvariantError(f"{where} under policy {self.shape.policy.text}")
        if kind == "not_met" and t is not None and met(t):
            raise InvariantError(f"{where}, but its try met its policy: {t}")
        if kind != "evicted" and self._before >= wr.deadline and w.paused_until <= self._before:
            raise InvariantError(f"{where} at {now - wr.started:.1f} s, past its deadline of {DEADLINE} s")
        self.outcomes.append(Outcome(w.id, wr.version, kind, wr.try_number, now, wr.quiet))
        w.version = wr.version + 1  # training moves on, whatever became of this version
        if kind == "refused":  # an older version than one complete or being written: catch up
            record = self.coordinator.record
            latest = record.latest_try()
            w.version = max(w.version, *(t.version for t in record.undecided()),
                            latest.version + 1 if latest is not None else 0)
        w.write = None

    # -- a reader's update() --------------------------------------------------------------------
    def _update(self, r: ReaderProc) -> None:
        coord = self.coordinator
        assert r.id is not None
        if r.transfer is not None:
            self._receive(r)
        if r.report is not None:
            if coord.call(r.report) is not None:
                r.report = None
            return
        if r.transfer is not None or not coord.up:
            return
        t = coord.record.next_for(r.id, r.incarnation, after=r.key)
        if t is not None:
            r.transfer = Transfer(t.number, t.version, t.key, t.writers, self.rng.choice([0, 1, 1, 2]))
            self._receive(r)
            if r.report is not None:
                coord.call(r.report)
                r.report = None

    def _receive(self, r: ReaderProc) -> None:
        x = r.transfer
        assert x is not None and r.id is not None
        senders = {p.id: p for p in self.running("writer")}
        lost = [w for w, inc in x.writers if w not in senders or senders[w].incarnation != inc]
        if not lost and any(senders[w].paused_until > self.clock.monotonic() for w, _ in x.writers):
            return  # a sender is stopped: the transfer stalls
        if x.steps > 0 and not lost:
            x.steps -= 1
            return
        r.transfer = None
        if lost or (not self.quiet and self.rng.random() < self.fault_rate / 2):
            r.engine, r.key = None, None  # a failed apply leaves the engine invalid
            r.report = Report(x.try_number, r.id, r.incarnation, "failed",
                              f"writer(s) {lost} went away" if lost else "a corrupt chunk")
            return
        r.engine, r.key = x.version, x.key
        self.applied[(r.incarnation, x.try_number)] = x.version
        r.report = Report(x.try_number, r.id, r.incarnation, "applied")

    # -- invariants -----------------------------------------------------------------------------
    def check(self) -> None:
        """After every step:

        * no reader claims a version it does not hold: an ``applied`` outcome is a try that
          process applied, and a live reader's holding in the record is what its engine holds;
        * a ``write()`` that returned ``ok`` met its policy, only ``all`` raises readers-failed
          (checked where a write returns);
        * nothing waits past its deadline: no running, awake writer is still in a ``write()``
          past its deadline, and no try is undecided past its deadline while the coordinator is up;
        * the generation is exactly the live members.
        """
        record, now = self.coordinator.record, self.clock.monotonic()
        where = f"step {self.steps}"
        if record is not self._checked:  # records are immutable: check each one once
            self._check_record(record, where)
            self._checked = record
        if self.coordinator.up and now >= self.coordinator.next_deadline():
            for t in record.undecided():
                if now >= t.deadline_at:
                    raise InvariantError(f"{where}: try {t.number} undecided {now - t.deadline_at:.1f} s past its "
                                       "deadline")
        for p in self.running("reader"):
            assert isinstance(p, ReaderProc)
            held = record.holdings.get(p.id) if p.joined and p.id is not None else None
            if held is not None and held.incarnation == p.incarnation and p.transfer is None and p.report is None \
                    and held.version != p.engine:
                raise InvariantError(f"{where}: the record says reader {p.id} holds version {held.version}, its engine "
                                   f"holds {p.engine}")
        for w in self.running("writer"):
            assert isinstance(w, WriterProc)
            if w.write is not None and w.paused_until <= now and now >= w.write.deadline:
                raise InvariantError(f"{where}: writer {w.id} still waits in write({w.write.version}) past its deadline")

    def _check_record(self, record: FleetRecord, where: str) -> None:
        for t in record.tries.values():
            for r, o in t.outcomes.items():
                if o.state == "applied" and (dict(t.readers)[r], t.number) not in self.applied:
                    raise InvariantError(f"{where}: try {t.number} says reader {r} applied it; that process never did")
        live = {(m.role, m.id, m.incarnation) for m in record.members.values() if m.live}
        seats = {("writer", i, inc) for i, inc in record.generation.writers} | {
            ("reader", i, inc) for i, inc in record.generation.readers}
        if seats != live:
            raise InvariantError(f"{where}: generation {record.generation.number} is {seats}, the live members {live}")

    # -- the quiet phase ------------------------------------------------------------------------
    def settle(self) -> int:
        """Churn stops: every stopped process resumes, every crashed one is restarted (an elastic
        fleet keeps the readers its policy needs), and the writers write until one version
        started now is out. Returns the steps it took until every live reader holds the newest
        complete version; raises InvariantError past :data:`CONVERGE_STEPS`."""
        self.quiet = True
        self._quiet_from = len(self.outcomes)
        now = self.clock.monotonic()
        for p in self.procs:  # a stopped process resumes during the next step
            p.paused_until = min(p.paused_until, now + 1e-6)
        for p in list(self.procs):
            if not p.running and not p.left and not p.replaced:
                self.restart(p)
        if self.coordinator.down_until is not None:
            self.coordinator.down_until = now
        for w in range(self.shape.writers):
            if not any(p.running and p.id == w for p in self.running("writer")):
                self.spawn("writer", w)
        if self.shape.readers is None:
            for _ in range(self.shape.policy.min_readers(None) - len(self.running("reader"))):
                self.spawn("reader", None)
        else:
            for r in range(self.shape.readers):
                if not any(p.id == r for p in self.running("reader")):
                    self.spawn("reader", r)
        for n in range(1, CONVERGE_STEPS + 1):
            self.step(QUIET_DT)
            if self.converged():
                self.quiet_steps = n
                return n
        record = self.coordinator.record
        raise InvariantError(f"no convergence {CONVERGE_STEPS} steps after churn stopped: latest "
                           f"{record.latest_try()}, readers {[(p.id, p.engine) for p in self.running('reader')]}, "
                           f"writes {self.outcomes[-4:]}")

    def _caught_up(self) -> bool:
        """Whether a write started in the quiet phase completed a try every running reader is in
        (a reader that joins after a try opened takes the next one: decide's rule 18)."""
        record = self.coordinator.record
        readers = {p.incarnation for p in self.running("reader")}
        for o in self.outcomes[self._quiet_from:]:
            t = record.tries.get(o.try_number) if o.quiet and o.kind == "ok" and o.try_number else None
            if t is not None and readers <= {inc for _, inc in t.readers}:
                return True
        return False

    def converged(self) -> bool:
        """The writers are done (:meth:`_caught_up`) and every running reader holds the newest
        complete version, with nothing in flight."""
        if not self._caught_up() or any(isinstance(w, WriterProc) and w.write for w in self.running("writer")):
            return False
        latest = self.coordinator.record.latest_try()
        assert latest is not None
        return all(isinstance(p, ReaderProc) and p.joined and p.engine == latest.version and p.transfer is None
                   and p.report is None for p in self.running("reader"))


def met(t: Try) -> bool:
    """Whether try ``t``'s outcomes meet its policy (worked out here, not by the code under test):
    ``all`` of the readers that did not leave, ``quorum=K`` K of them, ``fraction=F`` at least
    F of them (and one)."""
    counted = [o for o in t.outcomes.values() if o.state != "left"]
    applied = sum(o.state == "applied" for o in counted)
    p = t.policy
    if p.kind == "all":
        return bool(counted) and applied == len(counted)
    if p.kind == "quorum":
        return applied >= p.count
    return applied >= 1 and applied >= p.fraction * len(counted) - 1e-9


def _kind(t: Try) -> str:
    """What ``write()`` returns for a decided try."""
    if t.state == "complete":
        return "ok"
    if t.state == "failed" and any(o.state == "failed" for o in t.outcomes.values()):
        return "readers_failed" if t.policy.kind == "all" else "not_met"
    return "not_met" if t.state == "failed" and "policy" in t.why else "failed"


POLICIES = ("all", "quorum=1", "quorum=2", "fraction=0.5", "fraction=1.0")


def make_sim(seed: int) -> Sim:
    rng = random.Random(seed)
    policy = Policy.parse(rng.choice(POLICIES), deadline=DEADLINE)
    readers = rng.choice([None, None, 1, 2, 3])
    if readers is not None and policy.kind == "quorum" and policy.count > readers:
        readers = policy.count
    return Sim(JobShape(rng.randint(1, 2), readers, policy), rng)


def run_schedule(seed: int, steps: int | None = None) -> Sim:
    """One seeded schedule of faults, then the quiet phase (raises InvariantError)."""
    sim = make_sim(seed)
    rng = sim.rng
    for _ in range(steps if steps is not None else rng.randint(3, 12)):
        if rng.random() < 0.5:
            sim.inject()
        sim.step(rng.choice(STEP_DTS))
    sim.quiet_steps = sim.settle()
    return sim
