"""An elastic set of readers (``SyncConfig(num_readers=None)``, issue 36): the settings it takes
and refuses, reader seats, and the roster a generation stands for. The processes joining and
leaving a running job are tests/test_faults.py's ``test_elastic_readers_join_and_leave_...``.
"""

from __future__ import annotations

import json

import msgpack
import pytest

from weightsync import SyncConfig
from weightsync.job.channel import JobChannel
from weightsync.job.keys import layout_key, layouts_key
from weightsync.job.wire import Member
from weightsync.ports.records import LeaseRow, Participant
from weightsync.session import elastic
from weightsync.session.combinations import CombinationError
from weightsync.session.config import MAX_READER_SEATS
from weightsync.transport import TransportOptions
from weightsync.transport.nixl.common import resolve_mode


@pytest.mark.parametrize("completion", ["all", "fraction=0.5", "quorum=2"])
def test_an_elastic_set_takes_any_completion_policy_and_any_seat(completion):
    """Readers that left are planned no more (writer 0 drops them), so ``all`` and ``fraction``
    count the readers that are there."""
    config = SyncConfig(num_writers=2, num_readers=None, completion=completion, transport="shm")
    assert config.num_readers is None and config.reader_seats == MAX_READER_SEATS
    assert json.loads(config.settings())["num_readers"] is None  # compared across ranks as it is
    again = SyncConfig.from_wire(config.to_wire())
    assert again == config
    # a quorum larger than any count is fine: readers may still join
    SyncConfig(num_writers=1, num_readers=None, completion="quorum=64")


