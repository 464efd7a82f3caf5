"""torch.distributed transport over gloo (host memory): pairs in parallel lanes.

gloo moves each pair's bytes on its own connection, so up to
:data:`~weightsync.transport.torch.common.MAX_LANES` pairs run at once, one thread each,
sharing the staging bound; within a pair, messages keep their order, which is what
matches sends with receives. Per pair, the sender packs message i+1 while message i is on
the wire and the receiver posts the receive of message i+1 before scattering message i;
direct messages need no buffer (received straight into the destination parameter, sent
without packing when the source view is already a dense run of the right dtype), and up
to eight of them are in flight per pair. Setup and the schedule: :mod:`weightsync.transport.torch.common`.
With ``TransportOptions.delta_anchor_every`` set, pairs exchange only what changed since the
reader's version instead: each pair's lane lends its connection and staging buffers to
:mod:`weightsync.transport.delta.pairs` (a :class:`_GlooLink`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.distributed as dist

from weightsync.clock.deadline import Deadline
from weightsync.transport.base import PeerWatch, PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.delta.pairs import DeltaSync
from weightsync.transport.schedule import Message
from weightsync.transport.tensors import as_bytes, checksum, direct_source, dst_view, pack, scatter, src_view
from weightsync.transport.torch.common import MAX_LANES, Pair, TorchDistBase, TorchPairLink
from weightsync.transport.torch.gloo_group import break_group, gloo_options

if TYPE_CHECKING:
    from weightsync.plan import Plan
    from weightsync.plan.ops import Role
    from weightsync.transport.digests import VersionDigests

logger = logging.getLogger(__name__)

#: Messages in flight per pair; at most two of them use staging buffers, the rest are direct.
_MAX_IN_FLIGHT = 8
#: How long a lane may stay in a send's wait after its group broke before the call leaves it
#: behind (:meth:`GlooTransport._join_lanes`); every other wait fails within milliseconds of the break.
_STUCK_AFTER_BREAK = 1.0


class GlooTransport(TorchDistBase):
    """Two-sided p2p over a private gloo group (see module docstring)."""

    serves_cpu: ClassVar[bool] = True
    serves_cuda: ClassVar[bool] = False
    carries_deltas: ClassVar[bool] = True  # transport/delta/pairs.py over _GlooLink
    #: Integrity digests in the same pass as the pack and the scatter; direct messages are digested
    #: as they leave (writer) or right after they arrived (reader).
    fuses_digests: ClassVar[frozenset[str]] = frozenset({"writer", "reader"})

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.delta = DeltaSync(ctx) if ctx.options.delta_anchor_every else None
        self._broken: Future[float] | None = None  # the running call's: when its group was broken
        self._digests: VersionDigests | None = None

    def use_digests(self, digests: VersionDigests | None) -> bool:
        """Digest while packing and scattering (see :attr:`fuses_digests`); not with deltas, whose
        pairs move encodings instead (:mod:`weightsync.transport.delta`): False then."""
        self._digests = digests if self.delta is None else None
        return self._digests is not None

    def _bind(self, plan: Plan, parts: Sequence[Plan], tensors: Mapping[str, torch.Tensor],
              deadline: Deadline) -> None:
        super()._bind(plan, parts, tensors, deadline)
        if self.delta is not None:
            self.delta.prepared(tensors, phases=len(self._schedules))

    def _form_group(self, epoch: int, deadline: Deadline) -> Any:
        """The epoch's gloo group, formed within ``deadline``, failing within about a second of
        a peer's death, naming it.

        gloo's constructor (``connectFullMesh``) cannot be interrupted, and a rank that went
        away between arriving at the store and connecting makes it retry well past its
        timeout (seen: 100 s under a 20 s timeout, "Connect timeout"). So it runs on a daemon
        thread (it releases the GIL) while this one watches the leases and the deadline; a
        construction given up is left to end by itself, and the group it may still form is
        never used.
        """
        prefix = self._store_for(epoch, deadline)
        ctx = self.ctx
        formed: Future[Any] = Future()

        def construct() -> None:
            try:
                formed.set_result(dist.ProcessGroupGloo(prefix, ctx.global_rank, ctx.world_size,
                                                        gloo_options(ctx.options.host, deadline)))
            except BaseException as exc:  # handed to the waiting thread
                formed.set_exception(exc)

        threading.Thread(target=construct, name=f"weightsync-gloo-form-{epoch}", daemon=True).start()
        roles: list[tuple[Role, int]] = [("writer", ctx.num_writers), ("reader", ctx.num_readers)]
        watches = [PeerWatch(ctx, role, [r for r in range(n) if (role, r) != (ctx.role, ctx.rank)], known=self._holders)
                   for role, n in roles]
        what = f"the process group of epoch {epoch} to form"
        while True:
            try:
                return formed.result(timeout=min(0.1, max(deadline.remaining(), 0.0)))
            except FutureTimeout:
                pass
            except RuntimeError as exc:
                dead = "".join(w.describe() for w in watches)
                raise TransportError(f"{ctx.who}: process group of epoch {epoch} did not form{dead}: {exc}") from exc
            for watch in watches:
                watch.check(what)
            if deadline.expired:
                dead = "".join(w.describe() for w in watches)
                raise TransportError(f"{ctx.who}: process group of epoch {epoch} did not form within the "
                                     f"timeout{dead} (gloo was still connecting its pairs)")

    # -- data movement --------------------------------------------------------------------
    def send(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        move = self._send_pair
        if (delta := self.delta) is not None:
            def move(pair: Pair, run: _LaneRun) -> None:
                delta.send_pair(_GlooLink(self, run, pair), pair.messages, self._flats, phase=phase,
                                stats=run.stats, timer=run.timer)
        return self._run_pairs(version, deadline, move, self._phase_schedule(phase))

    def receive(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        move = self._receive_pair
        if (delta := self.delta) is not None:
            def move(pair: Pair, run: _LaneRun) -> None:
                delta.receive_pair(_GlooLink(self, run, pair), pair.messages, self._flats, phase=phase,
                                   stats=run.stats, timer=run.timer)
        return self._run_pairs(version, deadline, move, self._phase_schedule(phase))

    def _run_pairs(self, version: int, deadline: Deadline, move: Any, schedule: list[Pair]) -> TransferStats:
        """Run ``move`` for every peer (see :meth:`_run_lanes`) while two peer guards watch the
        group: gloo's waits cannot be interrupted, so when a rank's lease expires the guard
        breaks the group (:func:`break_group`) and the waits fail at once; the error names the
        dead rank.

        The guards watch this rank's peers and the ranks of its own role: each rank breaks its
        own group when a rank it depends on dies, and its error names that rank.
        - A peer is watched until its last pair of the call is done; after that its death (or
          its clean leave) cannot spoil what this rank received or sent.
        - A rank of its own role exchanges no bytes with this one: one that died breaks the
          group (the peers it had pairs with break theirs), but one that left on purpose (its
          lease released: a reader done with the version, a writer done writing) does not.

        A send that was on the wire when its pair closed never fails (gloo, see
        :meth:`_join_lanes`): the call leaves its lane behind and fails within about a second of
        the break.
        """
        pg = self._pg
        if pg is None:
            raise TransportError(f"{self.ctx.who}: no process group; call prepare() first")
        ctx = self.ctx
        same = range(ctx.num_writers if ctx.role == "writer" else ctx.num_readers)
        watches = (PeerWatch(ctx, self._other, sorted({pair.peer for pair in schedule}), known=self._holders),
                   PeerWatch(ctx, ctx.role, [r for r in same if r != ctx.rank], known=self._holders, departed=False))
        pairs_left = Counter(pair.peer for pair in schedule)
        lock = threading.Lock()

        def move_and_count(pair: Pair, run: _LaneRun) -> None:
            move(pair, run)
            with lock:
                pairs_left[pair.peer] -= 1
                if not pairs_left[pair.peer]:
                    watches[0].done_with(pair.peer)

        self._broken = broken = Future[float]()
        abort = lambda: self._break_group(pg)  # noqa: E731 (one abort for both guards)
        try:
            with watches[0].guard(abort=abort) as on_peers, watches[1].guard(abort=abort) as on_mates:
                try:
                    stats = self._run_lanes(version, deadline, pg, move_and_count, schedule, broken=broken)
                except TransportError as exc:
                    if not (on_peers.dead or on_mates.dead):
                        raise
                    error: TransportError | None = exc
                else:
                    error = None
        finally:
            self._broken = None
        for guard in (on_peers, on_mates):
            if guard.dead:  # even if every byte arrived meanwhile: the group is broken, the epoch must move on
                self._teardown_group()
                raise TransportError(guard.watch.died(guard.dead, f"version {version}")) from error
        return stats

    @property
    def _other(self) -> Literal["writer", "reader"]:
        return "reader" if self.ctx.role == "writer" else "writer"

    def _other_ranks(self) -> list[int]:
        """Every other rank of the group, by its rank in the group."""
        return [r for r in range(self.ctx.world_size) if r != self.ctx.global_rank]

    def _teardown_group(self) -> None:
        pg = self._pg
        if pg is not None and self.ctx.channel.lease_seconds > 0:
            # peers blocked on this rank fail now instead of at their timeout; the leases then
            # name the rank that died (:meth:`_blame`), which the pair that broke may not be
            self._break_group(pg)
        super()._teardown_group()

    def _break_group(self, pg: Any) -> None:
        """Break ``pg`` (:func:`break_group`) and tell the running call when, so that it leaves
        behind the lanes whose sends gloo never fails (:meth:`_join_lanes`)."""
        break_group(pg, self._other_ranks())
        if (broken := self._broken) is not None:
            with contextlib.suppress(InvalidStateError):  # broken twice (a guard and a lane): the first counts
                broken.set_result(time.monotonic())

    def _fail_group(self, run: _LaneRun) -> None:
        """A lane's wait or post failed: tear its group down, unless the lane was left behind
        (its group is gone, and the transport may have formed the next epoch's since)."""
        if not run.left_behind and run.pg is self._pg:
            self._teardown_group()

    def _run_lanes(self, version: int, deadline: Deadline, pg: Any, move: Any, schedule: list[Pair], *,
                   broken: Future[float]) -> TransferStats:
        """Run ``move`` for every peer, on up to ``MAX_LANES`` threads (see module docstring).

        Even one lane runs on a thread of its own, so that the call can leave it behind
        (:meth:`_join_lanes`) once ``broken`` is set (the group was broken).
        """
        lanes = max(1, min(len(schedule), MAX_LANES))
        runs = [_LaneRun(i, pg, deadline, TransferStats(version), schedule[i::lanes]) for i in range(lanes)]
        pool = ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="weightsync-torch")
        futures = [pool.submit(self._run_lane, run, move) for run in runs]
        left = False
        try:
            left = self._join_lanes(runs, futures, broken)
        finally:
            pool.shutdown(wait=not left)  # a lane left behind ends at its deadline
        results, errors = [], []
        for future in futures:
            if not future.done():
                continue
            try:
                results.append(future.result())
            except TransportError as exc:  # the first lane to fail aborted the group
                errors.append(exc)
        if errors:
            raise min(errors, key=lambda e: "abort" in str(e).lower())
        if left:
            peers = sorted(pair.peer for run in runs if run.left_behind for pair in run.pairs)
            raise TransportError(f"{self.ctx.who}: transfer with {self._other} {', '.join(map(str, peers))} failed: "
                                 "the process group broke while a send was on the wire")
        total = TransferStats(version)
        for stats in results:
            total.nbytes += stats.nbytes
            total.messages += stats.messages
            total.direct_bytes += stats.direct_bytes
            for name, seconds in stats.phases.items():  # lanes overlap: the slowest lane's time
                total.phases[name] = max(total.phases.get(name, 0.0), seconds)
        total.peak_extra_bytes = self._extra_bytes()
        return total

    def _join_lanes(self, runs: list[_LaneRun], futures: list[Future[TransferStats]], broken: Future[float]) -> bool:
        """Wait for every lane, or leave behind those stuck in a send that the broken group will
        never complete; True if some were left behind.

        gloo fails every pending operation of a pair it closes, except a send whose bytes are
        partly written (``tcp::Pair::signalException`` signals the bound buffers of its
        write queue, never the unbound ones that ``send`` posts): its wait runs to its timeout.
        Nothing else can wake it (torch 2.13 exposes no abort of a send), but its pair is
        closed and can never read its memory again, so once the group broke a lane that
        stayed ``_STUCK_AFTER_BREAK`` seconds in a send's wait is left to end at its deadline.
        Lanes in a receive's wait are never left behind (each fails within milliseconds of the
        break, and the closed pair keeps a late peer's bytes out of the reader's memory).
        """
        pending: set[Future[Any]] = set(futures)
        while pending and not broken.done():
            _, pending = wait(pending | {broken}, return_when=FIRST_COMPLETED)
            pending.discard(broken)
        while pending:
            _, pending = wait(pending, timeout=0.1)
            now, since = time.monotonic(), broken.result()
            stuck = [run for run, future in zip(runs, futures, strict=True) if future in pending]
            if stuck and all(run.sending_since is not None and now - max(run.sending_since, since) >= _STUCK_AFTER_BREAK
                             for run in stuck):
                for run in stuck:
                    run.left_behind = True
                logger.warning("%s: left %d lane(s) behind, in sends to %ss %s that the broken process group never "
                               "fails; they end at the call's deadline", self.ctx.who, len(stuck), self._other,
                               sorted(pair.peer for run in stuck for pair in run.pairs))
                return True
        return False

    def _run_lane(self, run: _LaneRun, move: Any) -> TransferStats:
        for pair in run.pairs:
            move(pair, run)
        run.stats.peak_extra_bytes = self._extra_bytes()
        return run.stats

    def _send_pair(self, pair: Pair, run: _LaneRun) -> None:
        peer, messages, stats, timer = pair.peer, pair.messages, run.stats, run.timer
        in_flight: deque[tuple[Any, Message, int]] = deque()
        sums = []
        for index, message in enumerate(messages):
            payload = direct_source(message, self._flats) if message.direct else None
            while len(in_flight) >= _MAX_IN_FLIGHT or (payload is None and _buffers_in_use(in_flight) == 2):
                self._wait(in_flight.popleft(), run, peer, sending=True)
            if payload is None:
                slot = _free_slot(in_flight)
                with timer("pack"):
                    payload = pack(message, self._flats, self._buffer(run.lane, slot), digests=self._digests)
            else:
                slot = -1
                if self._digests is not None:
                    with timer("digest"):
                        self._digests.sent(message.pieces[0].op, src_view(self._flats, message.pieces[0]))
            if self.ctx.options.checksum:
                with timer("checksum"):
                    sums.append(checksum(payload))
            with timer("transfer"):
                work = self._post(run, "send", payload, pair, message, tag=index)
            in_flight.append((work, message, slot))
            stats.nbytes += message.nbytes
            stats.messages += 1
            stats.direct_bytes += message.nbytes if message.direct else 0
        while in_flight:
            self._wait(in_flight.popleft(), run, peer, sending=True)
        if self.ctx.options.checksum and messages:
            tail = torch.tensor(sums, dtype=torch.int64, device=self.device)
            work = self._post(run, "send", tail, pair, messages[-1], tag=len(messages))
            self._wait((work, messages[-1], -1), run, peer, sending=True)

    def _receive_pair(self, pair: Pair, run: _LaneRun) -> None:
        peer, messages, stats, timer = pair.peer, pair.messages, run.stats, run.timer
        version = stats.version
        in_flight: deque[tuple[Any, Message, int]] = deque()
        sums: list[int] = []
        pending = deque(enumerate(messages))
        while pending or in_flight:
            while pending and len(in_flight) < _MAX_IN_FLIGHT and (
                    pending[0][1].direct or _buffers_in_use(in_flight) < 2):
                index, message = pending.popleft()
                if message.direct:
                    target, slot = as_bytes(dst_view(self._flats, message.pieces[0])), -1
                else:
                    slot = _free_slot(in_flight)
                    target = self._buffer(run.lane, slot)[: message.nbytes]
                with timer("transfer"):
                    work = self._post(run, "recv", target, pair, message, tag=index)
                in_flight.append((work, message, slot))
            work, message, slot = in_flight.popleft()
            self._wait((work, message, slot), run, peer, sending=False)
            payload = (as_bytes(dst_view(self._flats, message.pieces[0])) if message.direct
                       else self._buffer(run.lane, slot)[: message.nbytes])
            if self.ctx.options.checksum:
                with timer("checksum"):
                    sums.append(checksum(payload))
            if not message.direct:
                with timer("unpack"):
                    scatter(message, self._flats, payload, digests=self._digests)
            elif self._digests is not None:
                with timer("digest"):
                    self._digests.arrived(message.pieces[0].op, dst_view(self._flats, message.pieces[0]))
            stats.nbytes += message.nbytes
            stats.messages += 1
            stats.direct_bytes += message.nbytes if message.direct else 0
        if self.ctx.options.checksum and messages:
            tail = torch.empty(len(messages), dtype=torch.int64, device=self.device)
            work = self._post(run, "recv", tail, pair, messages[-1], tag=len(messages))
            self._wait((work, messages[-1], -1), run, peer, sending=False)
            for expected, got, message in zip(tail.tolist(), sums, messages, strict=True):
                if expected != got:
                    raise TransportError(
                        f"reader {self.ctx.rank}: checksum mismatch in version {version} from writer "
                        f"{peer}: {message.describe()}"
                    )

    def _post(self, run: _LaneRun, kind: str, tensor: torch.Tensor, pair: Pair, message: Message, *, tag: int) -> Any:
        """Post a send or receive; a broken connection surfaces here as well as in wait.

        Each message of a pair has its own tag (its index): with several receives in flight
        on one pair, gloo does not match same-tag messages to receives in posting order.
        """
        peer = pair.peer
        try:
            op = run.pg.send if kind == "send" else run.pg.recv
            return op([tensor], pair.peer_global, tag)
        except RuntimeError as exc:
            self._fail_group(run)
            # within the lane's deadline: a post fails after it too
            blame = "" if run.left_behind else self._blame(run.deadline)
            raise TransportError(f"{self.ctx.who}: transfer with {self._other} {peer} failed{blame} "
                                 f"({message.describe()}): {exc}") from exc

    def _wait(self, item: tuple[Any, Message, int], run: _LaneRun, peer: int, *, sending: bool) -> None:
        """Wait for a posted send or receive within the lane's deadline; while a send's wait
        lasts, ``run.sending_since`` says since when (:meth:`_join_lanes`)."""
        work, message, _ = item
        remaining = run.deadline.remaining(0.0)
        other = self._other
        try:
            with run.timer("transfer"):
                run.sending_since = time.monotonic() if sending else None
                try:
                    if remaining <= 0 or not work.wait(datetime.timedelta(seconds=remaining)):
                        raise TimeoutError(f"no progress within the timeout ({remaining:.1f}s left)")
                finally:
                    run.sending_since = None
        except (RuntimeError, TimeoutError) as exc:
            self._fail_group(run)  # a broken group cannot be reused; the next epoch rebuilds it
            blame = "" if run.left_behind else self._blame(run.deadline)
            raise TransportError(
                f"{self.ctx.who}: transfer with {other} {peer} failed{blame} ({message.describe()}): {exc}"
            ) from exc

    def _blame(self, deadline: Deadline) -> str:
        """Which ranks of the group are dead, for the error of a failed wait: `` (reader 1 is dead: ...)``.

        Dead includes restarted (its lease now held by a process that joined after the group
        formed). A rank that dies breaks its pairs, and the rank that notices breaks the whole group
        (:func:`break_group`), so the pair that failed here is rarely the dead rank's, and its
        lease expires only up to a ttl later: wait twice that (within the call's deadline) for
        a lease to say who it was. Empty if none did.
        """
        ctx = self.ctx
        writers = [r for r in range(ctx.num_writers) if (ctx.role, r) != ("writer", ctx.rank)]
        readers = [r for r in range(ctx.num_readers) if (ctx.role, r) != ("reader", ctx.rank)]
        watches = [PeerWatch(ctx, "writer", writers, known=self._holders),
                   PeerWatch(ctx, "reader", readers, known=self._holders)]
        ttl = ctx.channel.lease_seconds
        grace = 2 * ttl + 1.0 if ttl > 0 else 0.0  # expiry comes up to a ttl after death, later if the server stalled
        wait = Deadline.after(min(grace, deadline.remaining(0.0)))
        while True:
            try:
                dead = "".join(watch.describe() for watch in watches)
            except Exception as exc:  # the meta server is away: the failure speaks for itself
                logger.debug("%s: cannot read leases: %s", ctx.who, exc)
                return ""
            if dead or wait.expired:
                return dead
            time.sleep(0.25)


