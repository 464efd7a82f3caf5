"""What both connections to etcd share, with no HTTP library: etcd's v3 gateway requests and
answers as plain data, and the errors a failed call raises.

The sync connection (:mod:`weightsync.meta.etcd.kv`, over etcd3gw and ``requests``) and the
asyncio one (:mod:`weightsync.meta.etcd.gateway`, over ``aiohttp``) send the same JSON and read the
same answers, so everything that does not touch a socket lives here once:

- the parts of a transaction (:func:`put`, :func:`read`, :func:`unchanged`, ...) and the rows of
  its answer (:func:`rows_of`, :func:`count_of`);
- how a gateway error reads (:func:`reason_of`), which answers another member may serve
  (:data:`RETRY_STATUSES`), and the errors a call raises: :class:`EtcdUnavailableError` naming
  every member's last error (a lost quorum, or a TLS mismatch: :func:`tls_advice`), or the
  ``PermissionError`` / ``RuntimeError`` of a refused request (:func:`refused`);
- the order a call tries the members in, with backoff between rounds (:func:`failover`);
- the store instance a client pinned, compared in every change (:func:`pinned`, :func:`check_pinned`);
- one line of a watch stream (:func:`watch_line`).

    body = {"compare": [unchanged(key, 0)], "success": [put(key, b"v")], "failure": [read(key)]}
"""

from __future__ import annotations

import base64
import itertools
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.clock.deadline import Deadline
from weightsync.meta.calls import ServerStateLostError
from weightsync.meta.etcd.address import EtcdAddress

#: HTTP statuses of the gateway that another member (or a later try) may answer: etcd3gw's own
#: mapping (500 internal error, 503 no leader or unreachable member, 408 and 504 etcd's request timeout)
RETRY_STATUSES = frozenset({500, 503, 408, 504})
#: longest single HTTP request; a longer call is several tries (another member after each)
MAX_REQUEST_SECONDS = 5.0
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 0.5


class EtcdUnavailableError(ConnectionError):
    """No member of the etcd cluster could serve a call before its deadline (the message says
    which members refused and why: most often a lost quorum)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One key-value of a range read or a watch event."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range or watch cover every key starting with ``prefix``."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


def row_of(kv: dict[str, Any]) -> Row:
    """A key-value as the gateway writes it (base64 key and value, decimal revisions as strings)."""
    return Row(base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")),
               int(kv.get("mod_revision", 0)), int(kv.get("create_revision", 0)), int(kv.get("lease", 0)))


# -- transaction parts (etcd's KV API, as the gateway takes them) ----------------------------------------

def put(key: str, value: bytes, lease: int = 0) -> dict[str, Any]:
    request: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        request["lease"] = lease
    return {"request_put": request}


def delete(key: str, *, prefix: bool = False) -> dict[str, Any]:
    request = {"key": b64(key)}
    if prefix:
        request["range_end"] = b64(prefix_end(key))
    return {"request_delete_range": request}


def read(key: str, *, prefix: bool = False, count_only: bool = False) -> dict[str, Any]:
    request: dict[str, Any] = {"key": b64(key)}
    if prefix:
        request["range_end"] = b64(prefix_end(key))
    if count_only:
        request["count_only"] = True
    return {"request_range": request}


def unchanged(key: str, mod_revision: int) -> dict[str, Any]:
    """The key was not written since ``mod_revision`` (0: the key does not exist)."""
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


def holds(key: str, value: bytes) -> dict[str, Any]:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def rows_of(response: dict[str, Any]) -> list[Row]:
    """The rows of one ``request_range`` answer of a transaction."""
    return [row_of(kv) for kv in response.get("response_range", {}).get("kvs", [])]


def count_of(response: dict[str, Any]) -> int:
    return int(response.get("response_range", {}).get("count", 0))


@dataclass(frozen=True, slots=True)
class TxnAnswer:
    """A transaction's answer: whether its compares held, the revision after it, the answers of
    the branch that ran (one per request, in order)."""

    ok: bool
    revision: int
    responses: list[dict[str, Any]]

    @classmethod
    def from_gateway(cls, answer: dict[str, Any]) -> TxnAnswer:
        return cls(bool(answer.get("succeeded", False)), int(answer["header"]["revision"]),
                   list(answer.get("responses", [])))


# -- failover ------------------------------------------------------------------------------------------

def first_member(members: int) -> int:
    """The member a new connection asks first: a random one, so that the ranks of a large job
    spread their gateway work (JSON and gRPC on the member's side) over every member."""
    return random.randrange(members)


def backoff(rounds: int) -> float:
    """The pause after ``rounds + 1`` rounds in which no member answered (jittered, capped)."""
    return min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** rounds) * random.uniform(0.5, 1)


