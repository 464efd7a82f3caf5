"""Running the meta server: in-process (:class:`EmbeddedMetaServer`) or as ``weightsync meta-server``.

Single-machine runs need not start anything by hand: ``weightsync.meta.connect()`` starts an
embedded server on a daemon thread, bound to 127.0.0.1 on a free port, with a random token::

    with EmbeddedMetaServer() as server:
        with MetaClient(server.address, token=server.token) as client:
            ...

:func:`prepare_server` builds what both ways of running need: the listening socket (bound
before serving, so port 0 resolves to a real port at once), the state (replayed from the state
directory, if any) and a uvicorn server that wakes all long-polls when shutdown begins.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import uvicorn

from weightsync.clock.clock import SYSTEM, Clock
from weightsync.meta.config import new_token
from weightsync.meta.server import ServerConfig, create_app
from weightsync.meta.sqlite_store import SqliteStore
from weightsync.meta.state import MetaState

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn, plus: long-polls answer as soon as shutdown begins instead of holding it up."""

    def __init__(self, config: uvicorn.Config, state: MetaState) -> None:
        super().__init__(config)
        self.state = state
        self.ready = threading.Event()  # set once serving, or once run() ended (startup failed)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            super().run(sockets=sockets)
        finally:
            self.ready.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.watch.close()
        await super().shutdown(sockets=sockets)


def _nodelay_http_protocol() -> type[Any]:
    """uvicorn's HTTP protocol, with ``TCP_NODELAY`` on every accepted connection.

    A response leaves in more than one segment (headers, then body); without NODELAY the
    second waits for the client's delayed ACK, so every meta call took ~44 ms on Linux
    loopback instead of ~1.5 ms. Servers started from a pre-bound socket (ours) do not get
    NODELAY from asyncio's accept path, hence this.
    """
    base: type[Any]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    except ImportError:  # httptools is optional in uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol

    class NoDelayProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)

    return NoDelayProtocol


def raise_open_file_limit(wanted: int = 65536) -> int:
    """Raise this process's soft limit on open files toward ``wanted`` (capped by the hard limit).

    Every rank of a job keeps a connection to the meta server: 1280 ranks need more than the
    common default soft limit of 1024 descriptors. Returns the new soft limit.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logger.info("raised the open-file limit from %d to %d", soft, target)
        return target
    return soft


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=4096)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port "
                         "or --port 0 for a free one") from exc
    sock.set_inheritable(False)
    return sock


@dataclass(frozen=True, slots=True)
class PreparedServer:
    server: _Server
    sock: socket.socket
    state: MetaState

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])


def prepare_server(*, host: str = "127.0.0.1", port: int = 0, token: str,
                   state_dir: str | os.PathLike[str] | None = None, max_body_bytes: int = 64 << 20,
                   max_wait: float = 30.0, compact_bytes: int = 64 << 20, loop: str = "auto",
                   log_level: str = "warning", clock: Clock = SYSTEM, fleet_tick: float | None = 1.0
                   ) -> PreparedServer:
    """Load the state and bind the socket; ``server.run(sockets=[sock])`` then serves.

    ``clock`` is the fleet coordinator's time (a test passes a ManualClock, and ``fleet_tick=None``
    to tick the fleet itself instead of the server's timer)."""
    config = ServerConfig(token=token, max_body_bytes=max_body_bytes, max_wait=max_wait)
    state = MetaState(SqliteStore(state_dir, compact_bytes=compact_bytes) if state_dir is not None else None,
                      clock=clock, fleet_tick=fleet_tick)
    try:
        state.load()
        sock = bind(host, port)
    except BaseException:
        state.store.close()
        raise
    app = create_app(state, config)
    uv_config = uvicorn.Config(app, http=_nodelay_http_protocol(), lifespan="on",
                               log_level=log_level, access_log=False, loop=loop,
                               timeout_graceful_shutdown=5, timeout_keep_alive=75, server_header=False)
    return PreparedServer(_Server(uv_config, state), sock, state)


class EmbeddedMetaServer:
    """A meta server on a daemon thread of this process (context manager; :meth:`stop` to end it).

    Attributes:
        address: ``http://127.0.0.1:<port>``, for clients.
        token: the shared secret (random unless given).
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 state_dir: str | os.PathLike[str] | None = None, start_timeout: float = 30.0,
                 **options: Any) -> None:
        self.token = token or new_token()
        self.host = host
        self._port = port
        self._state_dir = state_dir
        self._options = options
        self._start_timeout = start_timeout
        self._prepared: PreparedServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        if self._prepared is None:
            raise RuntimeError("EmbeddedMetaServer.address before start()")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._prepared.port}"

    def start(self) -> EmbeddedMetaServer:
        """Start serving; returns once the server accepts requests.

        Raises:
            TimeoutError: it did not start within ``start_timeout`` seconds.
        """
        if self._thread is not None:
            raise RuntimeError("EmbeddedMetaServer already started")
        # loop="asyncio": never install uvloop's policy inside someone else's process
        prepared = prepare_server(host=self.host, port=self._port, token=self.token, state_dir=self._state_dir,
                                  loop="asyncio", **self._options)
        self._prepared = prepared
        self._thread = threading.Thread(target=prepared.server.run, kwargs={"sockets": [prepared.sock]},
                                        name=f"weightsync-meta-server:{prepared.port}", daemon=True)
        self._thread.start()
        prepared.server.ready.wait(self._start_timeout)
        if not prepared.server.started:
            self.stop()
            raise TimeoutError(f"the embedded meta server did not start within {self._start_timeout} s "
                               "(see the log for the cause)")
        logger.info("embedded meta server listening on %s", self.address)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (long-polls answer at once) and join the thread."""
        prepared, thread = self._prepared, self._thread
        if prepared is None or thread is None:
            return
        prepared.server.should_exit = True
        thread.join(timeout)
        if thread.is_alive():
            prepared.server.force_exit = True
            thread.join(timeout)
        if thread.is_alive():
            logger.error("the embedded meta server thread did not stop within %.0f s", 2 * timeout)
        prepared.sock.close()
        prepared.state.store.close()  # after a clean stop it is closed already (idempotent)
        self._thread = None

    def __enter__(self) -> EmbeddedMetaServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.address if self._prepared is not None else "not started"
        return f"EmbeddedMetaServer({where})"

