"""weightsync's own NCCL communicator, driven through nccl4py (NVIDIA's Python binding of NCCL).

The NCCL transport (:mod:`weightsync.transport.torch.nccl`) needs point-to-point messages between
GPUs that a dead peer can never turn into a killed trainer. torch's ``ProcessGroupNCCL`` cannot
give that without writing the process environment (issue 23, defect 10): in torch 2.13 its
watchdog thread, which on an asynchronous NCCL error of the group rethrows on its own thread
(``std::terminate``), is turned off only by ``TORCH_NCCL_BLOCKING_WAIT``, read with ``getenv`` in
the constructor; ``ProcessGroupNCCL::Options`` has no field for it (docs/gpu.md, "NCCL: what
weightsync does"). So weightsync drives NCCL itself: no torch process group, no torch watchdog,
nothing read from or written to ``os.environ``; the only watchdog of this communicator is
:class:`Watchdog`, which aborts it and never ends the process.

    comm = connect(store, rank=r, size=n, device=torch.device("cuda", 1), deadline=d)  # every rank
    comm.post([P2P("send", payload, peer=3), P2P("recv", landing, peer=0)])  # one group, current stream
    with Watchdog(deadline, comm.abort, watch, health=comm.error):
        event.synchronize()          # returns early once the watchdog aborted the communicator
    comm.abort()                     # teardown: local, never waits for peers

The nccl4py calls (nccl4py 0.6.0, ``nccl.core``, its stable ``__all__``):

* ``get_unique_id()`` on rank 0, ``UniqueId.as_bytes`` / ``UniqueId.from_bytes``: the 128-byte
  ``ncclUniqueId`` travels through the epoch's torch Store as raw bytes (no pickle).
* ``Communicator.init(nranks, rank, unique_id, config=NCCLConfig(blocking=False))``
  (``ncclCommInitRankScalable``) on the rank's current device. Non-blocking, so that no NCCL
  call waits for a peer with no deadline: init and ``group_end`` return at once (nccl4py's
  ``check_status`` lets ``ncclInProgress`` through) and ``Communicator.get_async_error()``
  (``ncclCommGetAsyncError``) reads ``ncclInProgress`` until the connection or the enqueue is
  done, then ``ncclSuccess`` or the error. This is NCCL's documented fault-tolerance pattern:
  poll, and ``ncclCommAbort`` when a timeout expires.
* ``group_start()`` / ``group_end()`` around ``Communicator.send(tensor, peer, stream=...)`` /
  ``Communicator.recv(...)`` (``ncclSend``/``ncclRecv``): a torch tensor resolves to its data
  pointer, element count and NCCL dtype (``nccl.core.interop.torch.resolve_tensor``), and the
  stream is the integer handle of torch's current stream, so a pack queued before a send and a
  scatter queued after a receive are ordered with it on the GPU, with no CPU wait.
* ``Communicator.abort()`` (``ncclCommAbort``): ends the communicator's kernels, so the CUDA
  event the CPU waits on completes. ``get_error_string`` / ``Communicator.get_last_error``
  word the errors.

Every call into one communicator is made under one lock (abort included), so the watchdog's
abort never runs inside another call on it; since the communicator is non-blocking no call holds
the lock for long, and the CPU's wait on the CUDA event is outside it.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from weightsync.clock.deadline import Deadline
from weightsync.transport.base import TransportError

if TYPE_CHECKING:
    import torch.distributed as dist

    from weightsync.transport.base import PeerWatch

logger = logging.getLogger(__name__)

#: What a rank without nccl4py is told (at init, and by ``weightsync doctor``).
MISSING = "the NCCL transport needs nccl4py (pip install weightsync[gpu])"
#: ``ncclResult_t`` values (nccl.h; part of NCCL's C ABI).
SUCCESS, IN_PROGRESS = 0, 7
#: Where rank 0 leaves the ``ncclUniqueId`` in the epoch's store.
UNIQUE_ID_KEY = "nccl/unique-id"


def nccl4py() -> ModuleType:
    """nccl4py's ``nccl.core``, imported on first use (a GPU-only optional dependency).

    Raises:
        ValueError: :data:`MISSING`, when it cannot be imported.
    """
    try:
        return importlib.import_module("nccl.core")
    except (ImportError, OSError, RuntimeError) as exc:  # absent, or its CUDA libraries are
        raise ValueError(f"{MISSING}: {exc}") from exc


def nccl4py_missing() -> str | None:
    """None when nccl4py imports here, else :data:`MISSING` and why."""
    try:
        nccl4py()
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class P2P:
    """One send or receive of a group; ``peer`` is a rank of the communicator."""

    op: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


class Communicator(Protocol):
    """What the NCCL transport asks of a communicator (:class:`NcclComm`, or a test's fake)."""

    def post(self, ops: Sequence[P2P]) -> None:
        """Enqueue ``ops`` as one NCCL group on the current stream; returns once enqueued (the
        GPU completes them in stream order). Raises RuntimeError if NCCL failed or was aborted."""
        ...

    def error(self) -> str | None:
        """The communicator's asynchronous error, worded, or None (polled by the watchdog)."""
        ...

    def abort(self) -> None:
        """Abort the communicator: safe from any thread, at any time, more than once."""
        ...


def current_stream(device: torch.device) -> Callable[[], int]:
    """The handle of torch's current stream on ``device``, read at each post."""
    return lambda: int(torch.cuda.current_stream(device).cuda_stream)


class NcclComm:
    """:class:`Communicator` over one nccl4py ``Communicator`` (module docstring)."""

    def __init__(self, nccl: ModuleType, comm: Any, *, stream: Callable[[], int]) -> None:
        self._nccl = nccl
        self._comm = comm
        self._stream = stream
        self._lock = threading.Lock()
        self.aborted = False

    def post(self, ops: Sequence[P2P]) -> None:
        if not ops:
            return
        for p in ops:  # nccl4py takes a tensor's pointer and element count: a strided view would be misread
            if not p.tensor.is_contiguous():
                raise ValueError(f"NCCL moves contiguous memory only; a {p.op} to rank {p.peer} got a strided "
                                 f"tensor of shape {tuple(p.tensor.shape)}")
        stream = self._stream()
        with self._lock:
            comm = self._live()
            self._nccl.group_start()
            try:
                for p in ops:
                    (comm.send if p.op == "send" else comm.recv)(p.tensor, p.peer, stream=stream)
            finally:
                self._nccl.group_end()
        self.wait()

    def wait(self) -> None:
        """Until the last init or group is done (``ncclInProgress`` no more). No deadline of its
        own: the caller's :class:`Watchdog` aborts, and this then raises.

        Raises:
            RuntimeError: NCCL reported an error, or the communicator was aborted.
        """
        pause = 0.0005
        while True:
            with self._lock:
                state = int(self._live().get_async_error())
            if state == SUCCESS:
                return
            if state != IN_PROGRESS:
                raise RuntimeError(self._describe(state))
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def error(self) -> str | None:
        with self._lock:
            if self.aborted:
                return None
            state = int(self._comm.get_async_error())
        return None if state in (SUCCESS, IN_PROGRESS) else self._describe(state)

    def abort(self) -> None:
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
            self._comm.abort()

    def _live(self) -> Any:
        if self.aborted:
            raise RuntimeError("the NCCL communicator was aborted")
        return self._comm

    def _describe(self, state: int) -> str:
        try:
            detail = self._comm.get_last_error()
        except Exception:  # the words are a courtesy: the code is what matters
            detail = ""
        return f"NCCL error {state} ({self._nccl.get_error_string(state)})" + (f": {detail}" if detail else "")


def connect(store: dist.Store, *, rank: int, size: int, device: torch.device, deadline: Deadline,
            stream: Callable[[], int] | None = None) -> NcclComm:
    """Form the communicator of ``size`` ranks (every rank calls this, on its device's scope:
    NCCL binds a communicator to the current CUDA device).

    Raises:
        ValueError: nccl4py is missing (:data:`MISSING`).
        TransportError: the ranks did not connect by the deadline (the communicator was aborted).
        RuntimeError: NCCL or the store failed.
    """
    nccl = nccl4py()
    if rank == 0:
        store.set(UNIQUE_ID_KEY, nccl.get_unique_id().as_bytes)
    else:
        store.wait([UNIQUE_ID_KEY], datetime.timedelta(seconds=deadline.remaining()))
    unique_id = nccl.UniqueId.from_bytes(store.get(UNIQUE_ID_KEY))
    comm = NcclComm(nccl, nccl.Communicator.init(size, rank, unique_id, config=nccl.NCCLConfig(blocking=False)),
                    stream=stream or current_stream(device))
    with Watchdog(deadline, comm.abort) as dog:
        try:
            comm.wait()
        except RuntimeError:
            if not dog.fired:
                comm.abort()
                raise
    if dog.fired:
        raise TransportError(f"the NCCL communicator did not connect on {device} in time (every rank of the job "
                             "must reach prepare); it was aborted")
    return comm


class Watchdog:
    """Calls ``abort`` once if the guarded block is still running at the deadline, as soon as
    ``watch`` reports a peer dead (NCCL itself never notices a dead peer: its kernels wait), or
    as soon as ``health`` reports the communicator's asynchronous error.

        with Watchdog(deadline, abort, watch, health=comm.error) as dog:
            event.synchronize()        # returns early if dog aborted the communicator
        if dog.fired: raise ...        # dog.reason(): the dead peers, NCCL's error, or the deadline
    """

    #: How often ``health`` is polled when no peer watch sets the pace.
    HEALTH_EVERY = 0.1

    def __init__(self, deadline: Deadline, abort: Callable[[], None], watch: PeerWatch | None = None, *,
                 health: Callable[[], str | None] | None = None) -> None:
        self.deadline = deadline
        self.abort = abort
        self.watch = watch
        self.health = health
        self.fired = False
        self.dead: dict[int, str] = {}
        self.failure: str | None = None
        self._next_watch = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="weightsync-nccl-watchdog", daemon=True)

    def _step(self) -> float:
        steps = [self.deadline.remaining(0.0)]
        if self.watch is not None:
            steps.append(self.watch.every)
        if self.health is not None:
            steps.append(self.HEALTH_EVERY)
        return min(steps)

    def _watch(self) -> None:
        while not self._done.wait(self._step()):
            if self.deadline.expired or self._unwell():
                break
        else:
            return
        self.fired = True
        try:
            self.abort()
        except Exception as exc:  # the sync reports the timeout either way
            logger.warning("aborting the NCCL communicator failed: %s", exc)

    def _unwell(self) -> bool:
        now = time.monotonic()
        if self.watch is not None and now >= self._next_watch:  # leases at their own pace, not NCCL's
            self._next_watch = now + self.watch.every
            try:
                self.dead = self.watch.dead()
            except Exception as exc:  # the meta server is away: the deadline still holds
                logger.debug("peer liveness unavailable: %s", exc)
        if self.health is not None:
            try:
                self.failure = self.health()
            except Exception as exc:
                logger.debug("NCCL state unavailable: %s", exc)
        return bool(self.dead) or self.failure is not None

    def reason(self) -> str:
        """Why it fired, for the error: the dead peers, NCCL's error, or the deadline."""
        if self.dead:
            role = self.watch.role if self.watch is not None else "peer"
            return "; ".join(f"{role} {r} is dead ({why})" for r, why in sorted(self.dead.items()))
        if self.failure is not None:
            return self.failure
        return "it did not complete in time"

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


__all__ = ["MISSING", "P2P", "Communicator", "NcclComm", "Watchdog", "connect", "nccl4py", "nccl4py_missing"]
