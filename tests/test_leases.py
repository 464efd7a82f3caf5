"""Leases on the meta server (:mod:`weightsync.meta.leases`): a stall of the server itself does
not expire the leases of live peers, while a peer that stops renewing still dies on time."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from weightsync.clock.clock import ManualClock
from weightsync.meta.leases import TICK_S, LeaseHeldError, Leases


def test_a_stalled_server_does_not_expire_live_leases_but_a_silent_peer_still_dies():
    clock = ManualClock()
    leases = Leases(clock)
    leases.watch_time()  # the server's keep_time task runs
    asyncio.run(leases.acquire("j", "writer", 0, incarnation="a", ttl=0.5, pid=1, host="h", wait=0.0))
    clock.advance(1.0)  # the server stood still: the heartbeats of that time wait unread
    assert leases.table("j")[0].age == pytest.approx(TICK_S)  # only the one tick it expected counts
    for _ in range(3):  # it runs again, looking at the clock every tick, and no heartbeat comes
        clock.advance(TICK_S)
        leases.tick()
    assert leases.table("j")[0].alive  # 0.4 s of silence: within the ttl
    for _ in range(2):
        clock.advance(TICK_S)
        leases.tick()
    row = leases.table("j")[0]
    assert not row.alive and "the meta server's lease of it (ttl 0.5 s) expired" in row.detail


def test_without_the_server_watching_time_an_unrenewed_lease_expires_after_its_ttl():
    clock = ManualClock()
    leases = Leases(clock)
    asyncio.run(leases.acquire("j", "reader", 1, incarnation="a", ttl=0.2, pid=1, host="h", wait=0.0))
    clock.advance(0.2)
    assert leases.table("j")[0].alive
    clock.advance(0.1)
    row = leases.table("j")[0]
    assert not row.alive and "last heartbeat 0.3 s ago" in row.detail


def test_a_second_process_claiming_a_live_rank_is_refused_naming_the_holder_until_its_lease_expires():
    clock = ManualClock()
    leases = Leases(clock)
    asyncio.run(leases.acquire("j", "writer", 2, incarnation="a", ttl=3.0, pid=41, host="n0", wait=0.0))
    clock.advance(2.9)
    with pytest.raises(LeaseHeldError, match=r"writer rank 2 of job 'j' is held by another live process \(pid 41 on "
                                             r"n0, last heartbeat 2.9 s ago \(ttl 3 s\)\): two processes claim"):
        asyncio.run(leases.acquire("j", "writer", 2, incarnation="b", ttl=3.0, pid=42, host="n1", wait=0.0))
    clock.advance(0.2)
    assert asyncio.run(leases.acquire("j", "writer", 2, incarnation="b", ttl=3.0, pid=42, host="n1", wait=0.0))


def test_a_rank_leaves_in_under_two_seconds_after_its_meta_server_stopped():
    """Shutdown in any order (issue 28 §5): a reader or writer that closes after the meta server
    stopped (vLLM's workers after the trainer engine's embedded server, an operator stopping
    `weightsync meta-server` first) used to stall 30 s and more, its heartbeat and the release
    of its lease retrying a server that is gone for good."""
    from weightsync.job.channel import JobChannel
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient

    server = EmbeddedMetaServer().start()
    meta = MetaClient(server.address, token=server.token)
    try:
        channel = JobChannel(meta, role="reader", rank=0)
        channel.register(host="h", group="default", layout=b"layout", lease=0.4)
        channel.start_heartbeat()
        server.stop()
        time.sleep(0.3)  # the heartbeat is retrying the server by now
        started = time.monotonic()
        channel.stop_heartbeat(release=True)
        assert time.monotonic() - started < 2.0
    finally:
        meta.close()
        server.stop()


def test_a_peer_whose_lease_a_restarted_process_took_over_is_dead_to_those_that_knew_the_old_one():
    """A restart takes the lease over the moment the dead process's expires, often before any
    peer looked: the torch transport's errors then named no one (the reader-kill fault test
    checked torch for timing only). A peer compared with who held the lease when its group
    formed is dead once another process holds it."""
    from weightsync.job.channel import JobChannel
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        first, watcher = JobChannel(meta, role="reader", rank=1), JobChannel(meta, role="writer", rank=0)
        first.register(host="h", group="default", layout=b"layout", lease=3.0)
        first.renew_lease()
        known = watcher.lease_holders()
        first.renew_lease(release=True)  # as if it died and its lease expired
        second = JobChannel(meta, role="reader", rank=1)
        second.register(host="h", group="default", layout=b"layout", lease=3.0)
        assert watcher.dead_peers("reader", [1], max_age=0.0) == {}  # alive, to whoever did not know the old one
        dead = watcher.dead_peers("reader", [1], max_age=0.0, known=known)
        assert list(dead) == [1] and f"pid {os.getpid()} on h) is gone: a restarted one holds the rank now" in dead[1]


def _writers(meta, n: int = 2):
    """JobChannels of ``n`` writers, registered with leases (no heartbeat thread: renewed by hand)."""
    from weightsync.job.channel import JobChannel

    out = [JobChannel(meta, role="writer", rank=r) for r in range(n)]
    for channel in out:
        channel.register(host="h", group="default", layout=b"layout", lease=3.0)
        channel.renew_lease()
    return out


def _restart(meta, rank: int):
    """A process that takes a dead writer's rank over, as ``SyncSession.register`` does."""
    from weightsync.job.channel import JobChannel

    channel = JobChannel(meta, role="writer", rank=rank)
    assert channel.register(host="h", group="default", layout=b"layout", lease=3.0)  # a restart
    channel.renew_lease()
    channel.rejoin()
    return channel


