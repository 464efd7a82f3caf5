"""The transport contract: how one rank moves its share of a plan's bytes.

Lifecycle (both roles)::

    transport = create_transport("torch", ctx)       # ctx: the rank's job channel, peers, options
    deadline = Deadline.after(60)                    # the caller's: every step of its operation shares it
    transport.connect(e, deadline=deadline)          # once per epoch: the epoch's connections
    transport.bind(plan, tensors, deadline=deadline) # then, and whenever the buffers' storage moved
    # every version (each under its operation's deadline):
    stats = transport.send(version, deadline=deadline)       # writer
    stats = transport.receive(version, deadline=deadline)    # reader
    transport.close()

**Connect and bind.** ``connect(epoch)`` forms what peers reach this rank by in that epoch (a
process group's rendezvous, a NIXL agent, the file directory announced for it, a shared
memory writer's fresh start) and drops the last epoch's; ``bind(plan, tensors)`` ties the
plan to memory within the connected epoch (flat views, message schedules, registrations, a
segment). The caller says which a version needs (:meth:`weightsync.session.sync_session.SyncSession.arm`:
connect when the epoch changed or after a failure, bind then or when the tensors moved), so
no transport compares epochs. ``prepare(plan, tensors, epoch=e)`` does both, connecting only
when ``e`` is not the connected epoch, for callers that arm a transport directly (tests,
benchmarks). The built-in transports inherit :class:`TransportBase`, which owns these steps,
the device and phase checks, timing and peer watching; a third party may too, or implement
:class:`Transport` itself.

**Phases.** ``bind(..., phases=split_plan(plan, layer_phases(...)))`` cuts every version
into phases of whole layers (:mod:`weightsync.plan.phases`); writers then ``send(v,
phase=i)`` and readers ``receive(v, phase=i)`` for ``i = 0, 1, ...`` in order, and a reader
may reuse the same memory for the destinations of different phases (its staging arena):
a transport writes a phase's bytes only between the start of ``receive(v, phase=i)`` and
its return. Without phases, everything is phase 0.

``connect`` and ``bind`` do the expensive work (rendezvous, memory registration, message
schedules); ``send``/``receive`` only move bytes. ``tensors`` maps
each local shard name in the plan to the torch tensor holding it: on the reader these are
the engine's parameters (or staging buffers when an engine must run its own loader), and
the transport writes straight into them. Every blocking call takes an explicit version and
the caller's :class:`~weightsync.clock.deadline.Deadline` (the one its whole operation shares,
never a float to turn back into one); a failure raises :class:`TransportError` naming the peer and the tensors.
Transports reach their peers (rendezvous addresses, memory handles) only through the job
channel's endpoints (:meth:`weightsync.job.channel.JobChannel.publish_endpoint`), one typed record per
transport and epoch (:mod:`weightsync.transport.endpoints`).

Capabilities are class attributes, so callers (and the contract tests) can ask what a
transport can do without instantiating it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

from weightsync.ports.channel import EndpointRecord, TransportChannel
from weightsync.tools.devices import RankPlacement, check_serves, parse_device, tensors_device
from weightsync.transport.errors import TransportError

if TYPE_CHECKING:
    import torch

    from weightsync.clock.deadline import Deadline
    from weightsync.plan import Plan
    from weightsync.plan.ops import Role
    from weightsync.ports.coordinator import Holder
    from weightsync.transport.digests import VersionDigests

E = TypeVar("E", bound=EndpointRecord)
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportOptions:
    """Knobs shared by every transport; all ranks of a job must use the same values.

    Attributes:
        max_bucket_bytes: bound on the extra memory a rank uses for staging during a sync
            (two buffers of half this size, so packing overlaps sending).
        direct_min_bytes: an op whose destination is one contiguous run and at least this
            large is received straight into the destination (no staging copy).
        checksum: send a checksum with every message and verify it on receipt.
        host: address peers use to reach this rank (multi-node); loopback by default.
        slots: version slots of one-sided transports (shared memory, file): a reader may
            fall ``slots - 1`` versions behind before the version it reads is overwritten.
        file_dir: directory of the file transport (shared storage across nodes).
        nixl_mode: how the NIXL transport moves bytes: "pull" (readers READ from writers'
            registered version slots), "push" (writers WRITE into readers' registered
            parameters) or "auto" (push when readers <= writers, else pull; see
            transport/nixl/common.py).
        shm_streaming: shared-memory readers copy while writers pack (x86-64 CPU only; see
            transport/shm/transport.py); False makes them wait for whole slots (for A/B measurements).
        delta_anchor_every: 0 sends every version in full; K >= 1 sends each reader only what
            changed since the version it holds and can vouch for (two-sided transports:
            :mod:`weightsync.transport.delta.pairs`; one-sided: :mod:`weightsync.transport.delta.published`; file:
            :mod:`weightsync.transport.file.changes`), with a full version at least every K versions
            (K=1: always full); NIXL push: :mod:`weightsync.transport.nixl.push_changes`. NCCL refuses it.
    """

    max_bucket_bytes: int = 64 << 20
    direct_min_bytes: int = 64 << 10
    checksum: bool = False
    host: str = "127.0.0.1"
    slots: int = 2
    file_dir: str = ""
    nixl_mode: Literal["auto", "pull", "push"] = "auto"
    shm_streaming: bool = True
    delta_anchor_every: int = 0

    def __post_init__(self) -> None:
        if self.max_bucket_bytes < 2 * 4096:
            raise ValueError(f"max_bucket_bytes must be at least 8192, got {self.max_bucket_bytes}")
        if self.direct_min_bytes < 0:
            raise ValueError(f"direct_min_bytes must be >= 0, got {self.direct_min_bytes}")
        if self.delta_anchor_every < 0:
            raise ValueError(f"delta_anchor_every must be >= 0 (0 = no deltas), got {self.delta_anchor_every}")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.nixl_mode not in ("auto", "pull", "push"):
            raise ValueError(f"nixl_mode must be 'auto', 'pull' or 'push', got {self.nixl_mode!r}")

    @property
    def message_bytes(self) -> int:
        """Largest staged message: half the bucket budget (two buffers in flight)."""
        return self.max_bucket_bytes // 2

    def digest(self) -> str:
        delta = f",delta={self.delta_anchor_every}" if self.delta_anchor_every else ""
        return (f"bucket={self.max_bucket_bytes},direct={self.direct_min_bytes},"
                f"checksum={int(self.checksum)}{delta}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportContext:
    """Who this rank is (its job ``channel``), where its tensors live, and how many peers it has.

    ``device`` is the device of the tensors this rank hands the transport (``"cpu"`` or
    ``"cuda:N"``, with its index): staging buffers, the process-group backend and memory
    registrations follow it, and ``bind`` refuses tensors elsewhere. ``placements`` are
    where every rank of the job runs (what the routed transport splits pairs by).
    ``keeps_received_bytes`` says whether a reader's tensors hold what arrived until the next
    receive (its engine's capability, :class:`weightsync.ports.engine.InferenceEngine`): only then
    may it apply what changed straight to them; otherwise a delta reader keeps a copy of its
    own (:mod:`weightsync.transport.delta.pairs`). ``elastic``: ``num_readers=None`` (seats joined).
    """

    channel: TransportChannel
    num_writers: int
    num_readers: int
    device: str = "cpu"
    options: TransportOptions = field(default_factory=TransportOptions)
    placements: tuple[RankPlacement, ...] = ()
    keeps_received_bytes: bool = True
    elastic: bool = False
    #: the completion policy is not ``all``: a reader's failure fails only its own share of a
    #: version (a transport whose writers send to each reader goes on without it)
    tolerates_reader_loss: bool = False

    def __post_init__(self) -> None:
        parse_device(self.device)

    @property
    def role(self) -> Role:
        return self.channel.role

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def who(self) -> str:
        """``"writer 3"``: how messages name this rank."""
        return self.channel.who

    @property
    def global_rank(self) -> int:
        """Writers are 0..W-1, readers W..W+R-1 in transports with one global numbering."""
        return self.rank if self.role == "writer" else self.num_writers + self.rank

    @property
    def world_size(self) -> int:
        return self.num_writers + self.num_readers


@dataclass(slots=True)
class TransferStats:
    """What one send/receive moved and where the time went (seconds per named phase)."""

    version: int
    nbytes: int = 0
    messages: int = 0
    direct_bytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    peak_extra_bytes: int = 0

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "bytes": self.nbytes, "messages": self.messages,
                "direct_bytes": self.direct_bytes, "phases": dict(self.phases),
                "peak_extra_bytes": self.peak_extra_bytes}


class PhaseTimer:
    """``with timer("pack"): ...`` accumulates wall time into a TransferStats phase."""

    def __init__(self, stats: TransferStats) -> None:
        self.stats = stats
        self._name = ""
        self._start = 0.0

    def __call__(self, name: str) -> PhaseTimer:
        self._name = name
        return self

    def __enter__(self) -> PhaseTimer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stats.add_phase(self._name, time.perf_counter() - self._start)


@runtime_checkable
class Transport(Protocol):
    """Moves the bytes of a plan between this rank and its peers (see module docstring)."""

    name: ClassVar[str]
    #: Bytes can land straight in destination memory (no receiver-side staging copy).
    writes_in_place: ClassVar[bool]
    #: Readers can fetch a version without the writer taking part (pull at any time).
    one_sided: ClassVar[bool]
    #: Devices whose memory the transport moves (``bind`` refuses tensors elsewhere).
    serves_cpu: ClassVar[bool]
    serves_cuda: ClassVar[bool]
    #: Writers publish version V *before* ``send(V)``: readers' ``receive(V)`` waits for the
    #: bytes itself (two-sided transports post receives; shared memory streams). Otherwise
    #: writers publish V once ``send(V)`` returned, and readers may read all of it at once.
    publishes_before_send: ClassVar[bool]
    #: Honours ``TransportOptions.delta_anchor_every`` (:func:`weightsync.transport.create_transport`
    #: refuses it, naming the transport, where this is False or absent).
    carries_deltas: ClassVar[bool]
    #: The roles for which it digests bytes while it copies them (:mod:`weightsync.transport.digests`);
    #: empty: the session digests each phase after it arrived.
    fuses_digests: ClassVar[frozenset[str]]

    def use_digests(self, digests: VersionDigests | None) -> bool:
        """Digest as it copies (only called where ``fuses_digests`` names this rank's role);
        False: it declines (a setting that changes what it copies), and the session digests."""

    def prepare(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, epoch: int, deadline: Deadline,
                phases: Sequence[Plan] | None = None) -> None:
        """:meth:`connect` unless ``epoch`` is the one connected, then :meth:`bind`."""

    def connect(self, epoch: int, *, deadline: Deadline) -> None:
        """Form the connections of ``epoch``, dropping any earlier ones (rendezvous, agents)."""

    def bind(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, deadline: Deadline,
             phases: Sequence[Plan] | None = None) -> None:
        """Bind the plan (cut into ``phases``) to ``tensors`` within the connected epoch:
        registrations, schedules, segments. Refuses tensors on another device than the context's."""

    def send(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats: ...

    def receive(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats: ...

    def forget_received(self) -> None:
        """Reader: its tensors may no longer hold what this transport last wrote into them
        (their version changed outside the reader), so the next receive builds on nothing it
        received before (with deltas: it is full). A no-op where nothing is kept."""

    def abandon(self, version: int) -> None:
        """Reader: it gave ``version`` up (a peer died, a check failed) wherever it failed, in
        its bind too, or took it from elsewhere (peer copies): a writer that holds memory until
        its readers are done with the version (shared-memory zero-copy) need not wait for this
        one. A no-op where no writer waits so."""

    def close(self) -> None: ...


class ServesDevices(Protocol):
    """The capabilities :func:`check_tensors_device` reads (every transport class has them)."""

    name: ClassVar[str]
    serves_cpu: ClassVar[bool]
    serves_cuda: ClassVar[bool]


def check_tensors_device(transport: ServesDevices, ctx: TransportContext,
                         tensors: Mapping[str, torch.Tensor]) -> None:
    """What every ``bind`` checks first: the tensors live on ``ctx.device``, which the
    transport serves (gloo would read GPU pointers as host memory, with no error of its own).

    Raises:
        ValueError: naming the transport, the device it serves and the tensors' device.
    """
    device = tensors_device((str(t.device) for t in tensors.values()), what=f"{ctx.who}'s tensors")
    if device != ctx.device:
        raise ValueError(f"{ctx.who}: the transport was set up for {ctx.device}, but the tensors it was given live "
                         f"on {device}")
    check_serves(transport.name, serves_cpu=transport.serves_cpu, serves_cuda=transport.serves_cuda, device=device,
                 who=ctx.who)


class PeerWatch:
    """Liveness of the peers a transport waits on, for its wait loops (rate-limited).

    Asks the job channel (:meth:`weightsync.job.channel.JobChannel.dead_peers`, leases on the meta
    server) at most every ``every`` seconds, so a spin loop may call :meth:`check` on every
    turn: a peer that died (killed, stopped, hung) fails the wait within about a second of
    its lease expiring, naming it, instead of at the timeout.
    """

    def __init__(self, ctx: TransportContext, role: Role, ranks: Sequence[int], *, every: float = 0.5,
                 known: Mapping[tuple[str, int], Holder] | None = None, departed: bool = True) -> None:
        self.ctx, self.role, self.ranks, self.every = ctx, role, list(ranks), every
        #: whether a peer that released its lease (left on purpose) counts as gone
        self.departed = departed
        #: the processes this rank waits on (a peer that restarted since is dead to it): those
        #: connected to (``known``), else those holding the leases when the watch first looked
        self.known = known
        self._next = time.monotonic() + every

    def dead(self, *, max_age: float = 0.25) -> dict[int, str]:
        """The watched peers that are dead now, by leases at most ``max_age`` seconds old."""
        if not self.ranks:
            return {}
        channel = self.ctx.channel
        if self.known is None:
            self.known = channel.lease_holders()
        ranks = self.ranks  # replaced, never changed in place (:meth:`done_with`), while a guard reads it
        return channel.dead_peers(self.role, ranks, max_age=max_age, known=self.known or None, departed=self.departed)

    def done_with(self, rank: int) -> None:
        """Stop watching ``rank``: what this rank needed of it is done (its death can no longer
        spoil the call that watches it)."""
        self.ranks = [r for r in self.ranks if r != rank]

    def describe(self) -> str:
        """`` (writer 1 is dead: ...)`` for error messages, or empty."""
        dead = self.dead()
        return "".join(f" ({self.role} {r} is dead: {why})" for r, why in sorted(dead.items()))

    def check(self, what: str) -> None:
        """Raise TransportError if a watched peer is dead (``what``: the wait, for the message)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every
        dead = self.dead()
        if dead:
            raise TransportError(self.died(dead, what))

    def died(self, dead: Mapping[int, str], what: str) -> str:
        """The message for peers found dead while this rank waited for ``what``."""
        rank, why = min(dead.items())
        others = f" (and {self.role}s {sorted(dead)[1:]})" if len(dead) > 1 else ""
        return f"{self.ctx.who}: {self.role} {rank}{others} died while this rank waited for {what}: {why}"

    def guard(self, abort: Callable[[], None]) -> PeerGuard:
        """A :class:`PeerGuard` calling ``abort`` when a watched peer dies (for blocking waits)."""
        return PeerGuard(self, abort)


class PeerGuard:
    """Watches peers' leases from a thread while a *blocking* call runs (a gloo wait, an NCCL
    event), and calls ``abort`` once when one of them is dead, so that the call returns within
    about a second of the lease expiring instead of at its timeout::

        with PeerWatch(ctx, "writer", peers).guard(abort=break_the_connections) as guard:
            work.wait(timeout)               # raises soon after abort()
        if guard.dead: raise TransportError(guard.watch.died(guard.dead, "version 3"))

    Polling loops call :meth:`PeerWatch.check` instead; this is for calls that cannot poll.
    """

    def __init__(self, watch: PeerWatch, abort: Callable[[], None]) -> None:
        self.watch, self.abort = watch, abort
        #: the dead peers that made it call ``abort`` (empty: it never did)
        self.dead: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-peer-guard-{watch.ctx.who}", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.watch.every):
            try:
                dead = self.watch.dead()
            except Exception as exc:  # the meta server is away: the blocking call has its own timeout
                logger.debug("%s: peer guard could not read leases: %s", self.watch.ctx.who, exc)
                continue
            if dead and not self._stop.is_set():
                self.dead = dict(dead)
                try:
                    self.abort()
                except Exception as exc:  # the call it interrupts reports the failure
                    logger.debug("%s: peer guard abort failed: %s", self.watch.ctx.who, exc)
                return

    def __enter__(self) -> PeerGuard:
        if self.watch.ranks:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


class TransportBase:
    """What the built-in transports share around their own connections and memory: the
    :class:`Transport` steps in order, the device and phase checks, timing and peer watching.

    Two steps, because a session needs them at different times: :meth:`connect` when the
    epoch changes (every connection is re-formed: a failed sync never poisons the next one),
    :meth:`bind` when the plan or the buffers' storage moved within an epoch (memory only:
    re-forming a process group there would cost a rendezvous and break peers that did not
    move). The caller says which (:meth:`weightsync.session.sync_session.SyncSession.arm`), so
    no transport compares epochs itself. A transport implements :meth:`_connect` and
    :meth:`_bind`; the checks around them live here once.
    """

    name: ClassVar[str]
    serves_cpu: ClassVar[bool]
    serves_cuda: ClassVar[bool]

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        #: the epoch whose connections this rank holds (None: none, or they broke)
        self.epoch: int | None = None
        #: how many phases the bound plan was cut into
        self.phase_count = 0

    def abandon(self, version: int) -> None:
        """See :meth:`Transport.abandon` (no writer of this transport waits for its readers so)."""

    def prepare(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, epoch: int, deadline: Deadline,
                phases: Sequence[Plan] | None = None) -> None:
        """Both steps, for callers that arm a transport directly (tests, benchmarks): connect
        when ``epoch`` is not the one connected, then bind."""
        check_tensors_device(self, self.ctx, tensors)  # before any connection forms
        if epoch != self.epoch:
            self.connect(epoch, deadline=deadline)
        self.bind(plan, tensors, deadline=deadline, phases=phases)

    def connect(self, epoch: int, *, deadline: Deadline) -> None:
        """Form the connections of ``epoch`` (dropping any earlier ones)."""
        self.epoch = None  # until the new ones formed: a failure leaves none
        self._connect(epoch, deadline)
        self.epoch = epoch

    def bind(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, deadline: Deadline,
             phases: Sequence[Plan] | None = None) -> None:
        """Bind this rank's share of ``plan`` (cut into ``phases``) to ``tensors`` under the
        connected epoch: flat views, schedules, registrations."""
        check_tensors_device(self, self.ctx, tensors)
        if self.epoch is None:
            raise RuntimeError(f"{self.ctx.who}: {self.name} transport bound before it connected")
        parts = phase_plans(plan, phases)
        self._bind(plan, parts, tensors, deadline)
        self.phase_count = len(parts)

    def _connect(self, epoch: int, deadline: Deadline) -> None:
        raise NotImplementedError

    def _bind(self, plan: Plan, parts: Sequence[Plan], tensors: Mapping[str, torch.Tensor],
              deadline: Deadline) -> None:
        raise NotImplementedError

    def check_phase(self, phase: int) -> None:
        """Refuse a phase the bound plan does not have (send and receive, first)."""
        check_phase(phase, self.phase_count, self.ctx.who)

    def new_stats(self, version: int) -> tuple[TransferStats, PhaseTimer]:
        """A send's or receive's stats, and the timer that adds its phases' time to them."""
        stats = TransferStats(version)
        return stats, PhaseTimer(stats)

    def peer_watch(self, role: Role, ranks: Sequence[int], **kwargs: Any) -> PeerWatch:
        """A :class:`PeerWatch` of these peers of this rank."""
        return PeerWatch(self.ctx, role, ranks, **kwargs)


def phase_plans(plan: Plan, phases: Sequence[Plan] | None) -> list[Plan]:
    """The phases a transport was bound with: ``[plan]`` when the version is not cut."""
    return [plan] if not phases else list(phases)


def check_phase(phase: int, count: int, who: str) -> None:
    if not 0 <= phase < count:
        raise ValueError(f"{who}: phase {phase} of a plan prepared with {count} phase(s)")
