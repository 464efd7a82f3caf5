"""The fleet coordinator on both backends: the embedded meta server (commands through the meta
client, ``decide`` applied under the server's lock, leases on a clock the test moves: nothing
sleeps; a restart replays the stored commands into the same record) and etcd (``decide`` in a
compare-and-put transaction by each client, members' leases as etcd leases). The scenarios
that do not depend on how a lease runs out run on both, through the same calls and answers.
"""

from __future__ import annotations

import itertools
import threading

import httpx
import pytest

from weightsync.clock.clock import ManualClock
from weightsync.meta.client import MetaClient
from weightsync.meta.embedded import EmbeddedMetaServer
from weightsync.meta.fleet.commands import Join, Leave, OpenTry, Ready, Report, Tick
from weightsync.ports.fleet import FleetRecord, JobShape, Policy

SHAPE = JobShape(1, None, Policy.parse("quorum=2", deadline=30.0))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000.0)


@pytest.fixture
def server(clock, tmp_path):
    with EmbeddedMetaServer(state_dir=tmp_path / "state", clock=clock, fleet_tick=None) as s:
        yield s


def _client(server: EmbeddedMetaServer) -> MetaClient:
    return MetaClient(server.address, job="fleet", token=server.token, timeout=10)


_jobs = itertools.count()


@pytest.fixture(scope="module")
def etcd_address(tmp_path_factory):
    """One single-member etcd for the module (each test takes a job of its own)."""
    from etcd_helpers import etcd_cluster

    cluster = etcd_cluster(tmp_path_factory.mktemp("etcd"), members=1)
    try:
        yield cluster.address
    finally:
        cluster.stop()


@pytest.fixture(params=["meta-server", "etcd"])
def coordinator(request, clock):
    """A factory of fleet clients of one job, on the embedded meta server or on etcd, all on ``clock``."""
    if request.param == "meta-server":
        server = request.getfixturevalue("server")
        yield lambda: _client(server)
        return
    from weightsync.meta.etcd.client import EtcdMetaClient

    address, job = request.getfixturevalue("etcd_address"), f"fleet{next(_jobs)}"
    opened: list[EtcdMetaClient] = []

    def open_client() -> EtcdMetaClient:
        opened.append(EtcdMetaClient(address, job=job, timeout=10, clock=clock))
        return opened[-1]

    try:
        yield open_client
    finally:
        for c in opened:
            c.close()


def _fleet(c: MetaClient) -> dict[str, str]:
    """A writer and three readers (elastic: the coordinator gives reader ids); their incarnations."""
    incs = {"w0": "w0-a"}
    assert c.fleet_join(Join("writer", 0, "w0-a", "h", 1, SHAPE), ttl=5.0).reply.kind == "joined"
    for n in range(3):
        answer = c.fleet_join(Join("reader", None, f"r{n}-a", "h", 10 + n, SHAPE), ttl=5.0)
        assert (answer.reply.kind, answer.reply.id) == ("joined", n)
        incs[f"r{n}"] = f"r{n}-a"
    return incs


def test_a_version_completes_under_quorum_through_the_client_with_typed_answers(coordinator):
    with coordinator() as c:
        _fleet(c)
        opened = c.fleet_command(OpenTry(1, 0, "w0-a", 30.0))
        assert opened.reply.kind == "try" and opened.generation == 4
        number = opened.reply.try_number
        assert c.fleet_command(Ready(number, 0, "w0-a", "fp")).reply.kind == "ok"
        for r in (0, 1):
            c.fleet_command(Report(number, r, f"r{r}-a", "applied", nbytes=10))
        view = c.fleet_record()
        assert isinstance(view.record, FleetRecord)
        t = view.record.tries[number]
        assert t.state == "complete" and t.reader_ids("applied") == [0, 1] and view.record.latest == number
        assert view.record.holdings[0].version == 1
        assert c.fleet_record(after=view.revision - 1).revision == view.revision  # nothing to wait for


