"""What writers and readers share: the job settings, planning, and the transport.

A :class:`SyncSession` is one rank's membership in a sync job. On first use
(:meth:`SyncSession.plan`) it registers the rank through the job channel (layout metadata
included), waits until every writer and reader has registered, rebuilds everyone's layout,
computes *this rank's* share of the plan (rank-local planning: no rank ever builds the
global plan), and creates the transport; the result is a frozen :class:`PlannedSync`.
Before each version, :meth:`SyncSession.arm` connects the transport when the version's
epoch changed and binds it then or when the buffers' storage moved. Writers and readers
(``roles/writer.py``, ``reader.py``) drive versions on top; epochs are explained in :mod:`weightsync.job.channel`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.clock.deadline import Deadline
from weightsync.job.channel import JobChannel, Member, Role
from weightsync.layout.roster import Roster
from weightsync.layout.wire import LayoutDecoder, check_rank, encode_descriptor, encode_explicit
from weightsync.plan import layer_phases, split_plan
from weightsync.ports.device import gpu_identity
from weightsync.session import elastic
from weightsync.session.combinations import refuse_combinations
from weightsync.session.config import SyncConfig
from weightsync.session.share import Quantizer, decode_roster, plan_share
from weightsync.tools.devices import RankPlacement, choose_transport, tensors_device, visible_gpus
from weightsync.tools.torch_layout import check_tensors
from weightsync.transport import TransportContext, TransportOptions, create_transport, unavailable_reason

if TYPE_CHECKING:
    import torch

    from weightsync.layout import LayoutProvider
    from weightsync.meta.client import AnyMetaClient
    from weightsync.plan import Plan
    from weightsync.transport import Transport
    from weightsync.transport.digests import VersionDigests

logger = logging.getLogger(__name__)


def device_of(tensors: Mapping[str, torch.Tensor], who: str) -> str:
    """The one device a rank's tensors live on (``"cuda:N"`` with its index)."""
    return tensors_device((str(t.device) for t in tensors.values()), what=f"{who}'s tensors")


class SyncError(RuntimeError):
    """A sync could not complete; the message names the version, the peer and the tensors."""


def state_lost(exc: BaseException) -> BaseException | None:
    """The :class:`~weightsync.meta.calls.ServerStateLostError` behind ``exc``, if any."""
    from weightsync.meta.calls import ServerStateLostError

    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None or isinstance(seen, ServerStateLostError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@dataclass(slots=True)
class SyncResult:
    """What one sync did on this rank: the version, bytes of weights moved (integrity digests,
    8 bytes per piece, not counted) and seconds per phase."""

    version: int
    nbytes: int
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())


@dataclass(frozen=True)
class PlannedSync:
    """A rank's planned share of the job: its plan, transport and the sync fingerprint.

    ``fingerprint`` hashes the plan's inputs and options together with the transport and its
    settings; writers publish it with every version and readers refuse a version whose
    fingerprint differs from theirs.
    """

    plan: Plan
    transport: Transport
    transport_name: str
    fingerprint: str
    seconds: float  # registration, rendezvous and planning
    device: str  # where this rank's tensors live ("cpu", "cuda:N")
    why: str  # why this transport (``auto``'s reasoning, or "requested")
    #: the canonical tensors of each phase (one phase, every tensor, without ``layer_phases``)
    phase_names: tuple[tuple[str, ...], ...] = ()
    #: this rank's plan cut by phase (empty without ``layer_phases``)
    phases: tuple[Plan, ...] = ()
    #: a writer's quantizer, when readers ask for FP8 or a block format it sends (``layout.quant_offers``,
    #: ``layout.quant_block_offers``)
    quantizer: Quantizer | None = None
    #: with ``SyncConfig.integrity``: the plan with its digest ops, and this rank's digests
    digests: VersionDigests | None = None

    @property
    def num_phases(self) -> int:
        return max(1, len(self.phases))


