"""The sync connection to an etcd cluster: every call fails over between its members, within a deadline.

:class:`EtcdKV` is how the sync client (:class:`~weightsync.meta.etcd.client.EtcdMetaClient`)
talks to etcd; the asyncio client has its twin, :mod:`weightsync.meta.etcd.gateway`, and both
build their requests and errors with :mod:`weightsync.meta.etcd.ops`. It speaks etcd's v3
HTTP/JSON gateway through ``etcd3gw`` (one ``Etcd3Client`` per member and thread: a ``requests``
session is not shared between threads), and adds what a coordinator needs on top:

- **failover**: a call that a member cannot answer (connection refused or reset, no leader,
  etcd's own request timeout) goes to the next member, with jittered backoff after each round,
  until the call's deadline; then :class:`~weightsync.meta.etcd.ops.EtcdUnavailableError` says
  which members refused and that a write needs a quorum (a majority of the members);
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

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client

from weightsync.clock.deadline import Deadline
from weightsync.meta.etcd import ops
from weightsync.meta.etcd.address import EtcdAddress
from weightsync.meta.etcd.ops import MAX_REQUEST_SECONDS, EtcdUnavailableError, Row, TxnAnswer, b64, prefix_end

__all__ = ["API_PATH", "EtcdKV", "EtcdUnavailableError"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: etcd 3.4 serves the gateway at /v3/ (and /v3beta/, gone in 3.5); etcd3gw's discovery costs a request
API_PATH = "/v3/"
#: etcd3gw's errors for the gateway statuses of :data:`~weightsync.meta.etcd.ops.RETRY_STATUSES` and
#: for connections that failed or timed out: another member may answer
_RETRIED = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError, etcd_errors.InternalServerError)


class EtcdKV:
    """One process's connection to an etcd cluster (see module docstring). Thread-safe."""

    def __init__(self, address: EtcdAddress, *, timeout: float = 30.0) -> None:
        self.address = address
        self.timeout = float(timeout)
        self._local = threading.local()
        self._token: str | None = None
        self._lock = threading.Lock()
        self._current = ops.first_member(len(address.endpoints))  # the last member that answered

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
            raise ops.no_user(a)
        client.session.headers.pop("Authorization", None)
        try:
            answer = client.post(client.get_url("/auth/authenticate"), json={"name": a.user,
                                                                               "password": a.password or ""})
        except etcd_errors.Etcd3Exception as exc:
            if isinstance(exc, _RETRIED):
                raise
            raise ops.bad_user(a, _reason(exc)) from None
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
        for index, pause in ops.failover(len(clients), self._current, deadline):
            time.sleep(pause)  # backoff between rounds over the members, not polling
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
        raise ops.unavailable(self.address, what, failures)

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
            if ops.wants_token(reason):
                self._authenticate(client)  # etcd's token expired (or was never sent): once more
                self._clients()
                try:
                    return fn(client)
                except etcd_errors.Etcd3Exception as again:
                    if isinstance(again, _RETRIED):
                        raise
                    reason = _reason(again)
            raise ops.refused(self.address, client.base_url, reason) from None

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
        return [ops.row_of(kv) for kv in answer.get("kvs", [])], int(answer["header"]["revision"])

    def get(self, key: str, deadline: Deadline | None = None) -> tuple[Row | None, int]:
        rows, revision = self.range(key, deadline=deadline)
        return (rows[0] if rows else None), revision

    def txn(self, compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
            failure: Sequence[dict[str, Any]] = (), *, what: str = "commit a transaction",
            deadline: Deadline | None = None) -> TxnAnswer:
        """One transaction (see :class:`~weightsync.meta.etcd.ops.TxnAnswer`)."""
        body = {"compare": list(compare), "success": list(success), "failure": list(failure)}
        return TxnAnswer.from_gateway(self.call(what, lambda c: c.post(c.get_url("/kv/txn"), json=body), deadline))

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
        return self.watch_rows(key, prefix=prefix, after=after, deadline=deadline) is not None

    def watch_rows(self, key: str, *, prefix: bool, after: int, deadline: Deadline) -> tuple[Row, ...] | None:
        """:meth:`watch`, returning the keys the first change put (empty: a delete, or the stream
        ended or was canceled) or None at the deadline."""
        create: dict[str, Any] = {"key": b64(key), "start_revision": after + 1}
        if prefix:
            create["range_end"] = b64(prefix_end(key))
        client = self._clients()[self._current]
        left = deadline.remaining(0.0)
        if left <= 0:
            return None
        try:
            response = client.session.post(client.get_url("/watch"), json={"create_request": create}, stream=True,
                                           timeout=(min(left, MAX_REQUEST_SECONDS), left))
        except requests.RequestException:
            self._current = (self._current + 1) % len(self.address.endpoints)
            time.sleep(min(deadline.remaining(0.0), ops.backoff(10)))  # backoff, then read again
            return ()
        try:
            return self._first_event(response)
        finally:
            response.close()

    def _first_event(self, response: requests.Response) -> tuple[Row, ...] | None:
        if response.status_code != 200:
            self._current = (self._current + 1) % len(self.address.endpoints)
            return ()
        buffer = b""
        try:
            for chunk in response.iter_content(chunk_size=None):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    seen = ops.watch_line(line)
                    if seen.wakes:
                        return seen.rows  # a change, or a watch etcd refused (compacted): read again
        except requests.exceptions.ConnectionError as exc:
            if "timed out" in str(exc).lower() or "timeout" in type(exc.__cause__ or exc).__name__.lower():
                return None
            self._current = (self._current + 1) % len(self.address.endpoints)
        except requests.RequestException:
            return None
        return ()  # the stream ended: its member went away


def _reason(exc: BaseException) -> str:
    """etcd's own message from a gateway error (``{"error": ..., "message": ...}``), else the exception."""
    detail = getattr(exc, "detail_text", None)  # etcd3gw keeps the answer's body there
    for text in (detail, *exc.args):
        if isinstance(text, str) and (said := ops.reason_of(text)) is not None:
            return said
    said = " ".join(str(a) for a in (detail, *exc.args) if a)[:300]
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__