def test_a_silent_reader_is_declared_dead_one_lease_later_and_quorum_still_completes(server, clock):
    with _client(server) as c:
        _fleet(c)
        number = c.fleet_command(OpenTry(1, 0, "w0-a", 30.0)).reply.try_number
        c.fleet_command(Ready(number, 0, "w0-a", "fp"))
        clock.advance(4.0)
        for role, id_, inc in (("writer", 0, "w0-a"), ("reader", 0, "r0-a"), ("reader", 1, "r1-a")):
            assert c.fleet_beat(role, id_, inc)
        assert c.fleet_tick().expired == ()
        clock.advance(1.5)  # reader 2: 5.5 s without a heartbeat, lease 5 s
        ticked = c.fleet_tick()
        assert ticked.expired == (("reader", 2, "r2-a"),) and ticked.generation == 5
        assert not c.fleet_beat("reader", 2, "r2-a")  # it rejoins as a new process
        view = c.fleet_record()
        assert view.record.tries[number].outcomes[2].state == "failed"
        assert view.record.tries[number].state == "published"  # a dead reader does not fail quorum=2
        c.fleet_command(Report(number, 0, "r0-a", "applied"))
        c.fleet_command(Report(number, 1, "r1-a", "applied"))
        assert c.fleet_record().record.tries[number].state == "complete"


def test_a_deadline_is_decided_by_the_tick_on_the_deciders_clock(coordinator, clock):
    with coordinator() as c:
        _fleet(c)
        number = c.fleet_command(OpenTry(1, 0, "w0-a", 3.0)).reply.try_number
        c.fleet_command(Ready(number, 0, "w0-a", "fp"))
        c.fleet_command(Report(number, 0, "r0-a", "applied"))
        clock.advance(3.0)
        for role, id_, inc in (("writer", 0, "w0-a"), ("reader", 0, "r0-a"), ("reader", 1, "r1-a"),
                               ("reader", 2, "r2-a")):
            c.fleet_beat(role, id_, inc)
        c.fleet_tick()
        t = c.fleet_record().record.tries[number]
        assert t.state == "failed" and t.reader_ids("missed") == [1, 2]
        assert "policy quorum=2 needs 2 of 3 reader(s): 1 applied it, by the deadline" in t.why


def test_a_restarted_server_replays_the_record_and_gives_every_member_one_lease(clock, tmp_path):
    state = tmp_path / "state"
    with EmbeddedMetaServer(state_dir=state, clock=clock, fleet_tick=None) as first, _client(first) as c:
        _fleet(c)
        number = c.fleet_command(OpenTry(1, 0, "w0-a", 30.0)).reply.try_number
        c.fleet_command(Ready(number, 0, "w0-a", "fp"))
        c.fleet_command(Report(number, 0, "r0-a", "applied"))
        c.fleet_command(Leave("reader", 2, "r2-a"))
        before = c.fleet_record()
    clock.advance(60.0)  # the coordinator was down for longer than any lease
    with EmbeddedMetaServer(state_dir=state, clock=clock, fleet_tick=None) as second, _client(second) as c:
        after = c.fleet_record()
        assert after.record == before.record and after.revision == before.revision
        assert c.fleet_tick().expired == ()  # leases are not stored: each live member gets one from now
        clock.advance(4.0)
        assert c.fleet_beat("writer", 0, "w0-a") and c.fleet_beat("reader", 0, "r0-a")
        clock.advance(1.5)
        assert c.fleet_tick().expired == (("reader", 1, "r1-a"),)


