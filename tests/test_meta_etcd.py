"""The coordinator port on a real 3-member etcd cluster: the meta server's contract scenarios, the
etcd address, leases, the store instance, and one sync job end to end.

The port-level scenarios of tests/test_meta_server.py run here unchanged against
:class:`~weightsync.meta.etcd.client.EtcdMetaClient` (imported below: pytest runs them with
this module's ``client`` fixture), so both backends pass one contract.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from etcd_helpers import etcd_cluster, meta, require_etcd, run_sync
from test_meta_server import (  # noqa: F401 (the shared contract scenarios, collected here again)
    reader,
    test_barrier_waits_then_times_out_naming_the_missing,
    test_counters_compare_and_set_and_long_poll,
    test_documents_put_get_and_long_poll,
    test_publish_needs_every_writer_with_one_fingerprint,
    test_readers_report_lag_and_wait,
    test_register_fetch_and_conflict,
    test_wait_version_times_out_with_none,
    writer,
)
from weightsync.meta.config import MetaEnv
from weightsync.meta.etcd.address import EtcdAddress
from weightsync.meta.etcd.ops import EtcdUnavailableError

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("etcd")]
_jobs = iter(range(1_000_000))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = etcd_cluster(tmp_path_factory.mktemp("etcd"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def client(cluster, request):
    """An etcd client on a job of its own: tests share the cluster, never a namespace."""
    job = f"t{next(_jobs)}-{request.node.name[:40].replace('[', '-').replace(']', '')}"
    with meta(cluster.address, job) as c:
        yield c


# --- the address -------------------------------------------------------------------------------------

def test_an_etcd_address_is_parsed_and_a_malformed_one_is_named(tmp_path):
    a = EtcdAddress.parse("etcd://h1:2379,h2:2379,[::1]:2380/mine")
    assert a.endpoints == (("h1", 2379), ("h2", 2379), ("::1", 2380)) and a.prefix == "mine" and not a.tls
    assert a.urls()[2] == "http://[::1]:2380"
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    b = EtcdAddress.parse(f"etcd://alice:s3cret@h1:2379?ca={ca}")
    assert (b.user, b.password, b.tls, b.ca) == ("alice", "s3cret", True, str(ca)) and "s3cret" not in str(b)
    for bad, why in [("etcd://", r"endpoint '' is not host:port"),
                     ("etcd://h1", r"endpoint 'h1' is not host:port"),
                     ("etcd://h1:2379,h1:2379", "names an endpoint twice"),
                     ("etcd://h1:99999", "is not host:port"),
                     ("etcd://u:pw@h1:2379?certificate=x", r"'etcd://u:\*\*\*@h1:2379\?certificate=x': unknown option"),
                     ("etcd://h1:2379?cert=/nonexistent", "is not a readable file"),
                     ("etcd://h1:2379/bad prefix", "key prefix 'bad prefix'")]:
        with pytest.raises(ValueError, match=why):
            EtcdAddress.parse(bad)
    env = MetaEnv.from_env({"WEIGHTSYNC_META_ADDR": "etcd://h1:2379,h2:2379", "WEIGHTSYNC_ETCD_PASSWORD": "pw"})
    assert env.address == "etcd://h1:2379,h2:2379" and env.etcd_password == "pw"
    with pytest.raises(ValueError, match=r"WEIGHTSYNC_ETCD_PASSWORD is set but the etcd address names no user"):
        EtcdAddress.parse("etcd://h1:2379").with_password("pw")
    with pytest.raises(ValueError, match="endpoint 'h1:x' is not host:port"):
        MetaEnv.from_env({"WEIGHTSYNC_META_ADDR": "etcd://h1:x"})


def test_plain_http_to_tls_members_is_named_however_the_library_words_the_hang_up():
    """etcd3gw (requests) and aiohttp word a TLS member's hang-up on plain HTTP differently, and
    the member either closes before answering or resets with our request unread (both seen here)."""
    from weightsync.meta.etcd.ops import tls_advice

    for said in ("ConnectionFailedError: ('Connection aborted.', RemoteDisconnected('Remote end closed connection "
                 "without response'))",
                 "ConnectionFailedError: ('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))",
                 "ServerDisconnectedError: Server disconnected",
                 "ClientOSError: [Errno 104] Connection reset by peer"):
        assert "as a member that speaks TLS does to plain HTTP" in (tls_advice(False, [said, said]) or ""), said
    assert tls_advice(False, ["ClientConnectorError: Cannot connect to host 127.0.0.1:1 [Connection refused]"]) is None


def test_the_gateways_failed_dial_is_named_however_the_race_words_it():
    """Under --client-cert-auth with a member certificate that does not allow client auth, etcd's
    gateway fails to dial its own gRPC server; which words it answers with is a race (each seen here)."""
    from weightsync.meta.etcd.ops import tls_advice

    for said in ('rpc error: code = Unavailable desc = connection closed',
                 'rpc error: code = Unavailable desc = "transport: failed to write client preface"',
                 "write tcp 127.0.0.1:34230->127.0.0.1:46983: use of closed network connection"):
        assert "must then allow client auth as well" in (tls_advice(True, [said]) or ""), said
    assert tls_advice(True, ["ClientConnectorError: Cannot connect to host 127.0.0.1:1 [Connection refused]"]) is None


def test_open_meta_picks_the_backend_from_the_address(monkeypatch):
    require_etcd()
    from weightsync.meta.client import MetaClient, open_meta
    from weightsync.meta.etcd.client import EtcdMetaClient

    monkeypatch.setenv("WEIGHTSYNC_META_ADDR", "etcd://127.0.0.1:1,127.0.0.1:2")
    with open_meta(job="j") as c:
        assert isinstance(c, EtcdMetaClient) and c.address == "etcd://127.0.0.1:1,127.0.0.1:2/weightsync"
    with pytest.raises(ValueError, match=r"is an etcd cluster, which MetaClient does not speak: use "
                                         r"weightsync.meta.open_meta"):
        MetaClient("etcd://127.0.0.1:1", token="abcdefgh")


# --- etcd's own -------------------------------------------------------------------------------------

def test_a_wiped_store_is_noticed_by_every_client_that_pinned_it(cluster, client):
    instance = client.pin_instance()
    client.register(writer(0))
    assert client.pin_instance() == instance  # pinning again finds the same store
    from weightsync.meta.calls import ServerStateLostError
    from weightsync.meta.etcd import ops

    client.kv.txn([], [ops.delete(client.etcd.prefix + "/", prefix=True)])  # the store wiped
    with pytest.raises(ServerStateLostError, match=r"the store is not the one this client registered with \(instance "
                                                   rf"{instance} is now gone\)"):
        client.publish_version(1, "fp", writer_rank=0, num_writers=1)


def test_a_lease_is_held_renewed_refused_to_a_second_process_and_released(client):
    assert client.acquire_lease("writer", 0, incarnation="a1", ttl=1, pid=7, host="n0") is False
    assert client.acquire_lease("writer", 0, incarnation="a1", ttl=1, pid=7, host="n0") is False  # renewal
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"writer rank 0 of job .* is held by another live process \(pid 7 on n0, its "
                                         r"etcd lease \(ttl 1 s\) is alive\): two processes claim the same rank \(pid 8 "
                                         r"on n1 asked\)"):
        client.acquire_lease("writer", 0, incarnation="b1", ttl=1, pid=8, host="n1", wait=0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    [row] = client.leases()
    assert (row.role, row.rank, row.incarnation, row.alive, row.released) == ("writer", 0, "a1", True, False)
    client.acquire_lease("writer", 0, incarnation="a1", ttl=1, pid=7, host="n0", release=True)
    [row] = client.leases()
    assert (row.alive, row.released) == (False, True) and "released its lease: it left the job" in row.detail
    assert client.acquire_lease("writer", 0, incarnation="b1", ttl=1, pid=8, host="n1") is True  # took over


def test_a_barrier_of_many_ranks_passes_at_once_and_every_rank_reads_one_roster(cluster, client):
    ranks = 24
    clients = [meta(cluster.address, client.job) for _ in range(ranks)]
    tables: list[object] = [None] * ranks

    def join(i: int) -> None:
        role, rank = ("writer", i) if i < ranks - 4 else ("reader", i - (ranks - 4))
        p = writer(rank) if role == "writer" else reader(rank)
        tables[i] = clients[i].join(p, writers=ranks - 4, readers=4, timeout=30)

    try:
        threads = [threading.Thread(target=join, args=(i,)) for i in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for c in clients:
            c.close()
    assert all(t is not None and t.count("writer") == ranks - 4 and t.count("reader") == 4 for t in tables)
    assert client.table().participants() == tables[0].participants()  # type: ignore[attr-defined]


# --- end to end -------------------------------------------------------------------------------------

def test_a_sync_job_runs_on_etcd_bitwise(cluster):
    versions = [0, 1, 2]
    out = run_sync(cluster.address, versions, job=f"sync{next(_jobs)}")
    assert not out.errors, out.errors
    assert out.reads == {0: versions, 1: versions} and all(all(e) for e in out.exact.values())
    assert [v for v, _ in out.writes[0]] == versions == [v for v, _ in out.writes[1]]


def test_a_sync_job_runs_on_the_etcd_cluster_its_config_names(cluster, monkeypatch):
    """``SyncConfig(meta_address="etcd://...")`` alone, no ``WEIGHTSYNC_META_ADDR``: every role
    opens its own client of that cluster (issue 38's "or the same in SyncConfig")."""
    monkeypatch.delenv("WEIGHTSYNC_META_ADDR", raising=False)
    versions = [0, 1]
    job = f"sync{next(_jobs)}"
    out = run_sync(cluster.address, versions, job=job, in_config=True)
    assert not out.errors, out.errors
    assert out.reads == {0: versions, 1: versions} and all(all(e) for e in out.exact.values())
    with meta(cluster.address, job) as c:
        assert c.latest_version().version == 1  # type: ignore[union-attr]  # the job ran on this cluster


def test_an_answer_is_read_with_the_instance_its_transaction_was_asked_with(cluster, client):
    """Two threads of one client (a reader's in-flight loop beside its caller): one pins the
    store while the other's pin is in flight. The interleaving, by hand: the second thread's
    transaction is asked unpinned, the first pins, then the answer arrives. Before, the answer
    was read with the instance pinned meanwhile and the pin failed with IndexError (seen in
    ``test_one_corrupted_byte_is_refused_on_etcd_as_on_the_meta_server``)."""
    from weightsync.meta.etcd import ops, steps

    client.instance = None
    operation = steps.pin_instance(client.keys)
    step = next(operation)
    compare, failure, asked = client.pinned(step)  # the second thread asks, unpinned
    first = client.pin_instance()  # the first thread pins meanwhile
    answer = client.unpinned(client.kv.txn(compare, step.success, failure, what=step.what), asked)
    with pytest.raises(StopIteration) as done:
        operation.send(answer)
    assert done.value.value == first and not answer.ok and ops.rows_of(answer.responses[0])


def test_one_corrupted_byte_is_refused_on_etcd_as_on_the_meta_server(cluster):
    """The integrity case of tests/test_integrity.py (2 writers, 2 readers on shared memory, one
    byte corrupted in transit in version 1), coordinated by the 3-member cluster: the digests
    travel through etcd, reader 0 refuses version 1 naming the tensor and the writer, its engine
    keeps version 0 bitwise, and version 2 lands."""
    from test_integrity import assert_refused_and_kept, run_job

    out = run_job("shm", coordinator=cluster.address)
    assert_refused_and_kept(out)


def test_a_failed_stage_aborts_the_fleet_commit_on_etcd_as_on_the_meta_server(cluster):
    """The fleet-wide commit's abort case of tests/test_fleet_commit.py (4 readers, reader 2's
    staging refuses version 1) coordinated by the 3-member cluster: the staged reports and the
    decision are etcd counters; no engine applies version 1, each keeps version 0 bitwise, and
    version 2 reaches all four."""
    from test_fleet_commit import Job, a_failed_stage_aborts_the_version, config

    job = f"fleet-commit{next(_jobs)}"
    a_failed_stage_aborts_the_version(Job(None, config(job=job), connect=lambda: meta(cluster.address, job)))


def _sync_get(address: str, key: str, *, timeout: float) -> bytes | None:
    with meta(address, "tls", timeout=timeout) as c:
        return c.get_document(key)


def _async_get(address: str, key: str, *, timeout: float = 1.0, password: str | None = None) -> bytes | None:
    """``get_document`` through the asyncio client (:mod:`weightsync.meta.etcd.async_client`)."""
    from weightsync.meta.etcd.async_client import AsyncEtcdMetaClient

    async def get() -> bytes | None:
        async with AsyncEtcdMetaClient(address, job="tls", timeout=timeout, password=password) as c:
            return await c.get_document(key)
    return asyncio.run(asyncio.wait_for(get(), 30))


def test_tls_with_a_client_certificate_is_spoken_and_each_tls_mismatch_is_named(tmp_path):
    """A member that requires client certificates (etcd's --client-cert-auth), reached with the CA
    and the client certificate in the address; without the certificate, over plain HTTP, and with a
    member certificate etcd's own gateway cannot use, the error says what to fix (not a lost quorum).
    The sync client (etcd3gw) and the asyncio one (aiohttp) alike."""
    from etcd_helpers import certificates

    tls = certificates(tmp_path / "pki")
    single = etcd_cluster(tmp_path / "tls", members=1, tls=tls)
    try:
        assert single.address.startswith("etcds://127.0.0.1:") and "cert=" in single.address
        with meta(single.address, "tls") as c:
            c.put_document("k", b"v")
            assert c.get_document("k") == b"v"
        assert _async_get(single.address, "k", timeout=10) == b"v"
        members = single.address.removeprefix("etcds://").split("?")[0]
        for get in (lambda a: _sync_get(a, "k", timeout=1), lambda a: _async_get(a, "k")):
            with pytest.raises(EtcdUnavailableError, match=r"The TLS handshake with every member failed: .*cert= and "
                                                           r"key= give a client certificate that CA signed"):
                get(f"etcds://{members}?ca={tls.ca}")
            with pytest.raises(EtcdUnavailableError, match=r"as a member that speaks TLS does to plain HTTP: use "
                                                           r"etcds://"):
                get(f"etcd://{members}")
    finally:
        single.stop()
    unusable = certificates(tmp_path / "pki-2", member_client_auth=False)
    single = etcd_cluster(tmp_path / "tls-2", members=1, tls=unusable)
    try:
        for get in (lambda a: _sync_get(a, "k", timeout=1), lambda a: _async_get(a, "k")):
            with pytest.raises(EtcdUnavailableError, match=r"must then allow client auth as well \(extendedKeyUsage "
                                                           r"serverAuth,clientAuth\)"):
                get(single.address)
    finally:
        single.stop()


def test_an_etcd_user_and_password_authenticate_and_a_wrong_one_is_named(tmp_path):
    import json
    import urllib.request

    single = etcd_cluster(tmp_path / "auth", members=1)
    try:
        def admin(path: str, body: dict, token: str = "") -> dict:
            request = urllib.request.Request(f"{single.urls[0]}/v3/{path}", data=json.dumps(body).encode(),
                                             method="POST", headers={"Authorization": token} if token else {})
            with urllib.request.urlopen(request, timeout=5) as r:
                return json.loads(r.read())

        admin("auth/user/add", {"name": "root", "password": "rootpw"})
        admin("auth/user/grant", {"user": "root", "role": "root"})
        admin("auth/enable", {})
        host = single.address.removeprefix("etcd://")
        from weightsync.meta.etcd.client import EtcdMetaClient

        with EtcdMetaClient(f"etcd://root@{host}", job="auth", password="rootpw") as c:  # WEIGHTSYNC_ETCD_PASSWORD
            c.put_document("k", b"v")
            assert c.get_document("k") == b"v"
        with EtcdMetaClient(f"etcd://root@{host}", job="tls", password="rootpw") as c:
            c.put_document("k", b"async")
        assert _async_get(f"etcd://root@{host}", "k", timeout=5, password="rootpw") == b"async"
        for get in (lambda a: _sync_get(a, "k", timeout=2), lambda a: _async_get(a, "k", timeout=2)):
            with pytest.raises(PermissionError, match=r"requires authentication: put the user in the address"):
                get(f"etcd://{host}")
            with pytest.raises(PermissionError, match=r"refused user 'root' \(.*\): check the user and "
                                                      r"WEIGHTSYNC_ETCD_PASSWORD"):
                get(f"etcd://root:wrong@{host}")
    finally:
        single.stop()
