"""The meta server as a real process on a free port, driven by its sync and async clients."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meta_proc import MetaServerProcess
from weightsync.meta import AsyncMetaClient, MetaClient, Participant, VersionInfo

pytestmark = pytest.mark.timeout(90)
MAX_BODY = 1 << 20
WRITER_BLOB = msgpack.packb({"layout": "megatron:tp=2,pp=2", "model": "model/abc"})
READER_BLOB = msgpack.packb({"layout": "vllm:tp=2", "model": "model/abc"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with MetaServerProcess(tmp_path_factory.mktemp("meta"), "--max-wait", "2",
                           "--max-body-bytes", str(MAX_BODY)) as proc:
        yield proc
    for http in _http.values():
        http.close()
    _http.clear()


_jobs = iter(range(1_000_000))


@pytest.fixture
def client(server, request):
    """A sync client on a job of its own: tests share the server, never a namespace."""
    job = f"t{next(_jobs)}-{request.node.name[:40].replace('[', '-').replace(']', '')}"
    with MetaClient(server.address, job=job, token=server.token, timeout=10) as c:
        yield c


def writer(rank: int, **kw) -> Participant:
    return Participant("writer", rank, kw.pop("group", "train"), kw.pop("host", f"node-{rank // 2}"),
                       kw.pop("endpoints", {"tcp": f"10.0.0.{rank}:29500"}), kw.pop("layout", WRITER_BLOB))


def reader(rank: int, **kw) -> Participant:
    return Participant("reader", rank, "rollout", kw.pop("host", "node-9"), {"tcp": f"10.0.1.{rank}:6000"},
                       kw.pop("layout", READER_BLOB))


_http: dict[str, httpx.Client] = {}


def raw(server, method: str, path: str, *, token: str | None = "", **kw) -> httpx.Response:
    """A plain HTTP request (no weightsync client), with the server's token unless ``token=None``."""
    headers = dict(kw.pop("headers", {}))
    if token is not None:
        headers.setdefault("Authorization", f"Bearer {token or server.token}")
    if server.address not in _http:
        _http.clear()
        _http[server.address] = httpx.Client(base_url=server.address, trust_env=False, timeout=10)
    return _http[server.address].request(method, path, headers=headers, **kw)


# --- participants --------------------------------------------------------------------------------

def test_register_fetch_and_conflict(client):
    assert client.register(writer(1)) is True
    assert client.register(writer(0)) is True
    assert client.register(reader(0)) is True
    assert client.register(writer(1)) is False  # idempotent: a retry is harmless
    people = client.participants()
    assert [(p.role, p.rank) for p in people] == [("reader", 0), ("writer", 0), ("writer", 1)]
    assert people[2] == writer(1) and people[0].layout == READER_BLOB
    assert client.participants("writer") == [writer(0), writer(1)]
    with pytest.raises(ValueError, match=r"writer rank 1 .* already registered with different data "
                                         r"\(host: 'node-0' != 'elsewhere'; endpoints: .*layout: blob"):
        client.register(writer(1, host="elsewhere", endpoints={"tcp": "x:1"}, layout=b"other"))
    table = client.table()
    assert table.layouts("writer") == {WRITER_BLOB: [0, 1]} and len(table.blobs) == 2


def test_barrier_waits_then_times_out_naming_the_missing(client):
    client.register(writer(0))
    client.register(reader(0))
    early = threading.Timer(0.3, lambda: client.register(writer(2)))
    early.start()
    with pytest.raises(TimeoutError, match=r"2/3 writers and 1/1 readers registered; missing writer ranks \[1\]"):
        client.wait_registered(writers=3, readers=1, timeout=1.0)
    early.join(10)
    late = threading.Timer(0.2, lambda: client.register(writer(1)))
    late.start()
    t0 = time.monotonic()
    people = client.wait_registered(writers=3, readers=1, timeout=10)
    late.join(10)  # its call may still be reading the answer when the waiter wakes
    assert time.monotonic() - t0 < 5 and len(people) == 4


