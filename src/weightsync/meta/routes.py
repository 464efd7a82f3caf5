"""The meta server's routes, in groups each registered on the app by one function
(:func:`weightsync.meta.server.create_app` calls them all). Long-polls are held at most
``ServerConfig.max_wait`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Literal

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

import weightsync
from weightsync.meta import status_page, wire
from weightsync.meta.leases import LeaseHeldError
from weightsync.meta.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from weightsync.meta.metrics import ServerMetrics
from weightsync.meta.requests import (
    JOB_PATTERN,
    MAX_INT,
    AppliedBody,
    CompareAndSetBody,
    Count,
    Documents,
    FailedBody,
    Job,
    LeaseBody,
    RegisterBody,
    VersionBody,
    Wait,
    _check_key,
    _describe,
    _parse,
    _reply,
)
from weightsync.meta.state import ConflictError, MetaState, RecordError
from weightsync.meta.store import StoreError
from weightsync.ports.records import MAX_RANK


def _holder(max_wait: float) -> Callable[[float], float]:
    """How long a long-poll asking for ``wait`` seconds is held: at most ``max_wait`` (``ServerConfig``)."""
    def held(wait: float) -> float:
        return min(wait, max_wait)
    return held


def register_error_handlers(app: FastAPI) -> None:
    """Errors the state raises, as the HTTP status that names them (409, 422, 503)."""

    @app.exception_handler(ConflictError)
    async def _conflict(request: Request, exc: ConflictError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _describe(list(exc.errors()), "request")}, status_code=422)

    @app.exception_handler(OSError)
    async def _disk(request: Request, exc: OSError) -> JSONResponse:
        return JSONResponse({"detail": f"the server could not persist the change: {exc}"}, status_code=503)

    @app.exception_handler(StoreError)
    async def _store(request: Request, exc: StoreError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(LeaseHeldError)
    async def _held(request: Request, exc: LeaseHeldError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(RecordError)
    async def _record(request: Request, exc: RecordError) -> JSONResponse:
        return JSONResponse({"detail": f"invalid request: {exc}"}, status_code=422)


def register_service_routes(app: FastAPI, state: MetaState, metrics: ServerMetrics) -> None:
    """Liveness, metrics, the status page and this server's identity (no job involved)."""
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
        return _reply(request, state.status(job))

    @app.get("/v1/server")
    async def server_identity(request: Request) -> Response:
        return _reply(request, {"instance": state.instance, "durable": state.durable, "started_at": state.started_at,
                                "version": weightsync.__version__})


def register_roster_routes(app: FastAPI, state: MetaState, max_wait: float) -> None:
    """Registration of a job's ranks, its roster (a barrier when asked), and forgetting a job."""
    held = _holder(max_wait)

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
        body = await _parse(request, RegisterBody)
        return await state.register(job, body.role, body.rank, group=body.group, host=body.host,
                                    endpoints=body.endpoints, layout=body.layout)

    @app.post("/v1/jobs/{job}/participants")
    async def post_participant(request: Request, job: Job) -> Response:
        return _reply(request, {"created": await register(request, job)})

    @app.get("/v1/jobs/{job}/participants")
    async def get_participants(request: Request, job: Job, *, writers: Count = 0, readers: Count = 0,
                               wait: Wait = 0.0, documents: Documents = ()) -> Response:
        return await roster(request, job, writers=writers, readers=readers, wait=wait, documents=documents)

    @app.post("/v1/jobs/{job}/join")
    async def join(request: Request, job: Job, *, writers: Count = 0, readers: Count = 0, wait: Wait = 0.0,
                   documents: Documents = ()) -> Response:
        await register(request, job)
        return await roster(request, job, writers=writers, readers=readers, wait=wait, documents=documents)

    @app.delete("/v1/jobs/{job}")
    async def delete_job(request: Request, job: Job) -> Response:
        return _reply(request, {"deleted": await state.delete_job(job)})


