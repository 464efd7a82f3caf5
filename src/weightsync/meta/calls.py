"""The meta server's API as data: each call is a request to send plus a parser for its answer.

Both clients (sync :class:`~weightsync.meta.client.MetaClient` and async
:class:`~weightsync.meta.client.AsyncMetaClient`) execute the same :class:`Call` objects, so
paths, bodies, error mapping and answer parsing exist once; the clients differ only in how
they wait (threads vs. asyncio).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote, urlencode

from weightsync.meta import wire
from weightsync.meta.fleet.answers import FleetAnswer, FleetTicked, FleetView
from weightsync.meta.fleet.commands import MEMBER_OPS, Command, command_to_wire
from weightsync.meta.records import ParticipantTable, check_document_key
from weightsync.ports.records import LeaseRow, ReaderReport, VersionInfo

T = TypeVar("T")

#: answers worth retrying: the server is restarting, overloaded or behind a proxy that is
RETRY_STATUSES = frozenset({502, 503, 504})
#: the request header naming the server instance a client pinned (see server.py, "Identity")
EXPECT_INSTANCE = "X-Weightsync-Expect-Instance"


class ServerStateLostError(ConnectionError):
    """The meta server is not the one this client registered with: it restarted without its
    state, so the job's registrations, versions and reader progress are gone (412)."""


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One HTTP request and how to read its answer.

    ``wait`` is how long the server may hold the request (a long-poll), so the client's read
    timeout is ``wait`` plus its own timeout. ``raw`` parsers get the body bytes, the others
    the decoded msgpack; ``missing_ok`` turns a 404 into ``parse(None)``.
    """

    method: str
    path: str
    parse: Callable[[Any], T]
    params: Mapping[str, Any] | None = None
    body: bytes | None = None
    content_type: str = wire.MSGPACK
    wait: float = 0.0
    raw: bool = False
    missing_ok: bool = False

    @property
    def url(self) -> str:
        return f"{self.path}?{urlencode(self.params, doseq=True)}" if self.params else self.path

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Content-Type": self.content_type} if self.body is not None else None


def detail(content: bytes) -> str:
    """The server's error message (errors are JSON ``{"detail": ...}``)."""
    try:
        obj = json.loads(content)
    except ValueError:
        return content[:300].decode("utf-8", "replace")
    return str(obj.get("detail", obj)) if isinstance(obj, dict) else str(obj)


def finish(call: Call[T], status: int, content: bytes, address: str) -> T:
    """Parse a non-retryable answer or raise the exception a user should see."""
    if status == 200:
        return call.parse(content if call.raw else wire.unpack(content))
    if status == 404 and call.missing_ok:
        return call.parse(None)
    reason = detail(content)
    where = f"{call.method} {address}{call.path}"
    if status == 401:
        raise PermissionError(f"the meta server at {address} rejected the token (401): {reason}")
    if status == 412:
        raise ServerStateLostError(f"meta server {address}: {reason}")
    if status in (400, 404, 409, 413, 415, 422):
        raise ValueError(reason if status == 409 else f"meta server refused {where} ({status}): {reason}")
    raise RuntimeError(f"meta server error on {where} ({status}): {reason}")


def _job(job: str) -> str:
    return f"/v1/jobs/{job}"


def _int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def register(job: str, participant: Any) -> Call[bool]:
    return Call("POST", f"{_job(job)}/participants", lambda o: bool(o["created"]),
                body=wire.pack(participant.to_wire()))


def _roster_params(writers: int, readers: int, wait: float, documents: Sequence[str]) -> dict[str, Any]:
    if isinstance(documents, str):
        raise TypeError("documents is a sequence of keys, e.g. documents=[key], not one string")
    return {"writers": _int("writers", writers), "readers": _int("readers", readers), "wait": f"{wait:.3f}",
            "documents": [check_document_key(k) for k in documents]}


def join(job: str, participant: Any, *, writers: int, readers: int, wait: float,
         documents: Sequence[str] = ()) -> Call[ParticipantTable]:
    return Call("POST", f"{_job(job)}/join", ParticipantTable.from_wire,
                params=_roster_params(writers, readers, wait, documents), body=wire.pack(participant.to_wire()),
                wait=wait)


def roster(job: str, *, writers: int = 0, readers: int = 0, wait: float = 0.0,
           documents: Sequence[str] = ()) -> Call[ParticipantTable]:
    return Call("GET", f"{_job(job)}/participants", ParticipantTable.from_wire,
                params=_roster_params(writers, readers, wait, documents), wait=wait)


def put_document(job: str, key: str, value: bytes) -> Call[None]:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"document values are bytes (e.g. msgpack.packb(obj)), not {type(value).__name__}")
    return Call("PUT", f"{_job(job)}/documents/{quote(check_document_key(key))}", lambda o: None,
                body=bytes(value), content_type=wire.OCTETS)


def get_document(job: str, key: str, *, wait: float) -> Call[bytes | None]:
    return Call("GET", f"{_job(job)}/documents/{quote(check_document_key(key))}", lambda b: b,
                params={"wait": f"{wait:.3f}"}, wait=wait, raw=True, missing_ok=True)


def counter(job: str, name: str, *, at_least: int = 0, wait: float = 0.0) -> Call[int]:
    return Call("GET", f"{_job(job)}/counters/{quote(check_document_key(name))}", lambda o: int(o["value"]),
                params={"at_least": _int("at_least", at_least), "wait": f"{wait:.3f}"}, wait=wait)


def compare_and_set(job: str, name: str, *, expected: int, value: int) -> Call[tuple[bool, int]]:
    body = {"expected": _int("expected", expected), "value": _int("value", value)}
    return Call("POST", f"{_job(job)}/counters/{quote(check_document_key(name))}",
                lambda o: (bool(o["swapped"]), int(o["value"])), body=wire.pack(body))