def test_conflicts_and_malformed_commands_are_refused_naming_the_cause(coordinator):
    with coordinator() as c:
        _fleet(c)
        other = JobShape(1, None, Policy.parse("all", deadline=30.0))
        with pytest.raises(ValueError, match="policy all here, quorum=2 there"):
            c.fleet_join(Join("reader", None, "x", "h", 1, other))
        with pytest.raises(ValueError, match="held by another live process"):
            c.fleet_join(Join("writer", 0, "w0-b", "h", 2, SHAPE))
        with pytest.raises(ValueError, match="coordinator's own command"):
            c.fleet_command(Tick())
        with pytest.raises(ValueError, match=r"field 'ttl' must be seconds in \(0.01, 3600\]"):
            c.fleet_join(Join("reader", None, "y", "h", 1, SHAPE), ttl=0.0)
        refused = c.fleet_command(Ready(99, 0, "w0-a", "fp"))
        assert refused.reply.kind == "refused" and "try 99 is unknown" in refused.reply.why
        assert c.fleet_record().record.members[("writer", 0)].incarnation == "w0-a"  # nothing changed


def test_a_malformed_command_body_is_answered_422_naming_the_field(server):
    with _client(server) as c:
        _fleet(c)
        r = httpx.post(f"{server.address}/v1/jobs/fleet/fleet/report", json={"try_number": "x"},
                       headers={"Authorization": f"Bearer {server.token}"}, trust_env=False, timeout=10)
        assert r.status_code == 422
        assert "fleet command 'report': field 'try_number' must be int, not 'x'" in r.json()["detail"]


def test_the_stored_commands_and_the_snapshot_rebuild_the_same_record():
    """Live, replayed from the stored commands (through their wire form) and rebuilt from a
    snapshot: one record."""
    import msgpack

    from weightsync.meta.events import FleetCommanded, encode_events, event_from_wire
    from weightsync.meta.fleet.commands import command_to_wire
    from weightsync.meta.reducer import MetaData, apply, replay, snapshot

    commands = [Join("writer", 0, "w", "h", 1, SHAPE), Join("reader", None, "a", "h", 2, SHAPE),
                Join("reader", None, "b", "h", 3, SHAPE), OpenTry(1, 0, "w", 30.0), Ready(1, 0, "w", "fp"),
                Report(1, 0, "a", "applied"), Leave("reader", 1, "b")]
    events = [FleetCommanded("job", msgpack.packb(command_to_wire(c)), 1_000.0 + i) for i, c in enumerate(commands)]
    live = MetaData()
    for event in events:
        apply(live, event)
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(encode_events(events))
    assert replay(event_from_wire(doc) for doc in unpacker) == live
    assert replay(snapshot(live)) == live
    record = live.jobs["job"].fleet
    assert record is not None and record.tries[1].state == "failed"  # reader 1 left: quorum=2 cannot be met
    assert record.holdings[0].version == 1 and live.jobs["job"].fleet_revision == 7


# --- on etcd: leases are etcd's, and every client decides ----------------------------------------------

def _alive_lease(c, role: str, id_: int) -> int:
    row, _ = c.kv.get(c.keys.fleet_alive(role, id_))
    assert row is not None, f"{role} {id_} has no alive key"
    return int(row.lease)


@pytest.mark.parametrize("coordinator", ["etcd"], indirect=True)
def test_on_etcd_a_member_whose_etcd_lease_ran_out_is_declared_dead_by_any_clients_tick(coordinator):
    """Reader 2's etcd lease ends (revoked here: what etcd does once no keep-alive came for its
    TTL); the next tick, from another client, declares it dead; quorum=2 still completes."""
    with coordinator() as c, coordinator() as other:
        _fleet(c)
        number = c.fleet_command(OpenTry(1, 0, "w0-a", 30.0)).reply.try_number
        c.fleet_command(Ready(number, 0, "w0-a", "fp"))
        assert other.fleet_tick().expired == ()  # every alive key is there
        c.kv.revoke(_alive_lease(c, "reader", 2))
        ticked = other.fleet_tick()
        assert ticked.expired == (("reader", 2, "r2-a"),) and ticked.generation == 5
        assert other.fleet_tick().expired == ()  # decided once
        assert not c.fleet_beat("reader", 2, "r2-a")  # it rejoins as a new process
        record = c.fleet_record().record
        assert record.members[("reader", 2)].state == "dead"
        assert "etcd lease expired" in record.members[("reader", 2)].detail
        assert record.tries[number].outcomes[2].state == "failed" and record.tries[number].state == "published"
        c.fleet_command(Report(number, 0, "r0-a", "applied"))
        c.fleet_command(Report(number, 1, "r1-a", "applied"))
        assert c.fleet_record().record.tries[number].state == "complete"
        again = c.fleet_join(Join("reader", 2, "r2-b", "h", 99, SHAPE), ttl=5.0)
        assert again.reply.kind == "joined" and again.reply.restarted
        assert c.fleet_beat("reader", 2, "r2-b")