def failover(members: int, first: int, deadline: Deadline) -> Iterator[tuple[int, float]]:
    """(the member to try next, seconds to pause before trying it), for a call whose last try
    failed: every member in turn from ``first``, with jittered backoff after each round over all
    of them (between rounds, not polling). Ends once the deadline leaves no room for another try:
    the caller then raises :func:`unavailable`."""
    pause = 0.0
    for tries in itertools.count():
        yield (first + tries) % members, pause
        pause = 0.0
        if (tries + 1) % members == 0:
            pause = backoff(tries // members)
            if deadline.remaining(0.0) <= pause:
                return
        elif deadline.expired:
            return


# -- the pinned store instance -------------------------------------------------------------------------

def pinned(compare: Sequence[dict[str, Any]], failure: Sequence[dict[str, Any]], key: str,
           instance: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``compare`` and ``failure`` of a transaction that also checks the pinned instance (``key``
    holds ``instance``; unchanged when nothing is pinned): the failure branch reads it first."""
    if instance is None:
        return list(compare), list(failure)
    return [*compare, holds(key, instance.encode())], [read(key), *failure]


def check_pinned(answer: TxnAnswer, instance: str | None, *, address: str, job: str) -> TxnAnswer:
    """The answer of a :func:`pinned` transaction as if unpinned (its failure reads without the
    instance's).

    Raises:
        ServerStateLostError: the store is not the one the client pinned (wiped or replaced).
    """
    if instance is None or answer.ok:
        return answer
    now = rows_of(answer.responses[0])
    if not now or now[0].value.decode() != instance:
        raise ServerStateLostError(
            f"etcd {address}: the store is not the one this client registered with (instance "
            f"{instance} is now {now[0].value.decode() if now else 'gone'}): it was wiped or replaced, so "
            f"job {job!r}'s registrations, versions and reader progress are gone; restart the job")
    return TxnAnswer(False, answer.revision, answer.responses[1:])


# -- errors --------------------------------------------------------------------------------------------

def reason_of(text: str) -> str | None:
    """etcd's own message in a gateway error body (``{"error": ..., "message": ...}``), or None."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return str(obj.get("message") or obj.get("error") or text) if isinstance(obj, dict) else text


def wants_token(reason: str) -> bool:
    """Whether etcd refused a request for want of a (fresh) auth token: authenticate, try once more."""
    return "token" in reason or "authenticat" in reason or "user name" in reason


def no_user(address: EtcdAddress) -> PermissionError:
    return PermissionError(f"etcd at {address} requires authentication: put the user in the address "
                           "(etcd://USER@host:2379,...) and its password in WEIGHTSYNC_ETCD_PASSWORD")


def bad_user(address: EtcdAddress, reason: str) -> PermissionError:
    return PermissionError(f"etcd at {address} refused user {address.user!r} ({reason}): check the user and "
                           "WEIGHTSYNC_ETCD_PASSWORD")


def refused(address: EtcdAddress, url: str, reason: str) -> Exception:
    """What a request a member answered for good (not one to retry elsewhere) raises."""
    if "permission denied" in reason:
        return PermissionError(f"etcd at {address} denied user {address.user!r}: {reason}; grant it read-write on "
                               f"the prefix {address.prefix}/")
    return RuntimeError(f"etcd at {url} refused a request: {reason}")


def tls_advice(tls: bool, reasons: Iterable[str], *, client_cert: bool = True) -> str | None:
    """What to fix when every member failed as a TLS mismatch fails (a lost quorum looks otherwise).

    Three cases, each seen against etcd 3.4: a handshake the members refuse or we cannot verify
    (``SSLError``; under TLS 1.3 a member refuses a missing client certificate after the
    handshake, and an HTTP library that writes before it reads may see only the broken pipe:
    with no ``client_cert``, that counts too); plain HTTP to members that speak TLS (they hang up
    without a response: each HTTP library words it its own way); and etcd's own HTTP gateway
    unable to dial its member's gRPC server (``connection closed``, or a gRPC transport error such
    as ``failed to write client preface``: which one is a race), which happens under
    ``--client-cert-auth`` when the member's certificate does not allow client auth.
    """
    reasons = list(reasons)
    if not reasons:
        return None
    refused = ("SSLError", "Broken pipe", "Connection reset") if tls and not client_cert else ("SSLError",)
    if all(any(x in r for x in refused) for r in reasons):
        return ("The TLS handshake with every member failed: check that ca= names the CA that signed the members' "
                "certificates, and that cert= and key= give a client certificate that CA signed when the members "
                "require one (--client-cert-auth)")
    # a member that speaks TLS closes a plain-HTTP connection: before its answer, or with our
    # request unread (a reset); each library words it its own way
    hung_up = ("Remote end closed connection without response", "Server disconnected without sending a response",
               "ServerDisconnectedError: Server disconnected", "Connection reset by peer")
    if not tls and all(any(h in r for h in hung_up) for r in reasons):
        return ("Every member hung up without a response, as a member that speaks TLS does to plain HTTP: use "
                "etcds:// with ca= (and cert= and key= when the members require client certificates)")
    dial_failed = ("connection closed", 'desc = "transport:', "use of closed network connection")
    if tls and all(any(d in r for d in dial_failed) for r in reasons):
        return ("Every member answered that its gRPC connection failed (as above): etcd's HTTP gateway could not "
                "reach the member's own gRPC server. Under --client-cert-auth etcd dials it with the member's "
                "certificate, which must then allow client auth as well (extendedKeyUsage serverAuth,clientAuth)")
    return None


def unavailable(address: EtcdAddress, what: str, failures: dict[str, str]) -> EtcdUnavailableError:
    """The error of a call no member answered before its deadline: each member's last error, and
    what to do (restore a quorum, or fix TLS)."""
    members = len(address.endpoints)
    quorum = members // 2 + 1
    said = "; ".join(f"{url}: {why}" for url, why in failures.items())
    advice = tls_advice(address.tls, failures.values(), client_cert=address.cert is not None) or (
        f"The cluster has lost quorum or is unreachable: etcd serves only while a majority ({quorum} of "
        f"{members}) of its members run and reach each other; restart the stopped members (etcdctl endpoint "
        "health shows which) or check the network to them")
    return EtcdUnavailableError(
        f"etcd cluster {address} could not {what} within the deadline: no member answered ({said}). {advice}")


# -- watches -------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WatchLine:
    """One line of a watch stream: the keys it put (deletes carry no value), and whether it ends
    the wait (a change, or a watch etcd canceled or refused: the caller reads again)."""

    rows: tuple[Row, ...]
    wakes: bool


def watch_line(line: bytes | str) -> WatchLine:
    """Parse one newline-delimited JSON message of ``/v3/watch``."""
    obj = json.loads(line) if line.strip() else {}
    if "error" in obj:  # e.g. an expired auth token: the stream is over, a read says why
        return WatchLine((), True)
    result = obj.get("result", {})
    events = result.get("events") or []
    rows = tuple(row_of(e["kv"]) for e in events if e.get("type", "PUT") == "PUT" and "kv" in e)
    return WatchLine(rows, bool(events) or bool(result.get("canceled")))