def publish_version(job: str, version: int, fingerprint: str, *, writer_rank: int,
                    num_writers: int, epoch: int = 0) -> Call[VersionInfo | None]:
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty str (the plan's fingerprint), got {fingerprint!r}")
    _int("num_writers", num_writers, 1)
    if not 0 <= _int("writer_rank", writer_rank) < num_writers:
        raise ValueError(f"writer_rank {writer_rank} must be below num_writers {num_writers}")
    body = {"version": _int("version", version), "fingerprint": fingerprint,
            "writer_rank": writer_rank, "num_writers": num_writers, "epoch": _int("epoch", epoch)}
    return Call("POST", f"{_job(job)}/versions", lambda o: VersionInfo.from_wire(o["published"]),
                body=wire.pack(body))


def latest_version(job: str, *, after: int = -1, wait: float = 0.0,
                   after_epoch: int | None = None) -> Call[VersionInfo | None]:
    params: dict[str, Any] = {"after": _int("after", after, -1), "wait": f"{wait:.3f}"}
    if after_epoch is not None:
        params["after_epoch"] = _int("after_epoch", after_epoch, -1)
    return Call("GET", f"{_job(job)}/versions/latest", lambda o: VersionInfo.from_wire(o["latest"]),
                params=params, wait=wait)


def report_applied(job: str, reader_rank: int, version: int, *, nbytes: int, seconds: float) -> Call[None]:
    body = {"version": _int("version", version), "nbytes": _int("nbytes", nbytes), "seconds": float(seconds)}
    return Call("POST", f"{_job(job)}/readers/{_int('reader_rank', reader_rank)}/applied", lambda o: None,
                body=wire.pack(body))


def report_failed(job: str, reader_rank: int, version: int, error: str, epoch: int | None = None, *,
                  invalid: bool = True, holds: int | None = None) -> Call[None]:
    body: dict[str, Any] = {"version": _int("version", version, -1), "error": str(error)[:4096],
                            "invalid": bool(invalid)}
    if epoch is not None:
        body["epoch"] = _int("epoch", epoch)
    if holds is not None and not invalid:
        body["holds"] = _int("holds", holds)
    return Call("POST", f"{_job(job)}/readers/{_int('reader_rank', reader_rank)}/failed", lambda o: None,
                body=wire.pack(body))


def readers(job: str, *, min_version: int = 0, count: int = 0, wait: float = 0.0, settled: int | None = None,
            applied: int = 0) -> Call[ReaderReport]:
    params = {"min_version": _int("min_version", min_version), "count": _int("readers", count),
              "wait": f"{wait:.3f}"}
    if settled is not None:
        params["settled"] = _int("settled", settled)
    if applied:
        params["applied"] = _int("applied", applied)
    return Call("GET", f"{_job(job)}/readers", ReaderReport.from_wire, params=params, wait=wait)


def server() -> Call[dict[str, Any]]:
    return Call("GET", "/v1/server", dict)


def lease(job: str, role: str, rank: int, *, incarnation: str, ttl: float, pid: int, host: str,
          wait: float = 0.0, release: bool = False) -> Call[bool]:
    body = {"incarnation": incarnation, "ttl": float(ttl), "pid": _int("pid", pid), "host": host,
            "release": bool(release)}
    return Call("POST", f"{_job(job)}/leases/{role}/{_int('rank', rank)}", lambda o: bool(o["took_over"]),
                params={"wait": f"{wait:.3f}"}, body=wire.pack(body), wait=wait)


def leases(job: str) -> Call[list[LeaseRow]]:
    return Call("GET", f"{_job(job)}/leases", lambda o: [LeaseRow.from_wire(row) for row in o["leases"]])


def status(job: str | None = None) -> Call[dict[str, Any]]:
    return Call("GET", "/v1/status", dict, params={"job": job} if job else None)


def delete_job(job: str) -> Call[bool]:
    return Call("DELETE", _job(job), lambda o: bool(o["deleted"]))


# --- the fleet coordinator (meta/fleet/routes.py) --------------------------------------------------

def fleet_command(job: str, command: Command, *, ttl: float | None = None) -> Call[FleetAnswer]:
    """A member's command (``Join``, ``Leave``, ``OpenTry``, ``Ready``, ``Fail``, ``Report``)."""
    if command.op not in MEMBER_OPS:
        raise ValueError(f"{type(command).__name__} is the coordinator's own command: members send "
                         f"{', '.join(MEMBER_OPS)}")
    body = {k: v for k, v in command_to_wire(command).items() if k != "op"}
    if ttl is not None:
        if command.op != "join":
            raise ValueError("ttl (the lease period) is given with a join only")
        body["ttl"] = float(ttl)
    return Call("POST", f"{_job(job)}/fleet/{command.op}", FleetAnswer.from_wire, body=wire.pack(body))


def fleet_beat(job: str, role: str, id_: int, incarnation: str) -> Call[bool]:
    body = {"role": role, "id": _int("id", id_), "incarnation": incarnation}
    return Call("POST", f"{_job(job)}/fleet/beat", lambda o: bool(o["live"]), body=wire.pack(body))


def fleet_tick(job: str) -> Call[FleetTicked]:
    return Call("POST", f"{_job(job)}/fleet/tick", FleetTicked.from_wire, body=wire.pack({}))


def fleet_record(job: str, *, after: int = -1, wait: float = 0.0) -> Call[FleetView]:
    return Call("GET", f"{_job(job)}/fleet", FleetView.from_wire,
                params={"after": _int("after", after, -1), "wait": f"{wait:.3f}"}, wait=wait)
