"""NIXL transport, push mode: writers WRITE straight into readers' registered parameters.

The protocol (ready words, notifications carrying the version) and when push is chosen:
:mod:`weightsync.transport.nixl.common`. With ``delta_anchor_every`` (host memory), a reader
that vouches for the previous version gets only what changed, WRITTEN into an inbox it
registered (:mod:`weightsync.transport.nixl.push_changes`); ``TransferStats.nbytes`` then counts
the encodings and the ops WRITTEN whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from weightsync.clock.deadline import Deadline
from weightsync.job.wire import WireError
from weightsync.layout.types import itemsize
from weightsync.ports import device as device_port
from weightsync.tools.codecs.delta import Kind
from weightsync.tools.torch_layout import TORCH_DTYPES
from weightsync.transport.base import PeerWatch, PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.delta.published import (
    DIGEST,
    KIND,
    NBYTES,
    OFFSET,
    ChangeLayout,
    ChangeReader,
    SlotChanges,
    check_delta,
)
from weightsync.transport.exposed import piece_key
from weightsync.transport.nixl.agent import Descriptors, Xfer
from weightsync.transport.nixl.common import (
    EMPTY,
    NixlBase,
    Peer,
    contiguous_runs,
    extent,
    notif_token,
    phase_token,
    row_major,
    send_live,
    token_text,
)
from weightsync.transport.nixl.push_changes import Inbox, InboxLayout, Outbox, make_inboxes
from weightsync.transport.tensors import op_dst_view

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp
    from weightsync.transport.endpoints import NixlEndpoint
    from weightsync.transport.schedule import Message

logger = logging.getLogger(__name__)

#: How often a waiting reader checks that the writers it waits for are alive.
_PROBE_S = 0.05


class NixlPushTransport(NixlBase):
    """Push mode of the NIXL transport (see module docstring)."""

    one_sided: ClassVar[bool] = False
    publishes_before_send: ClassVar[bool] = True  # readers raise their ready words on receive
    mode: ClassVar[str] = "push"
    carries_deltas: ClassVar[bool] = True  # host memory only (delta_published.check_delta)

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        check_delta(f"{self.name} (push)", ctx, slots=False)
        delta = ctx.options.delta_anchor_every
        self._published: SlotChanges | None = None  # writer: versions in two slots, each with its changes
        self._outboxes: list[Outbox] = []  # writer: per reader
        self._staged = torch.empty(0, dtype=torch.int64)  # writer: the readers' staged tables
        self._changes = ChangeReader(ctx) if delta and ctx.role == "reader" else None
        self._inboxes: list[Inbox] = []  # reader: per writer
        self._inbox_mem = torch.empty(0, dtype=torch.uint8)
        self._ops_from: dict[int, list[list[TransferOp]]] = {}  # reader: writer -> its ops, per phase
        self._gone: dict[int, str] = {}  # writer: readers given up for the rest of the epoch (dead)
        self._passed: dict[str, float] = {}  # reader: writer agent -> since when it says it sent the version

    def _release(self) -> None:
        super()._release()
        self._published = None
        self._outboxes, self._inboxes = [], []

    def forget_received(self) -> None:
        if self._changes is not None:
            self._changes.forget()

    # -- writer -----------------------------------------------------------------------------
    def _prepare_writer(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        me = self.ctx.rank
        delta = bool(self.ctx.options.delta_anchor_every)
        ops = [op for part in parts for op in part.ops if op.src_rank == me]
        self._exposed(parts, keep=None if delta else lambda op: not send_live(op))  # deltas: every op packed
        assert self._index is not None
        readers = sorted({op.dst_rank for op in ops})
        self._slot_bytes = max(self._index.total_bytes, 64)
        if delta:
            layout = ChangeLayout.for_index(self._index, 2, after=2 * self._slot_bytes)
            self._area = device_port.allocate(self.dev, layout.end, self.device, what=(
                f"{self.who}'s NIXL push slots with changes (2 x {device_port.gib(self._slot_bytes)})"),
                fix="use delta_anchor_every=0, or nixl_mode='pull'")
            self._published = SlotChanges(self._index, layout, self._area, slot_bytes=self._slot_bytes,
                                          anchor_every=self.ctx.options.delta_anchor_every)
            pairs = [[part.ops_between(me, r) for part in parts] for r in readers]
            inboxes = [InboxLayout.for_ops(pair) for pair in pairs]
            self._staged = torch.zeros(max(sum(b.rows for b in inboxes), 1), 5, dtype=torch.int64)
            at = np.cumsum([0, *(b.rows for b in inboxes)]).tolist()
            self._outboxes = [Outbox(pair, b, self._staged[at[i]: at[i + 1]], 0)
                              for i, (pair, b) in enumerate(zip(pairs, inboxes, strict=True))]
        else:
            self._area = self.dev.empty(self._slot_bytes, self.device, what=f"{self.who}'s NIXL pack area")
        # own word, readers' ready words, their vouch words for this writer (deltas)
        self._ctl = torch.full((1 + 2 * len(readers),), EMPTY, dtype=torch.int64)
        live = sorted({op.src_shard for op in ops if self._live(op)})
        self._pinned = set(live)
        self._register([self._area, *([self._staged] if delta else []), *(self._flats[name] for name in live)],
                       words=self._ctl)
        self._publish(epoch, deltas=delta)
        self._gone = {}
        peers, outboxes = [], []
        for i, r in enumerate(readers):
            try:
                peers.append(self._connect_peer(epoch, "reader", r, deadline, agree=self._reader_takes_changes))
            except TransportError as exc:
                if not self._give_up(r, exc, f"reader {r}", "the epoch", if_dead=True):
                    raise
                continue
            outboxes.extend(self._outboxes[i: i + 1])
        self._peers, self._outboxes = peers, outboxes
        t0 = time.perf_counter()
        for i, peer in enumerate(self._peers):
            peer.ctl = self._ready_xfer(i, peer)
            peer.phases = []
            for p, part in enumerate(parts):
                mine = part.ops_between(me, peer.rank)
                peer.phases.append([[(self._prepare_xfer(peer, "WRITE", self._runs(
                    peer, mine, base=s * self._slot_bytes), f"phase {p}"), None)] if mine else []
                    for s in range(2 if delta else 1)])
        self.setup["prepare_xfers_seconds"] = time.perf_counter() - t0

    def _live(self, op: TransferOp) -> bool:
        return self._published is None and send_live(op)

    def _reader_takes_changes(self, endpoint: NixlEndpoint, label: str) -> None:
        """With deltas, the reader must have published an inbox for this writer's changes."""
        if self._published is not None and (endpoint.inboxes or {}).get(self.ctx.rank) is None:
            raise TransportError(f"{self.who}: {label} takes no changes from this writer; set the same "
                                 "TransportOptions.delta_anchor_every on every rank")

    def _ready_xfer(self, i: int, peer: Peer) -> Xfer:
        """The READ of the reader's ready word and, with deltas, of its vouch word for this writer
        (the reader's words: ready, then one vouch word per writer rank); checks its inbox."""
        if self._published is None:
            return self._word_xfer(peer, self._ctl[1 + i: 2 + i], "ready word")
        inbox = (peer.endpoint.inboxes or {}).get(self.ctx.rank)
        out = self._outboxes[i]
        assert inbox is not None, "checked before connecting (_reader_takes_changes)"
        if inbox[1] != out.layout.nbytes:
            raise TransportError(f"{self.who}: {peer.label}'s change inbox has {inbox[1]} bytes, this writer "
                                 f"expects {out.layout.nbytes}: writer and reader disagree on their ops")
        out.inbox = inbox[0]
        word = self._ctl.data_ptr()
        n = len(self._peers)
        descs = Descriptors.of([word + 8 * (1 + i), word + 8 * (1 + n + i)],
                               [peer.endpoint.ctl, peer.endpoint.ctl + 8 * (1 + self.ctx.rank)], [8, 8])
        return self._prepare_xfer(peer, "READ", descs, "ready and vouch words", data=False)

    def _runs(self, peer: Peer, ops: list[TransferOp], *, base: int = 0) -> Descriptors:
        """One descriptor per run contiguous in both the source (live, or the area at ``base``)
        and the reader's tensor."""
        assert self._area is not None and self._index is not None
        try:
            shards = peer.endpoint.destination_shards(peer.label)
        except WireError as exc:
            raise TransportError(f"{self.who}: {exc}") from exc
        local, remote, lengths = [], [], []
        for op in ops:
            size = itemsize(op.dst_dtype)
            addr, nbytes = shards[op.dst_shard]
            if extent(op.box.sizes, op.dst_strides, op.dst_offset) * size > nbytes:
                raise TransportError(f"{self.who}: {peer.label}'s tensor {op.dst_shard} has {nbytes} bytes, too "
                                     f"few for {op.canonical} {op.box}: writer and reader disagree on layouts")
            if self._live(op):
                src, src_strides = self._flats[op.src_shard].data_ptr() + op.src_offset * size, op.src_strides
            else:
                at = self._index.entries[piece_key(op)][0]
                src, src_strides = self._area.data_ptr() + base + at, row_major(op.box.sizes)
            a, b, run = contiguous_runs(op.box.sizes, src_strides, op.dst_strides)
            local.append(src + a * size)
            remote.append(addr + (op.dst_offset + b) * size)
            lengths.append(np.full(len(a), run * size, dtype=np.int64))
        if not ops:
            return Descriptors.of([], [], [])
        # the reader registers the storages behind its tensors; a range that begins where one
        # storage begins begins a tensor, so never joining at a tensor's start keeps them apart
        return Descriptors.of(np.concatenate(local), np.concatenate(remote), np.concatenate(lengths),
                              local_starts=self._starts, remote_starts=[addr for addr, _ in shards.values()])

    def send(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        self._prepared_agent("send")
        self.check_phase(phase)
        stats, timer = self.new_stats(version)
        changes = self._published
        slot = 0 if changes is None else version % 2
        if changes is not None and phase == 0:
            changes.begin(version)
        self._copy_in()  # _pack synchronizes before the first WRITE
        try:
            with timer("pack"):
                self._pack(slot * self._slot_bytes, phase, then=None if changes is None else (
                    lambda key, op, at: changes.piece(version, key, op, at)))
            if self._digests is not None:  # pieces WRITTEN from the live shards: digested before they go
                with timer("digest"):
                    self._digests.fill(phase, self._flats)
            self._serve(version, phase, slot, deadline=deadline, stats=stats, timer=timer)
        except BaseException:
            if changes is not None:
                changes.abandon()  # the next version goes in full
            raise
        if phase == self.phase_count - 1:
            if changes is not None:
                changes.end(version)
            self._ctl[0] = version
        stats.peak_extra_bytes = (0 if self._area is None else self._area.numel()) + self._moved_bytes()
        return stats

    def _write_whole(self, peer: Peer, xfers: list[tuple[Xfer, Message | None]], *, token: int, deadline: Deadline,
                     stats: TransferStats, timer: PhaseTimer) -> None:
        for xfer, _ in xfers:
            with timer("transfer"):
                self._run(peer, xfer, deadline, notif=b"v%d" % token)
            stats.nbytes += xfer.nbytes
            stats.direct_bytes += xfer.nbytes
            stats.messages += 1

    def _write_changes(self, i: int, peer: Peer, version: int, phase: int, *, deadline: Deadline,
                       stats: TransferStats, timer: PhaseTimer) -> bool:
        """WRITE the reader's staged table and, when it vouched for this version's base, the
        changes (with the notification); returns whether they went (else the caller WRITEs whole)."""
        changes, agent = self._published, self._prepared_agent("send")
        assert changes is not None
        slot = version % 2
        delta = changes.book.base >= 0 and int(self._ctl[1 + len(self._peers) + i]) == phase_token(version, phase)
        ranges, whole, nbytes = self._outboxes[i].stage(version, phase, changes.tables[slot],
                                                        changes.areas[slot].data_ptr(), row_of=changes.book.row_of,
                                                        delta=delta)
        local, remote, lengths = (np.asarray(x, dtype=np.int64) for x in zip(*ranges, strict=True))
        what = f"version {version}'s change table"
        if delta:
            runs = self._runs(peer, whole, base=slot * self._slot_bytes)
            local, remote, lengths = (np.concatenate(x) for x in ((local, runs.local), (remote, runs.remote),
                                                                   (lengths, runs.lengths)))
            what = f"version {version}'s changes"
        with timer("transfer"):
            agent.run_once("WRITE", peer.agent, Descriptors(local, remote, lengths), "DRAM", deadline, what=what,
                           alive=peer.watch.check, notif=b"v%d" % phase_token(version, phase) if delta else b"")
        if delta:
            stats.nbytes += nbytes + sum(op.nbytes for op in whole)
            stats.messages += 1
        return delta

    def _serve(self, version: int, phase: int, slot: int, *, deadline: Deadline, stats: TransferStats,
               timer: PhaseTimer) -> None:
        """WRITE the phase to each reader once it asks for exactly this (version, phase) (see
        :func:`phase_token`), in the order they ask: a slow reader holds back no other.

        Under a completion policy other than ``all`` (``ctx.tolerates_reader_loss``), a reader
        that dies, fails or is late only misses the version (:meth:`_give_up`); the policy decides
        the write from the readers' reports. Otherwise its failure fails the send, naming it."""
        token = phase_token(version, phase)
        want = f"version {version} phase {phase}"
        pending = [i for i, peer in enumerate(self._peers) if peer.phases[phase][slot] and peer.rank not in self._gone]
        while pending:
            served = []
            for i in pending:
                peer = self._peers[i]
                try:
                    with timer("wait"):
                        if not self._asked(i, peer, token, want, deadline):
                            continue
                    if self._published is None or not self._write_changes(i, peer, version, phase, deadline=deadline,
                                                                          stats=stats, timer=timer):
                        self._write_whole(peer, peer.phases[phase][slot], token=token, deadline=deadline,
                                          stats=stats, timer=timer)
                except TransportError as exc:
                    if not self._give_up(peer.rank, exc, peer.label, f"version {version}"):
                        raise
                served.append(i)
            pending = [i for i in pending if i not in served]
            if pending and not served:
                self._check_waiting(pending, want, version, deadline)
                time.sleep(0.001)

    def _asked(self, i: int, peer: Peer, token: int, want: str, deadline: Deadline) -> bool:
        """One look at reader ``peer``'s ready word: whether it asks for exactly ``token`` now."""
        assert peer.ctl is not None
        self._run(peer, peer.ctl, deadline)  # an 8-byte READ; a dead peer fails it once its lease ends
        ready = int(self._ctl[1 + i])
        if ready > token:
            raise TransportError(f"{self.who}: {peer.label} waits for {token_text(ready)}, this writer sends {want}; "
                                 "writers and readers are out of step")
        return ready == token

    def _check_waiting(self, pending: list[int], want: str, version: int, deadline: Deadline) -> None:
        """Between looks at the ready words of ``pending`` readers: raise for a dead or late one
        (or, tolerating losses, give it up), rate-limited by each reader's lease watch."""
        for i in list(pending):
            peer = self._peers[i]
            try:
                if deadline.expired:
                    raise TransportError(f"{self.who}: {peer.label} did not ask for {want} in time (its last "
                                         f"request was {token_text(int(self._ctl[1 + i]))})")
                peer.watch.check(f"{peer.label} to ask for {want}")
            except TransportError as exc:
                if not self._give_up(peer.rank, exc, peer.label, f"version {version}"):
                    raise
                pending.remove(i)

    def _give_up(self, rank: int, exc: TransportError, label: str, what: str, *, if_dead: bool = False) -> bool:
        """Whether this writer goes on without reader ``rank`` after ``exc`` (a completion policy
        other than ``all``; ``if_dead``: only a reader whose lease says it is dead, so that a setting
        that does not combine still fails): it misses ``what``, and, when dead, every later version
        of the epoch too (its restart moves the job to a new one). False: ``exc`` fails the send."""
        if not self.ctx.tolerates_reader_loss:
            return False
        dead = PeerWatch(self.ctx, "reader", [rank]).dead(max_age=0.0)
        if if_dead and not dead:
            return False
        if dead:
            self._gone[rank] = dead[rank]
        logger.warning("%s goes on without %s for %s (the completion policy decides the write): %s", self.who,
                       label, "the rest of the epoch" if dead else what, exc)
        return True

    # -- reader -----------------------------------------------------------------------------
    def _prepare_reader(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        writers = sorted({op.src_rank for part in parts for op in part.ops})
        vouch = self.ctx.num_writers
        # ready word, a vouch word per writer rank (deltas), liveness mirrors
        self._ctl = torch.full((1 + vouch + len(writers),), EMPTY, dtype=torch.int64)
        inboxes = self._make_inboxes(parts, writers)
        self._register([*self._flats.values(), *([self._inbox_mem] if inboxes else [])], words=self._ctl)
        self._pinned = set(self._flats)
        self._publish(epoch, shards={name: (t.data_ptr(), t.numel() * t.element_size())
                                     for name, t in self._flats.items()}, inboxes=inboxes)
        self._peers = [self._connect_peer(epoch, "writer", w, deadline, agree=self._writer_sends_changes)
                       for w in writers]
        for i, peer in enumerate(self._peers):
            peer.ctl = self._word_xfer(peer, self._ctl[1 + vouch + i: 2 + vouch + i], "liveness word")
            peer.nbytes = [sum(op.nbytes for op in part.ops_between(peer.rank, self.ctx.rank)) for part in parts]
        self._ops_from = {peer.rank: [part.ops_between(peer.rank, self.ctx.rank) for part in parts]
                          for peer in self._peers}  # what each writer WRITEs, per phase
        if self._changes is not None:
            self._changes.prepared(len(parts))

    def _writer_sends_changes(self, endpoint: NixlEndpoint, label: str) -> None:
        """With deltas, the writer must publish changes for this reader's inbox."""
        if self._changes is not None and not endpoint.deltas:
            raise TransportError(f"{self.who}: {label} sends no changes; set the same "
                                 "TransportOptions.delta_anchor_every on every rank")

    def _make_inboxes(self, parts: list[Plan], writers: list[int]) -> dict[int, tuple[int, int]] | None:
        """With deltas, one inbox per writer in one registered buffer; writer -> (address, bytes)."""
        if self._changes is None:
            return None
        self._inbox_mem, self._inboxes, out = make_inboxes([[part.ops_between(w, self.ctx.rank) for part in parts]
                                                            for w in writers], writers)
        return out

    def receive(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        agent = self._prepared_agent("receive")
        self.check_phase(phase)
        stats = TransferStats(version)
        token = phase_token(version, phase)
        pending = {peer.agent: peer for peer in self._peers if peer.nbytes[phase]}
        self._passed.clear()
        self._copy_in()  # what this rank's tensors hold now: the base of deltas, the bytes no op writes
        vouched = self._vouch(version, phase, stats)
        # writers poll this word before they WRITE into our tensors, outside stream order: what
        # is queued on them (the engine's last forward, the previous phase's loads) completes first
        self.dev.synchronize(self.device)
        self.dev.signal(self._ctl, 0, token, covers=list(self._flats.values()))
        next_probe = time.monotonic() + _PROBE_S
        digests: dict[int, list[int]] = {}

        def take(notifs: dict[str, list[bytes]]) -> None:
            for name, messages in notifs.items():
                if name in pending and any(notif_token(m) >= token for m in messages):
                    peer = pending.pop(name)
                    if self._changes is None:
                        nbytes = peer.nbytes[phase]
                        if self._digests is not None:  # while the other writers still WRITE
                            with PhaseTimer(stats)("digest"):
                                for op in self._ops_from[peer.rank][phase]:
                                    self._digests.arrived(op, op_dst_view(self._flats, op))
                    else:
                        nbytes, digests[peer.rank] = self._take(peer, version, phase, vouched[peer.rank])
                    stats.nbytes += nbytes
                    stats.direct_bytes += nbytes
                    stats.messages += 1

        with PhaseTimer(stats)("transfer"):
            while pending:
                take(agent.take_notifs(timeout=0.005))
                now = time.monotonic()
                if pending and (deadline.expired or now > next_probe):
                    self._probe(pending, version, deadline, take)
                    next_probe = now + _PROBE_S
        if self._changes is not None:
            for writer, received in digests.items():
                self._changes.received((phase, writer), version, received)
            stats.peak_extra_bytes = self._changes.extra_bytes() + self._inbox_mem.numel()
        self._copy_out()
        stats.peak_extra_bytes += self._moved_bytes()
        return stats

    def _probe(self, pending: dict[str, Peer], version: int, deadline: Deadline,
               take: Callable[[dict[str, list[bytes]]], None]) -> None:
        """Fail for a pending writer that is dead (a dead writer never notifies; READing its word
        fails, or hangs until its lease expires) or late, unless its notification came meanwhile.

        A writer that sent its last version closes and leaves: its notification is delivered
        before its disconnection, but this rank may not have taken it yet (it was applying
        another writer's changes, or the poller was not scheduled). So each failure first takes
        what arrived, progressing NIXL now, and counts only for a writer still pending."""
        drain = self._prepared_agent("receive").take_notifs
        for peer in list(pending.values()):
            if peer.agent in pending and not deadline.expired:
                try:
                    assert peer.ctl is not None
                    self._run(peer, peer.ctl, deadline)
                    peer.watch.check(f"version {version} from {peer.label}")
                    self._check_not_passed(peer, version)
                except TransportError:
                    take(drain(timeout=0, progress=True))
                    if peer.agent in pending:
                        raise
        if deadline.expired:
            take(drain(timeout=0, progress=True))
            if pending:
                names = ", ".join(p.label for p in pending.values())
                raise TransportError(f"{self.who}: version {version} did not arrive from {names} in time")

    def _check_not_passed(self, peer: Peer, version: int) -> None:
        """Raise once writer ``peer``'s own word (READ into this rank's mirror) has said for 0.25 s
        (a notification still on its way) that it finished ``version`` or a newer one without
        notifying this reader: it sent it without this reader (a reader that came to it late, or
        given up under a quorum) and never sends it again. Such a reader waited until its timeout."""
        sent = int(self._ctl[1 + self.ctx.num_writers + self._peers.index(peer)])
        if sent < version:
            self._passed.pop(peer.agent, None)
            return
        if time.monotonic() - self._passed.setdefault(peer.agent, time.monotonic()) > 0.25:
            raise TransportError(f"{self.who}: {peer.label} sent version {sent} without this reader, so version "
                                 f"{version} will not come from it (this reader came to it late, or the writer went "
                                 "on without it under the completion policy); the next version reaches it")

    def _vouch(self, version: int, phase: int, stats: TransferStats) -> dict[int, bool]:
        """With deltas, set each writer's vouch word: this token when the memory holds ``version - 1``
        of its ops of the phase (checked by digest), else -1. Returns writer -> vouched."""
        out: dict[int, bool] = {}
        if self._changes is None:
            return out
        with PhaseTimer(stats)("vouch"):
            for peer, inbox in zip(self._peers, self._inboxes, strict=True):
                ops = inbox.ops[phase]
                base = self._changes.vouch((phase, peer.rank), ops, self._flats) if ops else -1
                out[peer.rank] = base >= 0 and base == version - 1
                self._ctl[1 + peer.rank] = phase_token(version, phase) if out[peer.rank] else EMPTY
        return out

    def _take(self, peer: Peer, version: int, phase: int, vouched: bool) -> tuple[int, list[int]]:
        """Bring ``peer``'s ops of the phase to ``version`` once its notification arrived: apply the
        changes in the inbox (the rest was WRITTEN whole into the destination), keep the shadow.
        Returns the bytes the writer WROTE (encodings and whole ops) and its digest of each op."""
        assert self._changes is not None
        inbox = next(b for p, b in zip(self._peers, self._inboxes, strict=True) if p is peer)
        ops = inbox.ops[phase]
        delta, rows = inbox.rows(version, phase, vouched=vouched, reader=self.ctx.rank, writer=peer.rank)
        shadow = self._changes.shadow_of((phase, peer.rank), ops)
        nbytes = 0
        for j, (op, row) in enumerate(zip(ops, rows, strict=True)):
            kept = None if shadow is None else shadow[j]
            if delta and row[KIND] != Kind.DENSE:
                self._changes.apply(op, row, inbox.area[row[OFFSET]: row[OFFSET] + row[NBYTES]], self._flats,
                                    writer=peer.rank, shadow=kept)
                nbytes += row[NBYTES]
                continue
            if kept is not None:  # the reader's own copy of what landed whole
                kept.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes).copy_(op_dst_view(self._flats, op))
            nbytes += op.nbytes
        return nbytes, [row[DIGEST] for row in rows]
