"""The asyncio connection to an etcd cluster: :class:`AsyncEtcdKV`, the twin of
:class:`~weightsync.meta.etcd.kv.EtcdKV` over ``aiohttp`` (no etcd3gw, no threads).

The same requests to etcd's v3 HTTP/JSON gateway (``/v3/kv/txn``, ``/v3/kv/range``,
``/v3/watch``, ``/v3/auth/authenticate``; base64 keys and values), built and read by
:mod:`weightsync.meta.etcd.ops`, with the same behaviour:

- **failover**: a call a member cannot answer (connection refused or reset, no leader, etcd's
  request timeout: :data:`~weightsync.meta.etcd.ops.RETRY_STATUSES`) goes to the next member,
  with jittered backoff after each round (:func:`~weightsync.meta.etcd.ops.failover`), until
  the call's deadline; then :class:`~weightsync.meta.etcd.ops.EtcdUnavailableError` names every
  member's last error and a lost quorum (or the TLS mismatch);
- **authentication**: etcd's user/password token in the ``Authorization`` header, renewed when
  etcd says it expired; TLS with the address's CA and client certificate (an ``ssl.SSLContext``
  built once per process and address);
- **watches with a deadline**: :meth:`AsyncEtcdKV.watch_rows` waits on one stream until a change,
  the deadline (None) or the stream's end (empty: the caller reads again, failing over); a
  stream outlives a deadline for the next wait on the same key (one stream per waiting rank).

One ``aiohttp.ClientSession`` per member, opened on first use: a rank usually talks to one member.

Why aiohttp and not httpx (which the embedded server's clients use): a gateway request costs a
client 0.41 ms of CPU through aiohttp against 1.60 ms through httpx here
(``benchmarks/etcd_gateway_costs.py``), and an etcd rank makes two requests where an embedded
server's rank makes one; at 1280 joining ranks on two cores that CPU was the etcd backend's
time (docs/benchmarks.md, "The same job on etcd").

    kv = AsyncEtcdKV(EtcdAddress.parse("etcd://n1:2379,n2:2379,n3:2379"), timeout=30)
    answer = await kv.txn([], [ops.read(key)])
    rows = await kv.watch_rows(key, prefix=False, after=answer.revision, deadline=Deadline.after(10))
    await kv.aclose()
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from weightsync.clock.deadline import Deadline
from weightsync.meta.client_base import ssl_context
from weightsync.meta.etcd import ops
from weightsync.meta.etcd.address import EtcdAddress
from weightsync.meta.etcd.ops import MAX_REQUEST_SECONDS, Row, TxnAnswer, b64, prefix_end

logger = logging.getLogger(__name__)

#: etcd 3.4 serves the gateway at /v3/ (as :data:`weightsync.meta.etcd.kv.API_PATH`)
API_PATH = "/v3/"


@dataclass(frozen=True, slots=True)
class _Watch:
    """A watch stream kept open between waits (see :meth:`AsyncEtcdKV.watch_rows`)."""

    key: str
    prefix: bool
    after: int
    member: int
    task: asyncio.Future[tuple[Row, ...]]


_JSON = {"Content-Type": "application/json"}


class _MemberError(Exception):
    """A member could not answer (its reason, worded as the sync connection words it): try another."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@functools.lru_cache(maxsize=16)
def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """The members' CA (else the system's) and our client certificate, loaded once per process:
    building a context costs ~20 ms, and a benchmark opens a client per simulated rank."""
    context = ssl.create_default_context(cafile=ca)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


#: what a request that got no answer raises: aiohttp's client errors (connection refused or reset,
#: a stream cut short), its timeouts, and a TLS alert the server sends after the handshake (TLS 1.3
#: refuses a client certificate so), which can reach us unwrapped
NO_ANSWER = (aiohttp.ClientError, TimeoutError, ssl.SSLError)

#: a request's connect and whole-answer limits (a watch stream has no read limit: see _first_event)
_STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=MAX_REQUEST_SECONDS, sock_read=None)