def register_document_routes(app: FastAPI, state: MetaState, max_wait: float) -> None:
    """A job's documents (raw bytes by key) and counters (compare-and-set integers)."""
    held = _holder(max_wait)

    @app.put("/v1/jobs/{job}/documents/{key:path}")
    async def put_document(request: Request, job: Job, key: str) -> Response:
        _check_key(key)
        value = await request.body()
        await state.put_document(job, key, value)
        return _reply(request, {"stored": len(value)})

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
        return _reply(request, {"value": await state.wait_counter(job, name, at_least, held(wait))})

    @app.post("/v1/jobs/{job}/counters/{name:path}")
    async def compare_and_set(request: Request, job: Job, name: str) -> Response:
        _check_key(name)
        body = await _parse(request, CompareAndSetBody)
        swapped, value = await state.compare_and_set(job, name, expected=body.expected, value=body.value)
        return _reply(request, {"swapped": swapped, "value": value})


def register_version_routes(app: FastAPI, state: MetaState, max_wait: float) -> None:
    """The version handshake: writers' reports, the latest version, readers' progress."""
    held = _holder(max_wait)

    @app.post("/v1/jobs/{job}/versions")
    async def post_version(request: Request, job: Job) -> Response:
        body = await _parse(request, VersionBody)
        info = await state.report_version(job, body.version, body.fingerprint, writer_rank=body.writer_rank,
                                          num_writers=body.num_writers, epoch=body.epoch)
        return _reply(request, {"published": info.to_wire() if info else None})

    @app.get("/v1/jobs/{job}/versions/latest")
    async def latest_version(request: Request, job: Job, after: Annotated[int, Query(ge=-1, lt=MAX_INT)] = -1,
                             wait: Wait = 0.0,
                             after_epoch: Annotated[int | None, Query(ge=-1, lt=MAX_INT)] = None) -> Response:
        info = await state.wait_version(job, after, held(wait), after_epoch)
        return _reply(request, {"latest": info.to_wire() if info else None})

    @app.post("/v1/jobs/{job}/readers/{rank}/applied")
    async def applied(request: Request, job: Job, rank: Annotated[int, Path(ge=0, lt=MAX_RANK)]) -> Response:
        body = await _parse(request, AppliedBody)
        await state.report_reader(job, rank, body.version, nbytes=body.nbytes, seconds=body.seconds)
        return _reply(request, {"ok": True})

    @app.post("/v1/jobs/{job}/readers/{rank}/failed")
    async def failed(request: Request, job: Job, rank: Annotated[int, Path(ge=0, lt=MAX_RANK)]) -> Response:
        body = await _parse(request, FailedBody)
        await state.report_reader(job, rank, body.version, error=body.error, epoch=body.epoch, invalid=body.invalid,
                                  holds=None if body.invalid else body.holds)
        return _reply(request, {"ok": True})

    @app.get("/v1/jobs/{job}/readers")
    async def readers(request: Request, job: Job, *, min_version: Annotated[int, Query(ge=0, lt=MAX_INT)] = 0,
                      count: Annotated[int, Query(ge=0, le=MAX_RANK)] = 0,
                      settled: Annotated[int | None, Query(ge=0, le=MAX_RANK)] = None,
                      applied: Annotated[int, Query(ge=0, le=MAX_RANK)] = 0, wait: Wait = 0.0) -> Response:
        if count:
            await state.wait_readers(job, min_version=min_version, count=count, wait=held(wait), settled=settled,
                                     applied=applied)
        latest = state.latest(job)
        return _reply(request, {"latest": latest.to_wire() if latest else None, "readers": state.readers(job)})


def register_lease_routes(app: FastAPI, state: MetaState, max_wait: float) -> None:
    """Participants' leases: take, renew or release one; the table of all."""
    held = _holder(max_wait)

    @app.post("/v1/jobs/{job}/leases/{role}/{rank}")
    async def lease(request: Request, job: Job, role: Literal["writer", "reader"],
                    rank: Annotated[int, Path(ge=0, lt=MAX_RANK)], wait: Wait = 0.0) -> Response:
        body = await _parse(request, LeaseBody)
        took_over = await state.leases.acquire(job, role, rank, incarnation=body.incarnation, ttl=body.ttl,
                                               pid=body.pid, host=body.host, wait=held(wait), release=body.release)
        return _reply(request, {"took_over": took_over})

    @app.get("/v1/jobs/{job}/leases")
    async def leases(request: Request, job: Job) -> Response:
        return _reply(request, {"leases": [row.to_wire() for row in state.leases.table(job)]})