def test_a_writer_dead_before_it_joined_a_version_is_out_of_that_epoch_at_once_and_its_restart_joins_the_next():
    """Writer 1 died between versions and writer 0 started version 2 without it. Writer 0 waited
    for writer 1's part until its timeout, because a restart might still join the epoch (issue 36:
    a dead writer named only at the 15 s timeout on torch and NIXL). Now writer 0 closes writer 1
    out of the epoch and gives the version up within half a lease, naming it; the restart finds
    its seat there closed, never completes that try with writer 0's given-up part, and joins the
    version when writer 0 writes it again in a later epoch."""
    from weightsync.clock.deadline import Deadline
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.ports.coordinator import PeerDiedError

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writer0, writer1 = _writers(meta)
        writer0.lease_seconds = 0.5  # look at the leases every 0.25 s
        writer1.renew_lease(release=True)  # it died between versions
        epoch = writer0.decide_epoch(2, Deadline.after(5))
        meta.publish_version(2, "fp", writer_rank=0, num_writers=2, epoch=epoch)
        started = time.monotonic()
        with pytest.raises(PeerDiedError, match=rf"writer 1 cannot publish its part of version 2 in epoch {epoch}: "
                                                rf"it has no live process \(pid .*\) and never joined epoch {epoch}: "
                                                "it is out of that epoch"):
            writer0.wait_readers(min_version=2, readers=0, deadline=Deadline.after(10), epoch=epoch, writers=2)
        assert time.monotonic() - started < 2.0
        restart = _restart(meta, 1)
        with pytest.raises(TimeoutError, match=f"did not start version 2 in epoch {epoch + 1} or later"):
            restart.decide_epoch(2, Deadline.after(1.0))  # not the epoch it was closed out of
        writer0.advance_epoch(epoch)  # as a writer does on PeerDiedError
        again = writer0.decide_epoch(2, Deadline.after(5), writers=2)
        assert again > epoch
        assert restart.decide_epoch(2, Deadline.after(5)) == again


