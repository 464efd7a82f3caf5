"""Invariants of the coordinator's decisions (:func:`weightsync.meta.fleet.decide.decide`) over
random schedules: joins, clean leaves, deaths, restarts, tries, reports (also from dead or
replaced processes), writer failures and time passing on a clock the test moves.

Checked after every step: no counter goes backwards (generation, try numbers, the newest
complete try, a try's state, a reader's final outcome); a process that is not a live member
never gets a version applied or held; a complete try met its policy; the generation lists
exactly the live members; a tick leaves no try undecided past its deadline. At the end the
same commands (through their wire form) at the same times give the same record and the same
replies (the embedded server replays its store; etcd re-decides on a conflict), and the record
survives its wire form.
"""

from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budget import examples
from weightsync.meta.fleet.commands import (
    Command,
    Expire,
    Fail,
    Join,
    Leave,
    OpenTry,
    Ready,
    Report,
    Tick,
    command_from_wire,
    command_to_wire,
)
from weightsync.meta.fleet.decide import FleetConflictError, Reply, decide
from weightsync.ports.fleet import FleetRecord, FleetWireError, JobShape, Policy, Try

STATE_RANK = {"open": 0, "published": 1, "complete": 2, "failed": 2, "superseded": 2}
#: weighted so that random schedules reach published and complete tries, not only failures
ACTIONS = ("progress",) * 8 + ("join_writer", "join_reader", "leave", "expire", "fail", "open", "ready", "report",
                              "late", "tick")


def _apply(record: FleetRecord, command: Command, now: float) -> tuple[FleetRecord, Reply | str]:
    try:
        decision = decide(record, command, now)
    except FleetConflictError as exc:
        return record, f"conflict: {exc}"
    return decision.record, decision.reply


def _pick(data: st.DataObject, likely: list, anything: list):
    """Mostly one of ``likely`` (the commands that move a try on), sometimes any of ``anything``
    (stale processes, decided tries: what the coordinator must ignore or refuse)."""
    pool = likely if likely and data.draw(st.integers(0, 3)) else anything
    return data.draw(st.sampled_from(pool))


def _draw_command(data: st.DataObject, record: FleetRecord, shape: JobShape, count: int) -> Command:
    action = data.draw(st.sampled_from(ACTIONS))
    inc = f"i{count}"
    members = sorted(record.members.values(), key=lambda m: (m.role, m.id))
    tries = sorted(record.tries.values(), key=lambda t: t.number)
    open_tries = [t for t in tries if not t.settled]
    if action == "progress":
        return _progress(record, shape, inc, count)
    if action == "join_writer":
        return Join("writer", data.draw(st.integers(0, shape.writers - 1)), inc, "h", count, shape)
    if action == "join_reader":
        id_ = None if shape.readers is None else data.draw(st.integers(0, shape.readers - 1))
        return Join("reader", id_, inc, "h", count, shape, data.draw(st.none() | st.integers(0, 3)))
    if action in ("leave", "expire") and members:
        m = _pick(data, [m for m in members if m.live], members)  # a stale lease event is ignored
        return Leave(m.role, m.id, m.incarnation) if action == "leave" else Expire(m.role, m.id, m.incarnation, "x")
    writers = [(m.id, m.incarnation) for m in members if m.role == "writer"]
    if action == "open" and writers:
        w = _pick(data, [(m.id, m.incarnation) for m in record.live("writer")], writers)
        newest = max((t.version for t in tries), default=0)
        return OpenTry(data.draw(st.integers(max(0, newest - 1), newest + 1)), w[0], w[1], 5.0)
    if action in ("ready", "fail") and tries and writers:
        t = _pick(data, open_tries, tries)
        w = _pick(data, list(t.writers), writers)
        if action == "ready":
            return Ready(t.number, w[0], w[1], data.draw(st.sampled_from(["fp"] * 7 + ["other"])))
        return Fail(t.number, "writer", w[0], w[1], "boom")
    readers = [(m.id, m.incarnation) for m in members if m.role == "reader"]
    if action == "report" and tries and readers:
        t = _pick(data, [t for t in open_tries if t.state != "open"], tries)
        r = _pick(data, list(t.readers), readers)
        outcome = data.draw(st.sampled_from(["applied"] * 4 + ["staged", "failed"]))
        return Report(t.number, r[0], r[1], outcome)
    late = [(t, r, inc) for t in tries for r, inc in t.readers  # its process ended, or was replaced
            if t.outcomes[r].state != "applied" and not (record.members[("reader", r)].live
                                                         and record.members[("reader", r)].incarnation == inc)]
    if action == "late" and late:  # a process the coordinator ended reports after all
        t, r, inc = data.draw(st.sampled_from(late))
        return Report(t.number, r, inc, "applied")
    return _progress(record, shape, inc, count)