@pytest.mark.parametrize(("settings", "message"), [
    ({"completion": "quorum=1", "commit": "fleet"},
     "num_readers=None (an elastic set of readers) with commit='fleet': the fleet's commit is decided for a fixed"),
    ({"transport": "torch"},
     "num_readers=None (an elastic set of readers) with transport='torch': its writers connect to every reader"),
    ({"completion": "quorum=1", "transport": "routed"},
     "num_readers=None (an elastic set of readers) with transport='routed': its writers connect to every reader"),
    ({"completion": "fraction=0.5", "transport": "nixl", "transport_options": TransportOptions(nixl_mode="push")},
     "num_readers=None (an elastic set of readers) with transport='nixl': its writers connect to every reader"),
])
def test_what_an_elastic_set_cannot_take_is_refused_where_it_is_written(settings, message):
    with pytest.raises(CombinationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SyncConfig(num_writers=1, num_readers=None, **settings)


def test_nixl_auto_pulls_for_an_elastic_set():
    """A push writer sends to each reader itself; ``auto`` picks push only for a known small count."""
    assert resolve_mode("auto", num_writers=4, num_readers=None) == "pull"
    assert resolve_mode("auto", num_writers=4, num_readers=2) == "push"
    SyncConfig(num_writers=4, num_readers=None, completion="quorum=1", transport="nixl")  # auto: pull, accepted


def test_a_reader_rank_is_a_seat():
    elastic.check_seat(0)
    elastic.check_seat(MAX_READER_SEATS - 1)
    for rank in (-1, MAX_READER_SEATS):
        with pytest.raises(ValueError, match=f"reader rank {rank} is no seat of an elastic set"):
            elastic.check_seat(rank)


class _Meta:
    """The coordinator's documents and registrations, as a dict and a list."""

    job = "rl"

    def __init__(self, participants: list[Participant], changes: list[tuple], leases: tuple[LeaseRow, ...] = ()) -> None:
        self.people = participants
        self.docs = {layout_key(g): msgpack.packb(list(change)) for g, change in enumerate(changes, start=1)}
        self.generation = len(changes)
        self.rows = list(leases)

    def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        return self.docs.get(key)

    def put_document(self, key: str, value: bytes) -> None:
        self.docs[key] = value

    def counter(self, key: str) -> int:
        assert key == layouts_key()
        return self.generation

    def compare_and_set(self, key: str, *, expected: int, value: int) -> tuple[bool, int]:
        assert key == layouts_key() and value == expected + 1
        done = self.generation == expected
        self.generation = value if done else self.generation
        return done, self.generation

    def leases(self) -> list[LeaseRow]:
        return self.rows

    def participants(self, role: str | None = None) -> list[Participant]:
        return [p for p in self.people if role is None or p.role == role]


def _participant(role: str, rank: int, layout: bytes) -> Participant:
    return Participant(role=role, rank=rank, group="rl", host="h", endpoints={"device": "cpu"}, layout=layout)


def test_a_generations_roster_holds_the_readers_joined_by_then_whenever_they_registered():
    """Writers plan a version at the generation writer 0 recorded for it: readers that joined
    later are not in it, a reader registered since the roster was read is, and every rank gets
    the same members with the layouts of their joins."""
    from weightsync.clock.deadline import Deadline

    registered = [_participant("writer", 0, b"w0"), _participant("reader", 0, b"r0-registered"),
                  _participant("reader", 1, b"r1"), _participant("reader", 2, b"r2")]
    meta = _Meta(registered, [("reader", 0, b"r0"), ("reader", 2, b"r2"), ("reader", 1, b"r1")])
    channel = JobChannel(meta, role="writer", rank=0)  # type: ignore[arg-type]
    seen = [Member.from_participant(p) for p in registered[:2]]  # read before readers 1 and 2 registered
    at = {g: channel.roster_at(seen, g, deadline=Deadline.after(5), joined_only=True) for g in (1, 2, 3)}
    assert [(m.role, m.rank, m.layout) for m in at[1]] == [("writer", 0, b"w0"), ("reader", 0, b"r0")]
    assert [(m.role, m.rank) for m in at[2]] == [("writer", 0), ("reader", 0), ("reader", 2)]
    assert elastic.reader_count(at[2]) == 3  # seats 0..2: seat 1 joined at generation 3
    assert [(m.role, m.rank) for m in at[3]] == [("writer", 0), ("reader", 0), ("reader", 1), ("reader", 2)]
    # a fixed job's roster keeps every registered reader
    assert len(channel.roster_at(seen, 3, deadline=Deadline.after(5))) == 2


def test_a_joined_reader_adopts_a_version_whose_setup_agrees_on_all_but_the_plan():
    """A version planned before a reader joined has another plan fingerprint; the transport and
    its settings (the part after the last ``-``) must agree for the reader to take it."""
    assert elastic.same_setup("3f2a9c-6d01aa42", "77e0b1-6d01aa42")
    assert not elastic.same_setup("3f2a9c-6d01aa42", "3f2a9c-0b9e1d7f")


def _lease(rank: int, *, alive: bool, released: bool = False, incarnation: str = "a") -> LeaseRow:
    return LeaseRow(role="reader", rank=rank, incarnation=incarnation, pid=7, host="h", ttl=5.0, age=0.0,
                    alive=alive, released=released, detail=f"pid 7 ({'alive' if alive else 'gone'})")


def test_a_reader_that_left_is_in_no_later_generation_and_a_new_join_of_its_seat_is():
    """A leave names the join it ends: it drops that join only; a process that took the seat and
    joined since stays, and a later join of the seat comes back."""
    from weightsync.clock.deadline import Deadline

    registered = [_participant("writer", 0, b"w0"), *(_participant("reader", r, b"r") for r in range(3))]
    meta = _Meta(registered, [("reader", 0, b"r0"), ("reader", 1, b"r1"), ("reader", 2, b"r2"),
                              ("reader", 1, b"", 2),             # 4: reader 1's join of generation 2 left
                              ("reader", 2, b"r2-eplb"),         # 5: a new layout, not a join
                              ("reader", 1, b"r1-again"),        # 6: seat 1 joined again
                              ("reader", 1, b"", 2),             # 7: a stale leave (of the join at 2)
                              ("reader", 2, b"", 3)])            # 8: reader 2's join (at 3) left
    channel = JobChannel(meta, role="writer", rank=0)  # type: ignore[arg-type]
    people = [Member.from_participant(p) for p in registered]

    def at(g: int) -> list[tuple[int, bytes]]:
        return [(m.rank, m.layout) for m in channel.roster_at(people, g, deadline=Deadline.after(5), joined_only=True)
                if m.role == "reader"]

    assert at(3) == [(0, b"r0"), (1, b"r1"), (2, b"r2")]
    assert at(4) == [(0, b"r0"), (2, b"r2")]
    assert at(5) == [(0, b"r0"), (2, b"r2-eplb")]
    assert at(6) == at(7) == [(0, b"r0"), (1, b"r1-again"), (2, b"r2-eplb")]
    assert at(8) == [(0, b"r0"), (1, b"r1-again")]
    roster = channel.roster_at(people, 8, deadline=Deadline.after(5), joined_only=True)
    assert elastic.reader_count(roster) == 2 and elastic.absent(roster) == frozenset()
    roster = channel.roster_at(people, 4, deadline=Deadline.after(5), joined_only=True)
    assert elastic.reader_count(roster) == 3 and elastic.absent(roster) == {1}


def test_writer_0_drops_the_joined_readers_whose_lease_ended_and_only_those():
    """Released (a clean leave) and expired (a death) leases end a join; a live lease, and a seat
    that never joined, are left alone. Each drop is one layout change naming the join it ends."""
    from weightsync.clock.deadline import Deadline

    registered = [_participant("writer", 0, b"w0"), *(_participant("reader", r, b"r") for r in range(4))]
    leases = (_lease(0, alive=True), _lease(1, alive=False, released=True), _lease(2, alive=False),
              _lease(3, alive=False))
    meta = _Meta(registered, [("reader", 0, b"r0"), ("reader", 1, b"r1"), ("reader", 2, b"r2")], leases)
    channel = JobChannel(meta, role="writer", rank=0)  # type: ignore[arg-type]
    dropped = channel.drop_departed_readers(deadline=Deadline.after(5))
    assert sorted(dropped) == [1, 2]  # seat 3 never joined: nothing to drop
    assert meta.generation == 5
    assert [msgpack.unpackb(meta.docs[layout_key(g)]) for g in (4, 5)] == [["reader", 1, b"", 2], ["reader", 2, b"", 3]]
    people = [Member.from_participant(p) for p in registered]
    roster = channel.roster_at(people, 5, deadline=Deadline.after(5), joined_only=True)
    assert [m.rank for m in roster if m.role == "reader"] == [0]
    assert channel.drop_departed_readers(deadline=Deadline.after(5)) == {}  # once only
    assert meta.generation == 5


def test_the_waits_count_the_readers_a_version_was_planned_for():
    """Under ``all`` a version is complete once every reader of its plan applied it; a seat that
    left (absent) counts neither for nor against it, whatever the report says of it."""
    from weightsync.job.completion import judge
    from weightsync.ports.fleet.policy import Policy
    from weightsync.ports.records import ReaderReport

    report = ReaderReport(None, ({"rank": 0, "version": 4}, {"rank": 1, "version": 2}, {"rank": 2, "version": 4}))
    everyone = Policy.parse("all", deadline=60.0)
    assert judge(everyone, 4, readers=3, report=report, dead={}).state == "waiting"  # reader 1 is behind
    done = judge(everyone, 4, readers=3, report=report, dead={1: "released"}, absent={1})
    assert done.state == "complete" and done.applied == (0, 2) and done.needed == 2 and done.missed == {}
    half = Policy.parse("fraction=0.5", deadline=60.0)
    assert judge(half, 4, readers=4, report=report, dead={}, absent={1, 3}).needed == 1
    # an absent seat that applied is not counted either
    assert judge(everyone, 4, readers=3, report=report, dead={}, absent={2}).state == "waiting"


def test_a_reader_whose_seat_is_no_rank_of_its_layout_is_refused_before_it_joins():
    """A reader on seat 1 whose engine layout has one rank (``hf:quant=fp8_block``): every writer
    rebuilds a reader's layout from its descriptor at its seat, and failed on it, so a
    misconfigured engine joining an elastic set ended the training job. The reader refuses itself,
    naming its layout and seat, before it holds a lease or publishes its join."""
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.tools.tiny import tiny_config

    cfg = tiny_config()
    with EmbeddedMetaServer() as server, MetaClient(server.address, job="seat", token=server.token) as meta:
        engine = ShardedEngine("hf:quant=fp8_block", cfg, 0)
        with pytest.raises(ValueError, match=r"reader 1: its layout hf:quant=fp8_block has ranks 0\.\.0, not 1"), \
                WeightReader(engine, rank=1, meta=meta, config=SyncConfig(num_writers=1, num_readers=None, job="seat",
                                                                          transport="shm", timeout=5)) as reader:
            reader.update(timeout=5)
        assert meta.counter(layouts_key()) == 0 and meta.leases() == []  # no join, no lease