@pytest.mark.parametrize("coordinator", ["etcd"], indirect=True)
def test_on_etcd_a_silent_member_is_named_dead_within_its_lease_period(coordinator):
    """Real time: a reader that joined with a 1 s lease and never beats is declared dead by a
    tick within about that second (etcd's own expiry), while the writer that beats stays."""
    import time

    with coordinator() as c:
        assert c.fleet_join(Join("writer", 0, "w0-a", "h", 1, SHAPE), ttl=30.0).reply.kind == "joined"
        assert c.fleet_join(Join("reader", None, "r0-a", "h", 2, SHAPE), ttl=1.0).reply.id == 0
        started = time.monotonic()
        expired: tuple = ()
        while not expired and time.monotonic() - started < 10.0:
            assert c.fleet_beat("writer", 0, "w0-a")
            expired = c.fleet_tick().expired
            time.sleep(0.1)
        assert expired == (("reader", 0, "r0-a"),), "the silent reader was not named within 10 s"
        assert time.monotonic() - started < 4.0
        assert c.fleet_record().record.members[("writer", 0)].live


@pytest.mark.parametrize("coordinator", ["etcd"], indirect=True)
def test_on_etcd_a_beat_after_the_etcd_lease_ran_out_but_before_any_tick_keeps_the_member(coordinator):
    """As on the server: a member is dead once a tick said so, not before; its beat in between
    takes a new etcd lease, and a leave takes its alive key away with it."""
    with coordinator() as c:
        _fleet(c)
        c.kv.revoke(_alive_lease(c, "reader", 1))
        assert c.fleet_beat("reader", 1, "r1-a")
        assert c.fleet_tick().expired == ()
        assert c.fleet_command(Leave("reader", 1, "r1-a")).reply.kind == "ok"
        assert c.kv.get(c.keys.fleet_alive("reader", 1))[0] is None
        assert c.fleet_tick().expired == () and not c.fleet_beat("reader", 1, "r1-a")


@pytest.mark.parametrize("coordinator", ["etcd"], indirect=True)
def test_on_etcd_members_joining_at_once_through_several_clients_each_get_a_seat_of_their_own(coordinator):
    """Twelve readers join from four clients at once: each change is decided on the record it
    changes (compare-and-put, decided again when another client got there first), so the seats
    are 0..11, each with its alive key, and the revision counts thirteen changes."""
    clients = [coordinator() for _ in range(4)]
    assert clients[0].fleet_join(Join("writer", 0, "w0-a", "h", 1, SHAPE)).reply.kind == "joined"
    seats: list[int] = []
    errors: list[BaseException] = []

    def join(c, n: int) -> None:
        try:
            for k in range(3):
                answer = c.fleet_join(Join("reader", None, f"r{n}-{k}", "h", 100 + 3 * n + k, SHAPE), ttl=5.0)
                assert answer.reply.kind == "joined"
                seats.append(answer.reply.id)
        except BaseException as exc:  # raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(c, n)) for n, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sorted(seats) == list(range(12))
    view = clients[0].fleet_record()
    assert view.revision == 13 and view.record.generation.number == 13
    assert len(view.record.generation.readers) == 12
    assert clients[1].fleet_tick().expired == ()  # every seat has its alive key


