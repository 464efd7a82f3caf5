"""The job channel: everything the ranks of a job say to each other, typed, in one place.

Writers, readers, transports and the tensor store talk through the meta server, and only
through :class:`JobChannel`. It owns every meta-server key (built in :mod:`weightsync.job.keys`,
used by nothing else) and the version handshake; leases are its :class:`~weightsync.job.liveness.Liveness`
part, what ranks post for each other its :class:`~weightsync.job.board.Board` part. What crosses it
is a frozen dataclass, encoded with msgpack or plain text, never pickle. Following one
version ``V`` from writer to reader::

    # every rank, once:            channel.register(host, layout_blob) -> channel.wait_roster(...)
    # writer 0 decides V's epoch:  epoch = channel.decide_epoch(V, deadline)   (the others wait for it)
    # transports, once per epoch:  channel.publish_endpoint(epoch, ShmEndpoint(path)) / channel.wait_endpoint(...)
    # every writer:                channel.publish_version(PublishedVersion(V, fingerprint, epoch), num_writers)
    # every reader:                published = channel.wait_version(after=applied, deadline)
    #                              ... receive, apply ...
    #                              channel.report_applied(V, nbytes, seconds)  or  channel.report_failed(V, why)
    # writers (staleness bound):   channel.wait_readers(min_version, readers, deadline)
    # with commit="fleet":         readers report_staged(V, epoch) after receiving, writer 0
    #                              decide_commit(...), readers wait_commit(...) before applying

**Epochs.** A transport's connections (a process group, shared-memory mappings, NIXL
registrations) belong to an *epoch*, a job-wide counter. A rank that sees a transfer fail,
and a rank that restarts, moves the job past the epoch it saw (:meth:`JobChannel.advance_epoch`,
a no-op when someone already did). Writer 0 fixes the epoch of each version once
(:meth:`JobChannel.decide_epoch`), every writer publishes the version with it, and readers
prepare their transport for the epoch they read in :class:`PublishedVersion`, so after a
failure the next version re-forms every connection cleanly. The same counter tells the tries
of one version apart: a version written again after a failure is written in a later epoch,
and the meta server keeps the one in the latest epoch. It has one name everywhere, on the
server too (``epoch``, ``after_epoch``): it numbers connections, and a try is one use of them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from weightsync.job.board import Board
from weightsync.job.epochs import Epochs
from weightsync.job.fleet_commit import FleetCommit
from weightsync.job.keys import (
    layout_key,
    layouts_key,
    model_key,
    tensor_table_key,
    version_layouts_key,
)
from weightsync.job.liveness import Liveness
from weightsync.job.reader_waits import ReaderWaits
from weightsync.job.wire import (
    STORE_FINGERPRINT,
    Member,
    PublishedVersion,
    TensorTable,
    WireError,
    model_digest,
    unpack_map,
)
from weightsync.plan.ops import Role
from weightsync.ports.coordinator import Holder, MetaPort, PeerDiedError, TransportBoard

if TYPE_CHECKING:
    from weightsync.clock.deadline import Deadline
    from weightsync.job.heartbeat import Heartbeat
    from weightsync.ports.records import LeaseRow

logger = logging.getLogger(__name__)

__all__ = ["STORE_FINGERPRINT", "Holder", "JobChannel", "Member", "MetaPort", "PeerDiedError", "PublishedVersion",
           "Role", "TransportBoard", "model_digest"]




def _layout_change(doc: bytes, generation: int, job: str) -> tuple[str, int, bytes, int]:
    """A stored layout change: ``[role, rank, layout]`` (a join, or a new layout), or
    ``[role, rank, b"", join]`` (the reader whose join was at generation ``join`` left)."""
    try:
        fields = msgpack.unpackb(doc)
        if not isinstance(fields, list) or len(fields) not in (3, 4):
            raise ValueError(f"expected [role, rank, layout] or [role, rank, b'', join], got {fields!r:.80}")
        left = int(fields[3]) if len(fields) == 4 else -1
        return str(fields[0]), int(fields[1]), bytes(fields[2]), left
    except (ValueError, TypeError, msgpack.ExtraData) as exc:
        raise WireError(f"layout change {generation} of job {job!r} is malformed: {exc}") from None


def settings_difference(mine: str, theirs: str) -> str:
    """``"layer_phases: True here, False there"`` for two ranks' settings (``SyncConfig.settings()``,
    a JSON object); the two texts whole when either is not one."""
    try:
        a, b = json.loads(mine), json.loads(theirs)
    except ValueError:
        a = b = None
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return f"{theirs} there, {mine} here"
    names = [k for k in {**a, **b} if a.get(k) != b.get(k)]
    return "; ".join(f"{k}: {json.dumps(a.get(k))} here, {json.dumps(b.get(k))} there" for k in names)

class JobChannel(Liveness, Board, ReaderWaits, FleetCommit, Epochs):
    """One rank's typed view of its job on the meta server (see module docstring).

    Args:
        meta: the meta client. A channel that only serves transports (their contract tests)
            may be given just a :class:`TransportBoard`.
        role, rank: who speaks; endpoints and reports are this rank's own.
    """

    def __init__(self, meta: MetaPort, *, role: Role, rank: int) -> None:
        self.meta = meta
        self.role: Role = role
        self.rank = rank
        #: this process's claim on (role, rank): a restarted process has a new one
        self.incarnation = secrets.token_hex(8)
        #: the oldest epoch this rank may take part in: the job's epoch when it (re)joined or last
        #: saw a failure. Endpoints of older epochs may belong to processes that are gone.
        self.min_epoch = 0
        #: this process replaced a dead one (registration found an earlier incarnation)
        self.restarted = False
        self._last_joined = -1  # the newest epoch this process joined a try in
        self._writing = -1  # writer 0: the version it recorded deciding last
        self.lease_seconds = 0.0
        self.host = ""
        self._heartbeat: Heartbeat | None = None
        self._lease_cache: tuple[float, dict[tuple[str, int], LeaseRow]] = (-1.0, {})
        #: the layout changes read so far, by generation: (role, rank, blob, left) where ``left`` is
        #: the generation of the join a leave ends (-1: a join or a layout change)
        self._changes: dict[int, tuple[str, int, bytes, int]] = {}
        #: the layout generation writer 0 last decided a version with
        self._decided_generation = 0

    @property
    def who(self) -> str:
        return f"{self.role} {self.rank}"

    # -- membership ---------------------------------------------------------------------------
    def register(self, *, host: str, group: str, layout: bytes, device: str = "cpu", gpu: str = "",
                 settings: str = "", lease: float = 0.0, sees: tuple[str, ...] = ()) -> bool:
        """Register this rank: its node, the device of its tensors (and that GPU's UUID, the identity
        other processes can compare), its layout blob and the job
        settings it runs with (compared across ranks, see :meth:`check_settings`).

        First the client pins the server's instance (a server that loses its state later is
        noticed at the next call) and, with ``lease`` seconds, this process takes the rank's
        lease (:mod:`weightsync.meta.leases`), waiting for a dead predecessor's to expire.
        Returns True if the rank was registered before (this process is a restart of it).

        Raises:
            ValueError: another live process holds this rank (two processes claim it).
        """
        from weightsync.ports.records import Participant

        self.pin_server()
        took_over = False
        if lease > 0:
            self.lease_seconds, self.host = lease, host
            took_over = self.meta.acquire_lease(self.role, self.rank, incarnation=self.incarnation, ttl=lease,
                                                pid=os.getpid(), host=host, wait=lease + 1.0)
        restarted = took_over or any(p.rank == self.rank for p in self.meta.participants(self.role))
        me = Member(self.role, self.rank, host, layout, device, gpu, settings or None, sees)
        self.meta.register(Participant(role=self.role, rank=self.rank, group=group, host=host,
                                       endpoints=me.endpoints(), layout=layout))
        return restarted

    def check_settings(self, settings: str, people: list[Member] | None = None) -> None:
        """Compare this rank's job settings with every rank registered so far.

        Each rank checks after registering (the later of two ranks that disagree sees the
        other) and again once the roster is complete (``people``), so every rank stops before
        planning, naming the ranks that differ.

        Raises:
            ValueError: naming the ranks whose settings differ and the settings themselves.
        """
        if people is None:
            people = [Member.from_participant(p) for p in self.meta.participants()]
        differ = [f"{m.who} ({settings_difference(settings, m.settings)})" for m in people
                  if m.settings is not None and m.settings != settings]
        if differ:
            raise ValueError(f"{self.who} runs job {self.meta.job!r} with other settings than "
                             f"{', '.join(differ[:8])}{' ...' if len(differ) > 8 else ''}: every writer and reader "
                             "of a job must use the same SyncConfig")

    def wait_roster(self, *, writers: int, readers: int, deadline: Deadline) -> list[Member]:
        """Everyone, once ``writers`` writers and ``readers`` readers registered."""
        people = self.meta.wait_registered(writers=writers, readers=readers, timeout=deadline.remaining())
        return [Member.from_participant(p) for p in people]

    # -- layouts that change while a job runs (an engine's EPLB placement) ---------------------
    def layout_generation(self) -> int:
        """How many times a rank changed its layout since the job started."""
        generation: int = self.meta.counter(layouts_key())
        return generation

    def publish_layout(self, layout: bytes, *, deadline: Deadline) -> int:
        """This rank's layout changed (an engine's expert placement moved): the job's layout
        generation moves on by one and names it. Returns the new generation.

        Writers plan each version at the generation writer 0 recorded for it
        (:meth:`version_generation`); versions planned before it are not for this rank."""
        return self._next_generation([self.role, self.rank, layout], deadline=deadline)

    def _next_generation(self, doc: list[Any], *, deadline: Deadline) -> int:
        """Take the job's next layout generation for the change ``doc`` (its stored document)."""
        while True:
            generation = self.layout_generation()
            done, _ = self.meta.compare_and_set(layouts_key(), expected=generation, value=generation + 1)
            if done:
                break
            if deadline.expired:
                raise TimeoutError(f"{self.who}: could not record a layout change in time")
        self.meta.put_document(layout_key(generation + 1), msgpack.packb(doc))
        return generation + 1

    def drop_departed_readers(self, *, deadline: Deadline) -> dict[int, str]:
        """Writer 0 of an elastic set of readers, before it decides a version: every joined reader
        whose lease ended (it left cleanly, releasing it, or died and it expired) leaves the job,
        one layout change each, so the version is planned without it. A leave names the join it
        ends: a process that took the seat since, and joined anew, stays. Returns the readers
        dropped: seat -> what the meta server knows of them."""
        generation = self.layout_generation()
        joined = {rank: g for (role, rank), (g, _) in self._present(generation, deadline).items() if role == "reader"}
        dead = self.dead_peers("reader", sorted(joined), max_age=0.0)
        for rank, why in sorted(dead.items()):
            left = self._next_generation(["reader", rank, b"", joined[rank]], deadline=deadline)
            logger.info("%s: reader %d left the job at layout generation %d (%s)", self.who, rank, left, why)
        return dead

    def _present(self, generation: int, deadline: Deadline) -> dict[tuple[str, int], tuple[int, bytes]]:
        """Each rank whose layout changes up to ``generation`` leave it in the job: (the generation
        of its join, the layout of its last change). Reads the changes not read yet.

        Raises:
            TimeoutError: a change's document did not appear in time.
            WireError: a change's document is malformed.
        """
        for g in range(1, generation + 1):
            if g in self._changes:
                continue
            doc = self.meta.get_document(layout_key(g), wait=deadline.remaining(0.0))
            if doc is None:
                raise TimeoutError(f"{self.who}: layout change {g} of job {self.meta.job!r} was not published in time")
            self._changes[g] = _layout_change(doc, g, self.meta.job)
        present: dict[tuple[str, int], tuple[int, bytes]] = {}
        for g in range(1, generation + 1):
            role, rank, blob, left = self._changes[g]
            key = (role, rank)
            if left < 0:
                present[key] = (present[key][0] if key in present else g, blob)
            elif key in present and present[key][0] == left:  # a leave of an older join does nothing
                del present[key]
        return present

    def roster_at(self, people: Sequence[Member], generation: int, *, deadline: Deadline,
                  joined_only: bool = False) -> list[Member]:
        """The roster as of layout generation ``generation``: each rank with the layout its last
        change up to that generation published (the one it registered when it changed none).
        ``joined_only`` (an elastic set of readers): only the readers whose join (their first
        change) is at that generation or before and who did not leave since, whenever they registered.

        Raises:
            TimeoutError: a change's document did not appear in time.
            WireError: a change's document is malformed.
        """
        now = {key: blob for key, (_, blob) in self._present(generation, deadline).items()}
        if joined_only:
            if {k for k in now if k[0] == "reader"} - {(m.role, m.rank) for m in people}:
                people = [Member.from_participant(p) for p in self.meta.participants()]  # joined since
            people = [m for m in people if m.role != "reader" or (m.role, m.rank) in now]
        return [dataclasses.replace(m, layout=now.get((m.role, m.rank), m.layout)) for m in people]

    def forget_layouts(self) -> None:
        """The meta server lost its state: its layout generations start over."""
        self._changes.clear()
        self._decided_generation = 0

    def version_generation(self, version: int, epoch: int) -> int:
        """The layout generation writer 0 planned ``version`` with in ``epoch`` (0: no layout changed)."""
        doc = self.meta.get_document(version_layouts_key(version, epoch))
        return int(doc.decode()) if doc is not None else 0

    def pin_server(self) -> None:
        """Pin the meta server's current instance: the first step of (re)joining, before anything
        is written to it (a server that later loses its state is noticed at the next call)."""
        self.meta.pin_instance()

    def publish_model_config(self, config: Mapping[str, Any]) -> str:
        """Store a model config once per job; returns the digest layout descriptors name it by."""
        digest = model_digest(config)
        self.meta.put_document(model_key(digest), json.dumps(config, sort_keys=True).encode())
        return digest

    def model_config(self, digest: str) -> Mapping[str, Any]:
        doc = self.meta.get_document(model_key(digest))
        if doc is None:
            raise ValueError(f"model config {digest} is missing from the meta server (job {self.meta.job!r})")
        config: Mapping[str, Any] = json.loads(doc)
        return config

    def publish_tensor_table(self, table: TensorTable) -> None:
        """The job's table of whole tensors (the writers' names, shapes and dtypes), once per job."""
        self.meta.put_document(tensor_table_key(), msgpack.packb(table.to_wire(), use_bin_type=True))

    def wait_tensor_table(self, *, deadline: Deadline) -> TensorTable | None:
        """The job's tensor table, once published; None at the deadline.

        Raises:
            WireError: the table is malformed (named).
        """
        raw = self.meta.get_document(tensor_table_key(), wait=deadline.remaining(0.0))
        if raw is None:
            return None
        try:
            return TensorTable.from_wire(unpack_map(raw))
        except WireError as exc:
            raise WireError(f"{self.who}: the tensor table of job {self.meta.job!r} is malformed: {exc}") from None

    # -- versions -----------------------------------------------------------------------------
    def publish_version(self, published: PublishedVersion, *, num_writers: int) -> None:
        """This writer's "``published.version`` is ready" (complete once every writer said so).

        Raises:
            ValueError: another writer published the version with a different fingerprint.
        """
        assert self.role == "writer", "only writers publish versions"
        self.meta.publish_version(published.version, published.sync_fingerprint, writer_rank=self.rank,
                                  num_writers=num_writers, epoch=published.epoch)

    def wait_version(self, *, after: int, deadline: Deadline, after_epoch: int | None = None
                     ) -> PublishedVersion | None:
        """The newest version newer than ``after`` (with ``after_epoch``: or ``after`` itself,
        written again in a later epoch), once one is published; None at the deadline."""
        info = self.meta.wait_version(after=after, timeout=deadline.remaining(0.0), after_epoch=after_epoch)
        return PublishedVersion.from_info(info) if info is not None else None

    def _wait_published(self, version: int, epoch: int, writers: int, deadline: Deadline) -> None:
        """Until every writer published ``version`` in ``epoch`` (or later), in slices of a lease
        so that a writer that can no longer publish in it is named within seconds instead of
        waited for (:meth:`_gone_from_try`)."""
        others = [w for w in range(writers) if not (self.role == "writer" and w == self.rank)]
        while True:
            step = deadline.remaining(0.0) if self.lease_seconds <= 0 else min(deadline.remaining(0.0),
                                                                                self.lease_seconds / 2)
            if self.meta.wait_version(after=version, timeout=step, after_epoch=epoch - 1) is not None:
                return
            gone = self._gone_from_try(version, epoch, others)
            if gone:
                rank, why = min(gone.items())
                raise PeerDiedError(f"{self.who}: writer {rank} cannot publish its part of version {version} in "
                                    f"epoch {epoch}: {why}")
            if deadline.expired:
                absent = self.dead_peers("writer", others, max_age=0.0)
                raise TimeoutError(f"{self.who}: epoch {epoch} of version {version} was not published by "
                                   "every writer in time (another writer did not publish its part" + "".join(
                                       f"; writer {r} has no live process and no restart of it joined: {why}"
                                       for r, why in sorted(absent.items())) + ")")

    def _gone_from_try(self, version: int, epoch: int, writers: Sequence[int]) -> dict[int, str]:
        """Writers of ``writers`` that will never publish ``version`` in ``epoch``: rank -> why
        (:meth:`writers_out_of_epoch`): the process that took its seat in the epoch died or was
        replaced; it had no live process and was closed out of the epoch (its restart joins a
        later one); its live process takes part only in later epochs (it restarted, or saw an
        epoch fail, after writer 0 decided this one); or its trainer went on to a newer version."""
        rows = self._leases(0.0)
        gone = {}
        for r in writers:
            row = rows.get(("writer", r))
            if row is None:
                continue  # no leases in this job: liveness is the transports' business
            why = self._out_of_epoch(epoch, r, row, version if self.role == "writer" else None)
            if why is not None:
                gone[r] = why
        return gone
