"""What writers and readers share: registration, layout exchange, planning, transports.

A :class:`SyncSession` is one rank's membership in a sync job. On first use it registers
the rank with the meta server (layout metadata included), waits until every writer and
reader has registered, rebuilds everyone's layout, computes *this rank's* share of the
plan (rank-local planning: no rank ever builds the global plan), and creates the
transport. Writers and readers (``writer.py``, ``reader.py``) drive versions on top.

**Generations.** A transport's connections (a process group, shared-memory mappings) are
tied to a *generation* number kept in the meta server. When a transfer fails, every rank
that saw the failure moves the job to the next generation (an idempotent compare-and-bump,
so many reporters bump once), and so does a rank that restarts. Writers publish each
version together with the generation they use, and readers follow it, so after a peer
dies the next version re-forms the connections cleanly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from weightsync.layout.wire import decode_layout, encode_descriptor, encode_explicit, model_key
from weightsync.plan import PlanOptions, build_local_plan
from weightsync.transport import TransportContext, TransportOptions, choose_transport, create_transport

if TYPE_CHECKING:
    import torch

    from weightsync.layout import RankLayout
    from weightsync.meta.client import MetaClient, Participant
    from weightsync.plan import Plan
    from weightsync.transport import Transport

logger = logging.getLogger(__name__)

Role = Literal["writer", "reader"]
_GENERATION_KEY = "generation"


class SyncError(RuntimeError):
    """A sync could not complete; the message names the version, the peer and the tensors."""


@dataclass(slots=True)
class SyncResult:
    """What one sync did on this rank: the version, bytes moved and seconds per phase."""

    version: int
    nbytes: int
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Job-wide settings; every writer and reader must pass the same values.

    Attributes:
        num_writers / num_readers: participants the job waits for before planning.
        transport: ``auto`` (shared memory on one host, torch p2p across hosts), or a name.
        staleness: how many versions training may run ahead of the slowest reader; 0 means
            synchronous (``write`` returns when every reader applied the version).
        timeout: default bound, in seconds, on every blocking step.
    """

    num_writers: int
    num_readers: int
    job: str = "default"
    transport: str = "auto"
    transport_options: TransportOptions = field(default_factory=TransportOptions)
    plan_options: PlanOptions = field(default_factory=PlanOptions)
    staleness: int = 0
    timeout: float = 300.0
    host: str = ""

    def __post_init__(self) -> None:
        if self.num_writers < 1 or self.num_readers < 1:
            raise ValueError(f"a job needs at least one writer and one reader, got "
                             f"{self.num_writers} writers and {self.num_readers} readers")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.transport_options.slots <= self.staleness:
            # One-sided transports keep a version slot per version a reader may lag behind.
            object.__setattr__(self, "transport_options",
                               dataclasses.replace(self.transport_options, slots=self.staleness + 1))