def _progress(record: FleetRecord, shape: JobShape, inc: str, count: int) -> Command:
    """The command that moves the job on: join a missing member, publish, apply, open the next version."""
    writers = {m.id: m for m in record.live("writer")}
    readers = {m.id: m for m in record.live("reader")}
    missing = [w for w in range(shape.writers) if w not in writers]
    if missing:
        return Join("writer", missing[0], inc, "h", count, shape)
    if record.readiness():
        free = [r for r in range(shape.readers or 0) if r not in readers]
        return Join("reader", free[0] if free else None, inc, "h", count, shape)
    for t in record.undecided():
        if t.state == "open":
            w = next(w for w, _ in t.writers if w not in t.ready)
            return Ready(t.number, w, dict(t.writers)[w], "fp")
        pending = [r for r, o in t.outcomes.items() if not o.final]
        if pending:
            return Report(t.number, pending[0], dict(t.readers)[pending[0]], "applied")
    newest = max((t.version for t in record.tries.values()), default=0)
    w = min(writers)
    return OpenTry(newest + 1, w, writers[w].incarnation, 5.0)


def _check_step(before: FleetRecord, after: FleetRecord, command: Command, now: float) -> None:
    assert after.generation.number >= before.generation.number and after.next_try >= before.next_try
    if before.latest is not None:
        assert after.latest is not None and after.tries[after.latest].key >= before.tries[before.latest].key
    live = {(m.role, m.id, m.incarnation) for m in after.members.values() if m.live}
    assert {("writer", i, inc) for i, inc in after.generation.writers} | {
        ("reader", i, inc) for i, inc in after.generation.readers} == live
    for r, held in after.holdings.items():
        assert ("reader", r, held.incarnation) in live
    for number, t in after.tries.items():
        _check_try(before.tries.get(number), t, live, now)
        if isinstance(command, Tick):
            assert t.decided or now < t.deadline_at, f"try {number} undecided past its deadline"
            assert t.state != "complete" or now < t.deadline_at or all(o.final for o in t.outcomes.values())


def _check_try(old: Try | None, t: Try, live: set[tuple[str, int, str]], now: float) -> None:
    if old is not None:
        assert STATE_RANK[t.state] >= STATE_RANK[old.state]
        if old.decided:
            assert t.state == old.state
        for r, o in old.outcomes.items():
            new = t.outcomes[r]
            if o.final and o.state != "missed":
                assert new == o, f"reader {r}'s outcome {o.state} became {new.state}"
            if new.state == "applied" and o.state != "applied":  # applied in this step: by a live member
                assert ("reader", r, dict(t.readers)[r]) in live
    counted = [o for o in t.outcomes.values() if o.state != "left"]
    applied = sum(o.state == "applied" for o in counted)
    if t.state == "complete":
        assert applied >= max(1, t.policy.needed(len(counted)))
        assert t.policy.kind != "all" or applied == len(counted)
        assert len(t.ready) == len(t.writers) and t.decided_at is not None
    assert set(t.outcomes) == {r for r, _ in t.readers}