def test_barrier_spans_several_server_long_polls(client):
    # the server holds a long-poll at most --max-wait 2 s; the client asks again until its timeout
    late = threading.Timer(2.6, lambda: client.register(reader(0)))
    late.start()
    t0 = time.monotonic()
    table = client.wait_table(writers=0, readers=1, timeout=10)
    late.join(10)  # its call may still be reading the answer when the waiter wakes
    assert 2.5 < time.monotonic() - t0 < 6 and table.count("reader") == 1


def test_job_namespaces_are_isolated(server, client):
    with MetaClient(server.address, job=client.job + "-other", token=server.token, timeout=10) as other:
        client.register(writer(0))
        other.register(writer(0, host="somewhere-else"))  # same rank, other job: no conflict
        client.put_document("k", b"mine")
        assert other.get_document("k") is None
        assert other.participants()[0].host == "somewhere-else" and client.participants()[0].host == "node-0"
        assert other.delete_job() is True and other.participants() == []
        assert client.participants() == [writer(0)]


def test_hundreds_of_concurrent_async_clients(server, client):
    n_writers, n_readers = 240, 60
    doc = b'{"hidden_size": 7168}'

    async def one(p: Participant) -> tuple[int, int, bytes | None]:
        async with AsyncMetaClient(server.address, job=client.job, token=server.token, timeout=30) as c:
            if p.role == "writer" and p.rank == 0:
                await c.put_document("model/abc", doc)
            table = await c.join(p, writers=n_writers, readers=n_readers, timeout=30, documents=["model/abc"])
            assert table.get(p.role, p.rank) == p
            return table.count("writer"), table.count("reader"), table.documents["model/abc"]

    async def everyone():
        people = [writer(r) for r in range(n_writers)] + [reader(r) for r in range(n_readers)]
        return await asyncio.gather(*(one(p) for p in people))

    results = asyncio.run(everyone())
    assert results == [(n_writers, n_readers, doc)] * (n_writers + n_readers)
    table = client.table()
    assert table.layouts("reader") == {READER_BLOB: list(range(n_readers))}


# --- documents -------------------------------------------------------------------------------------

def test_documents_put_get_and_long_poll(client):
    assert client.get_document("model/abc") is None
    assert client.get_document("model/abc", wait=0.2) is None
    late = threading.Timer(0.2, lambda: client.put_document("model/abc", b"\x00config"))
    late.start()
    assert client.get_document("model/abc", wait=10) == b"\x00config"
    late.join(10)
    client.put_document("model/abc", b"v2")
    assert client.get_document("model/abc") == b"v2"
    with pytest.raises(ValueError, match=r"invalid document key '\.\./etc'"):
        client.get_document("../etc")
    with pytest.raises(TypeError, match="document values are bytes"):
        client.put_document("k", "text")  # type: ignore[arg-type]


# --- versions and readers --------------------------------------------------------------------------

def test_publish_needs_every_writer_with_one_fingerprint(client):
    assert client.latest_version() is None
    assert client.publish_version(1, "fp-a", writer_rank=0, num_writers=3) is None
    assert client.publish_version(1, "fp-a", writer_rank=0, num_writers=3) is None  # retry
    with pytest.raises(ValueError, match=r"writer rank 2 reports version 1 with fingerprint 'fp-b', but writer "
                                         r"ranks \[0\] reported 'fp-a'"):
        client.publish_version(1, "fp-b", writer_rank=2, num_writers=3)
    with pytest.raises(ValueError, match="needs 4 writers, earlier reports said 3"):
        client.publish_version(1, "fp-a", writer_rank=1, num_writers=4)
    assert client.publish_version(1, "fp-a", writer_rank=1, num_writers=3) is None
    info = client.publish_version(1, "fp-a", writer_rank=2, num_writers=3)
    assert isinstance(info, VersionInfo) and (info.version, info.fingerprint) == (1, "fp-a")
    assert client.latest_version() == info
    assert client.publish_version(1, "fp-a", writer_rank=0, num_writers=3) == info  # late retry
    with pytest.raises(ValueError, match="published with fingerprint 'fp-a'"):
        client.publish_version(1, "fp-z", writer_rank=0, num_writers=3)
    client.publish_version(3, "fp-c", writer_rank=0, num_writers=1)
    with pytest.raises(ValueError, match=r"version 2 is older than the published version 3 .* must increase"):
        client.publish_version(2, "fp-a", writer_rank=0, num_writers=1)
    with pytest.raises(ValueError, match="writer_rank 3 must be below num_writers 3"):
        client.publish_version(4, "fp", writer_rank=3, num_writers=3)