def test_a_restart_that_took_its_seat_first_is_waited_for_and_a_closed_seat_stays_closed():
    """The restart taking a dead writer's seat and a peer closing it are one compare-and-set each
    from open: whichever comes first decides, and the other sees it."""
    from weightsync.clock.deadline import Deadline
    from weightsync.job.epochs import SEAT_CLOSED, seat_mark
    from weightsync.job.keys import seat_key
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writer0, writer1 = _writers(meta)
        writer1.renew_lease(release=True)
        epoch = writer0.decide_epoch(2, Deadline.after(5))
        restart = _restart(meta, 1)
        assert restart.decide_epoch(2, Deadline.after(5)) == epoch  # the restart came first: it joins
        assert meta.counter(seat_key(epoch, 1)) == seat_mark(restart.incarnation)
        assert writer0.writers_out_of_epoch(epoch, [1]).get(1) is None  # and is waited for
        restart.renew_lease(release=True)  # it dies in the try: gone, by the process that joined
        assert "the process that joined it died" in (writer0.writers_out_of_epoch(epoch, [1]).get(1) or "")
        assert meta.counter(seat_key(epoch + 7, 1)) == 0
        assert "it is out of that epoch" in (writer0.writers_out_of_epoch(epoch + 7, [1]).get(1) or "")
        assert meta.counter(seat_key(epoch + 7, 1)) == SEAT_CLOSED
        assert "it was closed out of epoch" in (writer0.writers_out_of_epoch(epoch + 7, [1]).get(1) or "")


def test_the_writers_out_of_an_epoch_are_answered_for_all_of_them_on_one_read_of_the_leases():
    """A transport waiting on several writers asked about each one, each time on a fresh read of
    the lease table: one read per writer at every look (a rendezvous of hundreds of writers read
    the table hundreds of times a second). One call now answers for all of them on one read."""
    from weightsync.clock.deadline import Deadline
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writers = _writers(meta, 4)
        epoch = writers[0].decide_epoch(2, Deadline.after(5))
        for dead in (writers[1], writers[3]):
            dead.renew_lease(release=True)
        reads = []
        leases = meta.leases
        meta.leases = lambda: reads.append(1) or leases()  # type: ignore[method-assign]
        out = writers[0].writers_out_of_epoch(epoch, [1, 2, 3])
        assert sorted(out) == [1, 3] and all("never joined epoch" in why for why in out.values()), out
        assert len(reads) == 1


def test_writer_0_starts_a_version_only_once_every_writer_has_a_live_process():
    """A try without one of a fixed set of writers can never be published: writer 0 waits for the
    dead writer's restart before it decides, naming the dead writer at its deadline."""
    import threading

    from weightsync.clock.deadline import Deadline
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writer0, writer1 = _writers(meta)
        writer0.lease_seconds = 0.5
        writer1.renew_lease(release=True)
        with pytest.raises(TimeoutError, match=r"version 3 was not started: a writer has no live process and no "
                                               r"restart of it came in time \(writer 1: pid"):
            writer0.decide_epoch(3, Deadline.after(1.0), writers=2)
        assert meta.counter("versions/3/epoch") == 0  # nothing decided
        restarts = []

        def restart() -> None:
            time.sleep(0.5)
            restarts.append(_restart(meta, 1))

        thread = threading.Thread(target=restart)
        thread.start()
        try:
            epoch = writer0.decide_epoch(3, Deadline.after(10), writers=2)
        finally:
            thread.join(10)
        assert restarts[0].decide_epoch(3, Deadline.after(5)) == epoch


def test_a_writer_gives_a_version_up_at_once_when_a_peer_that_joined_it_died():
    from weightsync.clock.deadline import Deadline
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.ports.coordinator import PeerDiedError

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writer0, writer1 = _writers(meta)
        writer0.lease_seconds = 0.5
        epoch = writer0.decide_epoch(1, Deadline.after(5))
        assert writer1.decide_epoch(1, Deadline.after(5)) == epoch  # it joined version 1
        writer1.renew_lease(release=True)  # and died in it
        started = time.monotonic()
        with pytest.raises(PeerDiedError, match=rf"writer 1 cannot publish its part of version 1 in epoch {epoch}: "
                                                r"the process that joined it died \(pid"):
            writer0.wait_readers(min_version=1, readers=0, deadline=Deadline.after(10), epoch=epoch, writers=2)
        assert time.monotonic() - started < 2.0
        _restart(meta, 1)  # a restart holds the rank now, and never joins the try its predecessor joined
        with pytest.raises(PeerDiedError, match="the process that joined it is gone: a restarted one holds the rank"):
            writer0.wait_readers(min_version=1, readers=0, deadline=Deadline.after(10), epoch=epoch, writers=2)


