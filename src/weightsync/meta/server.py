"""The meta server's HTTP API: a FastAPI app over :class:`~weightsync.meta.state.MetaState`.

    app = create_app(MetaState(), ServerConfig(token="s3cret"))
    uvicorn.run(app, host="127.0.0.1", port=0)     # or EmbeddedMetaServer / weightsync meta-server

Routes (all but ``/healthz`` need ``Authorization: Bearer <token>``; ``{job}`` namespaces jobs)::

    GET  /healthz                                     liveness, no token
    GET  /metrics                                     Prometheus
    GET  /status  |  /v1/status[?job=]                HTML page  |  JSON
    POST /v1/jobs/{job}/participants                  register one rank (idempotent; 409 if different)
    GET  /v1/jobs/{job}/participants?writers&readers&wait&documents   roster; long-polls for a barrier
    POST /v1/jobs/{job}/join?writers&readers&wait&documents   register + barrier + roster in one trip
    PUT  /v1/jobs/{job}/documents/{key}               raw bytes
    GET  /v1/jobs/{job}/counters/{name}?at_least&wait an integer (0 until set); long-polls for >= at_least
    POST /v1/jobs/{job}/counters/{name}               compare-and-set: {"expected": e, "value": v}
    GET  /v1/jobs/{job}/documents/{key}?wait          raw bytes; 404 if absent after the wait
    POST /v1/jobs/{job}/versions                      a writer's "version V is ready" report
    GET  /v1/jobs/{job}/versions/latest?after&wait    long-poll for a version newer than ``after``
                                      [&after_epoch]  ... or version ``after`` in a later epoch
    POST /v1/jobs/{job}/readers/{rank}/applied|failed a reader's progress
    GET  /v1/jobs/{job}/readers?min_version&count&wait       reader versions; long-poll
    DELETE /v1/jobs/{job}                             forget a job
    POST /v1/jobs/{job}/leases/{role}/{rank}?wait      take, renew or release a participant's lease
    GET  /v1/jobs/{job}/leases                        every lease: holder, alive, seconds since its heartbeat
    GET  /v1/server                                   this server's instance (the identity of its state)
    .../v1/jobs/{job}/fleet[/{op}]                    the fleet coordinator (meta/fleet/routes.py)

**Identity.** Every answer carries ``X-Weightsync-Instance``: the identity of the server's
state, new for every empty state and kept in ``--state-dir``. A request with
``X-Weightsync-Expect-Instance`` naming another one gets 412: the client registered with a
server whose state this one does not have (it restarted without its state directory), so
its job's registrations and versions are gone; clients then fail at once instead of waiting.

Bodies are msgpack (``Content-Type: application/msgpack``) or JSON; answers follow ``Accept``.
Errors are JSON ``{"detail": "..."}``: 401 token, 404, 409 conflict, 412 another server
state, 413 too large, 415 media type, 422 schema (naming the field), 503 the store cannot take
the change (a full disk: nothing was changed; the same request succeeds once it can).
Long-polls are held at most ``max_wait`` seconds and answer
with the current state when they end, so a client simply asks again.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import weightsync
from weightsync.meta import wire
from weightsync.meta.fleet.routes import fleet_router
from weightsync.meta.metrics import ServerMetrics
from weightsync.meta.routes import (
    register_document_routes,
    register_error_handlers,
    register_lease_routes,
    register_roster_routes,
    register_service_routes,
    register_version_routes,
)
from weightsync.meta.state import MetaState

logger = logging.getLogger(__name__)

INSTANCE_HEADER = b"x-weightsync-instance"
EXPECT_HEADER = b"x-weightsync-expect-instance"

PUBLIC_PATHS = frozenset({"/healthz"})



@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Settings of one server.

    Attributes:
        token: the shared secret every request (but ``/healthz``) must carry.
        max_body_bytes: larger request bodies are refused with 413.
        max_wait: the longest a long-poll is held before it answers with the current state.
    """

    token: str
    max_body_bytes: int = 64 << 20
    max_wait: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.token, str) or len(self.token) < 8:
            raise ValueError("the meta server token must be a string of at least 8 characters "
                             "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} is too small; use at least 1024")
        if not 0 < self.max_wait <= 3600:
            raise ValueError(f"max_wait={self.max_wait} must be in (0, 3600] seconds")