@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), writers=st.integers(1, 2), readers=st.sampled_from([None, 3]),
       policy=st.sampled_from(["all", "quorum=2", "fraction=0.5"]))
def test_random_schedules_keep_the_invariants_and_replay_alike(data, writers, readers, policy):
    shape = JobShape(writers, readers, Policy.parse(policy, deadline=5.0))
    record, now = FleetRecord.empty("job"), 1_000.0
    log: list[tuple[Command, float, Reply | str]] = []
    for count in range(data.draw(st.integers(5, 50))):
        now += data.draw(st.sampled_from([0.0] * 6 + [0.5, 2.0, 6.0]))
        command = _draw_command(data, record, shape, count)
        after, reply = _apply(record, command, now)
        _check_step(record, after, command, now)
        log.append((command, now, reply))
        record = after
    replayed = FleetRecord.empty("job")
    for command, at, reply in log:
        wire = command_from_wire(msgpack.unpackb(msgpack.packb(command_to_wire(command))))
        replayed, again = _apply(replayed, wire, at)
        assert again == reply
    assert replayed == record and FleetRecord.from_bytes(record.to_bytes()) == record


def _leaves(doc, path=()):
    """Every path to a value inside a wire document (maps and lists)."""
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _leaves(v, (*path, i))


def _replaced(doc, path, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(doc, dict):
        return {**doc, head: _replaced(doc[head], rest, value)}
    return [_replaced(v, rest, value) if i == head else v for i, v in enumerate(doc)]


def _busy_record() -> FleetRecord:
    shape = JobShape(2, None, Policy.parse("fraction=0.5", deadline=5.0))
    record, now = FleetRecord.empty("job"), 1_000.0
    for command in (Join("writer", 0, "w0", "h", 1, shape), Join("writer", 1, "w1", "h", 2, shape),
                    Join("reader", None, "r0", "h", 3, shape, 2), Join("reader", None, "r1", "h", 4, shape),
                    OpenTry(3, 0, "w0", 5.0), Ready(1, 0, "w0", "fp"), Ready(1, 1, "w1", "fp"),
                    Report(1, 0, "r0", "applied"), Expire("reader", 1, "r1", "x")):
        record, _ = _apply(record, command, now)
    return record


BUSY = _busy_record().to_wire()
JUNK = st.none() | st.booleans() | st.integers(-2, 2) | st.floats(allow_nan=True) | st.text(max_size=3) \
    | st.lists(st.integers(0, 2), max_size=2) | st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)


@settings(max_examples=examples(200), deadline=None)
@given(path=st.sampled_from(list(_leaves(BUSY))), junk=JUNK)
def test_a_malformed_record_is_refused_with_fleet_wire_error_and_nothing_else(path, junk):
    doc = _replaced(BUSY, path, junk)
    try:
        record = FleetRecord.from_wire(doc)
    except FleetWireError:
        return
    assert FleetRecord.from_wire(record.to_wire()) == record  # what was accepted is a well-formed record


COMMANDS = [command_to_wire(c) for c in (
    Join("reader", None, "a", "h", 1, JobShape(1, None, Policy.parse("quorum=2", deadline=5.0)), 3),
    Leave("writer", 0, "a"), Expire("reader", 2, "a", "x"), OpenTry(3, 0, "a", 5.0), Ready(1, 0, "a", "fp"),
    Fail(1, "reader", 0, "a", "boom"), Report(1, 0, "a", "applied", "", 10, 0.5), Tick())]


@settings(max_examples=examples(200), deadline=None)
@given(doc=st.sampled_from(COMMANDS), data=st.data(), junk=JUNK)
def test_a_malformed_command_is_refused_with_fleet_wire_error_and_nothing_else(doc, data, junk):
    doc = _replaced(doc, data.draw(st.sampled_from(list(_leaves(doc)))), junk)
    try:
        command = command_from_wire(doc)
    except FleetWireError:
        return
    assert command_from_wire(command_to_wire(command)) == command
