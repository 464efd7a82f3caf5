"""The connection to an etcd cluster: every call fails over between its members, within a deadline.

:class:`EtcdKV` is the only module that talks to etcd. It speaks etcd's v3 HTTP/JSON gateway
through ``etcd3gw`` (one ``Etcd3Client`` per member and thread: a ``requests`` session is not
shared between threads), and adds what a coordinator needs on top:

- **failover**: a call that a member cannot answer (connection refused or reset, no leader,
  etcd's own request timeout) goes to the next member, with jittered backoff after each round,
  until the call's deadline; then :class:`EtcdUnavailableError` says which members refused and
  that a write needs a quorum (a majority of the members);
- **authentication**: etcd's user/password (``/v3/auth/authenticate``; its token is sent as the
  ``Authorization`` header and renewed when etcd says it expired) and TLS client certificates;
- **watches with a deadline**: :meth:`EtcdKV.watch` holds one watch stream until an event or the
  deadline. It reads the stream itself (over etcd3gw's session and URL) because etcd3gw's
  ``Watcher`` cannot tell a stream that ended (its member died) from a quiet one: here the end of
  a stream returns at once and the caller reads again through the failover.

    kv = EtcdKV(EtcdAddress.parse("etcd://n1:2379,n2:2379,n3:2379"), timeout=30)
    rows, revision = kv.range("weightsync/jobs/j/doc/", prefix=True)
    kv.watch("weightsync/jobs/j/doc/", prefix=True, after=revision, deadline=Deadline.after(10))
"""

from __future__ import annotations

import base64
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client

from weightsync.clock.deadline import Deadline
from weightsync.meta.etcd.address import EtcdAddress

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: etcd 3.4 serves the gateway at /v3/ (and /v3beta/, gone in 3.5); etcd3gw's discovery costs a request
API_PATH = "/v3/"
#: longest single HTTP request; a longer call is several tries (another member after each)
MAX_REQUEST_SECONDS = 5.0
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 0.5
_RETRIED = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError, etcd_errors.InternalServerError)


class EtcdUnavailableError(ConnectionError):
    """No member of the etcd cluster could serve a call before its deadline (the message says
    which members refused and why: most often a lost quorum)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One key-value of a range read."""

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


def tls_advice(tls: bool, reasons: Iterable[str]) -> str | None:
    """What to fix when every member failed as a TLS mismatch fails (a lost quorum looks otherwise).

    Three cases, each seen against etcd 3.4: a handshake the members refuse or we cannot verify;
    plain HTTP to members that speak TLS (they hang up without a response); and etcd's own HTTP
    gateway unable to dial its member's gRPC server (``connection closed``, or a gRPC transport
    error such as ``failed to write client preface``: which one is a race), which happens under
    ``--client-cert-auth`` when the member's certificate does not allow client auth.
    """
    reasons = list(reasons)
    if not reasons:
        return None
    if all("SSLError" in r for r in reasons):
        return ("The TLS handshake with every member failed: check that ca= names the CA that signed the members' "
                "certificates, and that cert= and key= give a client certificate that CA signed when the members "
                "require one (--client-cert-auth)")
    if not tls and all("Remote end closed connection without response" in r for r in reasons):
        return ("Every member hung up without a response, as a member that speaks TLS does to plain HTTP: use "
                "etcds:// with ca= (and cert= and key= when the members require client certificates)")
    if tls and all("connection closed" in r or 'desc = "transport:' in r for r in reasons):
        return ("Every member answered that its gRPC connection failed (as above): etcd's HTTP gateway could not "
                "reach the member's own gRPC server. Under --client-cert-auth etcd dials it with the member's "
                "certificate, which must then allow client auth as well (extendedKeyUsage serverAuth,clientAuth)")
    return None


def _row(kv: dict[str, Any]) -> Row:
    return Row(base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")),
               int(kv.get("mod_revision", 0)), int(kv.get("create_revision", 0)), int(kv.get("lease", 0)))