def test_long_poll_wakes_within_50ms_of_a_publish(server, client):
    async def trial(version: int) -> float:
        async with AsyncMetaClient(server.address, job=client.job, token=server.token, timeout=10) as waiter, \
                AsyncMetaClient(server.address, job=client.job, token=server.token, timeout=10) as publisher:
            await publisher.latest_version()  # connections warm, as in a running job
            task = asyncio.ensure_future(waiter.wait_version(after=version - 1, timeout=20))
            await asyncio.sleep(0.2)  # let the long-poll reach the server (test setup, not polling)
            t0 = time.perf_counter()
            await publisher.publish_version(version, "fp", writer_rank=0, num_writers=1)
            info = await asyncio.wait_for(task, 10)
            assert info is not None and info.version == version
            return time.perf_counter() - t0

    latencies = [asyncio.run(trial(v)) for v in range(1, 6)]
    # publish round trip + wake-up + the waiter's answer, on a shared 2-core machine
    print("wake-up latencies (s):", [round(x, 4) for x in latencies])
    assert statistics.median(latencies) < 0.050, latencies


def test_wait_version_times_out_with_none(client):
    t0 = time.monotonic()
    assert client.wait_version(after=-1, timeout=0.3) is None
    assert 0.25 < time.monotonic() - t0 < 3


def test_readers_report_lag_and_wait(client):
    for r in range(3):
        client.register(reader(r))
    assert client.reader_versions() == {0: None, 1: None, 2: None}
    client.publish_version(1, "fp", writer_rank=0, num_writers=1)
    client.report_applied(0, 1, nbytes=100, seconds=0.5)
    client.report_applied(1, 1)
    assert client.wait_readers(min_version=1, readers=2, timeout=5) == {0: 1, 1: 1, 2: None}
    client.publish_version(2, "fp2", writer_rank=0, num_writers=1)
    client.report_failed(1, 2, "CUDA error: out of memory")
    with pytest.raises(TimeoutError, match=r"to apply \(or fail\) version >= 2: 1 did; laggards: rank 0 at 1$"):
        client.wait_readers(min_version=2, readers=2, timeout=0.3)  # ranks 0 and 1: rank 0 is behind
    client.report_applied(0, 2)
    # A reader that failed version 2 waits for version 3, never 2: it is done with 2.
    assert client.wait_readers(min_version=2, readers=2, timeout=5) == {0: 2, 1: None, 2: None}
    with pytest.raises(TimeoutError, match=r"to apply \(or fail\) version >= 2: 2 did; laggards: "
                                           r"rank 2 at no valid version$"):
        client.wait_readers(min_version=2, readers=3, timeout=0.3)
    late = threading.Timer(0.2, lambda: client.report_applied(2, 2))
    late.start()
    assert client.wait_readers(min_version=2, readers=3, timeout=10)[2] == 2
    late.join(10)
    status = client.status()
    lag = {r["rank"]: r["lag"] for r in status["reader_state"]}
    assert lag == {0: 0, 1: None, 2: 0}
    assert status["latest_version"]["version"] == 2 and status["last_sync_at"] is not None


