"""``WeightWriter``: one per training rank; publishes new weight versions.

    with WeightWriter(source, rank=dist.get_rank(), config=SyncConfig(num_writers=8, num_readers=4)) as w:
        for step in range(steps):
            train_step()
            w.write(step)          # returns when every reader applied it (staleness=0)

``write(V)`` sends exactly the bytes this rank's share of the plan assigns to it and
publishes ``V`` through the job channel (:mod:`weightsync.job.channel`) with the sync fingerprint
(plan + transport settings) and the transport epoch, which every reader checks before it
takes a byte. With ``staleness=K`` it returns as soon as the
data is out, and blocks only while the slowest reader is more than ``K`` versions behind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.clock.deadline import Deadline
from weightsync.job.channel import JobChannel, PeerDiedError, PublishedVersion
from weightsync.job.completion import Completion
from weightsync.job.fleet_commit import CommitVerdict
from weightsync.ports.fleet.policy import KEEP_COMPLETIONS
from weightsync.session.sync_session import SyncConfig, SyncError, SyncResult, SyncSession, device_of, state_lost
from weightsync.transport import TransportError

if TYPE_CHECKING:
    from weightsync.meta.client import AnyMetaClient
    from weightsync.ports.engine import TrainingSource

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WriteResult(SyncResult):
    """What one ``write`` did, with per-phase seconds (plan, prepare, send, wait_readers).

    ``completion``: under a ``quorum`` or ``fraction`` policy, who applied the version this
    write waited for and who missed it (:class:`~weightsync.job.completion.Completion`); None
    under ``all`` (every reader applied it) or when the write waited for no reader."""

    completion: Completion | None = None


class ReadersFailedError(SyncError):
    """Readers reported failing a version: ``write`` never returns success for it.

    Attributes:
        version: the version they failed (``write(V)`` waits for ``V - staleness``).
        failed: reader rank -> the error it reported. A reader that received in place holds
            no valid version until the next one, one that received into staging (vLLM,
            ``InflightReader``) still serves its previous version; the writer's next ``write``
            sends a newer version as usual.
    """

    def __init__(self, writer: int, version: int, failed: dict[int, str]) -> None:
        self.version, self.failed = version, dict(failed)
        shown = "; ".join(f"reader {r}: {why}" for r, why in sorted(failed.items())[:8])
        super().__init__(f"writer {writer}: {len(failed)} reader(s) failed version {version} (the next version "
                         f"brings them up to date): {shown}")


class PolicyNotMetError(SyncError):
    """Too few readers applied a version for the job's completion policy (``quorum=K`` or
    ``fraction=F``): too many failed it or died, or the deadline came. The version is out; the
    readers that missed it catch up on the next one.

    Attributes:
        completion: who applied the version and who missed it, and why.
    """

    def __init__(self, writer: int, completion: Completion) -> None:
        self.completion = completion
        self.version = completion.version
        super().__init__(f"writer {writer}: {completion.summary()}")


#: (meta server address, job, rank) of every open WeightWriter of this process
_OPEN: dict[tuple[str, str, int], WeightWriter] = {}


class WeightWriter:
    """A training rank's end of a sync job (see module docstring)."""

    def __init__(self, source: TrainingSource, *, rank: int, config: SyncConfig,
                 meta: AnyMetaClient | None = None) -> None:
        from weightsync.meta.client import job_meta

        self._own_meta = meta is None
        self.meta = job_meta(config.meta_address, job=config.job, given=meta)
        self._claim = (self.meta.address, config.job, rank)
        if self._claim in _OPEN:
            if self._own_meta:
                self.meta.close()
            raise ValueError(f"a WeightWriter for writer rank {rank} of job {config.job!r} (meta server "
                             f"{self.meta.address}) is already open in this process: close it first (two writers of "
                             "one rank would send over each other)")
        self.source = source
        self.config = config
        self.session = SyncSession("writer", rank, source, config, self.meta,
                                   device=lambda: device_of(source.tensors(), f"writer {rank}"))
        _OPEN[self._claim] = self
        self.version: int | None = None
        self._history: list[int] = []  # versions this writer published, oldest first
        #: the reader seats each version of the history was planned for: how many, and those of
        #: them with no reader (an elastic set's seats never joined, or left): a wait for that
        #: version counts the others
        self._seats: dict[int, tuple[int, frozenset[int]]] = {}
        self._policy = config.policy  # parsed once: every write consults it
        #: the newest versions' completions under a quorum or fraction policy (writer 0 posts them)
        self._completions: deque[Completion] = deque(maxlen=KEEP_COMPLETIONS)
        #: writer 0's fleet-commit decisions still under way (``commit="fleet"``), one per version
        self._deciding: list[threading.Thread] = []

    @property
    def rank(self) -> int:
        return self.session.rank

    def write(self, version: int, *, timeout: float | None = None) -> WriteResult:
        """Send and publish ``version`` (see module docstring), within ``timeout`` (the config's by
        default). A restarted writer's first write may also wait up to one more timeout for writer 0
        to start the version (:meth:`_joins_late`).

        Raises:
            ValueError: the version does not increase, or tensors disagree with the layout.
            ReadersFailedError: under ``completion="all"``, readers failed the version this write
                waited for (``version - staleness``) or died before applying it, naming them and
                why; the version is out, the next ``write`` (of a newer version) proceeds as usual.
            PolicyNotMetError: under a ``quorum`` or ``fraction`` policy, too few readers applied
                that version (naming who missed it, and why); the version is out.
            SyncError: a peer died, a timeout expired, or writers disagree on the plan;
                the job moves to a new epoch and the next ``write`` starts clean.
        """
        if self.version is not None and version <= self.version:
            raise ValueError(f"writer {self.rank}: version {version} does not increase past {self.version}")
        self.session.check_alive()
        written, history = self.version, list(self._history)
        try:
            return self._write(version, timeout)
        except Exception as exc:
            lost = state_lost(exc)
            if lost is None:
                raise
            self.session.forget()  # the next write registers and plans anew
            # The new server knows no version: this one may be written again (a trainer retries it).
            self.version, self._history = written, history
            raise SyncError(f"writer {self.rank}: version {version} failed: {lost}. This writer registers again "
                            "on its next write, which may write this version again") from exc

    def _write(self, version: int, timeout: float | None) -> WriteResult:
        budget = timeout if timeout is not None else self.config.timeout
        deadline = Deadline.after(budget)
        session, channel = self.session, self.session.channel
        result = WriteResult(version, 0)
        if session.planned is None:
            session.plan(deadline)
            result.phases["plan"] = session.timings["setup"]
        planned = session.planned
        assert planned is not None
        transport = planned.transport
        slots = self.config.transport_options.slots
        if transport.one_sided and len(self._history) >= slots:
            self._wait_slot(self._history[-slots], deadline, result)
        try:
            if self._joins_late(channel):
                deadline = self._once_writer_0_started(channel, version, deadline, budget)
            if session.elastic and self.rank == 0:  # readers that left are planned no more
                channel.drop_departed_readers(deadline=deadline)
            epoch = channel.decide_epoch(version, deadline, writers=self.config.num_writers)
            # a reader's layout changed (its engine's EPLB placement): plan the version at the
            # layout generation writer 0 recorded for it, as every writer does
            if session.follow_generation(channel.version_generation(version, epoch), deadline):
                planned = session.planned
                assert planned is not None
                transport = planned.transport
                result.phases["replan"] = session.timings["setup"]
        except TimeoutError as exc:
            raise SyncError(str(exc)) from exc
        published = PublishedVersion(version, planned.fingerprint, epoch)
        tensors = self.source.tensors()
        session.check_tensors(tensors)  # a clear error before anything is published or sent
        if planned.quantizer is not None:  # FP8 readers: quantize what this writer sends
            t0 = time.perf_counter()
            try:
                tensors = planned.quantizer.derive(tensors, exchange=lambda payload, publishers: (
                    channel.exchange_tile_maxima(version, payload, publishers, deadline=deadline)))
            except TimeoutError as exc:
                raise SyncError(str(exc)) from exc
            result.phases["quantize"] = time.perf_counter() - t0
        try:
            if transport.publishes_before_send:
                self._publish(published, result)
            t0 = time.perf_counter()
            session.arm(tensors, epoch, deadline)
            result.phases["prepare"] = time.perf_counter() - t0
            for phase in range(planned.num_phases):  # phases of whole layers, or the version at once
                if planned.digests is not None:  # in band: the phase's digest ops carry them
                    t0 = time.perf_counter()
                    planned.digests.before_send(phase, tensors)  # or the transport digests as it packs
                    result.phases["digest"] = result.phases.get("digest", 0.0) + time.perf_counter() - t0
                stats = transport.send(version, deadline=deadline, phase=phase)
                digests = planned.digests
                result.nbytes += stats.nbytes if digests is None else digests.weight_bytes(phase, stats.nbytes)
                for name, seconds in stats.phases.items():
                    result.phases[f"send.{name}"] = result.phases.get(f"send.{name}", 0.0) + seconds
            if not transport.publishes_before_send:
                self._publish(published, result)
        except TransportError as exc:
            session.disarm()
            channel.advance_epoch(epoch)
            if self.config.commit == "fleet" and self.rank == 0:  # readers that staged it must not wait on
                channel.record_commit(version, epoch, CommitVerdict("abort", f"writer 0's send failed: {exc}", -1, -1))
            raise SyncError(f"writer {self.rank}: version {version} failed: {exc}") from exc
        self.version = version
        self._history = [*self._history[-(slots + self.config.staleness):], version]
        self._seats = {v: self._seats.get(v, (session.reader_count, session.absent_readers)) for v in self._history}
        if self.config.commit == "fleet" and self.rank == 0:
            self._start_commit(version, epoch, deadline)
        k = self.config.staleness
        if len(self._history) > k:
            # Training may run at most k versions ahead of the slowest reader (of the quorum).
            if self._policy.kind == "all":
                self._wait_readers(self._history[-1 - k], deadline, result, timing="wait_readers",
                                   failed_is_error=True, epoch=epoch if k == 0 else None)
            else:
                self._wait_policy(self._history[-1 - k], deadline, result, epoch=epoch if k == 0 else None)
        logger.info("writer %d wrote version %d: %d bytes in %.3fs", self.rank, version, result.nbytes,
                    result.seconds)
        return result

    def _start_commit(self, version: int, epoch: int, deadline: Deadline) -> None:
        """Writer 0 decides ``version``'s fleet commit (:mod:`weightsync.job.fleet_commit`) on a
        thread of its own, so that with ``staleness > 0`` training goes on while the fleet stages
        it; with ``staleness=0`` the write waits for the readers' applies, which follow the decision."""
        channel = self.session.channel

        def decide() -> None:
            try:
                channel.decide_commit(self._policy, version, epoch, readers=self.session.reader_count,
                                      deadline=deadline)
            except Exception as exc:  # the readers must not wait for a decision that will not come
                logger.warning("writer 0 could not decide the fleet commit of version %d: %s", version, exc)
                try:
                    channel.record_commit(version, epoch, CommitVerdict(
                        "abort", f"writer 0 could not decide it: {exc}", -1, -1))
                except Exception as record_exc:
                    logger.warning("writer 0 could not record the abort of version %d: %s", version, record_exc)

        self._deciding = [t for t in self._deciding if t.is_alive()]
        thread = threading.Thread(target=decide, name=f"weightsync-commit-{version}", daemon=True)
        thread.start()
        self._deciding.append(thread)

    def _wait_slot(self, version: int, deadline: Deadline, result: WriteResult) -> None:
        """Before a one-sided transport overwrites the slot holding ``version`` (written ``slots``
        writes ago): every reader must have moved past it; under a quorum or fraction, the policy's
        readers (one further behind has its read overwritten, sees it by the slot's sequence word,
        fails that version and takes the next, so a restarting engine never holds writers up)."""
        if self._policy.kind == "all":
            self._wait_readers(version, deadline, result, timing="wait_slot", failed_is_error=False)
        else:
            self._wait_policy(version, deadline, result, timing="wait_slot", record=False)

    def _joins_late(self, channel: JobChannel) -> bool:
        """This is a restarted writer's first write, and writer 0 is not restarting with it.

        Its predecessor died part-way through a version; writer 0 learns of it only when that
        version fails, on writer 0's own timeout, and starts the next version after that. A
        restart is quick (seen in CI: under a second from the death to the wait), so when writer
        0 has not started this version in any epoch yet, the restarted writer waits one more
        timeout for it, and its write proper starts once writer 0 did. A version writer 0 did
        start, in an epoch the restart cannot join, fails within the write's own timeout as before."""
        return channel.restarted and self.version is None and self.rank != 0

    @staticmethod
    def _once_writer_0_started(channel: JobChannel, version: int, deadline: Deadline, budget: float) -> Deadline:
        """The deadline of a late-joining write (:meth:`_joins_late`): unchanged when writer 0 started
        ``version`` already; else, once writer 0 starts it within one more timeout, the whole budget
        from then on."""
        if channel.version_started(version, Deadline.after(0.0)):
            return deadline
        if channel.version_started(version, Deadline.after(deadline.remaining() + budget)):
            return Deadline.after(budget)
        return deadline

    def _publish(self, published: PublishedVersion, result: WriteResult) -> None:
        t0 = time.perf_counter()
        self.session.channel.publish_version(published, num_writers=self.config.num_writers)
        result.phases["publish"] = time.perf_counter() - t0

    def _wait_readers(self, min_version: int, deadline: Deadline, result: WriteResult, *, timing: str,
                      failed_is_error: bool, epoch: int | None = None) -> None:
        """Wait until every reader is done with ``min_version`` (as published in ``epoch``, when it is
        the version just written), timed as ``result.phases[timing]``. With ``failed_is_error`` (the
        staleness bound) a reader that failed it is an error, never a success."""
        t0 = time.perf_counter()
        try:
            readers, absent = self._seats_of(min_version)
            failed = self.session.channel.wait_readers(min_version=min_version, readers=readers, deadline=deadline,
                                                       epoch=epoch, writers=self.config.num_writers, absent=absent)
        except TimeoutError as exc:
            raise SyncError(f"writer {self.rank}: readers did not reach version {min_version} in time: {exc}") from exc
        except PeerDiedError as exc:
            if epoch is not None:  # never write in that epoch again: its connections include the dead process
                self.session.channel.advance_epoch(epoch)
            raise SyncError(str(exc)) from exc
        result.phases[timing] = result.phases.get(timing, 0.0) + time.perf_counter() - t0
        if failed and failed_is_error:
            raise ReadersFailedError(self.rank, min_version, failed)

    def _seats_of(self, version: int) -> tuple[int, frozenset[int]]:
        """How many reader seats ``version``'s plan spans, and those it had no reader for (the
        current plan's for a version this process did not write)."""
        return self._seats.get(version, (self.session.reader_count, self.session.absent_readers))

    def _wait_policy(self, min_version: int, deadline: Deadline, result: WriteResult, *, epoch: int | None = None,
                     timing: str = "wait_readers", record: bool = True) -> None:
        """Until ``min_version`` is decided under the job's quorum or fraction policy, timed as
        ``result.phases[timing]``. With ``record`` (the version this write waited for) the
        decision is the write's: kept in ``result.completion``, posted by writer 0, and an
        unmet policy raises; else (a slot's reuse) it only bounds the wait."""
        t0 = time.perf_counter()
        try:
            readers, absent = self._seats_of(min_version)
            completion = self.session.channel.wait_completion(
                self._policy, min_version=min_version, readers=readers, deadline=deadline,
                epoch=epoch, writers=self.config.num_writers, absent=absent)
        except TimeoutError as exc:
            raise SyncError(f"writer {self.rank}: version {min_version} was not published in time: {exc}") from exc
        except PeerDiedError as exc:
            if epoch is not None:
                self.session.channel.advance_epoch(epoch)
            raise SyncError(str(exc)) from exc
        result.phases[timing] = result.phases.get(timing, 0.0) + time.perf_counter() - t0
        if not record:
            return
        result.completion = completion
        if self.rank == 0:  # the status page's and /metrics' record of the newest versions
            self._completions.append(completion)
            self.session.channel.record_completions(self._completions)
        if completion.missed:
            logger.info("writer %d: %s", self.rank, completion.summary())
        if completion.state != "complete":
            raise PolicyNotMetError(self.rank, completion)

    def close(self) -> None:
        try:
            for thread in self._deciding:  # each ends by its version's deadline
                thread.join(self.config.timeout)
            self.session.close()
            if self._own_meta:
                self.meta.close()
        finally:
            if _OPEN.get(self._claim) is self:
                del _OPEN[self._claim]

    def __enter__(self) -> WeightWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
