"""What crosses the job channel (:mod:`weightsync.job.channel`): typed records with explicit wire forms.

Every value ranks tell each other through the meta server is a frozen dataclass here (or, for
a transport's endpoint, in :mod:`weightsync.transport.endpoints`), encoded as msgpack or as
plain fields of the meta server's API, never pickled, and checked field by field on receipt
(:class:`WireError` names the field). No key string is built here and nothing is packed into
a string: the sync fingerprint and the epoch of a version travel as two fields.

    member = Member.from_participant(p)       # device, GPU and settings, typed
    table = TensorTable.from_tensors([("w", (4, 8), "float32")])
    assert TensorTable.from_wire(msgpack.unpackb(msgpack.packb(table.to_wire()))) == table
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from weightsync.ports.channel import EndpointRecord  # noqa: F401  (re-exported: the channel's callers name it here)

if TYPE_CHECKING:
    from weightsync.plan.ops import Role
    from weightsync.ports.records import Participant, VersionInfo

#: What the tensor store publishes as the sync fingerprint of its versions (it has no plan).
STORE_FINGERPRINT = "tensorstore/1"

T = TypeVar("T")


class WireError(ValueError):
    """A record from another rank that is not what this release sends (names what is wrong)."""


def take(doc: Mapping[str, Any], name: str, kind: type[T] | tuple[type[Any], ...], what: str) -> T:
    """``doc[name]``, checked to be of ``kind`` (``what`` names it in the error: ``"a str"``).

    Raises:
        WireError: the field is missing or of another type.
    """
    if name not in doc:
        raise WireError(f"field {name!r} is missing")
    value = doc[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, (int, float))):
        raise WireError(f"field {name!r} must be {what}, not {type(value).__name__} {value!r:.40}")
    return value  # type: ignore[return-value]


def unpack_map(raw: bytes) -> Mapping[str, Any]:
    """One msgpack map (a record's wire form). Raises WireError otherwise."""
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"not msgpack ({exc})") from None
    if not isinstance(doc, dict):
        raise WireError(f"a msgpack {type(doc).__name__}, not a map")
    return doc


def model_digest(config: Mapping[str, Any]) -> str:
    """Content address of a model config (a layout descriptor names its model by it)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class PublishedVersion:
    """A version as writers publish it: the sync it belongs to and the transport epoch.

    ``sync_fingerprint`` hashes the plan, the transport and its settings: a reader takes no
    byte of a version whose fingerprint differs from its own. ``epoch`` is the job's transport
    epoch the writers wrote it in (a version written again after a failure has a later one).
    """

    version: int
    sync_fingerprint: str
    epoch: int
    published_at: float = 0.0

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")

    @classmethod
    def from_info(cls, info: VersionInfo) -> PublishedVersion:
        return cls(info.version, info.fingerprint, info.epoch, info.published_at)


@dataclass(frozen=True, slots=True)
class PeerCopy:
    """A reader's copy of the newest version it applied, for readers that join later
    (``SyncConfig.peer_sources``, :mod:`weightsync.roles.peer_copies`).

    ``path`` is a ``/dev/shm`` file on ``host`` whose control word says which version it holds
    now (the record may lag it by one version while the reader copies the next); ``version``,
    ``fingerprint`` and ``epoch`` are the version as the writers published it; ``digests``, the
    kind of the writers' digests the file holds beside the copy ("": none, the job runs without
    ``integrity``); ``remote``, how readers on other hosts read the file over NIXL (None: the
    reader serves its own host only, ``SyncConfig.peers_across_hosts`` off).
    """

    version: int
    fingerprint: str
    epoch: int
    host: str
    path: str
    nbytes: int
    digests: str = ""
    remote: RemoteCopy | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "fingerprint": self.fingerprint, "epoch": self.epoch, "host": self.host,
                "path": self.path, "nbytes": self.nbytes, "digests": self.digests,
                "remote": None if self.remote is None else self.remote.to_wire()}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> PeerCopy:
        """Raises WireError naming the field that is missing or malformed."""
        remote = doc.get("remote")
        if remote is not None and not isinstance(remote, Mapping):
            raise WireError(f"field 'remote' must be a map or nil, not {type(remote).__name__}")
        try:
            served = None if remote is None else RemoteCopy.from_wire(remote)
        except WireError as exc:
            raise WireError(f"field 'remote': {exc}") from None
        return cls(take(doc, "version", int, "an int"), take(doc, "fingerprint", str, "a str"),
                   take(doc, "epoch", int, "an int"), take(doc, "host", str, "a str"), take(doc, "path", str, "a str"),
                   take(doc, "nbytes", int, "an int"), take(doc, "digests", str, "a str"), served)


@dataclass(frozen=True)
class RemoteCopy:
    """Where a reader on another host reads a peer copy (:class:`PeerCopy`) over NIXL: the keeper's
    NIXL agent (its metadata, to connect to), the address and size of the copy's whole segment in
    the keeper's memory (control page, shards, digest table), and the segment's layout: each
    shard's ``(offset, numel, dtype)`` in the data area, where the digest table starts and how
    many entries it holds room for (what a reader on the host reads from the file's header)."""

    agent: bytes
    address: int
    size: int
    shards: Mapping[str, tuple[int, int, str]]
    entries_at: int
    capacity: int

    def to_wire(self) -> dict[str, Any]:
        return {"agent": self.agent, "address": self.address, "size": self.size,
                "shards": {name: list(entry) for name, entry in self.shards.items()},
                "entries_at": self.entries_at, "capacity": self.capacity}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> RemoteCopy:
        """Raises WireError naming the field that is missing or malformed."""
        shards: dict[str, tuple[int, int, str]] = {}
        for name, entry in take(doc, "shards", dict, "a map").items():
            if (not isinstance(name, str) or not isinstance(entry, (list, tuple)) or len(entry) != 3
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entry[:2])
                    or not isinstance(entry[2], str)):
                raise WireError(f"field 'shards' must map each shard name to [offset, numel, dtype], not "
                                f"{name!r:.40}: {entry!r:.60}")
            shards[name] = (entry[0], entry[1], entry[2])
        sizes = {key: take(doc, key, int, "an int") for key in ("address", "size", "entries_at", "capacity")}
        for key, value in sizes.items():
            if value < 0:
                raise WireError(f"field {key!r} must be >= 0, not {value}")
        return cls(take(doc, "agent", bytes, "bytes"), sizes["address"], sizes["size"], shards, sizes["entries_at"],
                   sizes["capacity"])