def test_status_page_json_and_metrics(server, client):
    client.register(writer(0))
    client.register(reader(0))
    client.publish_version(7, "fp7", writer_rank=0, num_writers=1)
    client.report_applied(0, 7, seconds=0.25)
    body = raw(server, "GET", "/v1/status").json()
    job = next(j for j in body["jobs"] if j["job"] == client.job)
    assert (job["writers"], job["readers"], job["latest_version"]["version"]) == (1, 1, 7)
    page = raw(server, "GET", "/status", token=None, auth=("anyone", server.token))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert f"job {client.job}" in page.text and "fp7" in page.text and "10.0.0.0:29500" in page.text
    metrics = raw(server, "GET", "/metrics").text
    assert f'weightsync_meta_participants{{job="{client.job}",role="writer"}} 1.0' in metrics
    assert f'weightsync_meta_latest_version{{job="{client.job}"}} 7.0' in metrics
    assert 'weightsync_meta_requests_total{method="POST",route="/v1/jobs/{job}/versions",status="200"}' in metrics


def test_status_page_and_metrics_show_each_versions_completion_and_who_caught_up(server, client):
    """Writer 0's record of the newest versions under a quorum (issue 36: who applied, who missed,
    who caught up), shown newest first; a malformed record is named, never half-shown."""
    import msgpack

    from weightsync.ports.fleet.policy import COMPLETIONS_KEY, Completion

    for rank in (0, 1, 2):
        client.register(reader(rank))
    done = [Completion(4, "quorum=2", 2, (0, 1), {2: "died before it applied version 4: lease expired"}, "complete"),
            Completion(5, "quorum=2", 2, (0,), {1: "out of <memory>", 2: "still applying"}, "failed")]
    client.put_document(COMPLETIONS_KEY, msgpack.packb([c.to_wire() for c in done]))
    client.report_applied(0, 5)
    client.report_applied(2, 5)  # reader 2's restart caught up; reader 1 did not
    job = next(j for j in raw(server, "GET", "/v1/status").json()["jobs"] if j["job"] == client.job)
    assert [(c["version"], c["state"], c["caught_up"]) for c in job["completions"]] == [(5, "failed", [2]),
                                                                                         (4, "complete", [2])]
    page = raw(server, "GET", "/status", token=None, auth=("anyone", server.token)).text
    page = page[page.index(f"<h2>job {client.job}</h2>"):]
    assert "<h3>Completion (quorum=2)</h3>" in page and "reader 1: out of &lt;memory&gt;" in page
    assert "1 of 2 needed: [0]" in page
    metrics = raw(server, "GET", "/metrics").text
    assert f'weightsync_meta_completion_applied_readers{{job="{client.job}",version="5"}} 1.0' in metrics
    assert f'weightsync_meta_completion_missed_readers{{job="{client.job}",version="5"}} 2.0' in metrics
    assert f'weightsync_meta_completion_failed_versions{{job="{client.job}"}} 1.0' in metrics

    client.put_document(COMPLETIONS_KEY, msgpack.packb([{**done[0].to_wire(), "applied": ["zero"]}]))
    job = next(j for j in raw(server, "GET", "/v1/status").json()["jobs"] if j["job"] == client.job)
    assert job["completions"] == [{"error": "the 'completions' document is malformed: field 'applied' must be a list "
                                            "of reader ranks, not ['zero']"}]
    assert "the &#x27;completions&#x27; document is malformed" in raw(server, "GET", "/status", token=None,
                                                                     auth=("anyone", server.token)).text