class SyncSession:
    """One rank's view of a job (see module docstring)."""

    def __init__(self, role: Role, rank: int, provider: Any, config: SyncConfig, meta: MetaClient) -> None:
        size = config.num_writers if role == "writer" else config.num_readers
        if not 0 <= rank < size:
            raise ValueError(f"{role} rank {rank} is outside 0..{size - 1} (the job has {size} {role}s)")
        self.role: Role = role
        self.rank = rank
        self.provider = provider
        self.config = config
        self.meta = meta
        self.host = config.host or socket.gethostname()
        self.plan: Plan | None = None
        self.transport: Transport | None = None
        self.transport_name = ""
        self.sync_fingerprint = ""
        self.prepared: tuple[int, tuple[int, ...]] | None = None  # (generation, buffer pointers)
        self.timings: dict[str, float] = {}
        self._registered = False

    # -- membership -----------------------------------------------------------------------
    def _layout_blob(self) -> bytes:
        descriptor = self.provider.descriptor()
        if descriptor is not None:
            layout_text, config = descriptor
            key = model_key(config)
            self.meta.put_document(key, json.dumps(config, sort_keys=True).encode())
            return encode_descriptor(layout_text, key)
        return encode_explicit(self.provider.layout())

    def register(self) -> None:
        from weightsync.meta.client import Participant

        if self._registered:
            return
        restarted = any(p.rank == self.rank for p in self.meta.participants(self.role))
        self.meta.register(Participant(role=self.role, rank=self.rank, group=self.config.job, host=self.host,
                                       endpoints={}, layout=self._layout_blob()))
        if restarted:
            # The others' connections do not include this new process: move everyone on.
            self.bump_generation(self.generation())
            logger.info("%s %d rejoined the job; generation bumped", self.role, self.rank)
        self._registered = True

    def generation(self) -> int:
        doc = self.meta.get_document(_GENERATION_KEY)
        return int(doc.decode()) if doc else 0

    def bump_generation(self, seen: int) -> None:
        """Move the job past generation ``seen`` (no-op if someone already did)."""
        if self.generation() == seen:
            self.meta.put_document(_GENERATION_KEY, str(seen + 1).encode())

    # -- planning -------------------------------------------------------------------------
    def ensure_planned(self, timeout: float) -> Plan:
        if self.plan is not None:
            return self.plan
        started = time.perf_counter()
        self.register()
        people = self.meta.wait_registered(writers=self.config.num_writers, readers=self.config.num_readers,
                                           timeout=timeout)
        writers, readers = self._decode(people)
        t0 = time.perf_counter()
        self.plan = build_local_plan(writers, readers, role=self.role, rank=self.rank,
                                     options=self.config.plan_options)
        self.timings["plan"] = time.perf_counter() - t0
        colocated = len({p.host for p in people}) == 1
        self.transport_name = choose_transport(self.config.transport, colocated=colocated)
        opts = self.config.transport_options
        digest = hashlib.blake2b(f"{self.transport_name}|{opts.digest()}".encode(), digest_size=4).hexdigest()
        self.sync_fingerprint = f"{self.plan.fingerprint}-{digest}"
        ctx = TransportContext(role=self.role, rank=self.rank, num_writers=self.config.num_writers,
                               num_readers=self.config.num_readers, meta=self.meta, options=opts)
        self.transport = create_transport(self.transport_name, ctx)
        self.timings["setup"] = time.perf_counter() - started
        logger.info("%s %d planned %d ops (%d bytes) over %s in %.3fs", self.role, self.rank, len(self.plan),
                    self.plan.total_bytes, self.transport_name, self.timings["plan"])
        return self.plan

    def _decode(self, people: list[Participant]) -> tuple[list[RankLayout], list[RankLayout]]:
        models: dict[str, Mapping[str, Any]] = {}

        def load_model(key: str) -> Mapping[str, Any]:
            if key not in models:
                doc = self.meta.get_document(key)
                if doc is None:
                    raise ValueError(f"model config {key} is missing from the meta server")
                models[key] = json.loads(doc)
            return models[key]

        writers = [decode_layout(p.layout, rank=p.rank, load_model=load_model) for p in people if p.role == "writer"]
        readers = [decode_layout(p.layout, rank=p.rank, load_model=load_model) for p in people if p.role == "reader"]
        return writers, readers

    # -- transport ------------------------------------------------------------------------
    def ensure_prepared(self, tensors: Mapping[str, torch.Tensor], generation: int, timeout: float) -> Transport:
        """(Re)prepare the transport when the generation or the buffers' storage changed."""
        assert self.plan is not None and self.transport is not None
        ptrs = tuple(t.data_ptr() for t in tensors.values())
        if self.prepared != (generation, ptrs):
            t0 = time.perf_counter()
            self.transport.prepare(self.plan, tensors, generation=generation, timeout=timeout)
            self.prepared = (generation, ptrs)
            self.timings["prepare"] = time.perf_counter() - t0
        return self.transport

    def invalidate(self) -> None:
        """Forget the transport's connections (after a failure)."""
        self.prepared = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.prepared = None
