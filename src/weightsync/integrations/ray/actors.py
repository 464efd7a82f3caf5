"""Trainer and rollout actors as weightsync ranks, with one call per group.

    attach_writers(trainers, config, conn)   # trainers[i] becomes writer i
    attach_readers(rollouts, config, conn)   # rollouts[i] becomes reader i
    ray.get([t.weightsync_write.remote(v) for t in trainers])      # or self.weightsync_write(v)
    ray.get([r.weightsync_update.remote(v) for r in rollouts])     # or self.weightsync_update(v)

An actor class inherits :class:`SyncActor` and says what it holds: ``weightsync_source()``
(a training source) on trainers, ``weightsync_engine()`` (an inference engine) on rollout
workers. Joining replaces the config's ``host`` with the actor's node name, which
placement compares (two Ray nodes on one machine are two nodes), and the transport's
address with the node's IP; the rest of :class:`weightsync.session.sync_session.SyncConfig` is the
caller's, identical on every rank. The config crosses Ray in its wire form
(:meth:`SyncConfig.to_wire`: plain data, checked on arrival), never as a pickled object.

**Node names.** A rank's node name is its Ray node's ``weightsync-node`` label when the node
has one (``ray start --labels weightsync-node=rack3-n7``), else its Ray node id. A job is
planned once for its ranks' placement, and a restarted rank may rejoin only at the place it
registered: label nodes by slot, give a replacement node the label of the node it replaces,
and actors restarted there rejoin the running job. Without labels, a rank restarted on
another node is refused by the meta server (its node differs), and the job must be started
again under a new job name. Two machines must never carry the same label: their ranks
would be routed over shared memory.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from weightsync.integrations.ray.meta import MetaConnection
from weightsync.session.sync_session import SyncConfig

if TYPE_CHECKING:
    from weightsync.job.channel import Role
    from weightsync.ports.engine import InferenceEngine, TrainingSource
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import WeightWriter

logger = logging.getLogger(__name__)


#: Ray node label naming a node's slot: a replacement node carrying it takes the dead one's place.
NODE_LABEL = "weightsync-node"


def node_identity() -> tuple[str, str]:
    """(node name, node IP address) of the calling process (see module docstring)."""
    context = ray.get_runtime_context()
    label = context.get_node_labels().get(NODE_LABEL, "")
    return (f"label:{label}" if label else context.get_node_id()), ray.util.get_node_ip_address()


def placed_config(config: SyncConfig) -> SyncConfig:
    """``config`` with this actor's node name as its node and its node IP as transport host."""
    node, ip = node_identity()
    return dataclasses.replace(config, host=node,
                               transport_options=dataclasses.replace(config.transport_options, host=ip))