def _reason(exc: BaseException) -> str:
    """A transport error, named so that :func:`~weightsync.meta.etcd.ops.tls_advice` reads it as
    it reads the sync connection's (``SSLError`` for a failed handshake)."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    name = "SSLError" if any(isinstance(c, ssl.SSLError) for c in chain) else type(exc).__name__
    root = chain[-1]  # a client error often says little; the OS's error at the bottom says more
    said = str(exc) or (f"{type(root).__name__}: {root}" if root is not exc else type(exc).__name__)
    return f"{name}: {said}"[:300]


class AsyncEtcdKV:
    """One client's asyncio connection to an etcd cluster (see module docstring). One event loop."""

    def __init__(self, address: EtcdAddress, *, timeout: float = 30.0) -> None:
        self.address = address
        self.timeout = float(timeout)
        self._urls = address.urls()
        self._members: list[aiohttp.ClientSession | None] = [None] * len(self._urls)
        self._token: str | None = None
        self._current = ops.first_member(len(self._urls))  # the last member that answered
        self._held: _Watch | None = None

    def _member(self, index: int) -> aiohttp.ClientSession:
        """The member's session, opened on first use (aiohttp binds it to the running loop)."""
        session = self._members[index]
        if session is None:
            a = self.address
            context = tls_context(a.ca, a.cert, a.key) if a.tls else ssl_context()
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=16),
                                            trust_env=False, raise_for_status=False)
            self._members[index] = session
        return session

    async def aclose(self) -> None:
        await self.release_watch()
        members, self._members = self._members, [None] * len(self._urls)
        await asyncio.gather(*(m.close() for m in members if m is not None))

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token is not None else {}

    def _url(self, index: int, path: str) -> str:
        return self._urls[index] + API_PATH + path

    # -- calls -----------------------------------------------------------------------------------
    async def call(self, what: str, path: str, body: dict[str, Any], deadline: Deadline | None = None) -> Any:
        """POST ``body`` to ``/v3/<path>`` of the current member, failing over to the others until
        ``deadline`` (default: the connection's timeout from now); etcd's answer.

        Raises:
            EtcdUnavailableError: no member answered in time (naming each one's last error).
            PermissionError: authentication failed or the user may not do this.
            RuntimeError: a member refused the request for good (naming etcd's reason).
        """
        deadline = deadline or Deadline.after(self.timeout)
        failures: dict[str, str] = {}
        for index, pause in ops.failover(len(self._urls), self._current, deadline):
            if pause:
                await asyncio.sleep(pause)  # backoff between rounds over the members, not polling
            try:
                answer = await self._authorized(index, path, body, deadline)
            except _MemberError as exc:
                failures[self._urls[index]] = exc.reason
                logger.debug("etcd member %s: %s (%s)", self._urls[index], exc.reason, what)
            else:
                self._current = index
                return answer
        raise ops.unavailable(self.address, what, failures)

    async def _authorized(self, index: int, path: str, body: dict[str, Any], deadline: Deadline) -> Any:
        if self.address.user is not None and self._token is None:
            await self._authenticate(index, deadline)
        status, text, answer = await self._send(index, path, body, deadline)
        if status == 200:
            return answer
        reason = ops.reason_of(text) or f"HTTP {status}: {text[:300]}"
        if ops.wants_token(reason):
            await self._authenticate(index, deadline)  # etcd's token expired (or was never sent): once more
            status, text, answer = await self._send(index, path, body, deadline)
            if status == 200:
                return answer
            reason = ops.reason_of(text) or f"HTTP {status}: {text[:300]}"
        raise ops.refused(self.address, self._urls[index], reason)

    async def _authenticate(self, index: int, deadline: Deadline) -> None:
        a = self.address
        if a.user is None:
            raise ops.no_user(a)
        self._token = None
        status, text, answer = await self._send(index, "auth/authenticate", {"name": a.user,
                                                                             "password": a.password or ""}, deadline)
        if status != 200:
            raise ops.bad_user(a, ops.reason_of(text) or f"HTTP {status}")
        self._token = str(answer["token"])

    async def _send(self, index: int, path: str, body: dict[str, Any], deadline: Deadline) -> tuple[int, str, Any]:
        """(status, body text, parsed answer when 200); _MemberError when another member may answer."""
        seconds = max(0.05, min(MAX_REQUEST_SECONDS, deadline.remaining(0.0)))
        try:
            async with self._member(index).post(self._url(index, path), data=json.dumps(body),
                                                headers=self._headers() | _JSON,
                                                timeout=aiohttp.ClientTimeout(total=seconds)) as r:
                status, raw = r.status, await r.read()
        except NO_ANSWER as exc:
            raise _MemberError(_reason(exc)) from None
        text = raw.decode("utf-8", "replace")
        if status in ops.RETRY_STATUSES:
            raise _MemberError(ops.reason_of(text) or f"HTTP {status}: {text[:300]}")
        return status, text, (json.loads(raw) if status == 200 else None)

    # -- operations ------------------------------------------------------------------------------
    async def txn(self, compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
                  failure: Sequence[dict[str, Any]] = (), *, what: str = "commit a transaction",
                  deadline: Deadline | None = None) -> TxnAnswer:
        """One transaction (see :class:`~weightsync.meta.etcd.ops.TxnAnswer`)."""
        body = {"compare": list(compare), "success": list(success), "failure": list(failure)}
        return TxnAnswer.from_gateway(await self.call(what, "kv/txn", body, deadline))

    async def grant(self, ttl: int, deadline: Deadline | None = None) -> int:
        """A new etcd lease of ``ttl`` seconds (etcd raises it to its minimum)."""
        return int((await self.call("grant a lease", "lease/grant", {"TTL": ttl, "ID": 0}, deadline))["ID"])

    async def keepalive(self, lease: int, deadline: Deadline | None = None) -> int:
        """Renew a lease; its TTL in seconds, or -1 if it expired (its keys are gone)."""
        answer = await self.call("renew a lease", "lease/keepalive", {"ID": lease}, deadline)
        return int(answer.get("result", answer).get("TTL", -1))

    async def revoke(self, lease: int, deadline: Deadline | None = None) -> None:
        await self.call("revoke a lease", "kv/lease/revoke", {"ID": lease}, deadline)

    async def watch_rows(self, key: str, *, prefix: bool, after: int, deadline: Deadline) -> tuple[Row, ...] | None:
        """Wait for a change of ``key`` (or under the prefix) made after revision ``after``: the
        keys it put (empty: a delete, or the stream ended or was refused: read again, failing
        over), or None at the deadline. The watch starts at ``after + 1``: nothing is missed.

        A watch that reached its deadline stays open (its stream, on its member) for the next
        wait of the same key from a later revision: a waiter that reads again every few seconds
        (to log who is missing) keeps one stream instead of opening one per read, which on a
        busy client could time out before it even reached etcd. It reports changes from an
        earlier revision on: at worst a change the new read saw already wakes the waiter, which
        reads again. :meth:`release_watch` closes it (the client does at the end of each call).
        """
        left = deadline.remaining(0.0)
        if left <= 0:
            return None
        held = self._held
        if held is None or (held.key, held.prefix, held.member) != (key, prefix, self._current) or held.after > after:
            await self.release_watch()
            create: dict[str, Any] = {"key": b64(key), "start_revision": after + 1}
            if prefix:
                create["range_end"] = b64(prefix_end(key))
            held = self._held = _Watch(key, prefix, after, self._current,
                                       asyncio.ensure_future(self._first_event(self._current, create)))
        done, _ = await asyncio.wait({held.task}, timeout=left)
        if not done:
            return None
        self._held = None
        try:
            return held.task.result()
        except NO_ANSWER as exc:  # no stream, or it broke: its member went away
            logger.debug("etcd member %s: %s (watch %s)", self._urls[held.member], _reason(exc), key)
            self._current = (held.member + 1) % len(self._urls)
            await asyncio.sleep(min(deadline.remaining(0.0), ops.backoff(10)))  # backoff, then read again
            return ()

    async def release_watch(self) -> None:
        """Close the watch kept open by :meth:`watch_rows`, if any."""
        held, self._held = self._held, None
        if held is not None:
            held.task.cancel()
            await asyncio.gather(held.task, return_exceptions=True)  # its stream closed, its error retrieved

    async def _first_event(self, index: int, create: dict[str, Any]) -> tuple[Row, ...]:
        # no read timeout: the waits on this stream have their deadlines (watch_rows), a dead
        # member's stream breaks, and a member that stops answering fails the waiter's next read
        async with self._member(index).post(self._url(index, "watch"), data=json.dumps({"create_request": create}),
                                            headers=self._headers() | _JSON, timeout=_STREAM_TIMEOUT) as response:
            if response.status != 200:
                self._current = (index + 1) % len(self._urls)
                return ()
            buffer = b""
            # the gateway sends one JSON line per event; a line (a roster) can be longer than
            # aiohttp's readline limit, so the lines are cut here
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    seen = ops.watch_line(line)
                    if seen.wakes:
                        return seen.rows  # a change, or a watch etcd refused (compacted): read again
            return ()  # the stream ended: its member went away