@dataclass(frozen=True, slots=True)
class Member:
    """One registered rank as the job sees it: where it runs and with what.

    Attributes:
        device: where its tensors live (``"cpu"``, ``"cuda:1"``); transports are chosen by it.
        gpu: that GPU's UUID (empty on CPU): the identity other processes can compare.
        settings: the job settings it runs with (``SyncConfig.settings()``), compared across
            ranks; None when it declared none (a rank registered by hand).
        sees: the UUIDs of every GPU its process sees (CUDA IPC opens a writer's memory on the
            writer's GPU, which the reader must see); empty when unknown.
    """

    role: Role
    rank: int
    host: str
    layout: bytes
    device: str = "cpu"
    gpu: str = ""
    settings: str | None = None
    sees: tuple[str, ...] = ()

    def endpoints(self) -> dict[str, str]:
        """The registration's endpoints map, where the meta server keeps these (only what is set)."""
        out = {"device": self.device}
        if self.gpu:
            out["gpu"] = self.gpu
        if self.settings is not None:
            out["settings"] = self.settings
        if self.sees:
            out["sees"] = ",".join(self.sees)
        return out

    @classmethod
    def from_participant(cls, p: Participant) -> Member:
        sees = p.endpoints.get("sees", "")
        return cls(p.role, p.rank, p.host, p.layout, p.endpoints.get("device", "cpu"),  # type: ignore[arg-type]
                   p.endpoints.get("gpu", ""), p.endpoints.get("settings"), tuple(sees.split(",")) if sees else ())

    @property
    def who(self) -> str:
        return f"{self.role} {self.rank}"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class TensorTable:
    """Whole named tensors: what a reader needs to allocate the buffers a writer sends into
    (verl's backend publishes one per job, :meth:`weightsync.job.channel.JobChannel.publish_tensor_table`)."""

    entries: tuple[TensorEntry, ...]

    @classmethod
    def from_tensors(cls, items: Iterable[tuple[str, Iterable[int], str]]) -> TensorTable:
        return cls(tuple(TensorEntry(name, tuple(int(n) for n in shape), dtype) for name, shape, dtype in items))

    def to_wire(self) -> dict[str, Any]:
        return {"format": 1, "tensors": [[e.name, list(e.shape), e.dtype] for e in self.entries]}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> TensorTable:
        """Raises WireError naming the entry that is malformed."""
        if take(doc, "format", int, "an int") != 1:
            raise WireError(f"tensor table format {doc['format']} is not 1 (another weightsync release?)")
        entries = []
        for i, row in enumerate(take(doc, "tensors", list, "a list")):
            ok = (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and isinstance(row[1], list)
                  and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in row[1])
                  and isinstance(row[2], str))
            if not ok:
                raise WireError(f"tensor table entry {i} must be [name, [sizes...], dtype], not {row!r:.60}")
            entries.append(TensorEntry(row[0], tuple(row[1]), row[2]))
        return cls(tuple(entries))
