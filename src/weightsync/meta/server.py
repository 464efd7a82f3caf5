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
import functools
import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import weightsync
from weightsync.meta import status_page, wire
from weightsync.meta.bodies import (
    MAX_INT,
    AppliedBody,
    CompareAndSetBody,
    FailedBody,
    LeaseBody,
    RegisterBody,
    VersionBody,
    describe_errors,
    encode_reply,
    parse_body,
)
from weightsync.meta.fleet.routes import fleet_router
from weightsync.meta.leases import LeaseHeldError
from weightsync.meta.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from weightsync.meta.metrics import ServerMetrics
from weightsync.meta.records import check_document_key
from weightsync.meta.state import ConflictError, MetaState, RecordError
from weightsync.meta.store import StoreError
from weightsync.ports.records import MAX_RANK

logger = logging.getLogger(__name__)

INSTANCE_HEADER = b"x-weightsync-instance"
EXPECT_HEADER = b"x-weightsync-expect-instance"

JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
PUBLIC_PATHS = frozenset({"/healthz"})
Job = Annotated[str, Path(pattern=JOB_PATTERN, description="job namespace")]
Wait = Annotated[float, Query(ge=0, le=3600, description="seconds to hold the request (long-poll)")]
Count = Annotated[int, Query(ge=0, lt=1 << 31, description="barrier: wait for this many registered")]
Documents = Annotated[Sequence[str], Query(max_length=64, description="documents to include in the answer")]


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

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": describe_errors(list(exc.errors()), "request")}, status_code=422)

    for kind, status, prefix in ((ConflictError, 409, ""), (LeaseHeldError, 409, ""), (StoreError, 503, ""),
                                 (OSError, 503, "the server could not persist the change: "),
                                 (RecordError, 422, "invalid request: ")):
        app.add_exception_handler(kind, _error_handler(status, prefix))

    app.include_router(fleet_router(state, max_wait=config.max_wait))
    held = functools.partial(min, config.max_wait)  # a long-poll is held at most max_wait
    _status_and_participant_routes(app, state, metrics, held)
    _document_and_version_routes(app, state, held)
    _reader_and_lease_routes(app, state, held)
    return app


