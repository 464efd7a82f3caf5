"""The records the coordinator port speaks (:mod:`weightsync.ports.coordinator`): participants,
published versions, leases and reader reports.

They belong to the port, not to the meta server that implements it today: the job channel and
the transports read them, :mod:`weightsync.meta` builds its columnar roster, its reducer and its
HTTP calls on them, and a coordinator other than the meta server would speak them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

ROLES = ("reader", "writer")  # sorted: participants are ordered by (role, rank)
MAX_RANK = 1 << 31


def check_role(role: str) -> str:
    """Return ``role`` if it is ``"writer"`` or ``"reader"``, else raise ValueError."""
    if role not in ROLES:
        raise ValueError(f"role must be 'writer' or 'reader', not {role!r}")
    return role


@dataclass(frozen=True, slots=True)
class Participant:
    """One registered rank of a job.

    Attributes:
        role: ``"writer"`` (a training rank that sends) or ``"reader"`` (an inference rank).
        rank: the rank within its role, ``0 <= rank < 2**31``.
        group: free-form group name (``"train"``, ``"rollout-0"``).
        host: host name or address the rank runs on.
        endpoints: transport name -> address peers use to reach this rank.
        layout: opaque layout descriptor; identical blobs are stored once.
    """

    role: str
    rank: int
    group: str = ""
    host: str = ""
    endpoints: Mapping[str, str] = field(default_factory=dict, hash=False)
    layout: bytes = b""

    def __post_init__(self) -> None:
        check_role(self.role)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < MAX_RANK:
            raise ValueError(f"{self.role} rank must be an int in [0, 2**31), not {self.rank!r}")
        for name in ("group", "host"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Participant.{name} must be a str, not {type(getattr(self, name)).__name__}")
        if not isinstance(self.endpoints, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.endpoints.items()):
            raise TypeError("Participant.endpoints must map transport names (str) to addresses (str), "
                            f"got {self.endpoints!r}")
        if not isinstance(self.layout, (bytes, bytearray, memoryview)):
            raise TypeError(f"Participant.layout must be bytes (e.g. msgpack.packb(descriptor)), "
                            f"not {type(self.layout).__name__}")
        object.__setattr__(self, "endpoints", MappingProxyType(dict(self.endpoints)))
        object.__setattr__(self, "layout", bytes(self.layout))

    @classmethod
    def _trusted(cls, role: str, rank: int, group: str, host: str, endpoints: dict[str, str],  # noqa: PLR0917
                 layout: bytes) -> Participant:
        """Build without re-validating: for rows the server validated (thousands per roster)."""
        p = object.__new__(cls)
        _SET_ROLE(p, role)
        _SET_RANK(p, rank)
        _SET_GROUP(p, group)
        _SET_HOST(p, host)
        _SET_ENDPOINTS(p, MappingProxyType(endpoints))
        _SET_LAYOUT(p, layout)
        return p

    def to_wire(self) -> dict[str, Any]:
        """The registration body (msgpack-ready)."""
        return {"role": self.role, "rank": self.rank, "group": self.group, "host": self.host,
                "endpoints": dict(self.endpoints), "layout": self.layout}


# slot setters: a frozen dataclass refuses attribute assignment, its slot descriptors do not
_SET_ROLE, _SET_RANK, _SET_GROUP, _SET_HOST, _SET_ENDPOINTS, _SET_LAYOUT = (
    Participant.__dict__[name].__set__ for name in ("role", "rank", "group", "host", "endpoints", "layout"))


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """A published weight version: all writers reported it with the same sync fingerprint, in one epoch.

    ``epoch`` is the job's transport epoch the writers wrote the version in: writers that failed
    a version write it again in a later epoch, which supersedes the earlier one. ``published_at``
    is the server's wall-clock time (seconds since the epoch).
    """

    version: int
    fingerprint: str
    published_at: float
    epoch: int = 0

    @classmethod
    def from_wire(cls, obj: Any) -> VersionInfo | None:
        if obj is None:
            return None
        return cls(int(obj["version"]), str(obj["fingerprint"]), float(obj["published_at"]), int(obj.get("epoch", 0)))

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "fingerprint": self.fingerprint, "published_at": self.published_at,
                "epoch": self.epoch}


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """One participant's lease as the server reports it (:mod:`weightsync.meta.leases`).

    Attributes:
        alive: it renewed within its ``ttl`` and did not release it.
        released: the process gave it up (it left; it did not die).
        age: seconds since its last heartbeat.
        detail: who holds it and its state, for messages (``"pid 41 on n0, last heartbeat 9.1 s ago"``).
    """

    role: str
    rank: int
    incarnation: str
    pid: int
    host: str
    ttl: float
    age: float
    alive: bool
    released: bool
    detail: str

    def to_wire(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "incarnation": self.incarnation, "pid": self.pid,
                "host": self.host, "ttl": self.ttl, "age": self.age, "alive": self.alive, "released": self.released,
                "detail": self.detail}

    @classmethod
    def from_wire(cls, obj: Any) -> LeaseRow:
        """Raises ValueError naming the field when the server's row is malformed."""
        try:
            row = cls(check_role(obj["role"]), int(obj["rank"]), str(obj["incarnation"]), int(obj["pid"]),
                      str(obj["host"]), float(obj["ttl"]), float(obj["age"]), obj["alive"], obj["released"],
                      str(obj["detail"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed lease row from the meta server ({exc!r}): {obj!r:.120}") from None
        if not isinstance(row.alive, bool) or not isinstance(row.released, bool):
            raise ValueError(f"malformed lease row from the meta server: 'alive' and 'released' are booleans: "
                             f"{obj!r:.120}")
        return row


@dataclass(frozen=True, slots=True)
class ReaderReport:
    """What ``GET /readers`` answers: the latest version and every known reader's state."""

    latest: VersionInfo | None
    rows: tuple[Mapping[str, Any], ...]

    @property
    def versions(self) -> dict[int, int | None]:
        return {int(r["rank"]): r["version"] for r in self.rows}

    def settled(self, min_version: int, readers: int | None = None) -> list[int]:
        """Registered reader ranks (below ``readers``, if given) done with ``min_version``:
        applied it or newer, or failed it or newer."""
        def last(row: Mapping[str, Any]) -> int:
            seen = [v for v in (row.get("version"), row.get("failed_version")) if v is not None]
            return max(seen, default=-1)
        return [int(r["rank"]) for r in self.rows if r.get("registered", True) and last(r) >= min_version
                and (readers is None or int(r["rank"]) < readers)]

    def applied(self, min_version: int, readers: int | None = None) -> list[int]:
        """Registered reader ranks (below ``readers``, if given) that applied ``min_version`` or newer."""
        return [int(r["rank"]) for r in self.rows if r.get("registered", True) and r.get("version") is not None
                and r["version"] >= min_version and (readers is None or int(r["rank"]) < readers)]

    def enough(self, min_version: int, readers: int, *, settled: int | None = None, applied: int = 0) -> bool:
        """Whether a writer's wait on reader ranks ``0..readers-1`` for ``min_version`` is over:
        ``settled`` of them (all by default) are done with it (applied or failed it or newer), or
        ``applied`` of them (when positive) applied it (a quorum)."""
        done = len(self.settled(min_version, readers)) >= (readers if settled is None else settled)
        return done or (applied > 0 and len(self.applied(min_version, readers)) >= applied)

    def failed(self, min_version: int, readers: int | None = None) -> dict[int, str]:
        """Registered reader ranks that failed ``min_version`` (or newer) and applied nothing as new
        since, with the error each reported."""
        return {int(r["rank"]): str(r.get("error") or "failed") for r in self.rows
                if r.get("registered", True) and (readers is None or int(r["rank"]) < readers)
                and r.get("failed_version") is not None and r["failed_version"] >= min_version
                and (r.get("version") is None or r["version"] < min_version)}

    @classmethod
    def from_wire(cls, obj: Any) -> ReaderReport:
        return cls(VersionInfo.from_wire(obj["latest"]), tuple(obj["readers"]))


__all__ = ["MAX_RANK", "ROLES", "LeaseRow", "Participant", "ReaderReport", "VersionInfo", "check_role"]