def test_a_writer_gives_a_version_up_at_once_when_the_restart_of_a_peer_takes_part_only_in_later_epochs():
    """Writer 1 died between versions; writer 0 decided version 2's epoch, then a reader saw that
    epoch fail before writer 1's restart registered: the restart takes part from the next epoch
    on (``decide_epoch`` waits for a newer decision), so waiting for it in this one is useless."""
    from weightsync.clock.deadline import Deadline
    from weightsync.job.channel import JobChannel
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.ports.coordinator import PeerDiedError

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writer0, writer1 = _writers(meta)
        writer0.lease_seconds = 0.5
        writer1.renew_lease(release=True)
        epoch = writer0.decide_epoch(2, Deadline.after(5))
        JobChannel(meta, role="reader", rank=0).advance_epoch(epoch)
        assert _restart(meta, 1).min_epoch == epoch + 1
        started = time.monotonic()
        with pytest.raises(PeerDiedError, match=rf"its process \(pid {os.getpid()} on h.*\) left epoch {epoch}: it "
                                                "takes part only in later epochs"):
            writer0.wait_readers(min_version=2, readers=0, deadline=Deadline.after(10), epoch=epoch, writers=2)
        assert time.monotonic() - started < 2.0


def test_a_restarted_writer_joins_a_try_decided_after_its_predecessors_last_epoch_though_the_epoch_moved_on():
    """Writer 1 and reader 1 died in version 1 together (issue 36's kill-both case, NIXL push,
    3 runs in 5). Writer 0 failed version 1 and decided version 2 in the next epoch at once; the
    restarted reader's registration then moved the job's epoch, and the restarted writer, which
    took part only from the epoch it found, waited for a newer decision while writer 0 waited for
    it in the one it had made, until their timeouts. The restart takes part from the epoch after
    the newest its predecessor joined a try in: no connection of a later epoch includes it."""
    from weightsync.clock.deadline import Deadline
    from weightsync.job.channel import JobChannel
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writer0, writer1 = _writers(meta)
        first = writer0.decide_epoch(1, Deadline.after(5))
        assert writer1.decide_epoch(1, Deadline.after(5)) == first  # writer 1 joined version 1...
        writer1.renew_lease(release=True)  # ...and died in it
        writer0.advance_epoch(first)  # writer 0 failed version 1
        second = writer0.decide_epoch(2, Deadline.after(5))
        assert second == first + 1
        reader = JobChannel(meta, role="reader", rank=1)  # the restarted reader moves the job on
        reader.register(host="h", group="default", layout=b"reader", lease=3.0)
        reader.rejoin()
        assert writer0.current_epoch() == second + 1
        restart = _restart(meta, 1)
        assert restart.min_epoch == second
        assert restart.decide_epoch(2, Deadline.after(2)) == second  # writer 0's decision, not a wait
        # and never an epoch its predecessor joined a try in: a restart of this one (it joined `second`)
        restart.renew_lease(release=True)
        assert _restart(meta, 1).min_epoch == second + 1


def test_a_writer_waiting_for_writer_0_to_start_a_version_gives_it_up_once_writer_0_writes_a_newer_one():
    """Writer 1 failed version 1 (its restart, or its retry, joins it only in a newer epoch) and its
    trainer writes version 1 again, while writer 0's went on to version 2: writer 0 never starts
    version 1 again, and writer 1 waited for it until its timeout (test_faults.py's "only the killed
    writer restarts" case: 20 s per run). It gives the version up within half a lease of writer 0's
    newer decision, and its next write joins writer 0's version."""
    from weightsync.clock.deadline import Deadline
    from weightsync.job.epochs import VersionSupersededError
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writer0, writer1 = _writers(meta)
        first = writer0.decide_epoch(1, Deadline.after(5))
        assert writer1.decide_epoch(1, Deadline.after(5)) == first
        writer1.advance_epoch(first)  # writer 1 failed version 1
        second = writer0.decide_epoch(2, Deadline.after(5))  # writer 0's trainer went on
        started = time.monotonic()
        with pytest.raises(VersionSupersededError, match="writer 1: writer 0 writes version 2 now, so version 1 is "
                                                         "superseded: writer 0 will not start it again"):
            writer1.decide_epoch(1, Deadline.after(10))  # writer 1's trainer writes step 1 again
        assert time.monotonic() - started < 3.0
        assert writer1.decide_epoch(2, Deadline.after(5)) == second
        # writer 0 behind (it has not decided version 3 yet): writer 1 waits for it, as before
        with pytest.raises(TimeoutError, match="did not start version 3") as caught:
            writer1.decide_epoch(3, Deadline.after(1.0))
        assert not isinstance(caught.value, VersionSupersededError)