class SyncActor:
    """Mixin for Ray actor classes that take part in a sync job (see module docstring)."""

    weightsync_writer: WeightWriter | None = None
    weightsync_reader: WeightReader | None = None

    def weightsync_source(self) -> TrainingSource:
        raise NotImplementedError(f"{type(self).__name__} joins as a writer: define weightsync_source()")

    def weightsync_engine(self) -> InferenceEngine:
        raise NotImplementedError(f"{type(self).__name__} joins as a reader: define weightsync_engine()")

    def weightsync_join(self, role: Role, rank: int, settings: dict[str, Any], address: str,
                        token: str) -> dict[str, Any]:
        """Become ``role`` ``rank`` of the job (called by :func:`attach_writers` / :func:`attach_readers`).

        ``settings`` is the job's ``SyncConfig`` in its wire form (plain data across Ray). The
        rank registers now (a quick call to the meta server, no waiting), so the job's roster is
        complete once both groups are attached; planning waits for the first sync.
        """
        self.weightsync_leave()
        config = SyncConfig.from_wire(settings, where=f"attach_{role}s")
        placed = placed_config(config)
        meta = MetaConnection(address, token).client(job=config.job)
        if role == "writer":
            from weightsync.roles.writer import WeightWriter

            self.weightsync_writer = WeightWriter(self.weightsync_source(), rank=rank, config=placed, meta=meta)
            self.weightsync_writer.session.register()
        else:
            from weightsync.roles.reader import WeightReader

            self.weightsync_reader = WeightReader(self.weightsync_engine(), rank=rank, config=placed, meta=meta)
            self.weightsync_reader.session.register()
        logger.info("%s %d joined job %s on node %s", role, rank, config.job, placed.host)
        return {"role": role, "rank": rank, "node": placed.host}

    def weightsync_write(self, version: int, timeout: float | None = None) -> dict[str, Any]:
        """Send and publish ``version`` (this actor is a writer)."""
        if self.weightsync_writer is None:
            raise RuntimeError(f"{type(self).__name__}: weightsync_write() before attach_writers()")
        result = self.weightsync_writer.write(version, timeout=timeout)
        return {"version": result.version, "bytes": result.nbytes, "seconds": result.seconds}

    def weightsync_update(self, version: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Apply the newest version, or at least ``version`` (this actor is a reader)."""
        if self.weightsync_reader is None:
            raise RuntimeError(f"{type(self).__name__}: weightsync_update() before attach_readers()")
        result = self.weightsync_reader.update(version, timeout=timeout)
        return {"version": result.version, "bytes": result.nbytes, "seconds": result.seconds}

    def weightsync_routes(self) -> dict[str, Any]:
        """Which transport moved this rank's pairs, and its bytes per route in the last sync."""
        role = self.weightsync_writer or self.weightsync_reader
        planned = role.session.planned if role is not None else None
        if planned is None:
            return {}
        transport = planned.transport
        return {"transport": planned.transport_name, "routes": getattr(transport, "routes", None),
                "last_bytes": getattr(transport, "last_bytes", None), "plan_bytes": planned.plan.total_bytes}

    def weightsync_leave(self) -> None:
        """Close this actor's writer or reader (connections, shared memory)."""
        for role in (self.weightsync_writer, self.weightsync_reader):
            if role is not None:
                role.close()
        self.weightsync_writer = self.weightsync_reader = None


def connection(config: SyncConfig, meta: MetaConnection | None) -> MetaConnection:
    """Where the actors find the coordinator: ``meta`` (:func:`meta_server`'s actor, or an etcd
    cluster's ``MetaConnection``), else the one ``config.meta_address`` names (an etcd cluster, or
    a meta server whose token the actors read from ``WEIGHTSYNC_META_TOKEN``).

    Raises:
        ValueError: neither is given, or both and they name different coordinators.
    """
    from weightsync.meta.config import same_coordinator

    if meta is None:
        if not config.meta_address:
            raise ValueError("no coordinator for the actors: pass meta=meta_server() (the meta server as a Ray actor) "
                             "or set SyncConfig.meta_address (an etcd cluster's etcd://host1:2379,...)")
        return MetaConnection(config.meta_address, "")
    if config.meta_address and not same_coordinator(config.meta_address, meta.address):
        raise ValueError(f"SyncConfig.meta_address is {config.meta_address!r} but meta= is {meta.address!r}: give one "
                         "of the two, or both for the same coordinator")
    return meta


def _attach(role: Role, actors: Sequence[Any], config: SyncConfig, meta: MetaConnection | None,
            timeout: float) -> list[dict[str, Any]]:
    size = config.num_writers if role == "writer" else config.num_readers
    if len(actors) != size:
        raise ValueError(f"{len(actors)} actors were given as {role}s, but the config says num_{role}s={size}: "
                         "pass one actor per rank")
    meta = connection(config, meta)
    settings = config.to_wire()
    calls = [a.weightsync_join.remote(role, rank, settings, meta.address, meta.token) for rank, a in enumerate(actors)]
    return list(ray.get(calls, timeout=timeout))


def rejoin(actor: Any, role: Role, rank: int, config: SyncConfig, meta: MetaConnection | None = None, *,
           timeout: float = 120.0) -> dict[str, Any]:
    """Make one (restarted) actor ``role`` ``rank`` again; the job moves to a new epoch."""
    meta = connection(config, meta)
    return dict(ray.get(actor.weightsync_join.remote(role, rank, config.to_wire(), meta.address, meta.token),
                        timeout=timeout))


def attach_writers(actors: Sequence[Any], config: SyncConfig, meta: MetaConnection | None = None, *,
                   timeout: float = 120.0) -> list[dict[str, Any]]:
    """Make ``actors[i]`` writer ``i`` of the job; returns each rank's node.

    Raises:
        ValueError: the number of actors is not ``config.num_writers``.
    """
    return _attach("writer", actors, config, meta, timeout)


def attach_readers(actors: Sequence[Any], config: SyncConfig, meta: MetaConnection | None = None, *,
                   timeout: float = 120.0) -> list[dict[str, Any]]:
    """Make ``actors[i]`` reader ``i`` of the job; returns each rank's node.

    Raises:
        ValueError: the number of actors is not ``config.num_readers``.
    """
    return _attach("reader", actors, config, meta, timeout)