def test_status_page_and_metrics_show_each_readers_validity(server, client):
    """A reader whose failed update touched its engine is invalid (since when, which version, the
    error) until it applies a version; one whose failure never reached its engine keeps its version;
    a client that does not say (an earlier release) was invalid."""
    for rank in (0, 1, 2):
        client.register(reader(rank))
    client.publish_version(5, "fp5", writer_rank=0, num_writers=1)
    client.report_applied(0, 5)
    client.report_applied(1, 5)
    before = time.time()
    client.report_failed(0, 6, "injected: the loader raised at layer 1", invalid=True)
    client.report_failed(1, 6, "writer 0 died before this reader connected", invalid=False, holds=5)
    assert raw(server, "POST", f"/v1/jobs/{client.job}/readers/2/failed",
               json={"version": 6, "error": "an earlier release"}).status_code == 200
    job = next(j for j in raw(server, "GET", "/v1/status").json()["jobs"] if j["job"] == client.job)
    rows = {r["rank"]: r for r in job["reader_state"]}
    assert (rows[0]["state"], rows[0]["version"], rows[0]["failed_version"]) == ("invalid", None, 6)
    assert before - 1 <= rows[0]["invalid_since"] <= time.time() + 1
    assert (rows[1]["state"], rows[1]["version"], rows[1]["invalid_since"]) == ("valid", 5, None)
    assert (rows[2]["state"], rows[2]["version"]) == ("invalid", None)
    since = rows[0]["invalid_since"]
    client.report_failed(0, 7, "again <b>", invalid=True)  # still invalid since the first failure
    assert client.wait_reader_report(min_version=0, readers=0, timeout=1).rows[0]["invalid_since"] == since

    page = raw(server, "GET", "/status", token=None, auth=("anyone", server.token)).text
    page = page[page.index(f"<h2>job {client.job}</h2>"):]  # this job's section (the server is the module's)
    page = page[:page.index("<h2>", 1)] if "<h2>" in page[1:] else page
    assert page.count("INVALID since") == 2 and "version 7: again &lt;b&gt;" in page
    metrics = raw(server, "GET", "/metrics").text
    assert f'weightsync_meta_reader_invalid{{job="{client.job}",rank="0"}} 1.0' in metrics
    assert f'weightsync_meta_reader_invalid{{job="{client.job}",rank="1"}} 0.0' in metrics
    [line] = [x for x in metrics.splitlines()
              if x.startswith(f'weightsync_meta_reader_invalid_since_seconds{{job="{client.job}",rank="0"}} ')]
    assert float(line.split()[-1]) == pytest.approx(since)
    assert f'weightsync_meta_reader_invalid_info{{error="again <b>",job="{client.job}",rank="0",version="7"}} 1.0' in metrics

    client.report_applied(0, 8)
    row = client.wait_reader_report(min_version=0, readers=0, timeout=1).rows[0]
    assert (row["state"], row["version"], row["invalid_since"], row["error"]) == ("valid", 8, None, None)


# --- security and validation -----------------------------------------------------------------------

def test_every_route_but_healthz_needs_the_token(server):
    assert raw(server, "GET", "/healthz", token=None).text == "ok"
    spec = raw(server, "GET", "/openapi.json").json()
    checked = 0
    for path, methods in spec["paths"].items():
        url = path.replace("{job}", "j").replace("{key}", "k").replace("{rank}", "0")
        for method in methods:
            if path == "/healthz":
                continue
            for headers in ({}, {"Authorization": "Bearer wrong-token-123"}, {"Authorization": "Basic Og=="},
                            {"Authorization": "Token " + server.token}):
                r = raw(server, method.upper(), url, token=None, headers=headers)
                assert r.status_code == 401, (method, url, headers, r.status_code)
                assert "WEIGHTSYNC_META_TOKEN" in r.json()["detail"]
            checked += 1
    assert checked >= 12
    assert raw(server, "GET", "/openapi.json", token=None).status_code == 401


def test_client_with_a_wrong_token_gets_a_clear_error(server):
    with MetaClient(server.address, token="not-the-token", timeout=5) as c, \
            pytest.raises(PermissionError, match=r"rejected the token \(401\)"):
        c.participants()


