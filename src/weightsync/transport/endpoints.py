"""Each transport's endpoint: what a rank publishes so that its peers can reach it in one epoch.

One frozen dataclass per transport, with an explicit msgpack wire form, checked field by field
when a peer's arrives (:class:`~weightsync.job.wire.WireError` names the field). Transports
publish and read them through the job channel, which keys them by ``transport``, epoch and rank::

    ctx.channel.publish_endpoint(epoch, ShmEndpoint(path="/dev/shm/weightsync-..."))
    peer = ctx.channel.wait_endpoint(ShmEndpoint, epoch, "writer", 0, deadline=deadline)   # or None

All wire types of the transports live here, in one place; nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from weightsync.job.wire import WireError, take

__all__ = ["FileEndpoint", "NixlEndpoint", "NixlSlots", "ShmEndpoint", "TorchArrival", "TorchRendezvous"]


@dataclass(frozen=True, slots=True)
class TorchRendezvous:
    """Writer 0's endpoint: the TCPStore every rank of the epoch's process group joins."""

    transport: ClassVar[str] = "torch"
    host: str
    port: int

    def to_wire(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> TorchRendezvous:
        port = take(doc, "port", int, "an int")
        if not 0 < port < 65536:
            raise WireError(f"field 'port' must be a TCP port, not {port}")
        return cls(take(doc, "host", str, "a str"), port)


@dataclass(frozen=True, slots=True)
class TorchArrival:
    """A rank of the torch transport's group is at the epoch's rendezvous (every rank publishes
    one; a process group forms only once all did). ``incarnation``: the process that came, so
    that a restart finding its predecessor's arrival knows that the group forms without it."""

    transport: ClassVar[str] = "torch-arrival"
    incarnation: str

    def to_wire(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> TorchArrival:
        return cls(take(doc, "incarnation", str, "a str"))


@dataclass(frozen=True, slots=True)
class ShmEndpoint:
    """A shared-memory writer's segment of the epoch (its path under ``/dev/shm``)."""

    transport: ClassVar[str] = "shm"
    path: str

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> ShmEndpoint:
        return cls(take(doc, "path", str, "a str"))


@dataclass(frozen=True, slots=True)
class FileEndpoint:
    """The file transport's directory of the epoch (writer 0 created it when none was configured)."""

    transport: ClassVar[str] = "file"
    directory: str

    def to_wire(self) -> dict[str, Any]:
        return {"directory": self.directory}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> FileEndpoint:
        return cls(take(doc, "directory", str, "a str"))


@dataclass(frozen=True, slots=True)
class NixlSlots:
    """A NIXL pull writer's registered version slots: ``slots`` areas of ``slot_bytes`` from
    address ``area``, laid out by ``index`` (an encoded :class:`~weightsync.transport.exposed.ExposedIndex`),
    and with deltas where the area's change tables follow (``changes``: a
    :class:`~weightsync.transport.delta.published.ChangeLayout` header)."""

    area: int
    slots: int
    slot_bytes: int
    index: bytes
    changes: Mapping[str, int] | None = field(default=None, hash=False)

    def to_wire(self) -> dict[str, Any]:
        doc = {"area": self.area, "slots": self.slots, "slot_bytes": self.slot_bytes, "index": self.index}
        if self.changes is not None:
            doc["changes"] = dict(self.changes)
        return doc

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> NixlSlots:
        changes = take(doc, "changes", dict, "a map") if "changes" in doc else None
        return cls(take(doc, "area", int, "an int"), take(doc, "slots", int, "an int"),
                   take(doc, "slot_bytes", int, "an int"), take(doc, "index", bytes, "bytes"), changes)


@dataclass(frozen=True, slots=True)
class NixlEndpoint:
    """A NIXL rank of the epoch: its mode, agent metadata, control words and device, plus what
    its mode exposes (a pull writer its version ``slots``; a push reader its ``shards``:
    tensor name -> (address, bytes) of the destination memory writers WRITE into). With deltas
    in push (:mod:`weightsync.transport.nixl.push_changes`), a writer says so (``deltas``) and
    a reader publishes its ``inboxes``: writer rank -> (address, bytes) of what it WRITEs changes into."""

    transport: ClassVar[str] = "nixl"
    mode: str
    agent: bytes
    ctl: int
    device: str
    slots: NixlSlots | None = None
    shards: Mapping[str, tuple[int, int]] | None = field(default=None, hash=False)
    deltas: bool = False
    inboxes: Mapping[int, tuple[int, int]] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.shards is not None:
            object.__setattr__(self, "shards", MappingProxyType(dict(self.shards)))
        if self.inboxes is not None:
            object.__setattr__(self, "inboxes", MappingProxyType(dict(self.inboxes)))

    def to_wire(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"mode": self.mode, "agent": self.agent, "ctl": self.ctl, "device": self.device}
        if self.slots is not None:
            doc["slots"] = self.slots.to_wire()
        if self.shards is not None:
            doc["shards"] = {name: list(where) for name, where in self.shards.items()}
        if self.deltas:
            doc["deltas"] = True
        if self.inboxes is not None:
            doc["inboxes"] = [[rank, *where] for rank, where in self.inboxes.items()]
        return doc

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> NixlEndpoint:
        slots = NixlSlots.from_wire(take(doc, "slots", dict, "a map")) if "slots" in doc else None
        shards = None
        if "shards" in doc:
            shards = {}
            for name, where in take(doc, "shards", dict, "a map").items():
                if not (isinstance(where, list) and len(where) == 2
                        and all(isinstance(x, int) and not isinstance(x, bool) for x in where)):
                    raise WireError(f"field 'shards': {name!r} must map to [address, bytes], not {where!r:.40}")
                shards[name] = (where[0], where[1])
        inboxes = None
        if "inboxes" in doc:
            inboxes = {}
            for where in take(doc, "inboxes", list, "a list"):
                if not (isinstance(where, list) and len(where) == 3
                        and all(isinstance(x, int) and not isinstance(x, bool) for x in where)):
                    raise WireError(f"field 'inboxes': each entry must be [writer, address, bytes], not {where!r:.40}")
                inboxes[where[0]] = (where[1], where[2])
        return cls(take(doc, "mode", str, "a str"), take(doc, "agent", bytes, "bytes"), take(doc, "ctl", int, "an int"),
                   take(doc, "device", str, "a str"), slots, shards, take(doc, "deltas", bool, "a bool")
                   if "deltas" in doc else False, inboxes)

    def exposed_slots(self, label: str) -> NixlSlots:
        """A pull writer's slots (``label`` names the peer in the error)."""
        if self.slots is None:
            raise WireError(f"{label}'s nixl endpoint exposes no version slots: is it a pull writer?")
        return self.slots

    def destination_shards(self, label: str) -> Mapping[str, tuple[int, int]]:
        """A push reader's destination tensors (``label`` names the peer in the error)."""
        if self.shards is None:
            raise WireError(f"{label}'s nixl endpoint exposes no destination tensors: is it a push reader?")
        return self.shards
