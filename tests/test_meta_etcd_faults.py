"""Faults of the etcd coordinator, each on a fresh 3-member cluster: its leader killed while versions
flow, its quorum lost and regained, and a client cut off from it.

Every wait is bounded: the cluster's members are killed and restarted by the test, and what the
job sees is read from etcd (a test waits for a lease to expire with a deadline, as a peer would).
"""

from __future__ import annotations

import time

import pytest

from etcd_helpers import etcd_cluster, meta, run_sync
from test_meta_server import reader

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("etcd")]


@pytest.fixture
def cluster(tmp_path):
    c = etcd_cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def _until(what: str, check, timeout: float = 10.0):
    """``check()``'s first true value within ``timeout`` seconds (etcd's lease expiry has no event a
    client outside the job can wait on without a watch of its own; this test looks every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_the_job_carries_on_when_the_etcd_leader_is_killed(cluster):
    versions, timeout = [0, 1, 2, 3, 4], 20.0
    killed: list[int] = []

    def kill_leader(version: int) -> None:
        if version == 1:
            killed.append(cluster.leader())
            cluster.kill(killed[0])

    out = run_sync(cluster.address, versions, job="leader", timeout=timeout, after_write=kill_leader)
    assert killed and not out.errors, out.errors
    # every version acknowledged to the writers reached every reader once, in order, bitwise
    assert out.reads == {0: versions, 1: versions} and all(all(e) for e in out.exact.values())
    assert all([v for v, _ in out.writes[r]] == versions for r in (0, 1))
    assert max(seconds for r in (0, 1) for _, seconds in out.writes[r]) < timeout
    assert cluster.leader() != killed[0]
    with meta(cluster.address, "leader") as c:
        latest = c.latest_version()
        assert latest is not None and latest.version == versions[-1]


def test_without_quorum_calls_fail_within_their_deadline_naming_it_and_the_next_version_succeeds(cluster):
    from weightsync.meta.etcd.ops import EtcdUnavailableError

    with meta(cluster.address, "quorum", timeout=3.0) as c:
        c.register(reader(0))
        assert c.publish_version(1, "fp", writer_rank=0, num_writers=1) is not None
        leader = cluster.leader()
        cluster.kill(leader)
        cluster.kill((leader + 1) % 3)
        for call in (lambda: c.publish_version(2, "fp", writer_rank=0, num_writers=1),
                     lambda: c.report_applied(0, 1)):
            t0 = time.monotonic()
            with pytest.raises(EtcdUnavailableError, match=r"could not .* within the deadline: no member answered "
                                                           r"\(.*\)\. The cluster has lost quorum or is unreachable: "
                                                           r"etcd serves only while a majority \(2 of 3\)"):
                call()
            assert time.monotonic() - t0 < 3.0 + 1.5  # the client's timeout, plus at most one request's slack
        cluster.start(leader)  # a member returns: a majority again
        c.timeout = c.kv.timeout = 15.0  # the election after it may take a few seconds on a loaded machine
        info = c.publish_version(2, "fp", writer_rank=0, num_writers=1)
        assert info is not None and info.version == 2 and c.latest_version() == info


def test_a_client_cut_off_from_etcd_is_named_dead_and_rejoins_as_a_new_incarnation(cluster):
    from weightsync.job.channel import JobChannel

    ports = cluster.client_ports
    cut_meta = meta(f"etcd://127.0.0.1:{ports[2]}", "cut", timeout=2.0)  # reaches member 2 only
    peer_meta = meta(f"etcd://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", "cut")
    again_meta = meta(f"etcd://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", "cut")
    cut = JobChannel(cut_meta, role="writer", rank=0)
    peer = JobChannel(peer_meta, role="reader", rank=0)
    again = JobChannel(again_meta, role="writer", rank=0)
    try:
        assert cut.register(host="n-cut", group="train", layout=b"L", lease=1.0) is False
        cut.start_heartbeat()
        peer.register(host="n-peer", group="rollout", layout=b"R", lease=1.0)
        known = peer.lease_holders()
        assert known[("writer", 0)].incarnation == cut.incarnation and peer.dead_peers("writer", [0]) == {}
        cluster.kill(2)  # the cut-off client's only member: its heartbeats reach nobody
        dead = _until("peers name the cut-off writer dead", lambda: peer.dead_peers("writer", [0], max_age=0))
        assert "pid" in dead[0] and "n-cut" in dead[0] and "expired" in dead[0], dead
        # it rejoins as a new process (a new incarnation) over members it reaches: a restart of the rank
        assert again.register(host="n-cut", group="train", layout=b"L", lease=1.0) is True
        again.start_heartbeat()
        assert peer.dead_peers("writer", [0], max_age=0) == {}
        assert "a restarted one holds the rank now" in peer.dead_peers("writer", [0], known=known, max_age=0)[0]
        # the old process, once it reaches etcd again, learns that the rank is no longer its own
        cluster.start(2)
        lost = _until("the old incarnation learns it lost the rank", lambda: cut.lost, timeout=15.0)
        assert "is held by another live process" in lost and "n-cut" in lost
    finally:
        for channel in (cut, peer, again):
            channel.stop_heartbeat(release=False)
        for m in (cut_meta, peer_meta, again_meta):
            m.close()




def test_without_quorum_write_and_update_fail_naming_it_and_the_job_resumes_when_a_member_returns(cluster):
    import threading

    from etcd_helpers import CONFIG, SOURCE, TARGET, values
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.torch_layout import fill_from_canonical

    config = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=15.0, job="quorum-job")
    source = ShardedSource(SOURCE.replace("tp=2", "tp=1"), CONFIG, 0)
    engine = ShardedEngine(TARGET.replace("replicas=2", "replicas=1"), CONFIG, 0)
    with WeightWriter(source, rank=0, config=config, meta=meta(cluster.address, "quorum-job", 3.0)) as w, \
            WeightReader(engine, rank=0, config=config, meta=meta(cluster.address, "quorum-job", 3.0)) as r:
        def sync(version: int) -> list[BaseException | int]:
            got: list[BaseException | int] = []

            def update() -> None:
                try:
                    got.append(r.update(version, timeout=config.timeout).version)
                except BaseException as exc:
                    got.append(exc)
            t = threading.Thread(target=update)
            t.start()
            fill_from_canonical(source.layout(), source.tensors(), values(version))
            try:
                w.write(version)
                got.append(version)
            except BaseException as exc:
                got.append(exc)
            t.join(30)
            assert not t.is_alive()
            return got

        assert sync(0) == [0, 0]
        leader = cluster.leader()
        cluster.kill(leader)
        cluster.kill((leader + 1) % 3)
        t0 = time.monotonic()
        failed = sync(1)
        assert time.monotonic() - t0 < config.timeout + 6.0
        for outcome in failed:
            assert isinstance(outcome, BaseException), failed
            chain, e = [], outcome
            while e is not None:
                chain.append(str(e))
                e = e.__cause__ or e.__context__
            assert any("lost quorum" in text for text in chain), chain
        cluster.start(leader)
        cluster.leader(timeout=20)
        assert sync(2) == [2, 2]  # the next version goes through


def test_churn_of_readers_under_a_quorum_runs_on_etcd_as_on_the_meta_server(cluster, tmp_path):
    """Issue 38: the fleet churn of the fault suite (tests/test_faults.py::churn), coordinated by
    etcd: readers SIGKILLed and replaced at random while versions flow under ``quorum=2`` of 4;
    every version completes, bitwise, and every reader ends on the last one."""
    from test_faults import LAUNCHED, churn, creator, shm_files

    LAUNCHED.clear()
    churn({"transport": "shm"}, tmp_path, writers=1, readers=4, versions=16, quorum=2, every=1.5, seed=38,
          coordinator=cluster.address)
    assert {n for n in shm_files() if creator(n) in LAUNCHED} == set()


@pytest.mark.heavy  # 20 s; the protocol is the coordinator's calls, which the churn test above runs on etcd, and
# the elastic set runs on the meta server by default: tests/test_faults.py::test_elastic_readers_join_and_leave_while_versions_flow_and_every_write_completes
def test_elastic_readers_join_and_leave_on_etcd_as_on_the_meta_server(cluster, tmp_path):
    """Issue 36's elastic readers (``num_readers=None``) coordinated by etcd: readers join on new
    seats and one dies while versions flow; every write completes, bitwise (tests/test_faults.py::elastic)."""
    from test_faults import LAUNCHED, creator, elastic, shm_files

    LAUNCHED.clear()
    elastic({"transport": "shm"}, tmp_path, coordinator=cluster.address)
    assert {n for n in shm_files() if creator(n) in LAUNCHED} == set()
