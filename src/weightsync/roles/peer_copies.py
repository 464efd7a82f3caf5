"""Peer copies: an engine that joins takes its first version from the engines beside it, not from the trainers.

A fleet grows while it trains (rollout engines are added when generation lags, and a dead
engine is replaced). Without peers, every new engine reads a whole version from the trainers'
memory, on the trainers' host and GPUs, while 127 engines next to it hold that version.
With ``SyncConfig(peer_sources=K)``:

* **Keeping.** A reader at a seat below ``K`` keeps a copy of each version it received, in its
  own layout (:class:`~weightsync.transport.shm.peer_copy.HeldCopy`, one ``/dev/shm`` file of
  its shard size), and publishes a :class:`~weightsync.job.wire.PeerCopy` record once its engine
  applied it. It copies after the receive, not in ``apply``: a prefetching engine's pause does
  not grow.
* **Taking.** A reader that holds no version (a fresh engine joining, a replacement, an engine
  a failure left invalid) first looks for the newest version that live peers on its host keep.
  It plans its share against their layouts (rank-local, like any plan: a peer of another
  tensor-parallel layout is a source like a training rank) and copies straight from their files.
  Then it follows the writers from the next version on.
* **Catching up.** A reader that holds a version but missed at least one since (under a
  ``quorum`` or ``fraction`` policy a slow or failing reader misses versions) takes the newest
  published version from peers too, when they hold it: it needs that version whole anyway (no
  delta reaches it across a gap), and the trainers serve one reader fewer. Peers that do not hold
  the newest published version yet leave it to the writers, as a reader that follows. A version
  that failed from the writers may still come from peers (their copy is whole): a NIXL push reader
  that came to the trainers' last version after they sent it is not left behind.
* **Who serves whom.** Each joining reader starts at the peer ``seat mod n`` among those that
  keep the version, and adds the next ones until their shards cover its own. Replicas of one
  layout each serve one joiner in full, so n peers serve n joiners at once with no peer read
  twice. The writers' bytes per version do not grow with the readers that joined.
* **Never a mixed engine.** The peer's control word is read before and after the copy (a
  seqlock). A peer that rewrote its copy meanwhile makes the copy torn: the engine is told
  (``abort``), and the reader reads the writers' newest version instead, as without peers.
  Peers on other hosts, dead peers, gone files and layouts that cannot serve are skipped the
  same way. The version is reported applied only after the engine applied it.

Copies move over shared memory, so by default peers serve the engines of their own host only
(from a GPU the copy goes through host memory), and across hosts a joining engine reads the
writers. **With** ``SyncConfig(peers_across_hosts=True)`` each keeping reader also serves its copy
over NIXL (:mod:`weightsync.transport.nixl.peer_read`), and a joining reader that finds no peer
on its host that can serve it reads what its plan needs from peers on other hosts, with the
same seqlock (read the version word, the shards, the word again): a replacement engine on a new
node, which has no peer beside it, loads no trainer either.

**With** ``integrity=True`` a keeping reader stores, beside its copy, the digest the writers
sent for each op it received (checked against what landed before its engine applied it). A
joining reader then takes a copy only from one peer of its own layout (the digests address its
shards as they address the peer's), digests each box where it landed, and compares: a box that
differs fails the copy, named, before its engine may apply a byte (it reads the writers then).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync.clock.deadline import Deadline
from weightsync.job.wire import PeerCopy, RemoteCopy
from weightsync.layout.types import itemsize
from weightsync.layout.wire import LayoutDecoder
from weightsync.plan import build_local_plan
from weightsync.ports import device as device_port
from weightsync.tools.codecs.digest import tensor_digest
from weightsync.tools.torch_layout import apply_copies, strided_view
from weightsync.transport import TransportError
from weightsync.transport.nixl.peer_read import CopyServer, fetch_copy, read_into
from weightsync.transport.shm.peer_copy import HeldCopy, MappedCopy, digest_entries, map_copy, refill_digests
from weightsync.transport.tensors import flat_views, op_dst_view, op_src_view

if TYPE_CHECKING:
    import torch

    from weightsync.job.wire import Member, PublishedVersion
    from weightsync.layout.types import RankLayout
    from weightsync.plan import Plan
    from weightsync.session.sync_session import SyncSession
    from weightsync.transport.digests import VersionDigests

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """A version to take from peers: its record, this reader's plan against them, their mappings
    (peers on this host) or where they are (peers on other hosts, read in :meth:`PeerCopies.take`),
    and the deadline the reads from other hosts keep."""

    copy: PeerCopy
    plan: Plan
    peers: tuple[MappedCopy | _Afar, ...]
    deadline: Deadline | None = None


@dataclass(frozen=True)
class _Afar:
    """A peer on another host, chosen for a plan; read (:func:`fetch_copy`) once the plan is known."""

    seat: int
    remote: RemoteCopy


def serving_order(seats: list[int], me: int) -> list[int]:
    """The peers a reader at seat ``me`` tries, in order: from ``seats[me mod n]`` on, wrapping
    (joiners at consecutive seats start at different peers)."""
    ordered = sorted(seats)
    start = me % len(ordered) if ordered else 0
    return ordered[start:] + ordered[:start]


class PeerCopies:
    """One reader's side of peer copies (see module docstring)."""

    def __init__(self, session: SyncSession) -> None:
        self.session = session
        self.count = session.config.peer_sources
        #: this reader keeps copies for others
        self.keeps = session.rank < self.count
        self._held: HeldCopy | None = None
        self._kind = ""  # the digests' kind the held copy's table holds for its version ("": none)
        #: the digest table last built, and the plan's digests it was built for (its boxes stay per plan)
        self._table: tuple[VersionDigests, torch.Tensor | None] | None = None
        self._decoder: LayoutDecoder | None = None
        #: serve and take copies across hosts, over NIXL (``SyncConfig.peers_across_hosts``)
        self.across = bool(getattr(session.config, "peers_across_hosts", False))
        self._server: CopyServer | None = None
        #: with a reader that lags (:meth:`should_look`): the newest published version, the one it takes
        self._catch_up: int | None = None

    # -- keeping ------------------------------------------------------------------------------
    def prepare(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Make the held copy's file and fault its pages in, when the reader plans, not in its first
        version (a new 336 MB file took 1 s to fill the first time, page by page, and 0.1 s after)."""
        if not self.keeps:
            return
        planned = self.session.planned
        entries = len(planned.plan.ops) if planned is not None and planned.digests is not None else 0
        try:
            self._held_for(flat_views(buffers), entries).segment.data.zero_()
        except (OSError, RuntimeError) as exc:  # /dev/shm full: its versions still come; it keeps none
            logger.warning("%s cannot keep a peer copy (%s); it serves no peer", self.session.channel.who, exc)
            self.close()

    def keep(self, version: int, buffers: Mapping[str, torch.Tensor], digests: VersionDigests | None = None) -> None:
        """Copy the version the engine's receive buffers hold (a peer's own, checked) into the held
        copy; with ``digests`` (its checks passed), the writers' digest of each op beside it."""
        if not self.keeps:
            return
        flats = flat_views(buffers)
        table = None
        if digests is not None:
            checked = [entry for phase in range(len(digests.runs)) for entry in digests.checked(phase)]
            if self._table is not None and self._table[0] is digests:  # the same plan: its boxes, new digests
                table = self._table[1] if self._table[1] is None else refill_digests(self._table[1], checked)
            else:
                table = digest_entries(list(flats), checked)
                self._table = (digests, table)
        held = self._held_for(flats, 0 if table is None else len(table))
        self._kind = "" if table is None or digests is None else digests.kind
        held.hold(version, flats, table)

    def _held_for(self, flats: Mapping[str, torch.Tensor], entries: int) -> HeldCopy:
        if self._held is not None and not self._held.fits(flats, entries):
            self._held.close()  # the engine's layout changed (EPLB), or its plan has more ops: a new one
            self._held = None
        if self._held is None:
            self._held = HeldCopy(self.session.rank, flats, entries=entries + entries // 4)  # room to re-plan
        return self._held

    def announce(self, published: PublishedVersion) -> None:
        """The engine applied ``published``, which the held copy holds: joining readers may take it."""
        held = self._held
        if held is None or held.version != published.version:
            return
        self.session.channel.publish_peer_copy(PeerCopy(published.version, published.sync_fingerprint,
                                                        published.epoch, self.session.host, held.path, held.nbytes,
                                                        self._kind, self._served(held)))

    def _served(self, held: HeldCopy) -> RemoteCopy | None:
        """How readers on other hosts read ``held`` (``peers_across_hosts``); None when off, or when
        NIXL fails here (this reader then serves its own host only, and says why)."""
        if not self.across:
            return None
        try:
            if self._server is None:
                self._server = CopyServer(self.session.rank, self.session.channel.who)
            return self._server.serve(held)
        except TransportError as exc:
            logger.warning("%s serves its peer copy on its own host only: %s", self.session.channel.who, exc)
            return None

    # -- taking -------------------------------------------------------------------------------
    def should_look(self, applied: int | None, asked: int | None) -> bool:
        """Whether a reader that applied ``applied`` (None: holds no version) and asks for ``asked``
        (None: the newest) looks for its version at peers first: it holds none, or it missed a
        version since (module docstring: catching up; then only the newest published version
        is taken from them, which :meth:`find` checks)."""
        self._catch_up = None
        if applied is None:
            return True
        if asked is not None:
            return False  # a version asked by number comes from the writers
        latest = self.session.channel.wait_version(after=applied + 1, deadline=Deadline.after(0.0))
        if latest is None:
            return False  # it follows: the next version is the writers' to send
        self._catch_up = latest.version
        return True

    def find(self, *, newer_than: int, deadline: Deadline) -> Found | None:
        """The newest version (past ``newer_than``) that live peers keep, planned for this reader
        against the fewest of them from its start in :func:`serving_order`; None when no peer can
        serve it (the reader then reads the writers). Peers on this host first; with
        ``peers_across_hosts``, those on other hosts that serve over NIXL after them. With
        ``integrity``, only a peer of this reader's own layout whose copy carries the writers'
        digests serves it: the reader checks every op against them (:meth:`take`)."""
        session, channel, me = self.session, self.session.channel, self.session.rank
        kind = self._checks()
        live = sorted(rank for role, rank in channel.lease_holders() if role == "reader" and rank < self.count)
        records = {seat: c for seat, c in channel.peer_copies([s for s in live if s != me]).items()
                   if (c.host == session.host or (self.across and c.remote is not None))
                   and c.version > newer_than  # a dead peer holds no lease
                   and (kind is None or c.digests == kind)}
        if not records:
            return None
        newest = max(c.version for c in records.values())
        if self._catch_up is not None and newest < self._catch_up:
            return None  # a lagging reader takes the newest published version, which the peers do not hold yet
        holders = [seat for seat, c in records.items() if c.version == newest]
        people = {(m.role, m.rank): m for m in self._roster(deadline)}
        mine = people.get(("reader", me))
        if mine is None:
            return None
        beside = [seat for seat in holders if records[seat].host == session.host]
        order = serving_order(beside, me) + serving_order([s for s in holders if s not in beside], me)
        chosen: list[MappedCopy | _Afar] = []
        for seat in order:
            if ("reader", seat) not in people or (kind is not None and not self._same_layout(people[("reader", seat)])):
                continue
            record = records[seat]
            if record.host == session.host:
                try:
                    mapped = map_copy(record.path, seat)
                except TransportError as exc:
                    logger.info("%s: not reading reader %d's peer copy: %s", channel.who, seat, exc)
                    continue
                if mapped.holds() != newest:
                    continue  # rewritten since it published the record
                chosen.append(mapped)
            else:
                assert record.remote is not None
                chosen.append(_Afar(seat, record.remote))
            plan = self._plan([people[("reader", p.seat)] for p in chosen], mine)
            if plan is not None:
                return Found(record, plan, tuple(chosen), deadline)
            if kind is not None:
                chosen.clear()  # checked copies come from one peer of this layout, whole
        return None

    def _fetch(self, found: Found) -> dict[int, MappedCopy]:
        """``found``'s peers on other hosts, each read from there into a staging copy (what its
        plan takes of it, and the digest table with ``integrity``): for a plan :func:`read_into`
        cannot read straight into the engine's buffers.

        Raises:
            TransportError: a peer could not be read, or held another version while it was read.
        """
        out = {}
        for peer in found.peers:
            if isinstance(peer, _Afar):
                shards = {op.src_shard for op in found.plan.ops if op.src_rank == peer.seat}
                fetched = fetch_copy(peer.remote, peer.seat, shards, table=self._checks() is not None,
                                     who=self.session.channel.who, deadline=self._afar_deadline(found))
                if fetched.holds() != found.copy.version:
                    raise TransportError(f"reader {peer.seat} rewrote its peer copy of version {found.copy.version} "
                                         f"while {self.session.channel.who} read it from its host")
                out[peer.seat] = fetched
        return out

    def _afar_deadline(self, found: Found) -> Deadline:
        """Half of what is left of the update's deadline: the writers remain, in the rest."""
        left = found.deadline.remaining(0.0) if found.deadline is not None else self.session.config.timeout
        return Deadline.after(left / 2)

    def _checks(self) -> str | None:
        """The digests' kind this reader checks a copy against (None: the job runs without ``integrity``)."""
        if not self.session.config.integrity:
            return None
        planned = self.session.planned
        assert planned is not None and planned.digests is not None, "a reader with integrity plans its digests"
        return planned.digests.kind

    def _same_layout(self, peer: Member) -> bool:
        """Whether ``peer``'s layout is this reader's (its digest table then addresses this reader's shards)."""
        if self._decoder is None:
            self._decoder = LayoutDecoder(self.session.channel.model_config)
        try:
            theirs = self._decoder.roster([(peer.rank, peer.layout)]).layout(peer.rank)
        except ValueError:
            return False
        return theirs.shards == self.session.provider.layout().shards

    def _roster(self, deadline: Deadline) -> list[Member]:
        channel = self.session.channel
        people = channel.wait_roster(writers=self.session.config.num_writers, readers=0, deadline=deadline)
        return channel.roster_at(people, channel.layout_generation(), deadline=deadline)

    def _plan(self, sources: list[Member], mine: Member) -> Plan | None:
        """This reader's share against ``sources``' layouts, or None when they do not cover it."""
        if self._decoder is None:
            self._decoder = LayoutDecoder(self.session.channel.model_config)
        options = dataclasses.replace(self.session.config.plan_options, allow_unneeded_sources=True)
        try:
            src = self._decoder.roster([(m.rank, m.layout) for m in sources])
            dst = self._decoder.roster([(mine.rank, mine.layout)])
            plan = build_local_plan(src, dst, role="reader", rank=mine.rank, options=options)
        except ValueError as exc:  # a tensor or box no source holds, another model, another dtype
            logger.debug("%s: peers %s cannot serve it: %s", self.session.channel.who, [m.rank for m in sources], exc)
            return None
        moved = sum(op.nbytes for op in plan.ops) + sum(op.nbytes for op in plan.copy_ops)
        return plan if moved == needed_bytes(self.session.provider.layout()) else None

    def take(self, found: Found, buffers: Mapping[str, torch.Tensor]) -> dict[int, int]:
        """Copy ``found``'s version into ``buffers``; returns the bytes taken from each peer seat.
        With ``integrity``, every op of the peer's table is checked against the writers' digest
        before the engine may apply a byte of it. A peer on another host is read over NIXL
        straight into the buffers (host memory, no dtype conversion, no checks), else through a
        staging copy (:func:`fetch_copy`).

        Raises:
            TransportError: a peer rewrote its copy while this reader copied (torn), one on
                another host could not be read, or (with ``integrity``) a box's digest is not the
                writers' (named): drop the copy.
        """
        flats = flat_views(buffers)
        afar = {p.seat: p for p in found.peers if isinstance(p, _Afar)}
        peers = {p.seat: p for p in found.peers if isinstance(p, MappedCopy)}
        kind = self._checks()
        direct = kind is None and all(f.device.type == "cpu" for f in flats.values()) and not any(
            op.converts for op in found.plan.ops if op.src_rank in afar)
        if afar and not direct:
            peers.update(self._fetch(found))
            afar = {}
        taken = dict.fromkeys([p.seat for p in found.peers], 0)
        dev = device_port.current()
        for op in found.plan.ops:
            if op.src_rank in peers:
                dev.copy(op_dst_view(flats, op), op_src_view(peers[op.src_rank].flats, op))  # H2D on a GPU
                taken[op.src_rank] += op.nbytes
        for seat, peer in afar.items():
            taken[seat] += read_into(peer.remote, seat, [op for op in found.plan.ops if op.src_rank == seat], flats,
                                     version=found.copy.version, who=self.session.channel.who,
                                     deadline=self._afar_deadline(found))
        for device in {flat.device for flat in flats.values()}:
            dev.synchronize(device)  # landed before the local copies, the checks and the seqlock read
        apply_copies(found.plan, buffers)
        if kind is not None:
            self._check(found, peers, flats, kind)
        torn = [seat for seat, p in peers.items() if p.holds() != found.copy.version]
        if torn:
            raise TransportError(f"reader(s) {torn} rewrote their peer copy of version {found.copy.version} while "
                                 f"{self.session.channel.who} copied it")
        return {seat: n for seat, n in taken.items() if n}

    def _check(self, found: Found, peers: Mapping[int, MappedCopy], flats: Mapping[str, torch.Tensor],
               kind: str) -> None:
        """Every op of the (one) peer's digest table, digested where it landed here, against the writers' digest."""
        (peer,) = peers.values()
        entries = peer.entries()
        if not entries:
            raise TransportError(f"reader {peer.seat}'s peer copy of version {found.copy.version} holds no digests")
        bad = []
        for shard, offset, sizes, strides, expected in entries:
            if tensor_digest(strided_view(flats[shard], sizes, strides, offset), kind).value != expected:  # type: ignore[arg-type]
                bad.append(f"{shard} at {offset} {list(sizes)}")
        if bad:
            raise TransportError(f"{len(bad)} of {len(entries)} boxes copied from reader {peer.seat}'s peer copy of "
                                 f"version {found.copy.version} differ from the writers' digests: {', '.join(bad[:3])}")

    def close(self) -> None:
        if self._server is not None:  # readers on other hosts stop reading it first
            self._server.close()
            self._server = None
        if self._held is not None:
            self._held.close()
            self._held = None


def needed_bytes(layout: RankLayout) -> int:
    """The bytes a reader of ``layout`` receives: every region of its shards, once each (padding excluded)."""
    return sum(region.numel * itemsize(shard.dtype) for shard, region in layout.regions())


__all__ = ["Found", "PeerCopies", "serving_order"]