def _status_and_participant_routes(app: FastAPI, state: MetaState, metrics: ServerMetrics,
                                   held: Callable[[float], float]) -> None:
    @app.get("/healthz", response_class=PlainTextResponse)
    async def healthz() -> Response:
        broken = state.broken()
        if broken is not None:  # a server that cannot persist changes must not look healthy
            return PlainTextResponse(f"unhealthy: {broken}", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/status", response_class=HTMLResponse)
    async def status_html() -> str:
        return status_page.render(state.status())

    @app.get("/v1/status")
    async def status_json(request: Request, job: Annotated[str | None, Query(pattern=JOB_PATTERN)] = None) -> Response:
        return encode_reply(request, state.status(job))

    async def roster(request: Request, job: str, *, writers: int, readers: int, wait: float,
                     documents: Sequence[str]) -> Response:
        for key in documents:
            _check_key(key)
        if writers or readers:
            await state.wait_registered(job, writers=writers, readers=readers, wait=held(wait))
        msgpack_ = wire.wants_msgpack(request.headers.get("accept"))
        body = state.roster(job, msgpack_=msgpack_)
        if documents:
            body = wire.extend_map(body, {"documents": {k: state.document(job, k) for k in documents}},
                                   msgpack_=msgpack_)
        return Response(body, media_type=wire.MSGPACK if msgpack_ else wire.JSON)

    async def register(request: Request, job: str) -> bool:
        body = await parse_body(request, RegisterBody)
        return await state.register(job, body.role, body.rank, group=body.group, host=body.host,
                                    endpoints=body.endpoints, layout=body.layout)

    @app.post("/v1/jobs/{job}/participants")
    async def post_participant(request: Request, job: Job) -> Response:
        return encode_reply(request, {"created": await register(request, job)})

    @app.get("/v1/jobs/{job}/participants")
    async def get_participants(request: Request, job: Job, *, writers: Count = 0, readers: Count = 0,
                               wait: Wait = 0.0, documents: Documents = ()) -> Response:
        return await roster(request, job, writers=writers, readers=readers, wait=wait, documents=documents)

    @app.post("/v1/jobs/{job}/join")
    async def join(request: Request, job: Job, *, writers: Count = 0, readers: Count = 0, wait: Wait = 0.0,
                   documents: Documents = ()) -> Response:
        await register(request, job)
        return await roster(request, job, writers=writers, readers=readers, wait=wait, documents=documents)



def _document_and_version_routes(app: FastAPI, state: MetaState, held: Callable[[float], float]) -> None:
    @app.put("/v1/jobs/{job}/documents/{key:path}")
    async def put_document(request: Request, job: Job, key: str) -> Response:
        _check_key(key)
        value = await request.body()
        await state.put_document(job, key, value)
        return encode_reply(request, {"stored": len(value)})

    @app.get("/v1/jobs/{job}/documents/{key:path}")
    async def get_document(job: Job, key: str, wait: Wait = 0.0) -> Response:
        _check_key(key)
        value = await state.wait_document(job, key, held(wait))
        if value is None:
            return JSONResponse({"detail": f"no document {key!r} in job {job!r}"}, status_code=404)
        return Response(value, media_type=wire.OCTETS)

    @app.get("/v1/jobs/{job}/counters/{name:path}")
    async def get_counter(request: Request, job: Job, name: str,
                          at_least: Annotated[int, Query(ge=0, lt=MAX_INT)] = 0, wait: Wait = 0.0) -> Response:
        _check_key(name)
        return encode_reply(request, {"value": await state.wait_counter(job, name, at_least, held(wait))})

    @app.post("/v1/jobs/{job}/counters/{name:path}")
    async def compare_and_set(request: Request, job: Job, name: str) -> Response:
        _check_key(name)
        body = await parse_body(request, CompareAndSetBody)
        swapped, value = await state.compare_and_set(job, name, expected=body.expected, value=body.value)
        return encode_reply(request, {"swapped": swapped, "value": value})

    @app.post("/v1/jobs/{job}/versions")
    async def post_version(request: Request, job: Job) -> Response:
        body = await parse_body(request, VersionBody)
        info = await state.report_version(job, body.version, body.fingerprint, writer_rank=body.writer_rank,
                                          num_writers=body.num_writers, epoch=body.epoch)
        return encode_reply(request, {"published": info.to_wire() if info else None})

    @app.get("/v1/jobs/{job}/versions/latest")
    async def latest_version(request: Request, job: Job, after: Annotated[int, Query(ge=-1, lt=MAX_INT)] = -1,
                             wait: Wait = 0.0,
                             after_epoch: Annotated[int | None, Query(ge=-1, lt=MAX_INT)] = None) -> Response:
        info = await state.wait_version(job, after, held(wait), after_epoch)
        return encode_reply(request, {"latest": info.to_wire() if info else None})



def _reader_and_lease_routes(app: FastAPI, state: MetaState, held: Callable[[float], float]) -> None:
    @app.post("/v1/jobs/{job}/readers/{rank}/applied")
    async def applied(request: Request, job: Job, rank: Annotated[int, Path(ge=0, lt=MAX_RANK)]) -> Response:
        body = await parse_body(request, AppliedBody)
        await state.report_reader(job, rank, body.version, nbytes=body.nbytes, seconds=body.seconds)
        return encode_reply(request, {"ok": True})

    @app.post("/v1/jobs/{job}/readers/{rank}/failed")
    async def failed(request: Request, job: Job, rank: Annotated[int, Path(ge=0, lt=MAX_RANK)]) -> Response:
        body = await parse_body(request, FailedBody)
        await state.report_reader(job, rank, body.version, error=body.error, epoch=body.epoch, invalid=body.invalid,
                                  holds=None if body.invalid else body.holds)
        return encode_reply(request, {"ok": True})

    @app.get("/v1/jobs/{job}/readers")
    async def readers(request: Request, job: Job, min_version: Annotated[int, Query(ge=0, lt=MAX_INT)] = 0,
                      count: Annotated[int, Query(ge=0, le=MAX_RANK)] = 0, wait: Wait = 0.0) -> Response:
        if count:
            await state.wait_readers(job, min_version=min_version, count=count, wait=held(wait))
        latest = state.latest(job)
        return encode_reply(request, {"latest": latest.to_wire() if latest else None, "readers": state.readers(job)})

    @app.get("/v1/server")
    async def server_identity(request: Request) -> Response:
        return encode_reply(request, {"instance": state.instance, "durable": state.durable,
                                      "started_at": state.started_at, "version": weightsync.__version__})

    @app.post("/v1/jobs/{job}/leases/{role}/{rank}")
    async def lease(request: Request, job: Job, role: Literal["writer", "reader"],
                    rank: Annotated[int, Path(ge=0, lt=MAX_RANK)], wait: Wait = 0.0) -> Response:
        body = await parse_body(request, LeaseBody)
        took_over = await state.leases.acquire(job, role, rank, incarnation=body.incarnation, ttl=body.ttl,
                                               pid=body.pid, host=body.host, wait=held(wait), release=body.release)
        return encode_reply(request, {"took_over": took_over})

    @app.get("/v1/jobs/{job}/leases")
    async def leases(request: Request, job: Job) -> Response:
        return encode_reply(request, {"leases": [row.to_wire() for row in state.leases.table(job)]})

    @app.delete("/v1/jobs/{job}")
    async def delete_job(request: Request, job: Job) -> Response:
        return encode_reply(request, {"deleted": await state.delete_job(job)})



def _error_handler(status: int, prefix: str) -> Any:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"{prefix}{exc}"}, status_code=status)
    return handle


def _check_key(key: str) -> None:
    try:
        check_document_key(key)
    except ValueError as exc:
        raise HTTPException(422, f"invalid request: field 'key': {exc}") from None