class SyncSession:
    """One rank's view of a job (see module docstring)."""

    def __init__(self, role: Role, rank: int, provider: LayoutProvider, config: SyncConfig,
                 meta: AnyMetaClient, *, device: Callable[[], str], keeps_received_bytes: bool = True) -> None:
        if meta.job != config.job:
            raise ValueError(f"SyncConfig(job={config.job!r}) but the MetaClient passed in speaks for job "
                             f"{meta.job!r}: build the client with job={config.job!r} (or leave meta= out)")
        #: an elastic set of readers (``num_readers=None``, :mod:`weightsync.session.elastic`)
        self.elastic = config.num_readers is None
        if self.elastic and role == "reader":
            elastic.check_seat(rank)
        else:
            size = config.num_writers if role == "writer" else config.num_readers
            assert size is not None
            if not 0 <= rank < size:
                raise ValueError(f"{role} rank {rank} is outside 0..{size - 1} (the job has {size} {role}s)")
        #: the reader seats of this rank's plan: ``num_readers``, or an elastic set's seats at its generation
        self.reader_count = config.num_readers or 0
        #: seats below ``reader_count`` that the plan has no reader for (an elastic set's seats never
        #: joined, or left): the writers' waits count the others
        self.absent_readers: frozenset[int] = frozenset()
        self.provider = provider
        self._device = device  # where the source's tensors or the engine's buffers live
        self._keeps_received_bytes = keeps_received_bytes  # a reader's engine's capability
        self.config = config
        self.channel = JobChannel(meta, role=role, rank=rank)
        self.host = config.host or socket.gethostname()
        self.planned: PlannedSync | None = None
        #: one plan() at a time: a second caller (an InflightReader's thread and its owner) waits and
        #: gets the first one's PlannedSync, not a second transport and digests replacing it mid-version
        self._planning = threading.Lock()
        self.timings: dict[str, float] = {}
        self._connected: int | None = None  # the epoch the transport connected in
        self._bound: tuple[int, ...] | None = None  # the buffers' data pointers it was bound to
        self._registered = False
        #: this session registers anew with a meta server that lost its state (see forget()): a
        #: reader then tells the new server the version its engine serves
        self.registered_anew = False
        #: the job's layout generation this rank's plan was made at (see JobChannel.publish_layout)
        self.generation = 0
        #: the generation of this rank's own last layout change (0: none)
        self.own_generation = 0
        self._published: tuple[Any, ...] = ()  # what this rank's layout was when it last published it
        self._previous: Plan | None = None  # the plan before the last re-plan: its writers' side is reused
        self._decoder: LayoutDecoder | None = None
        self._writers: tuple[tuple[bytes, ...], Roster] | None = None

    @property
    def role(self) -> Role:
        return self.channel.role

    @property
    def rank(self) -> int:
        return self.channel.rank

    # -- membership -----------------------------------------------------------------------
    def _layout_blob(self) -> bytes:
        descriptor = self.provider.descriptor()
        self._published = self._layout_now(descriptor)
        if descriptor is not None:
            layout_text, config = descriptor
            check_rank(layout_text, self.rank, self.channel.who)
            return encode_descriptor(layout_text, self.channel.publish_model_config(config))
        return encode_explicit(self.provider.layout())

    def _layout_now(self, descriptor: tuple[str, Mapping[str, Any]] | None) -> tuple[Any, ...]:
        """What this rank's layout is now, cheaply: its descriptor, or the layout object its
        provider hands out (a provider whose layout changes hands out a new one)."""
        if descriptor is not None:
            return ("descriptor", descriptor[0], json.dumps(descriptor[1], sort_keys=True, default=str))
        return ("layout", self.provider.layout())

    def device(self) -> str:
        """Where this rank's tensors live: published so that the job picks a transport that
        can move them (see :func:`weightsync.tools.devices.choose_transport`)."""
        return self._device()

    def register(self) -> None:
        if self._registered:
            return
        self.channel.pin_server()  # first: the layout blob below is already written to the server
        settings = self.config.settings()
        device = self.device()
        if self.config.integrity and device == "cpu":  # the fused digests' kernels, before this rank holds
            from weightsync.tools.codecs import digest_jit  # a lease: numba's start takes seconds under load

            digest_jit.for_rank(self.provider.layout().nbytes)
        restarted = self.channel.register(host=self.host, group=self.config.job, layout=self._layout_blob(),
                                          device=device, gpu=gpu_identity(device), settings=settings,
                                          lease=self.config.lease_seconds,
                                          sees=tuple(visible_gpus()) if device.startswith("cuda") else ())
        self.channel.start_heartbeat()
        self.channel.check_settings(settings)
        if restarted:  # the others' connections do not include this new process: move everyone on
            self.channel.rejoin()
            logger.info("%s rejoined the job; epoch advanced", self.channel.who)
        if self.elastic and self.role == "reader":  # its join: the next version is planned for it too
            self._check_joinable(Deadline.after(self.config.timeout))
            self.own_generation = self.channel.publish_layout(self._layout_blob(),
                                                              deadline=Deadline.after(self.config.timeout))
            logger.info("%s joined the job's elastic readers at layout generation %d", self.channel.who,
                        self.own_generation)
        self._registered = True

    def _check_joinable(self, deadline: Deadline) -> None:
        """A reader plans its share against the writers before it joins an elastic set: every writer
        plans for the readers that joined, so one they cannot serve (another model, a tensor no
        writer holds) would fail them all. Raises ValueError naming why, before the join."""
        people = self.channel.wait_roster(writers=self.config.num_writers, readers=0, deadline=deadline)
        mine = [m for m in people if m.role == "writer" or (m.role, m.rank) == ("reader", self.rank)]
        try:
            plan_share(*self._decode(mine), role="reader", rank=self.rank, options=self.config.plan_options)
        except ValueError as exc:
            raise ValueError(f"{self.channel.who} cannot join the job's elastic readers: {exc}") from exc

    # -- planning -------------------------------------------------------------------------
    def plan(self, deadline: Deadline) -> PlannedSync:
        """This rank's share of the job, planned once (the first call waits for everyone; a call
        from another thread meanwhile waits for it and returns the same plan)."""
        if not self._planning.acquire(timeout=deadline.remaining()):
            raise TimeoutError(f"{self.channel.who}: another thread was still planning this rank's share")
        try:
            if self.planned is None:
                self.planned = self._plan(deadline)
            return self.planned
        finally:
            self._planning.release()

    def relayout(self, deadline: Deadline) -> bool:
        """If this rank's layout changed since it was published (an engine's EPLB placement
        moved), publish the new one and re-plan at the job's next layout generation; True if so.
        Versions the writers planned before are not for this rank (the reader skips them)."""
        now, before = self._layout_now(self.provider.descriptor()), self._published
        if now[0] == before[0] and (now[1] is before[1] if now[0] == "layout" else now == before):
            return False
        blob = self._layout_blob()
        self.own_generation = self.channel.publish_layout(blob, deadline=deadline)
        logger.info("%s: its layout changed; the job's layout generation is now %d", self.channel.who,
                    self.own_generation)
        self.follow_generation(self.own_generation, deadline)
        return True

    def follow_generation(self, generation: int, deadline: Deadline, *, with_self: bool = False) -> bool:
        """Re-plan at layout generation ``generation`` unless the plan was made at it; True if it
        re-planned. The writers' side of the old plan is reused (only the readers' changed), and
        a fresh transport connects in the next epoch. ``with_self``: this reader of an elastic set
        joined after ``generation``, and plans its share of a version planned then as if it had
        been there (:mod:`weightsync.session.elastic`, "the newest version at once")."""
        if not self._planning.acquire(timeout=deadline.remaining()):
            raise TimeoutError(f"{self.channel.who}: another thread was still planning this rank's share")
        try:
            if self.planned is not None and self.generation == generation:
                return False
            old, self.planned = self.planned, None
            self.disarm()
            if old is not None:
                self._previous = old.plan
                old.transport.close()
                if old.digests is not None:
                    old.digests.close()
            self.planned = self._plan(deadline, generation, with_self=with_self)
            return True
        finally:
            self._planning.release()

    def _decode(self, people: Sequence[Member]) -> tuple[Roster, Roster]:
        """Everyone's layout as columns; the writers' roster of the last plan when their blobs are
        the same (a re-plan after a reader's layout changed decodes the readers only)."""
        if self._decoder is None:
            self._decoder = LayoutDecoder(self.channel.model_config)
        sides = []
        for role in ("writer", "reader"):
            members = [(p.rank, p.layout) for p in people if p.role == role]
            blobs = tuple(blob for _, blob in members)
            if role == "writer" and self._writers is not None and self._writers[0] == blobs:
                sides.append(self._writers[1])
                continue
            side = self._decoder.roster(members) if members else Roster.from_layouts([])
            if role == "writer":
                self._writers = (blobs, side)
            sides.append(side)
        return sides[0], sides[1]

    def _plan(self, deadline: Deadline, generation: int | None = None, *, with_self: bool = False) -> PlannedSync:
        started = time.perf_counter()
        self.register()
        people = self.channel.wait_roster(writers=self.config.num_writers, readers=self.config.num_readers or 0,
                                          deadline=deadline)
        self.channel.check_settings(self.config.settings(), people)
        if generation is None:
            generation = self.channel.layout_generation()
            if self.elastic and generation < 1:
                generation = elastic.first_join(self.channel, deadline)
        if generation:
            registered = people
            people = self.channel.roster_at(people, generation, deadline=deadline, joined_only=self.elastic)
            if all((m.role, m.rank) != (self.role, self.rank) for m in people):
                if not with_self and self.role == "reader" and self.elastic and generation >= self.own_generation > 0:
                    # writer 0 dropped this reader (its lease lapsed: a pause, a stopped process): join again,
                    # and take the version planned for it after that
                    self.own_generation = self.channel.publish_layout(self._layout_blob(), deadline=deadline)
                    logger.warning("%s had left the job at layout generation %d (its lease lapsed); it joined "
                                   "again at %d", self.channel.who, generation, self.own_generation)
                    with_self = True
                if with_self:
                    people = [*people, *(m for m in registered if (m.role, m.rank) == (self.role, self.rank))]
        if self.elastic:
            self.reader_count = elastic.reader_count(people)
            self.absent_readers = elastic.absent(people)
        t0 = time.perf_counter()
        writers, readers = self._decode(people)
        self.timings["decode"] = time.perf_counter() - t0
        plan, writers, quantizer = plan_share(writers, readers, role=self.role, rank=self.rank,
                                              options=self.config.plan_options, timings=self.timings,
                                              previous=self._previous)
        self.generation = generation
        self.timings["plan"] = time.perf_counter() - t0  # all of the rank-local work above
        placements = [RankPlacement(m.role, m.rank, m.host, m.device, m.gpu, m.sees) for m in people]
        unavailable = {n: r for n in ("shm", "nixl", "file") if (r := unavailable_reason(n)) is not None}
        choice = choose_transport(self.config.transport, placements, unavailable=unavailable)
        refuse_combinations(self.config.to_wire(), transport=choice.name, why=choice.reason)
        opts = self.config.transport_options
        phase_names: tuple[tuple[str, ...], ...] = ()
        phases: tuple[Plan, ...] = ()
        if self.config.layer_phases:
            phase_names = layer_phases(writers.canonical_tensors(), budget_bytes=opts.max_bucket_bytes)
            phases = tuple(split_plan(plan, phase_names))
        device = self.device()
        digests = None
        if self.config.integrity:
            from weightsync.tools.codecs.digest import kind_for
            from weightsync.transport.digests import VersionDigests

            digests = VersionDigests(plan, phases or None, role=self.role, rank=self.rank,
                                     kind=kind_for(m.device for m in people), device=device)
        checked = f"|digests={digests.kind}" if digests is not None else ""
        digest = hashlib.blake2b(f"{choice.name}|{opts.digest()}|phases={len(phase_names)}{checked}".encode(),
                                 digest_size=4).hexdigest()
        ctx = TransportContext(channel=self.channel, num_writers=self.config.num_writers,
                               num_readers=self.reader_count, device=device, options=opts, elastic=self.elastic,
                               placements=tuple(placements), keeps_received_bytes=self._keeps_received_bytes,
                               tolerates_reader_loss=self.config.completion != "all")
        transport = create_transport(choice.name, ctx)
        if digests is not None and digests.fuses(transport.fuses_digests):
            digests.fused = transport.use_digests(digests)  # it may decline (a setting that changes what it copies)
        self.timings["setup"] = time.perf_counter() - started
        planned = PlannedSync(plan, transport, choice.name, f"{plan.fingerprint}-{digest}", self.timings["setup"],
                              device, choice.reason, phase_names, phases, quantizer, digests)
        logger.info("%s planned %d ops (%d bytes) over %s on %s (%s) in %.3fs", self.channel.who, len(plan),
                    plan.total_bytes, choice.name, device, choice.reason, self.timings["plan"])
        return planned

    # -- transport ------------------------------------------------------------------------
    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Before a version is published: the tensors agree with this rank's layout (shape,
        dtype, contiguous), whatever the transport (:func:`weightsync.tools.torch_layout.check_tensors`)."""
        check_tensors(self.provider.layout(), tensors, self.channel.who)

    def arm(self, tensors: Mapping[str, torch.Tensor], epoch: int, deadline: Deadline) -> Transport:
        """The planned transport, connected in ``epoch`` and bound to ``tensors``.

        It connects only when the epoch changed (or after :meth:`disarm`), and binds when it
        connected or the buffers' storage moved: the transport is told which step to take
        rather than comparing epochs itself, and memory that moved within an epoch never
        re-forms its connections."""
        planned = self.planned
        if planned is None:
            raise RuntimeError(f"{self.channel.who}: arm() before plan()")
        digests = planned.digests
        plan, phases = (planned.plan, planned.phases) if digests is None else (digests.plan, digests.phases)
        if digests is not None:  # the transport moves the digests too, in band
            tensors = digests.attach(tensors)
        ptrs = tuple(t.data_ptr() for t in tensors.values())
        transport = planned.transport
        try:
            if self._connected != epoch:
                t0 = time.perf_counter()
                self._bound = None  # a new epoch binds anew, whatever the buffers
                transport.connect(epoch, deadline=deadline)
                self._connected = epoch
                self.timings["connect"] = time.perf_counter() - t0
            if self._bound != ptrs:
                t0 = time.perf_counter()
                transport.bind(plan, tensors, deadline=deadline, phases=phases or None)
                self._bound = ptrs
                self.timings["bind"] = time.perf_counter() - t0
        except BaseException:
            self.disarm()  # whatever half formed, the next arm connects anew
            raise
        return transport

    def disarm(self) -> None:
        """Forget the transport's connections (after a failure): the next version connects anew."""
        self._connected = self._bound = None

    def check_alive(self) -> None:
        """Raise if another process took this rank over (its heartbeat found out)."""
        if self.channel.lost is not None:
            raise SyncError(f"{self.channel.who} no longer belongs to job {self.config.job!r}: {self.channel.lost}")

    def forget(self) -> None:
        """Start over (the meta server lost its state): the next version registers and plans anew."""
        self.close(release=False)
        self._registered = False
        self.registered_anew = True
        self.generation = self.own_generation = 0  # the new server starts at generation 0
        self.channel.forget_layouts()

    def close(self, *, release: bool = True) -> None:
        self.channel.stop_heartbeat(release=release)
        if self.planned is not None:
            self.planned.transport.close()
            if self.planned.digests is not None:
                self.planned.digests.close()
            self.planned = None
        self.disarm()


__all__ = ["PlannedSync", "SyncConfig", "SyncError", "SyncResult", "SyncSession", "TransportOptions", "decode_roster",
           "plan_share"]