@dataclass
class _LaneRun:
    """What one lane (thread) of a send or receive works with."""

    lane: int
    pg: Any
    deadline: Deadline
    stats: TransferStats
    pairs: list[Pair]
    timer: PhaseTimer = field(init=False)
    #: since when the lane waits for a send to complete (None: it does not)
    sending_since: float | None = field(default=None, init=False)
    #: the call gave up on this lane (stuck in a send of a broken group, see ``_join_lanes``)
    left_behind: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.timer = PhaseTimer(self.stats)


@dataclass(frozen=True)
class _GlooLink(TorchPairLink):
    """One pair of a lane as :class:`weightsync.transport.delta.pairs.PairLink`: its tagged sends and
    receives on the lane's group, under the lane's deadline, and the lane's three buffers."""

    transport: GlooTransport
    run: _LaneRun
    pair: Pair

    def post(self, op: Literal["send", "recv"], tensor: torch.Tensor, message: Message, *,
             tag: int) -> tuple[Any, Message, bool]:
        return self.transport._post(self.run, op, tensor, self.pair, message, tag=tag), message, op == "send"

    def wait(self, posted: tuple[Any, Message, bool]) -> None:
        work, message, sending = posted
        self.transport._wait((work, message, -1), self.run, self.pair.peer, sending=sending)

    def buffer(self, slot: int) -> torch.Tensor:
        return self.transport._buffer(self.run.lane, slot)




def _buffers_in_use(in_flight: deque[tuple[Any, Message, int]]) -> int:
    return sum(1 for _, _, slot in in_flight if slot >= 0)


def _free_slot(in_flight: deque[tuple[Any, Message, int]]) -> int:
    used = {slot for _, _, slot in in_flight}
    return 0 if 0 not in used else 1
