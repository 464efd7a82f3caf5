"""The coordinator's decisions (:func:`weightsync.meta.fleet.decide.decide`), rule by rule, on a
clock the test moves: members and generations, tries and their outcomes under each policy."""

from __future__ import annotations

import json

import msgpack
import pytest

from weightsync.clock.clock import ManualClock
from weightsync.meta.fleet.commands import (
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
from weightsync.meta.fleet.decide import FleetConflictError, decide
from weightsync.ports.fleet import FleetRecord, FleetWireError, JobShape, Policy, Try

T0 = 1_000.0


class Fleet:
    """A record and a clock; ``do`` applies a command and returns the reply."""

    def __init__(self, writers: int = 1, readers: int | None = 2, policy: str = "all", deadline: float = 10.0):
        self.record = FleetRecord.empty("job")
        self.now = T0
        self.shape = JobShape(writers, readers, Policy.parse(policy, deadline=deadline))
        self.deadline = deadline
        self.incs: dict[tuple[str, int], str] = {}
        self.counter = 0

    def do(self, command):
        decision = decide(self.record, command, self.now)
        self.record = decision.record
        # every record survives its wire form (the store and an etcd key hold exactly that)
        assert FleetRecord.from_bytes(decision.record.to_bytes()) == decision.record
        assert command_from_wire(msgpack.unpackb(msgpack.packb(command_to_wire(command)))) == command
        return decision.reply

    def join(self, role: str, id_: int | None = None, holds: int | None = None):
        self.counter += 1
        inc = f"inc{self.counter}"
        reply = self.do(Join(role, id_, inc, "h", 100 + self.counter, self.shape, holds))
        assert reply.kind == "joined", reply
        self.incs[(role, reply.id)] = inc
        return reply

    def open(self, version: int, writer: int = 0):
        return self.do(OpenTry(version, writer, self.incs[("writer", writer)], self.deadline))

    def ready(self, number: int, writer: int = 0, fingerprint: str = "fp"):
        return self.do(Ready(number, writer, self.incs[("writer", writer)], fingerprint))

    def report(self, number: int, reader: int, outcome: str = "applied", detail: str = ""):
        return self.do(Report(number, reader, self.incs[("reader", reader)], outcome, detail))

    def expire(self, role: str, id_: int):
        return self.do(Expire(role, id_, self.incs[(role, id_)], "its lease expired"))

    def publish(self, version: int, writers: int = 1):
        number = self.open(version).try_number
        assert number is not None
        for w in range(writers):
            if w:
                assert self.open(version, w).try_number == number
            self.ready(number, w)
        return number

    def state(self, number: int) -> str:
        return self.record.tries[number].state


def test_joins_make_generations_and_readers_without_an_id_get_the_lowest_free_one():
    fleet = Fleet(readers=None)
    assert fleet.join("writer", 0).generation == 1
    assert [fleet.join("reader").id for _ in range(3)] == [0, 1, 2]
    assert fleet.record.generation.number == 4
    fleet.expire("reader", 1)
    assert fleet.record.generation.number == 5 and fleet.record.generation.cause == "reader 1 died"
    assert [i for i, _ in fleet.record.generation.readers] == [0, 2]
    again = fleet.join("reader")
    assert again.id == 1 and again.restarted  # the seat of the dead reader, a new incarnation
    assert fleet.record.generation.number == 6


def test_a_join_with_another_shape_or_outside_the_job_is_refused_naming_what_differs():
    fleet = Fleet(writers=2, readers=2, policy="all")
    fleet.join("writer", 0)
    other = JobShape(2, 3, Policy.parse("quorum=2", deadline=5))
    with pytest.raises(FleetConflictError, match=r"num_readers 3 here, 2 there; policy quorum=2 here, all there"):
        fleet.do(Join("reader", 0, "x", "h", 1, other))
    with pytest.raises(FleetConflictError, match=r"reader 2 is outside job 'job', which has 2 readers"):
        fleet.do(Join("reader", 2, "x", "h", 1, fleet.shape))
    fleet.join("reader", 0)
    with pytest.raises(FleetConflictError, match="held by another live process"):
        fleet.do(Join("reader", 0, "other", "h", 1, fleet.shape))


def test_a_try_opens_once_the_generation_is_ready_and_every_writer_joins_it():
    fleet = Fleet(writers=2, readers=2)
    fleet.join("writer", 0)
    fleet.join("reader", 0)
    assert fleet.open(1).kind == "waiting"
    assert "writer(s) [1] have no live process" in fleet.open(1).why
    fleet.join("writer", 1)
    assert "reader(s) [1] have no live process (policy all of 2)" in fleet.open(1).why
    fleet.join("reader", 1)
    number = fleet.open(1).try_number
    assert fleet.open(1, writer=1).try_number == number  # the other writer joins the same try
    fleet.ready(number, 0)
    assert fleet.state(number) == "open"
    fleet.ready(number, 1)
    assert fleet.state(number) == "published"
    t = fleet.record.next_for(0, fleet.incs[("reader", 0)])
    assert t is not None and t.number == number and t.version == 1


def test_all_completes_when_every_reader_applied_and_fails_when_one_fails():
    fleet = Fleet(readers=2)
    fleet.join("writer", 0)
    fleet.join("reader", 0)
    fleet.join("reader", 1)
    first = fleet.publish(1)
    fleet.report(first, 0)
    assert fleet.state(first) == "published"
    fleet.report(first, 1)
    assert fleet.state(first) == "complete" and fleet.record.latest == first
    second = fleet.publish(2)
    generation = fleet.record.generation.number
    fleet.report(second, 1, "failed", "checksum mismatch")
    t = fleet.record.tries[second]
    assert t.state == "failed" and "reader 1: checksum mismatch" in t.why
    assert fleet.record.generation.number == generation + 1  # its connections are re-formed
    assert fleet.record.holdings[0].version == 1 and 1 not in fleet.record.holdings


def test_quorum_completes_at_k_and_a_dead_reader_does_not_fail_it():
    fleet = Fleet(readers=None, policy="quorum=2")
    fleet.join("writer", 0)
    for _ in range(3):
        fleet.join("reader")
    number = fleet.publish(1)
    fleet.expire("reader", 2)
    assert fleet.state(number) == "published"
    fleet.report(number, 0)
    fleet.report(number, 1)
    assert fleet.state(number) == "complete"
    assert fleet.record.tries[number].outcomes[2].state == "failed"


def test_quorum_fails_as_soon_as_it_cannot_be_met_and_at_the_deadline_readers_are_missed():
    fleet = Fleet(readers=None, policy="quorum=2", deadline=10)
    fleet.join("writer", 0)
    for _ in range(3):
        fleet.join("reader")
    first = fleet.publish(1)
    fleet.report(first, 0, "failed", "boom")
    fleet.expire("reader", 1)
    assert fleet.state(first) == "failed" and "needs 2 of 3 reader(s): 0 applied it" in fleet.record.tries[first].why
    fleet.join("reader")
    second = fleet.publish(2)
    fleet.report(second, 0)
    fleet.now += 9.9
    fleet.do(Tick())
    assert fleet.state(second) == "published"
    fleet.now += 0.2
    fleet.do(Tick())
    t = fleet.record.tries[second]
    assert t.state == "failed" and t.reader_ids("missed") == [1, 2]
    third = fleet.publish(3)
    fleet.report(third, 0)
    fleet.report(third, 1)
    fleet.now += 11
    fleet.do(Tick())
    t = fleet.record.tries[third]
    assert t.state == "complete" and t.reader_ids("missed") == [2] and t.settled
    fleet.report(third, 2)  # late: it still applied it
    assert fleet.record.tries[third].outcomes[2].state == "applied"


def test_a_dead_writer_fails_its_try_and_its_restart_writes_the_version_again():
    fleet = Fleet(writers=2, readers=1)
    for w in range(2):
        fleet.join("writer", w)
    fleet.join("reader", 0)
    number = fleet.open(1).try_number
    fleet.open(1, 1)
    fleet.ready(number, 0)
    fleet.expire("writer", 1)
    t = fleet.record.tries[number]
    assert t.state == "failed" and t.why.startswith("writer 1 died")
    assert fleet.open(1).kind == "waiting"
    fleet.join("writer", 1)
    again = fleet.open(1).try_number
    assert again != number and fleet.open(1, 1).try_number == again


def test_opening_a_newer_version_supersedes_unpublished_older_tries_and_older_versions_are_refused():
    fleet = Fleet(writers=2, readers=1)
    for w in range(2):
        fleet.join("writer", w)
    fleet.join("reader", 0)
    old = fleet.open(1, writer=1).try_number  # a restarted writer 1 writes version 1 again...
    assert fleet.open(2, writer=0).kind == "try"  # ...while writer 0 moved on to version 2
    assert fleet.state(old) == "superseded" and "writer 0 opened version 2" in fleet.record.tries[old].why
    refused = fleet.open(1, writer=1)
    assert refused.kind == "refused" and "version 2 is being written" in refused.why


def test_a_published_try_of_an_older_version_is_not_superseded_by_a_newer_one():
    fleet = Fleet(readers=1)
    fleet.join("writer", 0)
    fleet.join("reader", 0)
    first = fleet.publish(1)
    second = fleet.publish(2)  # staleness 1: the writer runs ahead
    assert fleet.state(first) == "published" and fleet.state(second) == "published"
    assert fleet.record.next_for(0, fleet.incs[("reader", 0)]).number == second  # the newest one


def test_writers_that_planned_different_syncs_fail_the_try():
    fleet = Fleet(writers=2, readers=1)
    for w in range(2):
        fleet.join("writer", w)
    fleet.join("reader", 0)
    number = fleet.open(1).try_number
    fleet.open(1, 1)
    fleet.ready(number, 0, "fp-a")
    reply = fleet.ready(number, 1, "fp-b")
    assert reply.kind == "refused" and "planned different syncs" in reply.why
    assert fleet.state(number) == "failed"


def test_a_reader_that_joined_after_a_try_opened_is_not_in_it_and_waits_for_the_next():
    fleet = Fleet(readers=None, policy="fraction=0.5")
    fleet.join("writer", 0)
    fleet.join("reader")
    number = fleet.publish(1)
    late = fleet.join("reader")
    assert fleet.record.next_for(late.id, fleet.incs[("reader", late.id)]) is None
    fleet.report(number, 0)
    assert fleet.state(number) == "complete"
    nxt = fleet.publish(2)
    assert fleet.record.next_for(late.id, fleet.incs[("reader", late.id)]).number == nxt


def test_a_writer_failure_fails_the_try_and_moves_the_generation():
    fleet = Fleet(readers=1)
    fleet.join("writer", 0)
    fleet.join("reader", 0)
    number = fleet.publish(1)
    generation = fleet.record.generation.number
    fleet.do(Fail(number, "writer", 0, fleet.incs[("writer", 0)], "reader 0 died while this rank waited"))
    assert fleet.state(number) == "failed" and fleet.record.generation.number == generation + 1
    assert fleet.record.generation.cause == f"try {number} of version 1 failed"


def test_a_clean_leave_is_not_a_failure_under_all():
    fleet = Fleet(readers=None)
    fleet.join("writer", 0)
    fleet.join("reader")
    fleet.join("reader")
    number = fleet.publish(1)
    fleet.report(number, 0)
    fleet.do(Leave("reader", 1, fleet.incs[("reader", 1)]))
    assert fleet.state(number) == "complete"
    assert fleet.record.tries[number].outcomes[1].state == "left"


def test_an_unpublished_try_fails_at_its_deadline_naming_the_writer_that_did_not_publish():
    fleet = Fleet(writers=2, readers=1, deadline=5)
    for w in range(2):
        fleet.join("writer", w)
    fleet.join("reader", 0)
    number = fleet.open(1).try_number
    fleet.ready(number, 0)
    fleet.now += 6
    fleet.do(Tick())
    assert fleet.state(number) == "failed" and "writer(s) [1] did not publish" in fleet.record.tries[number].why


def test_old_tries_are_pruned_but_the_newest_complete_one_stays():
    fleet = Fleet(readers=1)
    fleet.join("writer", 0)
    fleet.join("reader", 0)
    for v in range(1, 20):
        n = fleet.publish(v)
        fleet.report(n, 0)
    assert len(fleet.record.tries) <= 9 and fleet.record.latest in fleet.record.tries
    assert fleet.record.latest_try().version == 19


def test_malformed_commands_and_records_are_refused_naming_the_field():
    with pytest.raises(FleetWireError, match="field 'version' must be int"):
        command_from_wire({"op": "open", "version": "1", "writer": 0, "incarnation": "a", "deadline": 1.0})
    with pytest.raises(FleetWireError, match="fleet command 'open': a try's deadline must be a positive number"):
        command_from_wire({"op": "open", "version": 1, "writer": 0, "incarnation": "a", "deadline": float("nan")})
    with pytest.raises(FleetWireError, match="field 'opened_at' must be a number, not nan"):
        Try.from_wire({**_a_try().to_wire(), "opened_at": float("nan")})
    with pytest.raises(FleetWireError, match="field 'number' must be an int, not True"):
        Try.from_wire({**_a_try().to_wire(), "number": True})
    with pytest.raises(FleetWireError, match="unknown fleet command 'nope'"):
        command_from_wire({"op": "nope"})
    with pytest.raises(FleetWireError, match="field 'generation' is missing"):
        FleetRecord.from_wire({"job": "j", "members": [], "tries": [], "holdings": [], "next_try": 1})
    with pytest.raises(ValueError, match="policy 'quorum=x'"):
        Policy.parse("quorum=x", deadline=1)
    with pytest.raises(ValueError, match="is not one of 'all', 'quorum=K'"):
        Policy.parse("most", deadline=1)


def test_a_dead_reader_never_completes_a_version_even_one_it_missed():
    fleet = Fleet(readers=None, policy="quorum=1", deadline=5)
    fleet.join("writer", 0)
    fleet.join("reader")
    fleet.join("reader")
    number = fleet.publish(1)
    fleet.report(number, 0)
    fleet.now += 6
    fleet.do(Tick())
    assert fleet.record.tries[number].outcomes[1].state == "missed"
    fleet.expire("reader", 1)
    reply = fleet.report(number, 1)  # the dead process's late report (it was declared dead first)
    assert reply.kind == "ignored" and "not a live member" in reply.why
    assert fleet.record.tries[number].outcomes[1].state == "missed" and 1 not in fleet.record.holdings


def test_a_try_whose_readers_all_left_is_not_complete():
    fleet = Fleet(readers=None)
    fleet.join("writer", 0)
    fleet.join("reader")
    number = fleet.publish(1)
    fleet.do(Leave("reader", 0, fleet.incs[("reader", 0)]))
    t = fleet.record.tries[number]
    assert t.state == "failed" and "needs 1 of 0 reader(s)" in t.why and fleet.record.latest is None


def test_a_replacement_joins_as_a_new_incarnation_and_the_old_process_cannot_come_back():
    fleet = Fleet(readers=2, policy="quorum=1")
    fleet.join("writer", 0)
    fleet.join("reader", 0)
    fleet.join("reader", 1)
    old = fleet.incs[("reader", 1)]
    fleet.expire("reader", 1)
    with pytest.raises(FleetConflictError, match=r"declared dead .*joins again as a new incarnation"):
        fleet.do(Join("reader", 1, old, "h", 1, fleet.shape))
    reply = fleet.join("reader", 1)
    assert reply.restarted and fleet.record.generation.cause == "reader 1 restarted"
    assert fleet.record.generation.readers[1] == (1, fleet.incs[("reader", 1)]) != (1, old)


@pytest.mark.parametrize(("text", "readers", "needed"), [
    ("all", 4, 4), ("quorum=3", 8, 3), ("fraction=0.75", 4, 3), ("fraction=0.5", 3, 2), ("fraction=0.1", 3, 1),
    ("fraction=1", 5, 5)])
def test_the_readers_each_policy_needs(text, readers, needed):
    assert Policy.parse(text, deadline=1).needed(readers) == needed


def test_decide_reads_no_clock(monkeypatch):
    import time

    def no_clock() -> float:
        raise AssertionError("decide read the system clock")

    for name in ("time", "monotonic", "perf_counter"):
        monkeypatch.setattr(time, name, no_clock)
    fleet = Fleet(readers=1, deadline=5)
    fleet.join("writer", 0)
    fleet.join("reader", 0)
    number = fleet.publish(1)
    fleet.now += 6
    fleet.do(Tick())
    assert fleet.state(number) == "failed"


def test_the_manual_clock_moves_only_forward_when_told():
    clock = ManualClock(start=5.0)
    assert (clock.monotonic(), clock.now()) == (5.0, 5.0)
    clock.advance(2.5)
    assert clock.monotonic() == 7.5
    with pytest.raises(ValueError, match=r"a clock never goes back: advance\(-1\)"):
        clock.advance(-1)


def test_a_record_survives_json_as_well_as_msgpack():
    fleet = Fleet(writers=2, readers=None, policy="fraction=0.5")
    for w in range(2):
        fleet.join("writer", w)
    fleet.join("reader", holds=3)
    fleet.join("reader")
    number = fleet.publish(4, writers=2)
    fleet.report(number, 0)
    fleet.expire("reader", 1)
    doc = json.loads(json.dumps(fleet.record.to_wire()))
    assert FleetRecord.from_wire(doc) == fleet.record
    assert FleetRecord.from_bytes(fleet.record.to_bytes()) == fleet.record
    for command in (Join("reader", None, "a", "h", 1, fleet.shape, 2), Tick(), Report(1, 0, "a", "staged")):
        assert command_from_wire(json.loads(json.dumps(command_to_wire(command)))) == command


def _a_try() -> Try:
    fleet = Fleet(readers=1)
    fleet.join("writer", 0)
    fleet.join("reader", 0)
    number = fleet.publish(1)
    return fleet.record.tries[number]


def test_a_report_on_a_failed_try_still_moves_the_readers_holding():
    """A reader that applied (or failed to apply) a try that another reader failed meanwhile: the
    try stays failed, but the record says what the reader's engine holds now (found by the
    simulator: the record claimed reader 0 held version 1 while its engine held version 2)."""
    fleet = Fleet(readers=2, policy="all")
    fleet.join("writer", 0)
    fleet.join("reader", 0)
    fleet.join("reader", 1)
    first = fleet.publish(1)
    fleet.report(first, 0)
    fleet.report(first, 1)
    second = fleet.publish(2)
    fleet.report(second, 1, "failed", "boom")
    assert fleet.state(second) == "failed"
    assert fleet.report(second, 0).kind == "ignored"  # reader 0 applied it all the same
    assert fleet.state(second) == "failed" and fleet.record.tries[second].outcomes[0].state == "pending"
    held = fleet.record.holdings[0]
    assert (held.version, held.try_number) == (2, second)
    third = fleet.publish(3)
    fleet.report(third, 1, "failed", "boom")
    assert fleet.report(third, 0, "failed", "its engine broke").kind == "ignored"
    assert fleet.state(third) == "failed" and 0 not in fleet.record.holdings  # its engine holds no valid version
