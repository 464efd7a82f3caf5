"""What the meta server's routes take and answer: path and query types, the request bodies
(strict pydantic models: an unknown or mistyped field is a 422 naming it), and the parsing and
encoding of bodies (msgpack or JSON, by ``Content-Type`` and ``Accept``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException

from weightsync.meta import wire
from weightsync.meta.records import check_document_key
from weightsync.ports.records import MAX_RANK

JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Job = Annotated[str, Path(pattern=JOB_PATTERN, description="job namespace")]
Wait = Annotated[float, Query(ge=0, le=3600, description="seconds to hold the request (long-poll)")]
Count = Annotated[int, Query(ge=0, lt=1 << 31, description="barrier: wait for this many registered")]
Documents = Annotated[Sequence[str], Query(max_length=64, description="documents to include in the answer")]
#: every integer the server stores or compares fits in msgpack's and the store's int64
MAX_INT = 1 << 62
VersionNumber = Annotated[int, Field(ge=0, lt=MAX_INT)]
Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]


# --- request bodies ------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, val_json_bytes="base64")


Name = Annotated[str, Field(max_length=256)]


class RegisterBody(_Body):
    role: Literal["writer", "reader"]
    rank: Annotated[int, Field(ge=0, lt=MAX_RANK)]
    group: Annotated[str, Field(max_length=128)] = ""
    host: Name = ""
    endpoints: Annotated[dict[Annotated[str, Field(min_length=1, max_length=64)],
                              Annotated[str, Field(max_length=1024)]], Field(max_length=64)] = {}
    layout: bytes = b""


class VersionBody(_Body):
    version: VersionNumber
    fingerprint: Annotated[str, Field(min_length=1, max_length=256)]
    writer_rank: Annotated[int, Field(ge=0, lt=MAX_RANK)]
    num_writers: Annotated[int, Field(ge=1, le=MAX_RANK)]
    epoch: Annotated[int, Field(ge=0, lt=MAX_INT)] = 0

    @model_validator(mode="after")
    def _rank_in_range(self) -> VersionBody:
        if self.writer_rank >= self.num_writers:
            raise ValueError(f"writer_rank {self.writer_rank} must be below num_writers {self.num_writers}")
        return self


class AppliedBody(_Body):
    version: VersionNumber
    nbytes: Annotated[int, Field(ge=0, lt=MAX_INT)] = 0
    seconds: Seconds = 0.0


class CompareAndSetBody(_Body):
    expected: Annotated[int, Field(ge=0, lt=MAX_INT)]
    value: Annotated[int, Field(ge=0, lt=MAX_INT)]


class LeaseBody(_Body):
    incarnation: Annotated[str, Field(min_length=1, max_length=64)]
    ttl: Annotated[float, Field(gt=0.01, le=3600, allow_inf_nan=False)]
    pid: Annotated[int, Field(ge=0, lt=1 << 31)] = 0
    host: Name = ""
    release: bool = False


class FailedBody(_Body):
    version: Annotated[int, Field(ge=-1, lt=MAX_INT)]
    error: Annotated[str, Field(max_length=4096)]
    epoch: Annotated[int | None, Field(ge=0, lt=MAX_INT)] = None
    #: the failure left the engine a mix of versions (clients that do not say: it did)
    invalid: bool = True
    #: the version a valid engine still serves (None: what it started with)
    holds: Annotated[int | None, Field(ge=0, lt=MAX_INT)] = None


M = TypeVar("M", bound=_Body)


def _describe(errors: list[Any], where: str = "body") -> str:
    parts = []
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
        field = ".".join(loc) if loc else where
        parts.append(f"field '{field}': {e.get('msg', 'invalid')}" if loc else f"{where}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


async def _parse(request: Request, model: type[M]) -> M:
    data = await request.body()
    ctype = wire.media_type(request.headers.get("content-type"))
    try:
        if wire.is_msgpack(ctype):
            return model.model_validate(wire.unpack(data))
        if ctype in ("application/json", ""):
            return model.model_validate_json(data)
    except ValidationError as exc:
        raise HTTPException(422, _describe(exc.errors(include_url=False))) from None
    except wire.BodyError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    raise HTTPException(415, f"unsupported content type {ctype!r}: send application/msgpack or application/json")


def _reply(request: Request, obj: Any) -> Response:
    body, ctype = wire.encode(obj, msgpack_=wire.wants_msgpack(request.headers.get("accept")))
    return Response(body, media_type=ctype)


def _check_key(key: str) -> None:
    try:
        check_document_key(key)
    except ValueError as exc:
        raise HTTPException(422, f"invalid request: field 'key': {exc}") from None