class EtcdKV:
    """One process's connection to an etcd cluster (see module docstring). Thread-safe."""

    def __init__(self, address: EtcdAddress, *, timeout: float = 30.0) -> None:
        self.address = address
        self.timeout = float(timeout)
        self._local = threading.local()
        self._token: str | None = None
        self._lock = threading.Lock()
        self._current = 0  # the member calls go to first (the last one that answered)

    # -- members ---------------------------------------------------------------------------------
    def _clients(self) -> list[Etcd3Client]:
        clients: list[Etcd3Client] | None = getattr(self._local, "clients", None)
        if clients is None:
            a = self.address
            clients = [Etcd3Client(host, port, protocol="https" if a.tls else "http", ca_cert=a.ca, cert_key=a.key,
                                   cert_cert=a.cert, timeout=MAX_REQUEST_SECONDS, api_path=API_PATH)
                       for host, port in a.endpoints]
            for c in clients:
                c.session.trust_env = False  # a proxy from the environment never sits between members and us
            self._local.clients = clients
        if self._token is not None:
            for c in clients:
                c.session.headers["Authorization"] = self._token
        return clients

    def close(self) -> None:
        for c in getattr(self._local, "clients", None) or []:
            c.session.close()
        self._local.clients = None

    def _authenticate(self, client: Etcd3Client) -> None:
        a = self.address
        if a.user is None:
            raise PermissionError(f"etcd at {a} requires authentication: put the user in the address "
                                  "(etcd://USER@host:2379,...) and its password in WEIGHTSYNC_ETCD_PASSWORD")
        client.session.headers.pop("Authorization", None)
        try:
            answer = client.post(client.get_url("/auth/authenticate"), json={"name": a.user,
                                                                               "password": a.password or ""})
        except etcd_errors.Etcd3Exception as exc:
            if isinstance(exc, _RETRIED):
                raise
            raise PermissionError(f"etcd at {a} refused user {a.user!r} ({_reason(exc)}): check the user and "
                                  "WEIGHTSYNC_ETCD_PASSWORD") from None
        with self._lock:
            self._token = str(answer["token"])

    # -- calls -----------------------------------------------------------------------------------
    def call(self, what: str, fn: Callable[[Etcd3Client], T], deadline: Deadline | None = None) -> T:
        """``fn(member)`` on the current member, failing over to the others until ``deadline``
        (default: the connection's timeout from now).

        Raises:
            EtcdUnavailableError: no member answered in time (naming each one's last error).
            PermissionError: authentication failed or the user may not do this.
        """
        deadline = deadline or Deadline.after(self.timeout)
        failures: dict[str, str] = {}
        clients = self._clients()
        for tries in range(1 << 30):
            index = (self._current + tries) % len(clients)
            client = clients[index]
            client.timeout = max(0.05, min(MAX_REQUEST_SECONDS, deadline.remaining(0.0)))
            try:
                result = self._authorized(client, fn)
            except _RETRIED as exc:
                failures[client.base_url] = _reason(exc)
                logger.debug("etcd member %s: %s (%s)", client.base_url, _reason(exc), what)
            else:
                self._current = index
                return result
            if (tries + 1) % len(clients) == 0:
                pause = min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** (tries // len(clients))) * random.uniform(0.5, 1)
                if deadline.remaining(0.0) <= pause:
                    raise self._unavailable(what, failures, deadline)
                time.sleep(pause)  # backoff between rounds over the members, not polling
            elif deadline.expired:
                raise self._unavailable(what, failures, deadline)
        raise AssertionError("unreachable")

    def _authorized(self, client: Etcd3Client, fn: Callable[[Etcd3Client], T]) -> T:
        if self.address.user is not None and self._token is None:
            self._authenticate(client)
            self._clients()
        try:
            return fn(client)
        except etcd_errors.Etcd3Exception as exc:
            if isinstance(exc, _RETRIED):
                raise
            reason = _reason(exc)
            if "token" in reason or "authenticat" in reason or "user name" in reason:
                self._authenticate(client)  # etcd's token expired (or was never sent): once more
                self._clients()
                try:
                    return fn(client)
                except etcd_errors.Etcd3Exception as again:
                    if isinstance(again, _RETRIED):
                        raise
                    exc, reason = again, _reason(again)
            if "permission denied" in reason:
                raise PermissionError(f"etcd at {self.address} denied user {self.address.user!r}: {reason}; grant "
                                      f"it read-write on the prefix {self.address.prefix}/") from None
            raise RuntimeError(f"etcd at {client.base_url} refused a request: {reason}") from None

    def _unavailable(self, what: str, failures: dict[str, str], deadline: Deadline) -> EtcdUnavailableError:
        members = len(self.address.endpoints)
        quorum = members // 2 + 1
        said = "; ".join(f"{url}: {why}" for url, why in failures.items())
        advice = tls_advice(self.address.tls, failures.values()) or (
            f"The cluster has lost quorum or is unreachable: etcd serves only while a majority ({quorum} of "
            f"{members}) of its members run and reach each other; restart the stopped members (etcdctl endpoint "
            "health shows which) or check the network to them")
        return EtcdUnavailableError(
            f"etcd cluster {self.address} could not {what} within the deadline: no member answered ({said}). {advice}")

    # -- operations ------------------------------------------------------------------------------
    def range(self, key: str, *, prefix: bool = False, deadline: Deadline | None = None,
              keys_only: bool = False) -> tuple[list[Row], int]:
        """The key (or every key under the prefix), linearizable; and the cluster's revision."""
        body: dict[str, Any] = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(prefix_end(key))
        if keys_only:
            body["keys_only"] = True
        answer = self.call(f"read {key}", lambda c: c.post(c.get_url("/kv/range"), json=body), deadline)
        return [_row(kv) for kv in answer.get("kvs", [])], int(answer["header"]["revision"])

    def get(self, key: str, deadline: Deadline | None = None) -> tuple[Row | None, int]:
        rows, revision = self.range(key, deadline=deadline)
        return (rows[0] if rows else None), revision

    def txn(self, compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
            failure: Sequence[dict[str, Any]] = (), *, what: str = "commit a transaction",
            deadline: Deadline | None = None) -> tuple[bool, int, list[dict[str, Any]]]:
        """One transaction: (whether the compares held, the revision after it, the responses)."""
        body = {"compare": list(compare), "success": list(success), "failure": list(failure)}
        answer = self.call(what, lambda c: c.post(c.get_url("/kv/txn"), json=body), deadline)
        return bool(answer.get("succeeded", False)), int(answer["header"]["revision"]), answer.get("responses", [])

    def grant(self, ttl: int, deadline: Deadline | None = None) -> int:
        """A new etcd lease of ``ttl`` seconds (etcd raises it to its minimum, about 1.5 election timeouts)."""
        answer = self.call("grant a lease", lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": ttl, "ID": 0}),
                           deadline)
        return int(answer["ID"])

    def keepalive(self, lease: int, deadline: Deadline | None = None) -> int:
        """Renew a lease; its TTL in seconds, or -1 if it expired (its keys are gone)."""
        answer = self.call("renew a lease", lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}),
                           deadline)
        result = answer.get("result", answer)
        return int(result.get("TTL", -1))

    def revoke(self, lease: int, deadline: Deadline | None = None) -> None:
        self.call("revoke a lease", lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease}), deadline)

    def watch(self, key: str, *, prefix: bool, after: int, deadline: Deadline) -> bool:
        """Wait for a change of ``key`` (or under the prefix) made after revision ``after``.

        Returns True once one arrived (or the stream ended: the caller reads again, failing over),
        False at the deadline. Events between ``after`` and the watch's start are not missed:
        the watch starts at revision ``after + 1``.
        """
        create: dict[str, Any] = {"key": b64(key), "start_revision": after + 1}
        if prefix:
            create["range_end"] = b64(prefix_end(key))
        client = self._clients()[self._current]
        left = deadline.remaining(0.0)
        if left <= 0:
            return False
        try:
            response = client.session.post(client.get_url("/watch"), json={"create_request": create}, stream=True,
                                           timeout=(min(left, MAX_REQUEST_SECONDS), left))
        except requests.RequestException:
            self._current = (self._current + 1) % len(self.address.endpoints)
            time.sleep(min(deadline.remaining(0.0), _BACKOFF_MAX * random.uniform(0.5, 1)))  # backoff, then read again
            return True
        try:
            return self._first_event(response)
        finally:
            response.close()

    def _first_event(self, response: requests.Response) -> bool:
        if response.status_code != 200:
            self._current = (self._current + 1) % len(self.address.endpoints)
            return True
        buffer = b""
        try:
            for chunk in response.iter_content(chunk_size=None):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    result = json.loads(line).get("result", {}) if line.strip() else {}
                    if result.get("events") or result.get("canceled"):
                        return True  # a change, or a watch etcd refused (compacted): read again
        except requests.exceptions.ConnectionError as exc:
            if "timed out" in str(exc).lower() or "timeout" in type(exc.__cause__ or exc).__name__.lower():
                return False
            self._current = (self._current + 1) % len(self.address.endpoints)
        except requests.RequestException:
            return False
        return True  # the stream ended: its member went away


def _reason(exc: BaseException) -> str:
    """etcd's own message from a gateway error (``{"error": ..., "message": ...}``), else the exception."""
    detail = getattr(exc, "detail_text", None)  # etcd3gw keeps the answer's body there
    for text in (detail, *exc.args):
        if isinstance(text, str) and text.lstrip().startswith("{"):
            try:
                obj = json.loads(text)
            except ValueError:
                continue
            return str(obj.get("message") or obj.get("error") or text) if isinstance(obj, dict) else text
    said = " ".join(str(a) for a in (detail, *exc.args) if a)[:300]
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


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
    return [_row(kv) for kv in response.get("response_range", {}).get("kvs", [])]


def count_of(response: dict[str, Any]) -> int:
    return int(response.get("response_range", {}).get("count", 0))
