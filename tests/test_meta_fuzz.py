"""Hostile input against every route of a durable meta server: always 4xx with a message.

A real ``weightsync meta-server`` process with a state directory (so every accepted change
goes through the journal) gets malformed, oversized and hostile requests from hypothesis:
odd job names and document keys, huge integers in bodies and queries, deep nesting, ranks
out of range, replays. Each answer must be 2xx or a 4xx with a ``detail``, never a 5xx;
meanwhile a well-behaved job on the same server keeps exactly the state its clients built,
``/healthz`` stays ok, and a restart replays the journal.
"""

from __future__ import annotations

import json

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meta_proc import MetaServerProcess
from weightsync.meta import MetaClient, Participant

pytestmark = pytest.mark.timeout(180)
MAX_BODY = 1 << 16
GOOD_JOB = "well-behaved"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    with MetaServerProcess(directory, "--max-wait", "0.2", "--max-body-bytes", str(MAX_BODY),
                           "--state-dir", str(directory / "state")) as proc:
        with httpx.Client(base_url=proc.address, trust_env=False, timeout=10,
                          headers={"Authorization": f"Bearer {proc.token}"}) as http:
            proc.http = http
            with MetaClient(proc.address, job=GOOD_JOB, token=proc.token, timeout=10) as good:
                good.register(Participant("writer", 0, "train", "node-0", {"device": "cpu"}, b"w"))
                good.register(Participant("reader", 0, "rollout", "node-1", {"device": "cpu"}, b"r"))
                good.put_document("models/abc", b'{"hidden": 8}')
                good.publish_version(1, "fp@0", writer_rank=0, num_writers=1)
                good.report_applied(0, 1, nbytes=1000, seconds=0.5)
                proc.good = good
                proc.expected = _snapshot(good)
                yield proc


def _snapshot(client: MetaClient) -> dict:
    status = client.status()
    return {"participants": status["participants"], "latest": status["latest_version"],
            "readers": [{k: r[k] for k in ("rank", "version", "nbytes", "error")} for r in status["reader_state"]],
            "documents": status["documents"], "model": client.get_document("models/abc")}


