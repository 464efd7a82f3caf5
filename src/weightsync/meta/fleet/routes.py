"""The fleet coordinator's routes on the meta server: commands in, ``decide``'s replies out.

The server applies :func:`~weightsync.meta.fleet.decide.decide` under its lock
(:meth:`MetaState.decide_fleet <weightsync.meta.state.MetaState.decide_fleet>`) and stores
each change as the command itself, replayed through ``decide`` after a restart. Routes (the
server's token and body rules apply; bodies and answers are msgpack or JSON)::

    POST /v1/jobs/{job}/fleet/tick         expire members whose lease ran out, decide deadlines
    POST /v1/jobs/{job}/fleet/beat         {role, id, incarnation}: a heartbeat -> {"live": bool}
    POST /v1/jobs/{job}/fleet/{op}         op: join | leave | open | ready | fail | report; the body
                                           holds the command's fields (meta/fleet/commands.py),
                                           a join may add "ttl" (its lease period, seconds)
    GET  /v1/jobs/{job}/fleet?after&wait   {"revision", "record"}; long-polls for revision > after

A command answers ``{"reply": Reply, "generation": n, "revision": n}``; a command that
contradicts the job answers 409 with ``decide``'s message, a malformed one 422 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from weightsync.meta import wire
from weightsync.meta.fleet.commands import MEMBER_OPS, command_from_wire
from weightsync.meta.fleet.decide import FleetConflictError
from weightsync.meta.fleet.leases import check_ttl
from weightsync.meta.records import check_job
from weightsync.meta.state import MetaState
from weightsync.ports.fleet import FleetWireError
from weightsync.ports.fleet.policy import ROLES, is_int


def _job(job: str) -> str:
    try:
        return check_job(job)
    except ValueError as exc:
        raise HTTPException(422, f"invalid request: field 'job': {exc}") from None


async def _body(request: Request) -> dict[str, Any]:
    data = await request.body()
    ctype = wire.media_type(request.headers.get("content-type"))
    try:
        if wire.is_msgpack(ctype):
            doc = wire.unpack(data)
        elif ctype in ("application/json", ""):
            doc = json.loads(data or b"{}")
        else:
            raise HTTPException(415, f"unsupported content type {ctype!r}: send application/msgpack or "
                                     "application/json")
    except wire.BodyError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    except ValueError as exc:
        raise HTTPException(400, f"body is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise HTTPException(422, "invalid request: the body must be a map of the command's fields")
    return doc


def _answer(request: Request, obj: Any) -> Response:
    body, ctype = wire.encode(obj, msgpack_=wire.wants_msgpack(request.headers.get("accept")))
    return Response(body, media_type=ctype)


def _ttl(doc: dict[str, Any]) -> float | None:
    try:
        return check_ttl(doc.pop("ttl", None))
    except ValueError as exc:
        raise HTTPException(422, f"invalid request: {exc}") from None


def fleet_router(state: MetaState, *, max_wait: float) -> APIRouter:
    """The fleet routes over ``state`` (see module docstring); long-polls end after ``max_wait``."""
    router = APIRouter()

    @router.post("/v1/jobs/{job}/fleet/tick")
    async def tick(request: Request, job: str) -> Response:
        expired = await state.fleet_tick(_job(job))
        return _answer(request, {"expired": [[e.role, e.id, e.incarnation] for e in expired],
                                 "generation": state.fleet(job).generation.number,
                                 "revision": state.fleet_revision(job)})

    @router.post("/v1/jobs/{job}/fleet/beat")
    async def beat(request: Request, job: str) -> Response:
        doc: dict[str, Any] = await _body(request)
        role, inc = doc.get("role"), doc.get("incarnation")
        id_: Any = doc.get("id")
        if role not in ROLES or not is_int(id_) or not isinstance(inc, str) or set(doc) - {"role", "id", "incarnation"}:
            raise HTTPException(422, "invalid request: a heartbeat is {role: 'writer'|'reader', id: int, "
                                     f"incarnation: str}}, not {doc!r:.80}")
        return _answer(request, {"live": state.fleet_beat(_job(job), str(role), id_, str(inc))})

    @router.post("/v1/jobs/{job}/fleet/{op}")
    async def command(request: Request, job: str, op: Literal[MEMBER_OPS]) -> Response:  # type: ignore[valid-type]
        doc = await _body(request)
        ttl = _ttl(doc) if op == "join" else None
        try:
            parsed = command_from_wire({**doc, "op": op})
        except FleetWireError as exc:
            raise HTTPException(422, f"invalid request: {exc}") from None
        try:
            decision = await state.decide_fleet(_job(job), parsed, ttl=ttl)
        except FleetConflictError as exc:
            raise HTTPException(409, str(exc)) from None
        return _answer(request, {"reply": decision.reply.to_wire(), "generation": decision.record.generation.number,
                                 "revision": state.fleet_revision(job)})

    @router.get("/v1/jobs/{job}/fleet")
    async def record(request: Request, job: str, after: Annotated[int, Query(ge=-1, lt=1 << 62)] = -1,
                     wait: Annotated[float, Query(ge=0, le=3600)] = 0.0) -> Response:
        revision, current = await state.wait_fleet(_job(job), after, min(wait, max_wait))
        return _answer(request, {"revision": revision, "record": current.to_wire()})

    return router


__all__ = ["fleet_router"]
