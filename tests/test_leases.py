"""Leases on the meta server (:mod:`weightsync.meta.leases`): a stall of the server itself does
not expire the leases of live peers, while a peer that stops renewing still dies on time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from weightsync.meta.leases import Leases


def test_a_stalled_server_does_not_expire_live_leases_but_a_silent_peer_still_dies():
    async def run() -> tuple[bool, bool]:
        leases = Leases()
        clock = asyncio.create_task(leases.keep_time())
        await asyncio.sleep(0.05)
        await leases.acquire("j", "writer", 0, incarnation="a", ttl=0.5, pid=1, host="h", wait=0.0)
        time.sleep(1.0)  # the event loop stands still: the heartbeats of that time wait unread
        after_stall = leases.table("j")[0].alive
        await asyncio.sleep(0.8)  # the loop runs and no heartbeat comes: the peer is dead
        after_silence = leases.table("j")[0].alive
        clock.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await clock
        return after_stall, after_silence

    assert asyncio.run(run()) == (True, False)


def test_without_the_clock_an_unrenewed_lease_expires_after_its_ttl():
    async def run() -> bool:
        leases = Leases()
        await leases.acquire("j", "reader", 1, incarnation="a", ttl=0.2, pid=1, host="h", wait=0.0)
        time.sleep(0.3)
        row = leases.table("j")[0]
        return row.alive or "last heartbeat" not in row.detail

    assert asyncio.run(run()) is False


def test_a_rank_leaves_in_under_two_seconds_after_its_meta_server_stopped():
    """Shutdown in any order (issue 28 §5): a reader or writer that closes after the meta server
    stopped (vLLM's workers after the trainer engine's embedded server, an operator stopping
    `weightsync meta-server` first) used to stall 30 s and more, its heartbeat and the release
    of its lease retrying a server that is gone for good."""
    from weightsync.job import JobChannel
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
    from weightsync.job import JobChannel
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