HUGE = st.sampled_from([2**62, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63), -(2**70), 10**30])
integers = st.integers(-5, 5) | HUGE
scalars = (st.none() | st.booleans() | integers | st.floats() | st.text(max_size=12)
           | st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
FIELDS = ["role", "rank", "group", "host", "endpoints", "layout", "version", "fingerprint", "writer_rank",
          "num_writers", "nbytes", "seconds", "error", "expected", "value"]
near_valid = st.fixed_dictionaries(
    {"role": st.sampled_from(["writer", "reader", "admin", ""]), "rank": integers},
    optional={f: values for f in FIELDS if f not in ("role", "rank")})
well_typed = st.fixed_dictionaries({
    "version": integers, "fingerprint": st.text(min_size=1, max_size=8), "writer_rank": integers,
    "num_writers": integers, "nbytes": integers, "seconds": st.floats() | integers, "error": st.text(max_size=8)})


def _packed(obj) -> bytes:
    """msgpack, or JSON for integers msgpack cannot carry (the server takes both)."""
    try:
        return msgpack.packb(obj)
    except OverflowError:
        return json.dumps(obj, default=lambda b: b.hex()).encode()


def _deep(depth: int, as_json: bool) -> bytes:
    """``[[[...]]]`` nested ``depth`` deep (msgpack: fixarrays of one element)."""
    return ("[" * depth + "]" * depth).encode() if as_json else b"\x91" * depth + b"\x90"


bodies = (st.binary(max_size=64) | values.map(_packed) | near_valid.map(_packed) | well_typed.map(_packed)
          | st.builds(_deep, st.integers(50, 100_000), st.booleans()))
jobs = st.sampled_from(["fuzz", "fuzz.2", "-bad", "a" * 129, "%2e%2e", "..", "a/b", "ünï", "x y", GOOD_JOB + "x"])
keys = st.sampled_from(["k", "a/b/c", "../etc", "/abs", "a" * 300, "%00", "a..b", "epoch", "models/abc"])
ranks = st.sampled_from(["0", "1", "-1", "2147483648", "99999999999999999999", "x", "1.5"])
queries = st.dictionaries(st.sampled_from(["after", "wait", "writers", "readers", "count", "min_version",
                                           "documents", "job", "at_least"]),
                          st.sampled_from(["0", "-1", "1", "1e9", "nan", "inf", "-5", "x", str(2**70), "0.01"]),
                          max_size=3)


@st.composite
def requests(draw):
    job = draw(jobs)
    route = draw(st.sampled_from([
        ("POST", f"/v1/jobs/{job}/participants"), ("GET", f"/v1/jobs/{job}/participants"),
        ("POST", f"/v1/jobs/{job}/join"), ("PUT", f"/v1/jobs/{job}/documents/{draw(keys)}"),
        ("GET", f"/v1/jobs/{job}/documents/{draw(keys)}"), ("POST", f"/v1/jobs/{job}/versions"),
        ("GET", f"/v1/jobs/{job}/versions/latest"), ("POST", f"/v1/jobs/{job}/readers/{draw(ranks)}/applied"),
        ("POST", f"/v1/jobs/{job}/readers/{draw(ranks)}/failed"), ("GET", f"/v1/jobs/{job}/readers"),
        ("GET", "/v1/status"), ("POST", f"/v1/jobs/{job}/counters/{draw(keys)}"),
        ("GET", f"/v1/jobs/{job}/counters/{draw(keys)}"), ("POST", f"/v1/jobs/{job}/leases/writer/{draw(ranks)}"),
        ("GET", f"/v1/jobs/{job}/leases"), ("GET", "/v1/server"),
    ]))
    ctype = draw(st.sampled_from(["application/msgpack", "application/json", "text/plain", ""]))
    return (*route, draw(queries), draw(bodies), ctype)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(request=requests())
def test_hostile_requests_get_4xx_with_a_message(server, request):
    method, path, params, body, ctype = request
    r = server.http.request(method, path, params=params, content=body if method != "GET" else None,
                            headers={"Content-Type": ctype} if ctype else {})
    assert r.status_code < 500, (method, path, params, body[:200], r.status_code, r.text[:500])
    if r.status_code >= 400 and r.status_code != 404:
        assert r.json()["detail"], r.text


def test_replays_of_good_requests_change_nothing(server):
    good = server.good
    for _ in range(3):  # a client that retries everything it already did
        good.register(Participant("writer", 0, "train", "node-0", {"device": "cpu"}, b"w"))
        good.publish_version(1, "fp@0", writer_rank=0, num_writers=1)
        good.report_applied(0, 1, nbytes=1000, seconds=0.5)
        good.put_document("models/abc", b'{"hidden": 8}')
    assert _snapshot(good) == server.expected


def test_the_journal_refuses_what_it_cannot_store_and_stays_healthy(server):
    """``nbytes=2**70`` once killed the journal's writer: every later change answered 500."""
    r = server.http.post(f"/v1/jobs/{GOOD_JOB}x/readers/0/applied",
                         content=json.dumps({"version": 1, "nbytes": 2**70}),
                         headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "nbytes" in r.json()["detail"]
    r = server.http.post(f"/v1/jobs/{GOOD_JOB}x/readers/0/applied", content=b'{"version": 1, "seconds": 1e999}',
                         headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    assert server.http.get("/healthz").text == "ok"
    with MetaClient(server.address, job="other", token=server.token, timeout=10) as other:
        other.put_document("after", b"still stored")  # the journal goes on
        assert other.get_document("after") == b"still stored"


def test_after_the_fuzzing_the_good_job_is_intact_across_a_restart(server):
    assert server.http.get("/healthz").status_code == 200
    assert _snapshot(server.good) == server.expected
    server.restart()  # replays the journal every accepted hostile change went to
    with MetaClient(server.address, job=GOOD_JOB, token=server.token, timeout=10) as good:
        assert _snapshot(good) == server.expected