def test_schema_errors_are_422_naming_the_field(server, client):
    path = f"/v1/jobs/{client.job}/participants"
    cases = [({"role": "writer", "rank": -1}, "field 'rank'"),
             ({"role": "boss", "rank": 0}, "field 'role'"),
             ({"role": "writer", "rank": 0, "endpoints": {"tcp": 5}}, "field 'endpoints.tcp'"),
             ({"role": "writer", "rank": 0, "layout": "not-bytes"}, "field 'layout'"),
             ({"role": "writer", "rank": 0, "colour": "red"}, "field 'colour'"),
             ([1, 2], "body")]
    for body, field in cases:
        r = raw(server, "POST", path, content=msgpack.packb(body), headers={"Content-Type": "application/msgpack"})
        assert r.status_code == 422 and field in r.json()["detail"], (body, r.text)
    r = raw(server, "POST", path, json={"role": "writer", "rank": "zero"})
    assert r.status_code == 422 and "field 'rank'" in r.json()["detail"]
    r = raw(server, "POST", path, json={"role": "reader", "rank": 3, "layout": "aGk="})  # JSON: base64 bytes
    assert r.status_code == 200 and client.participants("reader")[0].layout == b"hi"
    r = raw(server, "GET", f"/v1/jobs/{client.job}/versions/latest?wait=soon")
    assert r.status_code == 422 and "field 'query.wait'" in r.json()["detail"]
    assert raw(server, "GET", "/v1/jobs/bad job!/participants").status_code in (404, 422)
    r = raw(server, "POST", path, content=b"<xml/>", headers={"Content-Type": "text/xml"})
    assert r.status_code == 415


def test_truncated_bodies_are_400(server, client):
    body = msgpack.packb(writer(0).to_wire())
    for cut in range(len(body)):
        r = raw(server, "POST", f"/v1/jobs/{client.job}/participants", content=body[:cut],
                headers={"Content-Type": "application/msgpack"})
        assert r.status_code == 400, (cut, r.text)
    r = raw(server, "POST", f"/v1/jobs/{client.job}/participants", content=body + b"\x00",
            headers={"Content-Type": "application/msgpack"})
    assert r.status_code == 400 and "after its msgpack object" in r.json()["detail"]
    assert client.participants() == []


def test_oversized_bodies_are_413(server, client):
    url = f"/v1/jobs/{client.job}/documents/big"
    assert raw(server, "PUT", url, content=b"x" * (MAX_BODY + 1)).status_code == 413
    assert raw(server, "PUT", url, content=b"x" * MAX_BODY).status_code == 200

    def chunks():  # no Content-Length: the server counts while reading
        for _ in range(17):
            yield b"y" * (64 << 10)

    r = raw(server, "PUT", url, content=chunks())
    assert r.status_code == 413 and "exceeds the server's limit" in r.json()["detail"]
    assert client.get_document("big") == b"x" * MAX_BODY


POST_ROUTES = ["participants", "join", "versions", "readers/0/applied", "readers/0/failed"]
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=12)
field_names = st.sampled_from(["role", "rank", "group", "host", "endpoints", "layout", "version", "fingerprint",
                               "writer_rank", "num_writers", "nbytes", "seconds", "error"])
near_valid = st.dictionaries(field_names, msgpack_values, max_size=6)


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(POST_ROUTES), body=st.binary(max_size=200) | msgpack_values.map(msgpack.packb)
       | near_valid.map(msgpack.packb))
def test_fuzzed_bodies_never_break_the_server(server, route, body):
    r = raw(server, "POST", f"/v1/jobs/fuzz/{route}", content=body, headers={"Content-Type": "application/msgpack"})
    assert r.status_code in (200, 400, 409, 422), (route, body, r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["detail"]


def test_server_is_healthy_after_the_fuzzing(server):
    assert raw(server, "GET", "/healthz", token=None).status_code == 200
    assert raw(server, "GET", "/v1/status").status_code == 200


def test_counters_compare_and_set_and_long_poll(client):
    assert client.counter("epoch") == 0
    assert client.compare_and_set("epoch", expected=0, value=1) == (True, 1)
    assert client.compare_and_set("epoch", expected=0, value=5) == (False, 1)  # someone moved it already
    late = threading.Timer(0.2, lambda: client.compare_and_set("epoch", expected=1, value=2))
    late.start()
    assert client.counter("epoch", at_least=2, wait=10) == 2
    late.join(10)
    assert client.counter("epoch", at_least=3, wait=0.2) == 2  # timed out: the current value
    assert client.status()["counters"] == {"epoch": 2}