# --- the guard: token, body size, metrics --------------------------------------------------------

class Guard:
    """ASGI middleware: checks the token, caps request bodies and records request metrics."""

    def __init__(self, app: ASGIApp, *, token: str, max_body_bytes: int, metrics: ServerMetrics,
                 state: MetaState) -> None:
        self.app = app
        self.state = state
        self.token = token.encode()
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, cred = value.partition(b" ")
                if scheme.lower() == b"basic":
                    try:
                        cred = base64.b64decode(cred, validate=True).partition(b":")[2]
                    except (binascii.Error, ValueError):
                        return False
                elif scheme.lower() != b"bearer":
                    return False
                return hmac.compare_digest(cred.strip(), self.token)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        instance = self.state.instance.encode()

        async def send_recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (INSTANCE_HEADER, instance)]}
            await send(message)

        try:
            if scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
                await _send_error(send_recording, 401, "missing or wrong token: send 'Authorization: Bearer "
                                  "<token>' with the server's token (WEIGHTSYNC_META_TOKEN or "
                                  "WEIGHTSYNC_META_TOKEN_FILE)",
                                  [(b"www-authenticate", b'Bearer realm="weightsync"'),
                                   (b"www-authenticate", b'Basic realm="weightsync"')])
                return
            expected = next((v for k, v in scope["headers"] if k == EXPECT_HEADER), None)
            if expected is not None and expected != instance:
                await _send_error(send_recording, 412, self._other_state(expected.decode("latin-1")))
                return
            length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                await _send_error(send_recording, 413, f"request body of {int(length)} bytes exceeds the "
                                  f"server's limit of {self.max_body_bytes} (--max-body-bytes)")
                return
            await self.app(scope, self._capped(receive), send_recording)
        finally:
            route = scope.get("route")
            self.metrics.observe(getattr(route, "path", "other"), scope["method"], status,
                                 time.perf_counter() - started)

    def _other_state(self, expected: str) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.state.started_at))
        if self.state.durable:
            how = "with a state directory that is not the one, or was restored or rolled back to an earlier state"
            then = ("the job's registrations, versions and reader progress may be gone or older than what this "
                    "client saw: register again")
        else:
            how = "without --state-dir"
            then = ("it lost the job's registrations, versions and reader progress. Run it with --state-dir to "
                    "ride out restarts")
        return (f"this meta server (instance {self.state.instance}, started {started}, {how}) is not the server "
                f"instance {expected} this client registered with: {then}")

    def _capped(self, receive: Receive) -> Receive:
        seen = 0

        async def capped_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, f"request body exceeds the server's limit of {self.max_body_bytes} "
                                             "bytes (--max-body-bytes)")
            return message
        return capped_receive


async def _send_error(send: Send, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = wire.to_json({"detail": detail})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


# --- the app -------------------------------------------------------------------------------------

def create_app(state: MetaState, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``state``. Its lifespan starts and closes the state."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.close()

    options: dict[str, Any] = {}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        # newer FastAPI checks for OpenTelemetry providers on every request; /metrics covers us
        options["telemetry"] = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="weightsync meta server", version=weightsync.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, **options)
    metrics = ServerMetrics(state)
    app.add_middleware(Guard, token=config.token, max_body_bytes=config.max_body_bytes, metrics=metrics, state=state)
    app.state.meta = state
    register_error_handlers(app)
    app.include_router(fleet_router(state, max_wait=config.max_wait))
    register_service_routes(app, state, metrics)
    register_roster_routes(app, state, config.max_wait)
    register_document_routes(app, state, config.max_wait)
    register_version_routes(app, state, config.max_wait)
    register_lease_routes(app, state, config.max_wait)
    return app