@pytest.mark.parametrize("coordinator", ["etcd"], indirect=True)
def test_on_etcd_a_fleet_record_or_lease_weightsync_did_not_write_is_named(coordinator):
    from weightsync.meta.etcd import ops

    with coordinator() as c:
        _fleet(c)  # a member's lease key: named, not read as a dead member
        c.txn([], [ops.put(c.keys.fleet_alive("reader", 1), b"junk")], what="corrupt it")
        with pytest.raises(ValueError, match=r"fleet/alive/reader/0000000001' holds a malformed fleet lease"):
            c.fleet_tick()
        assert c.fleet_record().record.members[("reader", 1)].live
        c.txn([], [ops.put(c.keys.fleet_record, b"\x93not a record")], what="corrupt it")
        with pytest.raises(ValueError, match=r"fleet/record' holds a malformed fleet record .*only weightsync"):
            c.fleet_record()


@pytest.mark.parametrize("coordinator", ["etcd"], indirect=True)
def test_on_etcd_the_asyncio_client_has_the_same_fleet_calls_and_its_members_are_the_sync_clients(coordinator,
                                                                                                  clock):
    """The asyncio etcd client had no fleet calls: a serving fleet's engines could join the record
    only through a thread each. It runs the same steps as the sync client now: twelve readers
    join at once on one event loop and get seats 0..11; a member it seated is the sync client's
    to tick dead; its wait for the record wakes on the sync client's change; a refused command
    leaves no alive key behind and names the cause."""
    import asyncio

    from weightsync.meta.etcd.async_client import AsyncEtcdMetaClient

    with coordinator() as sync:
        assert sync.fleet_join(Join("writer", 0, "w0-a", "h", 1, SHAPE), ttl=30.0).reply.kind == "joined"

        async def scenario() -> None:
            async with AsyncEtcdMetaClient(sync.address, job=sync.job, timeout=10, clock=clock) as meta:
                answers = await asyncio.gather(*(meta.fleet_join(Join("reader", None, f"r{n}-a", "h", 10 + n, SHAPE),
                                                                 ttl=5.0) for n in range(12)))
                assert sorted(a.reply.id for a in answers) == list(range(12))
                assert all(a.reply.kind == "joined" for a in answers)
                seat = {a.reply.id: f"r{n}-a" for n, a in enumerate(answers)}  # who got which seat: any order
                assert await meta.fleet_beat("reader", 3, seat[3])
                view = await meta.fleet_record()
                assert view.revision == 13 and len(view.record.generation.readers) == 12

                sync.kv.revoke(_alive_lease(sync, "reader", 3))  # etcd ends reader 3's lease
                assert sync.fleet_tick().expired == (("reader", 3, seat[3]),)
                assert not await meta.fleet_beat("reader", 3, seat[3])
                assert (await meta.fleet_tick()).expired == ()  # decided once, by whichever client ticked

                waiting = asyncio.ensure_future(meta.fleet_record(after=view.revision + 1, wait=10.0))
                await asyncio.sleep(0.2)
                opened = await asyncio.to_thread(sync.fleet_command, OpenTry(1, 0, "w0-a", 30.0))
                woke = await asyncio.wait_for(waiting, timeout=10.0)
                assert woke.revision == opened.revision and woke.record.tries[opened.reply.try_number].version == 1

                with pytest.raises(ValueError, match="num_writers"):  # the job's shape is fixed by the first join
                    await meta.fleet_join(Join("reader", None, "x", "h", 99, JobShape(2, None, SHAPE.policy)), ttl=5.0)
                assert (await meta.fleet_command(Leave("reader", 5, seat[5]))).reply.kind == "ok"

        asyncio.run(scenario())
        assert sync.kv.get(sync.keys.fleet_alive("reader", 5))[0] is None  # a leave takes its alive key away
        assert sync.kv.get(sync.keys.fleet_alive("reader", 12))[0] is None  # the refused join seated no one
        record = sync.fleet_record().record
        assert record.members[("reader", 3)].state == "dead" and record.members[("reader", 5)].state == "left"