def test_a_job_restarted_from_an_older_checkpoint_waits_for_writer_0s_restart_not_its_dead_process():
    """The whole job stops after version 3 and resumes from the checkpoint of step 1: the record
    that writer 0 wrote version 3 is its dead process's, and says nothing of the restart's
    versions, so restarted writer 1 waits for restarted writer 0 to start version 1 (it gave
    version 1 up at once on the first cut of the superseding rule, which read a bare counter)."""
    import threading

    from weightsync.clock.deadline import Deadline
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writer0, writer1 = _writers(meta)
        for version in (1, 2, 3):
            epoch = writer0.decide_epoch(version, Deadline.after(5))
            assert writer1.decide_epoch(version, Deadline.after(5)) == epoch
        writer0.renew_lease(release=True)
        writer1.renew_lease(release=True)
        restart0, restart1 = _restart(meta, 0), _restart(meta, 1)
        decided: list[int] = []

        def writer_0_resumes() -> None:
            time.sleep(2.0)  # past writer 1's first look at what writer 0 writes (half a lease)
            decided.append(restart0.decide_epoch(1, Deadline.after(5)))

        thread = threading.Thread(target=writer_0_resumes)
        thread.start()
        try:
            epoch = restart1.decide_epoch(1, Deadline.after(10))  # writer 0's restart's decision, not a give-up
        finally:
            thread.join(10)
        assert decided == [epoch]




def test_writer_0_retrying_a_version_the_others_went_past_gives_it_up_at_once():
    """Writer 0's trainer writes a failed version again while writer 1's went on to the next
    (a restarted rank resumes at a later step): each waited for the other until its timeout.
    Writer 0 now gives the older version up: at once when it retries and writer 1 already waits
    for the newer one, else within half a lease of its waits (publishes, rendezvous), and its next
    write joins writer 1's version."""
    import threading

    from weightsync.clock.deadline import Deadline
    from weightsync.job.epochs import VersionSupersededError
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.ports.coordinator import PeerDiedError

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        writer0, writer1 = _writers(meta)
        writer0.lease_seconds = 0.5
        first = writer0.decide_epoch(1, Deadline.after(5))
        assert writer1.decide_epoch(1, Deadline.after(5)) == first
        writer0.advance_epoch(first)  # both failed version 1
        writer1.advance_epoch(first)
        retry = writer0.decide_epoch(1, Deadline.after(5), writers=2)  # writer 1 has not gone on yet
        decided: list[int] = []
        thread = threading.Thread(target=lambda: decided.append(writer1.decide_epoch(2, Deadline.after(10))))
        thread.start()  # writer 1's trainer went on to version 2: it waits for writer 0 to start it
        try:
            time.sleep(0.3)  # writer 1 records what it writes before it waits
            for channel in (writer0, writer1):  # no heartbeat threads here: renewed by hand
                channel.renew_lease()
            started = time.monotonic()
            with pytest.raises(PeerDiedError, match=rf"writer 1 cannot publish its part of version 1 in epoch {retry}: "
                                                    "it writes version 2 now, so version 1 is superseded"):
                writer0.wait_readers(min_version=1, readers=0, deadline=Deadline.after(10), epoch=retry, writers=2)
            assert time.monotonic() - started < 2.0
            assert "superseded" in (writer0.writers_out_of_epoch(retry, [1]).get(1) or "")  # the transports' question
            writer0.advance_epoch(retry)
            for channel in (writer0, writer1):
                channel.renew_lease()
            with pytest.raises(VersionSupersededError, match="writer 0: writer 1 writes version 2 now, so version 1 "
                                                             "is superseded"):
                writer0.decide_epoch(1, Deadline.after(5), writers=2)  # its trainer tries once more: at once
            epoch = writer0.decide_epoch(2, Deadline.after(5), writers=2)
        finally:
            thread.join(10)
        assert decided == [epoch]
