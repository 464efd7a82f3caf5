"""The meta server's state as a pure reducer: replaying journals rebuilds exactly the live state."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weightsync.meta.state as state_module
from budget import examples
from weightsync.meta.events import (
    DocumentPut,
    EventError,
    ReaderFailed,
    VersionReported,
    event_from_wire,
    event_to_wire,
)
from weightsync.meta.reducer import MetaData, ReaderState, apply, replay, snapshot
from weightsync.meta.state import ConflictError, MetaState
from weightsync.ports.records import VersionInfo

pytestmark = pytest.mark.timeout(120)

jobs = st.sampled_from(["a", "b"])
ranks = st.integers(0, 2)
operations = st.lists(st.one_of(
    st.tuples(st.just("register"), jobs, st.sampled_from(["writer", "reader"]), ranks, st.sampled_from(["h1", "h2"]),
              st.sampled_from([b"L1", b"L2"])),
    st.tuples(st.just("document"), jobs, st.sampled_from(["k1", "k2"]), st.binary(max_size=3)),
    st.tuples(st.just("cas"), jobs, st.integers(0, 3), st.integers(0, 4)),
    st.tuples(st.just("report"), jobs, st.integers(0, 4), st.sampled_from(["f", "g"]), st.integers(0, 1),
              st.integers(1, 2), st.integers(0, 3)),
    st.tuples(st.just("reader"), jobs, ranks, st.integers(0, 4), st.none() | st.just("boom"),
              st.none() | st.integers(0, 3), st.booleans(), st.none() | st.integers(0, 3)),
    st.tuples(st.just("drop"), jobs),
), max_size=40)


async def _run(state: MetaState, ops: list[tuple]) -> None:
    for op, job, *args in ops:
        try:
            if op == "register":
                role, rank, host, layout = args
                await state.register(job, role, rank, group="g", host=host, endpoints={"device": "cpu"}, layout=layout)
            elif op == "document":
                await state.put_document(job, *args)
            elif op == "cas":
                await state.compare_and_set(job, "epoch", expected=args[0], value=args[1])
            elif op == "report":
                version, fingerprint, writer, writers, epoch = args
                await state.report_version(job, version, fingerprint, writer_rank=min(writer, writers - 1),
                                           num_writers=writers, epoch=epoch)
            elif op == "reader":
                rank, version, error, epoch, invalid, holds = args
                await state.report_reader(job, rank, version, nbytes=8, seconds=0.5, error=error, epoch=epoch,
                                          invalid=invalid, holds=holds)
            else:
                await state.delete_job(job)
        except ConflictError:
            pass  # refused: nothing changed


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations)
def test_replaying_the_journal_of_a_live_server_rebuilds_its_state(monkeypatch, ops):
    """Whatever requests a server took, the events it journaled rebuild its state exactly, and
    so does its snapshot, also through the events' stored (msgpack) form."""
    journal = []

    def recording(data, event):
        journal.append(event)
        return apply(data, event)

    monkeypatch.setattr(state_module, "apply", recording)
    state = MetaState()
    asyncio.run(_run(state, ops))
    assert replay(journal) == state.data
    assert replay(snapshot(state.data)) == state.data
    stored = [event_from_wire(msgpack.unpackb(msgpack.packb(event_to_wire(e)))) for e in snapshot(state.data)]
    assert replay(stored) == state.data


def test_an_earlier_releases_journal_replays():
    """A journal written before the epoch had one name (``attempt``), with a snapshot's readers
    as ``applied``/``failed`` maps: its versions keep their epochs, its readers their state."""
    journal = [
        {"op": "register", "job": "j", "role": "reader", "rank": 0, "group": "g", "host": "h", "endpoints": {},
         "layout": "x" * 32, "at": 1.0},
        {"op": "version", "job": "j", "version": 3, "fingerprint": "fp@2", "at": 2.0, "attempt": 2},
        {"op": "report", "job": "j", "version": 4, "fingerprint": "fp@5", "attempt": 5, "writer_rank": 0,
         "num_writers": 2, "at": 3.0},
        {"op": "failed", "job": "j", "rank": 0, "version": 3, "nbytes": 0, "seconds": 0.0, "at": 4.0,
         "applied_at": 1.5, "error": "peer died"},
    ]
    data = replay(event_from_wire(r) for r in journal)
    job = data.jobs["j"]
    assert job.latest == VersionInfo(3, "fp@2", 2.0, epoch=2)
    assert (job.pending[4].epoch, job.pending[4].ranks) == (5, {0})
    assert job.readers[0] == ReaderState(version=None, nbytes=0, seconds=0.0, at=4.0, applied_at=1.5,
                                         error="peer died", failed_version=3, invalid_since=4.0)


def test_a_version_in_a_later_epoch_supersedes_it_and_clears_failures_of_it():
    data = MetaData()
    apply(data, VersionReported("j", 2, "fp", 0, 0, 1, 1.0))
    apply(data, ReaderFailed("j", 0, 2, "writer died", 0, 0.0, 2.0))
    notices = apply(data, VersionReported("j", 2, "fp", 1, 0, 1, 3.0))
    assert data.jobs["j"].latest == VersionInfo(2, "fp", 3.0, epoch=1)
    assert data.jobs["j"].readers[0].failed_version is None  # the readers take the new epoch of it
    assert [type(n).__name__ for n in notices] == ["VersionChanged"]
    assert apply(data, VersionReported("j", 2, "fp", 0, 0, 1, 4.0)) == []  # a late report of the old epoch
    assert data.jobs["j"].latest.epoch == 1


@pytest.mark.parametrize(("wire", "message"), [
    ({"op": "document", "job": "j", "key": "k", "at": 1.0}, "stored 'document' event lacks field 'value'"),
    ({"op": "document", "job": "j", "key": "k", "value": "text", "at": 1.0},
     "stored 'document' event: field 'value' must be bytes, not 'text'"),
    ({"op": "counter", "job": "j", "name": "epoch", "value": True, "at": 1.0},
     "field 'value' must be an int, not True"),
    ({"op": "register", "job": "j", "role": "admin", "rank": 0, "group": "", "host": "", "endpoints": {},
      "layout": "", "at": 0}, "field 'role' must be 'writer' or 'reader'"),
    ({"op": "grow", "job": "j"}, "unknown op 'grow'"),
    (["op", "drop"], "is not a map with an 'op'"),
])
def test_a_malformed_stored_event_is_named(wire, message):
    with pytest.raises(EventError, match=message):
        event_from_wire(wire)


def test_events_round_trip_through_their_wire_form():
    event = DocumentPut("j", "model/x", b"\x00{}", 12.5)
    assert event_from_wire(msgpack.unpackb(msgpack.packb(event_to_wire(event)))) == event
