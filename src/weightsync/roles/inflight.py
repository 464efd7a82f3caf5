"""In-flight updates: pull version V+1 in the background while the engine generates with V.

    updater = InflightReader(engine, rank=worker_id, config=config)
    updater.start()                              # background thread: receive into staging
    while serving:
        updater.step_boundary()                  # between two engine steps: apply if staged
        engine_step()                            # always runs on one whole version

A background thread runs an ordinary :class:`~weightsync.roles.reader.WeightReader` whose
"engine" is a *staging* copy of the real engine's receive buffers, so the transport never
writes into the weights the engine is using. When a version has fully arrived in staging
the thread hands it over and waits; the serving thread calls :meth:`step_boundary` between
two steps, which copies staging into the live buffers and calls the engine's own ``apply``.
The engine's pause is that copy alone, never the transfer. Because the copy happens in the
serving thread at a step boundary, a step never sees half of a version.

Only after the live apply does the reader report the version applied to the meta server,
so a writer's staleness bound (``SyncConfig.staleness``) counts versions the engine really
serves. A transfer that fails leaves the live weights untouched at their (valid) version;
the live engine is touched only by the copy at the step boundary, and if that copy or the
engine's ``apply`` fails, the engine is invalid (``version`` None) until the next version goes
live, and :meth:`InflightReader.step_boundary` raises.

**Streams.** The background thread receives on a stream of its own: on the default stream,
which it would share with the engine's forward, every step would queue behind the transfer.
The copy into the live buffers, on the serving thread's stream, is ordered after the receive
by an event, and the next receive into staging after that copy by another.

**Memory.** One staging copy of this reader's receive buffers: exactly the bytes of its
shards (:attr:`InflightReader.extra_bytes`), whatever the number of versions in flight,
because the background thread receives the next version only after the previous one was
handed over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from weightsync.clock.deadline import Deadline
from weightsync.ports import device as device_port
from weightsync.roles.reader import UpdateResult, WeightReader
from weightsync.session.sync_session import SyncConfig, SyncError

if TYPE_CHECKING:
    from weightsync.layout import RankLayout
    from weightsync.meta.client import AnyMetaClient
    from weightsync.ports.engine import InferenceEngine, Invalid

logger = logging.getLogger(__name__)


class _ClosedError(RuntimeError):
    """The in-flight reader was closed while a version waited for its step boundary."""


class _StagingEngine:
    """The background reader's engine: staging buffers shaped like the live engine's."""

    stages_in_phases: ClassVar[bool] = False
    keeps_received_bytes: ClassVar[bool] = True  # step_boundary copies out of staging, never into it
    in_place_names: tuple[str, ...] | None = ()  # staging only: the live weights change at a step boundary

    def __init__(self, live: InferenceEngine, timeout: float) -> None:
        self.live = live
        self.timeout = timeout
        # Copies, not empty tensors: bytes no op writes (a vocabulary's padding rows) must not
        # reach the live weights as garbage at the first step boundary.
        self.buffers = {name: t.detach().clone(memory_format=torch.contiguous_format)
                        for name, t in live.receive_buffers().items()}
        self.cond = threading.Condition()
        self.ready: int | None = None  # staged, waiting for a step boundary
        self.failure: BaseException | None = None  # the live engine could not take ``ready``
        self.closed = False
        self.dev = device_port.current()
        self.device = str(next(iter(self.buffers.values())).device) if self.buffers else "cpu"
        self.received_at: Any = None  # an event after the staged version's receive, on its stream
        self.copied_at: Any = None  # an event after the live copy out of staging, on the serving stream

    # -- InferenceEngine ------------------------------------------------------------------
    def layout(self) -> RankLayout:
        return self.live.layout()

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return self.live.descriptor()

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        return self.buffers

    def receiving(self, version: int) -> None:
        """Only staging receives: the live weights are untouched until a step boundary."""

    def apply(self, version: int) -> None:
        """Hand ``version`` to the serving thread and wait until it is live."""
        deadline = Deadline.after(self.timeout)
        with self.cond:
            self.received_at = self.dev.record(self.device)  # on the receiving thread's stream
            self.ready = version
            self.cond.notify_all()
            while self.ready is not None and not self.closed:
                if not self.cond.wait(timeout=deadline.remaining(0.0)):
                    self.ready = None
                    raise TimeoutError(f"the engine reached no step boundary within {self.timeout:.0f}s to apply "
                                       f"version {version}")
            if self.ready is not None:  # closed while waiting: the version never went live
                self.ready = None
                raise _ClosedError(f"closed before version {version} was applied")
            failure, self.failure = self.failure, None
        if failure is not None:  # the live engine failed it (and knows: invalid)
            raise failure

    def abort(self, version: int, error: BaseException) -> None:
        """Only staging was written, or the live engine was told at the step boundary."""

    @property
    def weight_version(self) -> int | None:
        return self.live.weight_version

    @property
    def invalid(self) -> Invalid | None:
        return self.live.invalid


class InflightReader:
    """A reader that receives in the background and applies at step boundaries (module docstring).

    Args:
        engine: the live engine; its ``receive_buffers`` must keep their storage (in place).
        rank, config, meta: as for :class:`~weightsync.roles.reader.WeightReader`.
        poll: seconds the background thread waits for a version before checking for ``close``.
    """

    def __init__(self, engine: InferenceEngine, *, rank: int, config: SyncConfig,
                 meta: AnyMetaClient | None = None, poll: float = 0.5) -> None:
        if poll <= 0:
            raise ValueError(f"poll must be positive, got {poll}")
        self.engine = engine
        self.poll = poll
        self._staging = _StagingEngine(engine, config.timeout)
        self.reader = WeightReader(self._staging, rank=rank, config=config, meta=meta)
        self._live = dict(engine.receive_buffers())
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        #: Results of the versions applied so far (transfer phases, plus ``apply`` = the pause).
        self.results: list[UpdateResult] = []
        #: Seconds of the last live apply (the engine's pause).
        self.last_pause = 0.0
        self.error: BaseException | None = None

    @property
    def version(self) -> int | None:
        """The version the live engine serves."""
        return self.engine.weight_version

    @property
    def invalid(self) -> Invalid | None:
        """Why the live engine serves no valid version (None: it does)."""
        return self.engine.invalid

    @property
    def staged_version(self) -> int | None:
        """A version that fully arrived and waits for the next step boundary, if any."""
        return self._staging.ready

    @property
    def extra_bytes(self) -> int:
        """Memory this reader adds to the engine: one staging copy of its receive buffers."""
        return sum(t.numel() * t.element_size() for t in self._staging.buffers.values())

    def start(self) -> InflightReader:
        if self._thread is None:
            self._thread = threading.Thread(target=self._pull, name=f"weightsync-inflight-{self.reader.rank}",
                                            daemon=True)
            self._thread.start()
        return self

    def _pull(self) -> None:
        staging = self._staging
        with staging.dev.on_stream(staging.dev.new_stream(staging.device)):
            self._pull_versions()

    def _pull_versions(self) -> None:
        reader, staging = self.reader, self._staging
        try:
            reader.session.register()  # writers plan (and publish) only once every reader registered
        except BaseException as exc:
            self.error = exc
            return
        while not self._stop.is_set():
            staging.dev.order_after(staging.copied_at, staging.device)  # the last live copy read staging
            # Wait in short polls (so close() is prompt), then transfer under the full timeout.
            seen = max(x for x in (self._staging.weight_version, reader.last_failed, -1) if x is not None)
            try:
                if reader.session.channel.wait_version(after=seen, deadline=Deadline.after(self.poll)) is None:
                    continue
                result = reader.update(timeout=reader.config.timeout)
            except TimeoutError as exc:
                self.error = exc
                continue
            except _ClosedError:
                return
            except SyncError as exc:
                if isinstance(exc.__cause__, _ClosedError):
                    return
                logger.warning("reader %d: in-flight update failed, live weights kept: %s", self.reader.rank, exc)
                self.error = exc
                continue
            except BaseException as exc:  # surfaced to the serving thread by step_boundary
                self.error = exc
                return
            self.results.append(result)

    def step_boundary(self) -> int | None:
        """Apply a staged version now (call between two engine steps); returns it, or None.

        Raises:
            SyncError: the background thread stopped on an error it cannot recover from, or the
                engine could not take the staged version (it is then invalid if it was touched,
                until the next version goes live; the background thread carries on).
        """
        staging = self._staging
        if staging.ready is None:
            if self.error is not None and (self._thread is None or not self._thread.is_alive()):
                raise SyncError(f"reader {self.reader.rank}: background updates stopped: {self.error}")
            return None
        with staging.cond:
            version = staging.ready
            if version is None:
                return None
            t0 = time.perf_counter()
            try:
                self.engine.receiving(version)
                staging.dev.order_after(staging.received_at, staging.device)
                with torch.no_grad():
                    for name, live in self._live.items():
                        staging.dev.copy(live, staging.buffers[name])
                staging.copied_at = staging.dev.record(staging.device)
                self.engine.apply(version)
            except Exception as exc:
                self.engine.abort(version, exc)
                staging.failure = exc  # the background reader reports it
                left = ("is invalid until the next version goes live" if self.engine.invalid is not None
                        else f"still serves {self.engine.weight_version}")
                raise SyncError(f"reader {self.reader.rank}: the engine could not take version {version} at a step "
                                f"boundary ({exc}); it {left}") from exc
            finally:
                staging.ready = None
                staging.cond.notify_all()
            self.last_pause = time.perf_counter() - t0
        return version

    def wait_version(self, min_version: int, *, timeout: float | None = None) -> int:
        """Block until the live engine serves ``min_version`` or newer (the caller is at a boundary).

        Raises:
            TimeoutError: no such version was staged in time.
        """
        deadline = Deadline.after(timeout if timeout is not None else self.reader.config.timeout)
        staging = self._staging
        while (self.version is None or self.version < min_version):
            if self.step_boundary() is not None:
                continue
            remaining = deadline.remaining(0.0)
            if remaining <= 0:
                raise TimeoutError(f"reader {self.reader.rank}: version {min_version} did not arrive in time "
                                   f"(serving {self.version})")
            with staging.cond:
                if staging.ready is None:
                    staging.cond.wait(timeout=min(remaining, 0.05))
        assert self.version is not None
        return self.version

    def close(self) -> None:
        self._stop.set()
        with self._staging.cond:
            self._staging.closed = True
            self._staging.cond.notify_all()
        if self._thread is not None:
            self._thread.join(self.poll + 30)
            self._thread = None
        self.reader.close()

    def __enter__(self) -> InflightReader:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
