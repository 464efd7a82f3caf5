"""``WeightReader``: one per inference worker; applies new weight versions.

    reader = WeightReader(engine, rank=worker_id, config=SyncConfig(num_writers=8, num_readers=4))
    result = reader.update(timeout=60)      # newest version, straight into the engine's memory
    print(result.version, result.nbytes, result.phases)

``update`` waits for a version newer than the one applied (through the job channel,
:mod:`weightsync.job.channel`), checks that the writers' sync fingerprint equals its own (same
plan, transport and settings), receives exactly its ops, lets the engine apply them and
reports the version to the meta server, only once every op arrived. If anything fails, the
engine is told (``abort``), the failure is reported with what it left, and ``update`` raises
:class:`SyncError` naming the version, the peer and the tensors; the next ``update``
(for a newer version) starts clean.

What a failure leaves is the engine's to say (``InferenceEngine.invalid``): once a byte of the
version reached the weights it serves, it is invalid (``version`` None) until a later version is
applied in full; before that (a refused plan, a dead writer, bytes only in staging) it keeps
its version. An invalid engine vouches for none of the bytes it holds: its next version comes
in full, never as a delta.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from weightsync.clock.deadline import Deadline
from weightsync.job.channel import PublishedVersion
from weightsync.roles.peer_copies import PeerCopies
from weightsync.session.elastic import same_setup
from weightsync.session.sync_session import SyncConfig, SyncError, SyncResult, SyncSession, device_of, state_lost
from weightsync.tools.torch_layout import apply_copies
from weightsync.transport import TransportError

if TYPE_CHECKING:
    from weightsync.meta.client import AnyMetaClient
    from weightsync.ports.engine import InferenceEngine, Invalid, PhasedEngine, ServingVersion
    from weightsync.session.sync_session import PlannedSync

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class UpdateResult(SyncResult):
    """What one ``update`` applied: version, bytes received and seconds per phase, and the bytes
    taken from each peer's copy by seat when it came from peers (``SyncConfig.peer_sources``;
    empty: from the writers)."""

    peers: dict[int, int] = field(default_factory=dict)

    @property
    def transfer_seconds(self) -> float:
        return sum(v for k, v in self.phases.items() if k.startswith("receive."))

    @property
    def gbps(self) -> float:
        """Received gigabytes per second over the transfer phases."""
        return self.nbytes / self.transfer_seconds / 1e9 if self.transfer_seconds else 0.0


@dataclass(frozen=True)
class Received:
    """A version :meth:`WeightReader.receive` put in the engine's receive buffers, checked, and
    not applied yet: hand it to :meth:`WeightReader.apply`."""

    published: PublishedVersion
    nbytes: int
    phases: dict[str, float]
    planned: PlannedSync | None  # the plan it came under (a reader that re-registers drops it)
    peers: Mapping[int, int] = field(default_factory=dict)  # bytes by peer seat, when taken from peers

    @property
    def version(self) -> int:
        return self.published.version


class WeightReader:
    """An inference worker's end of a sync job (see module docstring)."""

    def __init__(self, engine: InferenceEngine, *, rank: int, config: SyncConfig,
                 meta: AnyMetaClient | None = None) -> None:
        from weightsync.meta.client import job_meta

        if config.commit == "fleet":
            refuse_live_receives(engine)
        self._own_meta = meta is None
        self.meta = job_meta(config.meta_address, job=config.job, given=meta)
        self.engine = engine
        #: the engine's phase hooks, when it stages phase by phase (its declared capability)
        self._phased = cast("PhasedEngine", engine) if engine.stages_in_phases else None
        self.config = config
        self.session = SyncSession("reader", rank, engine, config, self.meta, device=self._device,
                                   keeps_received_bytes=engine.keeps_received_bytes)
        if config.peer_sources and config.layer_phases and self._phased is not None:
            raise ValueError(f"peer_sources={config.peer_sources} with layer_phases=True and {type(engine).__name__}, "
                             "which then stages phase by phase: its receive buffers never hold a whole version to "
                             "keep or take. Set layer_phases=False (whole-model staging), or peer_sources=0")
        #: copies kept for, and taken from, the readers beside it (``SyncConfig.peer_sources``)
        self._peers = PeerCopies(self.session) if config.peer_sources else None
        self._failed: int | None = None
        self._failed_epoch = -1  # the epoch the version that failed here was published in
        self._adopted: int | None = None  # the version taken on joining an elastic set, planned before the join
        #: the version this reader last applied (at first: the engine's own; None after a failure)
        self._applied: int | None = engine.weight_version
        #: (the version this reader last made live, when): the ``since`` of :meth:`serving`
        self._live: tuple[int | None, float | None] = (engine.weight_version, None)

    def _device(self) -> str:
        if self._phased is not None:  # its buffers are laid out only once the phases are known
            return self._phased.device
        return device_of(self.engine.receive_buffers(), f"reader {self.rank}")

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def version(self) -> int | None:
        """The version the engine's weights are at (None: none yet, or invalid)."""
        return self.engine.weight_version

    @property
    def invalid(self) -> Invalid | None:
        """Why the engine serves no valid version: a failed update touched its weights (None: valid)."""
        return self.engine.invalid

    def serving(self) -> ServingVersion:
        """Which version the engine serves, since when, valid or not (see :class:`ServingVersion`).
        ``since`` is when this reader applied it; None for what the engine started with, or for a
        version set on the engine outside this reader."""
        from weightsync.ports.engine import ServingVersion

        version, since = self._live
        return ServingVersion.of(self.engine, since=since if self.engine.weight_version == version else None)

    @property
    def last_failed(self) -> int | None:
        """The last version that failed here, until one is applied (it is never re-taken)."""
        return self._failed

    def update(self, version: int | None = None, *, timeout: float | None = None) -> UpdateResult:
        """Apply the newest version (or at least ``version``); see module docstring.

        Raises:
            TimeoutError: no suitable version was published within ``timeout``.
            ValueError: the writers' sync fingerprint differs from this reader's.
            SyncError: the transfer failed; the engine is invalid if the failure touched its weights
                (``invalid``), else at the version it had.
        """
        return self.apply(self.receive(version, timeout=timeout))

    def follow_layout(self, *, timeout: float | None = None) -> bool:
        """Call when the engine's layout changed (vLLM's EPLB moved experts): the job re-plans
        this reader's share before the writers' next version. True if the layout had changed.

        :meth:`update` checks too, before it waits for a version; a version the writers had
        already planned by then is not taken (it is reported failed, the engine keeps its
        weights) and the next one is. Telling the reader when the placement moves, from the
        engine's rebalance step, keeps that from happening.
        """
        self.session.check_alive()
        if self.session.planned is None:
            return False  # the first plan reads the layout as it is then
        return self.session.relayout(Deadline.after(timeout if timeout is not None else self.config.timeout))

    def receive(self, version: int | None = None, *, timeout: float | None = None) -> Received:
        """The first half of :meth:`update`: receive (and check) the newest version, or at least
        ``version``, into the engine's receive buffers, without applying it.

        With an engine that stages (vLLM, SGLang) and receives nothing into its live weights,
        the engine keeps serving its version meanwhile: :class:`~weightsync.roles.prefetch.Prefetch` runs this in the
        background while the engine generates, and :meth:`apply` is then the engine's pause.
        Raises as :meth:`update`.
        """
        self.session.check_alive()
        return self._guarded(lambda: self._receive(version, timeout))

    def apply(self, received: Received) -> UpdateResult:
        """The second half of :meth:`update`: let the engine apply what :meth:`receive` staged,
        and report it applied. Raises ``SyncError`` if the engine cannot."""
        return self._guarded(lambda: self._apply(received))

    def _guarded(self, step: Callable[[], T]) -> T:
        try:
            return step()
        except Exception as exc:
            lost = state_lost(exc)
            if lost is None:
                raise
            self.session.forget()  # the next update registers and plans anew
            # The new server's versions and epochs start over: a failure here says nothing about them.
            self._failed, self._failed_epoch = None, -1
            raise SyncError(f"reader {self.rank}: update failed: {lost}. This reader registers again on its next "
                            f"update (its engine keeps version {self.version})") from exc

    def _receive(self, version: int | None, timeout: float | None) -> Received:
        deadline = Deadline.after(timeout if timeout is not None else self.config.timeout)
        session = self.session
        phases: dict[str, float] = {}
        if session.planned is None:
            session.plan(deadline)
            if self._peers is not None:
                assert session.planned is not None
                self._lay_out(session.planned.phase_names)  # a phased engine's buffers: one whole-model staging
                self._peers.prepare(self.engine.receive_buffers())
            phases["plan"] = session.timings["setup"]
            if session.registered_anew and self.version is not None:  # tell the new server what this engine serves
                session.channel.report_applied(self.version, nbytes=0, seconds=0.0)
                session.registered_anew = False
        elif session.relayout(deadline):  # the engine's layout moved (EPLB): the job re-plans it
            phases["plan"] = session.timings["setup"]
        if self._peers is not None and self._peers.should_look(self._applied, version):  # none, or it lags
            taken = self._from_peers(version, deadline, phases)
            if taken is not None:
                return taken
        t0 = time.perf_counter()
        published = self._wait_for_version(version, deadline)
        published = self._planned_alike(published, version, deadline, phases)
        phases["wait"] = time.perf_counter() - t0 - phases.get("replan", 0.0)
        planned = session.planned
        assert planned is not None
        self._lay_out(planned.phase_names)
        self._notice_outside_change()
        v = published.version
        try:
            buffers = self.engine.receive_buffers()
            t0 = time.perf_counter()
            transport = session.arm(buffers, published.epoch, deadline)
            phases["prepare"] = time.perf_counter() - t0
            if self.engine.invalid is not None:  # it vouches for none of its bytes: this version comes in full
                transport.forget_received()
            self.engine.receiving(v)  # from here on, bytes land in the receive buffers
            nbytes = 0
            for phase in range(planned.num_phases):
                if planned.digests is not None:
                    planned.digests.begin(phase)
                stats = transport.receive(v, deadline=deadline, phase=phase)
                nbytes += stats.nbytes if planned.digests is None else planned.digests.weight_bytes(phase, stats.nbytes)
                for name, seconds in stats.phases.items():
                    phases[f"receive.{name}"] = phases.get(f"receive.{name}", 0.0) + seconds
                if planned.digests is not None:  # before the engine loads or applies a byte of it
                    t0 = time.perf_counter()
                    planned.digests.check(phase, buffers, version=v)
                    phases["check"] = phases.get("check", 0.0) + time.perf_counter() - t0
                copies = planned.phases[phase] if planned.phases else planned.plan
                if copies.num_copies:  # boxes this reader holds twice (EPLB's redundant experts)
                    t0 = time.perf_counter()
                    apply_copies(copies, buffers)
                    phases["copy"] = phases.get("copy", 0.0) + time.perf_counter() - t0
                if planned.phases:  # an engine staging phase by phase loads this one now
                    t0 = time.perf_counter()
                    self._phase_arrived(v, phase, planned.phase_names[phase])
                    phases["load"] = phases.get("load", 0.0) + time.perf_counter() - t0
            if self.config.commit == "fleet":  # staged and checked: the fleet's decision comes in apply()
                t0 = time.perf_counter()
                session.channel.report_staged(v, published.epoch, moved_past=self._moved_past(v))
                phases["stage"] = time.perf_counter() - t0
            self._keep(v, buffers, phases)
        except (TransportError, ValueError) as exc:
            self._fail(published, exc)
            adopted = (f" (version {v} was planned before this reader joined the elastic set: the next version "
                       "is planned for it)") if self._adopted == v else ""
            raise SyncError(f"reader {self.rank}: version {v} failed: {exc}{adopted}") from exc
        except Exception as exc:
            self._fail(published, exc)
            raise SyncError(f"reader {self.rank}: engine could not load version {v}: {exc}") from exc
        return Received(published, nbytes, phases, self.session.planned)

    def _from_peers(self, version: int | None, deadline: Deadline, phases: dict[str, float]) -> Received | None:
        """The newest version live peers keep, copied into the receive buffers (:mod:`weightsync.roles.peer_copies`);
        None when none can serve it, or the copy tore (the engine is told; it reads the writers)."""
        assert self._peers is not None and self.session.planned is not None
        t0 = time.perf_counter()
        found = self._peers.find(newer_than=self._newer_than(version, failed=False), deadline=deadline)
        if found is None:
            return None
        copy = found.copy
        self._lay_out(self.session.planned.phase_names)
        self.engine.receiving(copy.version)
        try:
            taken = self._peers.take(found, self.engine.receive_buffers())
        except Exception as exc:  # torn, a box that differs, anything: the engine is told, the writers serve it
            self.engine.abort(copy.version, exc)
            self._applied = self.engine.weight_version
            logger.warning("reader %d: %s; it reads the writers instead", self.rank, exc)
            return None
        self.session.planned.transport.forget_received()  # the transport received none of it: no base for deltas
        self.session.planned.transport.abandon(copy.version)  # zero-copy writers holding it for this reader stop
        phases["peers"] = time.perf_counter() - t0
        logger.info("reader %d took version %d from peers %s", self.rank, copy.version, sorted(taken))
        return Received(PublishedVersion(copy.version, copy.fingerprint, copy.epoch), sum(taken.values()), phases,
                        self.session.planned, taken)

    def _keep(self, version: int, buffers: Mapping[str, Any], phases: dict[str, float]) -> None:
        """A reader at a seat below ``peer_sources`` keeps what it received for readers that join; a
        copy it cannot keep (``/dev/shm`` full) fails no version here: it serves no peer instead."""
        if self._peers is None or not self._peers.keeps:
            return
        t0, planned = time.perf_counter(), self.session.planned
        try:
            self._peers.keep(version, buffers, planned.digests if planned is not None else None)
        except Exception as exc:
            logger.warning("reader %d could not keep a peer copy of version %d (%s); it serves none", self.rank,
                           version, exc)
            self._peers.close()
        phases["keep"] = time.perf_counter() - t0

    def _planned_alike(self, published: PublishedVersion, version: int | None, deadline: Deadline,
                       phases: dict[str, float]) -> PublishedVersion:
        """``published``, or a later version, planned as this reader planned: a version planned at a
        later layout generation (another reader's layout changed) makes this reader re-plan; one
        planned before this reader's own layout changed is not for it (it reports the version
        failed, keeping its engine as it is, and waits for the next)."""
        session = self.session
        while True:
            planned = session.planned
            assert planned is not None
            if published.sync_fingerprint == planned.fingerprint:
                return published
            generation = session.channel.version_generation(published.version, published.epoch)
            if generation < session.own_generation and self._adopt(published, generation, deadline, phases):
                self._adopted = published.version
                return published
            if generation < session.own_generation:
                why = (f"version {published.version} (epoch {published.epoch}) was planned at layout generation "
                       f"{generation}, before this reader's layout changed (generation {session.own_generation}); "
                       "it takes the next version")
                logger.info("reader %d: %s", self.rank, why)
                self._failed, self._failed_epoch = published.version, published.epoch
                session.channel.report_failed(published.version, why, epoch=published.epoch)
                published = self._wait_for_version(version, deadline)
                continue
            t0 = time.perf_counter()
            if generation != session.generation and session.follow_generation(generation, deadline):
                phases["replan"] = phases.get("replan", 0.0) + time.perf_counter() - t0
                continue
            raise ValueError(
                f"reader {self.rank}: writers published version {published.version} with sync fingerprint "
                f"{published.sync_fingerprint}, this reader computed {planned.fingerprint}: writers and readers "
                "disagree on the plan, transport or its settings")

    def _adopt(self, published: PublishedVersion, generation: int, deadline: Deadline,
               phases: dict[str, float]) -> bool:
        """A reader that just joined an elastic set takes the newest version at once, though it was
        planned before the join: it plans its own share as if it had been there (True when the plan
        agrees with the writers' on all but the readers; its reads must then find every piece in
        what the writers expose, or the version fails here and it takes the next one)."""
        session = self.session
        if not session.elastic or self._applied is not None or published.version == self._failed:
            return False
        t0 = time.perf_counter()
        session.follow_generation(generation, deadline, with_self=True)
        phases["replan"] = phases.get("replan", 0.0) + time.perf_counter() - t0
        assert session.planned is not None
        return same_setup(published.sync_fingerprint, session.planned.fingerprint)

    def _apply(self, received: Received) -> UpdateResult:
        published, nbytes, phases = received.published, received.nbytes, dict(received.phases)
        v = published.version
        if received.planned is not self.session.planned:
            raise SyncError(f"reader {self.rank}: version {v} was received under a plan this reader has since "
                            "dropped (it registered again); receive it again")
        if self.config.commit == "fleet":
            t0 = time.perf_counter()
            verdict = self.session.channel.wait_commit(v, published.epoch, deadline=Deadline.after(self.config.timeout))
            phases["commit"] = time.perf_counter() - t0
            if verdict.decision != "commit":
                self._not_committed(published, verdict.why)
        t0 = time.perf_counter()
        try:
            self.engine.apply(v)
        except Exception as exc:
            self._fail(published, exc)
            raise SyncError(f"reader {self.rank}: engine could not apply version {v}: {exc}") from exc
        phases["apply"] = time.perf_counter() - t0
        result = UpdateResult(v, nbytes, phases, dict(received.peers))
        self._applied = v
        self._live = (v, time.time())
        self.session.channel.report_applied(v, nbytes=nbytes, seconds=result.seconds)
        if self._peers is not None:
            self._peers.announce(published)
        self._failed = None
        logger.info("reader %d applied version %d: %d bytes, %.3fs", self.rank, v, nbytes, result.seconds)
        return result

    def _lay_out(self, phases: tuple[tuple[str, ...], ...]) -> None:
        """A phased engine lays its staging out for the job's phases (idempotent)."""
        if self._phased is not None:
            self._phased.use_phases(phases or None)

    def _phase_arrived(self, version: int, phase: int, names: tuple[str, ...]) -> None:
        """Tell an engine that stages phase by phase (``PhasedEngine``) that a phase is complete."""
        if self._phased is not None:
            self._phased.phase_arrived(version, phase, names)

    def _notice_outside_change(self) -> None:
        """The engine's version moved without this reader (``engine.update(..., version=older)``,
        a failed manual update, a version set to None): whatever the transport kept of what it
        received is no base to build on, and the versions this reader took stay taken."""
        if self.engine.weight_version == self._applied:
            return
        if self._applied is not None:  # None: this reader's last receive failed, it knows
            logger.warning("reader %d: the engine's version changed from %s to %s outside this reader; the next "
                           "version is received in full", self.rank, self._applied, self.engine.weight_version)
        assert self.session.planned is not None
        self.session.planned.transport.forget_received()

    def _wait_for_version(self, version: int | None, deadline: Deadline) -> PublishedVersion:
        # Never re-take a version that already failed here, nor one this reader applied before its engine's
        # version moved back (two-sided writers moved on: they would send another version's bytes under
        # that number). The same version written again in a later epoch (writers restarted) is fine.
        want = self._newer_than(version)
        retry = self._failed_epoch if self._failed is not None and want == self._failed else None
        while True:
            if deadline.expired:
                raise TimeoutError(f"reader {self.rank}: no version newer than {want} was published in time")
            published = self.session.channel.wait_version(after=want, deadline=deadline, after_epoch=retry)
            if published is not None:
                return published

    def _newer_than(self, version: int | None, *, failed: bool = True) -> int:
        """The version it takes only newer ones than: held, applied or (``failed``) failed; ``version - 1``
        if asked. Peers may serve a version that failed from the writers: their copy is whole."""
        seen = max(x for x in (self.version, self._applied, self._failed if failed else None, -1) if x is not None)
        return seen if version is None else max(seen, version - 1)

    def _moved_past(self, version: int) -> range:
        """The older versions whose fleet commit may still wait on this reader, which skipped them
        (the writers ran ahead of it, at most ``staleness + 1`` versions)."""
        seen = max(x for x in (self._applied, self._failed, -1) if x is not None)
        return range(max(seen + 1, version - self.config.staleness - 1), version)

    def _not_committed(self, published: PublishedVersion, why: str) -> None:
        """The fleet did not commit ``published``: the engine drops what it staged and keeps its
        version (it was never touched), and the version is reported failed with the reason."""
        v = published.version
        error = SyncError(f"reader {self.rank}: version {v} was not committed fleet-wide, so the engine keeps "
                          f"version {self.engine.weight_version}: {why}")
        self._failed, self._failed_epoch = v, published.epoch
        self.engine.abort(v, error)
        self._applied = self.engine.weight_version
        self.session.channel.report_failed(v, f"not committed fleet-wide: {why}", epoch=published.epoch,
                                           invalid=self.engine.invalid is not None, holds=self.engine.weight_version)
        logger.info("%s", error)
        raise error

    def _fail(self, published: PublishedVersion, exc: BaseException) -> None:
        self._failed, self._failed_epoch = published.version, published.epoch
        self.engine.abort(published.version, exc)
        self._applied = self.engine.weight_version  # None if the failure left it invalid
        if self.session.planned is not None:  # a writer holding memory for it stops waiting for this reader
            self.session.planned.transport.abandon(published.version)
        self.session.disarm()
        channel = self.session.channel
        channel.advance_epoch(published.epoch)
        try:
            if self.config.commit == "fleet":  # writer 0 decides the fleet commit without waiting for this reader
                channel.report_stage_failed(published.version, published.epoch, str(exc))
            channel.report_failed(published.version, str(exc), epoch=published.epoch,
                                  invalid=self.engine.invalid is not None, holds=self.engine.weight_version)
        except Exception as report_exc:  # the failure itself is what the caller must see
            logger.warning("reader %d could not report its failure: %s", self.rank, report_exc)

    def close(self) -> None:
        if self._peers is not None:
            self._peers.close()
        self.session.close()
        if self._own_meta:
            self.meta.close()

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def live_receives(engine: InferenceEngine) -> str | None:
    """What of ``engine``'s receives reach the weights it serves ("into its live weights", or the
    tensors taken in place), or None when it receives into staging only (``in_place_names == ()``):
    what :class:`~weightsync.roles.prefetch.Prefetch` and ``commit="fleet"`` need."""
    names = engine.in_place_names
    if names is not None and not names:
        return None
    return f"{len(names)} tensors ({', '.join(names[:2])}, ...) straight into the model" if names \
        else "into its live weights"


def refuse_live_receives(engine: InferenceEngine) -> None:
    """``commit="fleet"`` needs an engine whose receive buffers are staging only: one that
    receives into the weights it serves would switch before the fleet's commit."""
    what = live_receives(engine)
    if what is not None:
        raise ValueError(f"commit='fleet' needs an engine that receives into staging only, so that it switches when "
                         f"the fleet commits; {type(engine).__name__} receives {what}. Use VLLMEngine(in_place=False), "
                         "SGLangEngine, or an InflightReader (which stages for any engine), or commit='each'")
