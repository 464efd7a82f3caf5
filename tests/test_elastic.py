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
from weightsync.job.keys import layout_key
from weightsync.job.wire import Member
from weightsync.ports.records import Participant
from weightsync.session import elastic
from weightsync.session.combinations import CombinationError
from weightsync.session.config import MAX_READER_SEATS
from weightsync.transport import TransportOptions
from weightsync.transport.nixl.common import resolve_mode


def test_an_elastic_set_takes_a_quorum_and_any_seat():
    config = SyncConfig(num_writers=2, num_readers=None, completion="quorum=2", transport="shm")
    assert config.num_readers is None and config.reader_seats == MAX_READER_SEATS
    assert json.loads(config.settings())["num_readers"] is None  # compared across ranks as it is
    again = SyncConfig.from_wire(config.to_wire())
    assert again == config
    # a quorum larger than any count is fine: readers may still join
    SyncConfig(num_writers=1, num_readers=None, completion="quorum=64")


@pytest.mark.parametrize(("settings", "message"), [
    ({}, "num_readers=None (an elastic set of readers) with completion='all': readers that left keep their seats"),
    ({"completion": "fraction=0.5"}, "num_readers=None (an elastic set of readers) with completion='fraction=0.5'"),
    ({"completion": "quorum=1", "commit": "fleet"},
     "num_readers=None (an elastic set of readers) with commit='fleet': the fleet's commit is decided for a fixed"),
    ({"completion": "quorum=1", "transport": "torch"},
     "completion='quorum=1' with transport='torch': its writers send to every reader themselves"),
    ({"completion": "quorum=1", "transport": "routed"},
     "completion='quorum=1' with transport='routed': its writers send to every reader themselves"),
    ({"completion": "quorum=1", "transport": "nixl", "transport_options": TransportOptions(nixl_mode="push")},
     "completion='quorum=1' with transport='nixl' in push mode"),
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

    def __init__(self, participants: list[Participant], changes: list[tuple[str, int, bytes]]) -> None:
        self.people = participants
        self.docs = {layout_key(g): msgpack.packb([role, rank, blob]) for g, (role, rank, blob)
                     in enumerate(changes, start=1)}

    def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        return self.docs.get(key)

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
