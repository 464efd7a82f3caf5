"""The asyncio etcd client (:class:`~weightsync.meta.etcd.async_client.AsyncEtcdMetaClient`) on a real
3-member etcd cluster: what it registers is what the sync client and the embedded server's roster
show; a barrier waits on a watch (counted in the members' own gRPC metrics) and releases when the
last rank registers; a killed member is failed over; a lost quorum is named within the deadline;
wrong input is named before anything is written.

Every test bounds its waits (``asyncio.wait_for``, the clients' timeouts) and stops the clusters it
started; the members' metrics are read over plain HTTP.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from etcd_helpers import etcd_cluster, meta
from test_meta_server import reader, writer
from weightsync.meta import wire
from weightsync.meta.calls import ServerStateLostError
from weightsync.meta.etcd import ops
from weightsync.meta.etcd.async_client import AsyncEtcdMetaClient
from weightsync.meta.etcd.ops import EtcdUnavailableError
from weightsync.meta.records import ParticipantTable
from weightsync.meta.state import MetaState

pytestmark = [pytest.mark.timeout(90), pytest.mark.xdist_group("etcd")]
_jobs = iter(range(1_000_000))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = etcd_cluster(tmp_path_factory.mktemp("etcd-async"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def fresh(tmp_path):
    """A cluster of its own, for a test that kills members."""
    c = etcd_cluster(tmp_path / "etcd")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def job(request):
    return f"a{next(_jobs)}-{request.node.name[:40]}"


def run(coro, seconds: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, seconds))


def grpc_calls(cluster) -> dict[str, int]:
    """gRPC calls the running members started, by method (a gateway request is one of them)."""
    counts: dict[str, int] = {}
    for i, url in enumerate(cluster.urls):
        if cluster.procs[i] is None:
            continue
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("grpc_server_started_total{"):
                    method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
                    counts[method] = counts.get(method, 0) + int(float(line.rsplit(" ", 1)[1]))
    return counts


def embedded_roster(job: str, people) -> ParticipantTable:
    """The roster the embedded meta server answers for these registrations (its own state and encoding)."""
    async def register() -> bytes:
        state = MetaState()
        for p in people:
            await state.register(job, p.role, p.rank, group=p.group, host=p.host, endpoints=p.endpoints,
                                 layout=p.layout)
        return state.roster(job, msgpack_=True)
    return ParticipantTable.from_wire(wire.unpack(asyncio.run(register())))


# --- what it registers ------------------------------------------------------------------------------

def test_async_joins_are_the_roster_the_sync_client_and_the_embedded_server_show(cluster, job):
    people = [writer(r) for r in range(6)] + [reader(r) for r in range(3)]

    async def main() -> list[ParticipantTable]:
        clients = [AsyncEtcdMetaClient(cluster.address, job=job, timeout=10) for _ in people]
        try:
            await clients[0].put_document("model/cfg", b"{config}")
            return await asyncio.gather(*(c.join(p, writers=6, readers=3, timeout=20, documents=["model/cfg"])
                                          for c, p in zip(clients, people, strict=True)))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    tables = run(main())
    expected = embedded_roster(job, people)
    with meta(cluster.address, job) as sync:
        seen = sync.table(documents=["model/cfg"])
        assert sync.register(writer(2)) is False  # the async client's registration, to the sync one
        assert sync.get_document("model/cfg") == b"{config}"
    for table in [*tables, seen]:
        assert table.participants() == expected.participants() == sorted(people, key=lambda p: (p.role, p.rank))
        assert table.layouts("writer") == expected.layouts("writer")
        assert table.documents == {"model/cfg": b"{config}"}

    async def again() -> None:  # and the other way: the sync client's registration, to the async one
        async with AsyncEtcdMetaClient(cluster.address, job=job, timeout=10) as c:
            assert await c.register(writer(2)) is False
            with pytest.raises(ValueError, match=r"writer rank 2 of job .* is already registered with different "
                                                 r"data \(host: 'node-1' != 'elsewhere'\)"):
                await c.register(writer(2, host="elsewhere"))
            assert await c.participants("reader") == [reader(0), reader(1), reader(2)]
    run(again())


def test_a_barrier_waits_on_one_watch_per_rank_and_releases_when_the_last_registers(cluster, job, monkeypatch):
    from weightsync.meta.etcd import barrier

    monkeypatch.setattr(barrier, "PROGRESS_SECONDS", 60.0)  # no progress read within this test, however slow
    waiting = 7

    async def main() -> float:
        clients = [AsyncEtcdMetaClient(cluster.address, job=job, timeout=10) for _ in range(waiting + 1)]
        try:
            base = grpc_calls(cluster).get("Watch", 0)
            joins = [asyncio.ensure_future(c.join(writer(r), writers=waiting + 1, readers=0, timeout=20))
                     for r, c in enumerate(clients[:waiting])]
            for _ in range(100):  # until every waiter registered and watches (the members count their watches)
                await asyncio.sleep(0.1)
                if grpc_calls(cluster).get("Watch", 0) - base >= waiting:
                    break
            before = grpc_calls(cluster)
            assert before.get("Watch", 0) - base == waiting
            await asyncio.sleep(1.5)
            assert not any(j.done() for j in joins)
            assert grpc_calls(cluster) == before, "a waiting rank sent requests: it polls instead of watching"
            t0 = time.monotonic()
            last = await clients[waiting].join(writer(waiting), writers=waiting + 1, readers=0, timeout=20)
            tables = await asyncio.gather(*joins)
            released = time.monotonic() - t0
            assert all(t.participants() == last.participants() for t in tables) and last.count("writer") == 8
            after = grpc_calls(cluster)
            # the last rank: its registration, one read of every registration, the roster stored; the
            # waiters: nothing (the watch event carried the roster)
            assert after.get("Txn", 0) - before.get("Txn", 0) == 3, (before, after)
            assert after.get("Watch", 0) == before.get("Watch", 0)
            return released
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    assert run(main()) < 3.0


def test_a_barrier_times_out_naming_the_missing_and_a_late_rank_reads_the_stored_roster(cluster, job):
    async def main() -> None:
        async with AsyncEtcdMetaClient(cluster.address, job=job, timeout=10) as c, \
                AsyncEtcdMetaClient(cluster.address, job=job, timeout=10) as d, \
                AsyncEtcdMetaClient(cluster.address, job=job, timeout=10) as late:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"1/2 writers and 0/1 readers registered; missing writer ranks "
                                                   r"\[1\] \(1\) and reader ranks \[0\] \(1\)"):
                await c.join(writer(0), writers=2, readers=1, timeout=0.5)
            assert time.monotonic() - t0 < 2.5
            await c.put_document("late", b"x")
            tables = await asyncio.gather(c.join(writer(1), writers=2, readers=1, timeout=10),
                                          d.join(reader(0), writers=2, readers=1, timeout=10))
            assert all(t.count("writer") == 2 and t.count("reader") == 1 for t in tables)
            # a rank that never registered, after the barrier: the stored roster, the documents read now
            table = await late.wait_table(writers=2, readers=1, timeout=5, documents=["late", "absent"])
            assert table.documents == {"late": b"x", "absent": None}
            assert table.participants() == tables[0].participants()

    run(main())


# --- faults ------------------------------------------------------------------------------------------

def test_a_member_killed_while_ranks_wait_is_failed_over(fresh):
    ranks = 6

    async def main() -> None:
        clients = [AsyncEtcdMetaClient(fresh.address, job="kill", timeout=15) for _ in range(ranks)]
        # a follower: a proposal in flight when the leader dies waits out etcd's request timeout (5 s),
        # which tests/test_meta_etcd_faults.py covers with the sync client
        victim = next(i for i in range(3) if i != fresh.leader())
        try:
            for i, c in enumerate(clients):
                c.kv._current = (victim + i) % 3  # the member each asks first: two ranks on each
            joins = [asyncio.ensure_future(c.join(writer(r), writers=ranks, readers=0, timeout=30))
                     for r, c in enumerate(clients[:-1])]
            await asyncio.sleep(1.0)
            fresh.kill(victim)  # two waiters' watch streams break; the last rank asks it first
            clients[-1].kv._current = victim
            t0 = time.monotonic()
            last = await clients[-1].join(writer(ranks - 1), writers=ranks, readers=0, timeout=30)
            tables = await asyncio.wait_for(asyncio.gather(*joins), 20)
            assert all(t.participants() == last.participants() for t in tables) and last.count("writer") == ranks
            assert clients[-1].kv._current != victim  # it answered through another member
            assert time.monotonic() - t0 < 5.0
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    run(main(), 60)


def test_without_quorum_a_call_fails_within_its_deadline_naming_the_lost_quorum(fresh):
    async def main() -> None:
        async with AsyncEtcdMetaClient(fresh.address, job="quorum", timeout=2.0) as c:
            await c.put_document("k", b"v")
            leader = fresh.leader()
            fresh.kill(leader)
            fresh.kill((leader + 1) % 3)
            for call in (lambda: c.join(writer(0), writers=1, readers=0, timeout=30),
                         lambda: c.get_document("k")):
                t0 = time.monotonic()
                with pytest.raises(EtcdUnavailableError, match=r"could not .* within the deadline: no member answered "
                                                               r"\(.*\)\. The cluster has lost quorum or is "
                                                               r"unreachable: etcd serves only while a majority "
                                                               r"\(2 of 3\)"):
                    await call()
                assert time.monotonic() - t0 < 2.0 + 1.5  # the client's timeout, plus at most one request's slack

    run(main(), 30)


# --- wrong input and a replaced store ---------------------------------------------------------------

def test_wrong_input_is_named_before_anything_is_written(cluster, job):
    with pytest.raises(ValueError, match=r"an etcd address starts with etcd:// or etcds://"):
        AsyncEtcdMetaClient("http://127.0.0.1:2379", job=job)
    with pytest.raises(ValueError, match=r"timeout must be positive seconds, got 0"):
        AsyncEtcdMetaClient(cluster.address, job=job, timeout=0)

    async def main() -> None:
        async with AsyncEtcdMetaClient(cluster.address, job=job, timeout=5) as c:
            with pytest.raises(TypeError, match=r"register takes a Participant\(role, rank, group, host, endpoints, "
                                                r"layout\), not dict"):
                await c.join({"role": "writer", "rank": 0}, writers=1, readers=0, timeout=1)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=r"writers must be an int >= 0, got -1"):
                await c.join(writer(0), writers=-1, readers=0, timeout=1)
            with pytest.raises(TypeError, match=r"documents is a sequence of keys, e.g. documents=\[key\]"):
                await c.join(writer(0), writers=1, readers=0, timeout=1, documents="model/cfg")
            with pytest.raises(TypeError, match=r"document values are bytes"):
                await c.put_document("k", "text")  # type: ignore[arg-type]
            assert await c.participants() == []  # nothing was written
            # a roster someone else wrote under weightsync's prefix is named, not decoded
            await c.kv.txn([], [ops.put(c.keys.roster, b"not a roster")])
            with pytest.raises(ValueError, match=r"etcd key '.*/part/roster' holds a malformed roster .*only "
                                                 r"weightsync may write under"):
                await c.table()

    run(main())


def test_a_wiped_store_is_noticed_by_an_async_client_that_pinned_it(cluster, job):
    async def main() -> None:
        async with AsyncEtcdMetaClient(cluster.address, job=job, timeout=5) as c:
            instance = await c.pin_instance()
            await c.register(writer(0))
            await c.kv.txn([], [ops.delete(c.etcd.prefix + "/", prefix=True)])  # the store wiped
            with pytest.raises(ServerStateLostError, match=rf"instance {instance} is now gone"):
                await c.register(writer(1))

    run(main())
