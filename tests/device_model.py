"""A CPU model of the device port that *enforces* GPU rules (tests only).

Installed with ``weightsync.ports.device.use(DeviceModel())``, it makes CPU tensors behave like
tensors on a GPU as far as these rules go, against the same transport and engine code that runs
on a GPU (:mod:`weightsync.ports.device` is the port; each rule has a negative test in
``tests/test_device_model.py``):

* **Streams and asynchronous completion.** ``copy`` only queues the copy on the calling thread's
  current stream (its process's default stream, or a stream of its own: ``new_stream`` /
  ``on_stream``); it runs at a ``synchronize`` (every stream of the process), at a ``wait`` on an
  event recorded after it, or at a point chosen at random (seeded). ``order_after`` makes a
  stream wait for another's event, as ``cudaStreamWaitEvent``.
* **Hazards.** Memory with pending work is touched by something not ordered after that work: a
  copy on another stream (of this process or another), the CPU or a NIC (``touch``, NIXL
  transfers, which may complete later than they are posted: ``tests/nixl_model.py``), or a
  ready signal announcing it (``signal``). An engine's forward pass (``forward``) queued behind
  work another thread put on its stream (a background transfer stalling decode) is one too.
  Each is a :class:`HazardError`, raised and recorded.
* **CUDA IPC, as torch counts it** (``torch/csrc/StorageSharing.cpp``, ``CudaIPCTypes.cpp``):
  ``share`` starts a counter at 1, each consumer's free of what it ``open``-ed (or a
  ``release``) decrements it; the exporter's block is freed once the exporter freed it and
  every counter is 0. A counter below 0 is a leak (torch reads it as unsigned: the block stays
  in limbo forever), a block freed while a consumer still maps it an early free, both
  violations; :meth:`DeviceModel.leaks` lists blocks still held. A handle cannot be opened by
  the process that exported it (CUDA refuses), and memory of an expandable segment cannot be
  shared unless it was allocated ``shareable``.
* **A memory budget per GPU, as torch's caching allocator splits it.** ``reserve`` takes an
  engine's share (as vLLM takes its KV cache out of ``gpu_memory_utilization``); ``cache``
  and ``graph_pool`` make a process's allocator hold memory reserved but unallocated (free
  blocks, in fragments or whole segments; CUDA graph pools); an allocation past what one block
  can get raises ``torch.OutOfMemoryError``, and ``free_bytes`` reports what one can get.
  A process's first use of a device (an allocation, or an IPC open: its CUDA context) takes
  ``context`` bytes there.

Processes are simulated per thread (``with model.as_process("engine"): ...``): a thread outside
any ``as_process`` belongs to the real process. GPUs are device strings: ``"cpu"`` (every tensor
of a test, by default) or ``"cuda:N"`` (allocated on the CPU, accounted on GPU N).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from device_model_memory import Block, Gpu, MemoryRules

Range = tuple[int, int]  # [start, end) in bytes


class HazardError(AssertionError):
    """A GPU rule was broken (also recorded in :attr:`DeviceModel.violations`)."""


def span(t: torch.Tensor) -> Range:
    """The bytes a (possibly strided) view touches, as one range."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def overlaps(a: Range, b: Range) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@dataclass
class Op:
    seq: int
    reads: list[Range]
    writes: list[Range]
    run: Callable[[], None]
    what: str
    thread: int = 0
    after: dict[str, int] = field(default_factory=dict)  # streams' work it waits for: {stream: seq}


@dataclass
class Event:
    stream: str
    seq: int
    after: dict[str, int] = field(default_factory=dict)


@dataclass
class Stream:
    owner: str  # the process whose synchronize completes it
    ops: list[Op] = field(default_factory=list)
    waits: dict[str, int] = field(default_factory=dict)  # order_after: {stream: seq}


class DeviceModel(MemoryRules):
    """The device port on CPU tensors, with GPU rules enforced (module docstring).

    Args:
        gpu_types: device types treated as GPU memory (default: ``cpu``, i.e. every tensor).
        budget: bytes of each GPU's memory (or ``{device: bytes}``; None: unlimited).
        context: bytes a process's first use of a device takes from its budget (a CUDA context).
        expandable_segments: the allocator maps memory into expandable segments, which
            ``share`` refuses unless the memory was allocated ``shareable``.
        seed: of the random completion points.
        chance: probability that a port call first completes a random prefix of a stream.
    """

    def __init__(self, *, gpu_types: Sequence[str] = ("cpu",), budget: int | dict[str, int] | None = None,
                 seed: int = 0, chance: float = 0.3, context: int = 0, expandable_segments: bool = False) -> None:
        self.gpu_types = frozenset(gpu_types)
        self.budget = budget
        self.context = context
        self.expandable_segments = expandable_segments
        #: (process, device) pairs with a "CUDA context": made by an allocation or an IPC open there
        self.contexts: set[tuple[str, str]] = set()
        self.violations: list[str] = []
        self.peak = 0
        self.allocations: dict[int, tuple[int, str]] = {}  # id -> (bytes, what)
        self.pinned: list[tuple[int, str]] = []  # page-locked host buffers asked for: (bytes, what)
        self._gpus: dict[str, Gpu] = {}
        self._streams: dict[str, Stream] = {}
        self._nic: list[Op] = []  # NIXL transfers posted and not complete
        self._seq = 0
        self._rng = random.Random(seed)
        self._chance = chance
        self._lock = threading.RLock()
        self._local = threading.local()
        self._blocks: dict[int, Block] = {}
        self._by_ptr: dict[int, int] = {}  # a block's base address -> its key
        self._exports: dict[int, tuple[int, str]] = {}  # token -> (block key, exporter)
        self._graveyard: list[torch.Tensor] = []  # freed early: kept so that CPU tests do not crash
        self._tokens = 0
        self._keys = 0
        self._mappings = 0
        self._side = 0
        #: called first by every synchronize (a test's hook into a transfer under way)
        self.before_synchronize: Callable[[], None] | None = None

    # -- processes and streams ------------------------------------------------------------------
    def process(self) -> str:
        return getattr(self._local, "process", None) or f"pid{os.getpid()}"

    @contextlib.contextmanager
    def as_process(self, name: str) -> Iterator[None]:
        """Run the block as process ``name`` (its own default stream, its own IPC identity)."""
        before = getattr(self._local, "process", None), getattr(self._local, "stream", None)
        self._local.process, self._local.stream = name, None
        try:
            yield
        finally:
            self._local.process, self._local.stream = before

    def current_stream(self) -> str:
        return getattr(self._local, "stream", None) or self.process()

    def _stream(self, key: str) -> Stream:
        if key not in self._streams:
            self._streams[key] = Stream(owner=key)
        return self._streams[key]

    def new_stream(self, device: str | torch.device) -> str | None:
        if not self.is_gpu(device):
            return None
        with self._lock:
            self._side += 1
            key = f"{self.process()}/stream{self._side}"
            self._streams[key] = Stream(owner=self.process())
            return key

    @contextlib.contextmanager
    def on_stream(self, stream: str | None) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        if stream is not None:
            self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    # -- rules ------------------------------------------------------------------------------
    def _hazard(self, message: str) -> HazardError:
        self.violations.append(message)
        return HazardError(message)

    def _pending(self, ranges: Sequence[Range], *, writes_only: bool, skip: str | None = None) -> Op | None:
        """A pending op writing (or, unless ``writes_only``, also reading) one of ``ranges`` that
        stream ``skip`` (None: the CPU) is not ordered after: on another stream, or the NIC's."""
        waits = self._streams[skip].waits if skip in self._streams else {}
        for key, stream in self._streams.items():
            if key == skip:
                continue
            for op in stream.ops:
                if op.seq <= waits.get(key, 0):
                    continue
                touched = op.writes if writes_only else op.writes + op.reads
                if any(overlaps(r, t) for r in ranges for t in touched):
                    return op
        for op in self._nic:
            touched = op.writes if writes_only else op.writes + op.reads
            if any(overlaps(r, t) for r in ranges for t in touched):
                return op
        return None

    def _check_access(self, reads: Sequence[Range], writes: Sequence[Range], who: str, *,
                      skip: str | None = None) -> None:
        op = self._pending(reads, writes_only=True, skip=skip)
        if op is not None:
            raise self._hazard(f"{who} reads memory that pending work still writes ({op.what})")
        op = self._pending(writes, writes_only=False, skip=skip)
        if op is not None:
            raise self._hazard(f"{who} writes into memory with pending reads or writes ({op.what})")

    def _enqueue(self, key: str, reads: list[Range], writes: list[Range], run: Callable[[], None], what: str) -> Op:
        self._seq += 1
        stream = self._stream(key)
        op = Op(self._seq, reads, writes, run, what, threading.get_ident(), dict(stream.waits))
        stream.ops.append(op)
        return op

    # -- the port: streams and copies ---------------------------------------------------------
    def is_gpu(self, device: str | torch.device) -> bool:
        return torch.device(device).type in self.gpu_types

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._lock:
            self._progress()
            stream = self.current_stream()
            reads, writes = [span(src)], [span(dst)]
            self._check_access(reads, writes, f"a copy on {stream}'s stream", skip=stream)
            self._enqueue(stream, reads, writes, lambda: dst.copy_(src), f"a copy queued by {self.process()} on "
                                                                          f"{stream}")

    def forward(self, tensors: Sequence[torch.Tensor], what: str = "a forward pass") -> None:
        """The engine's kernels reading ``tensors``, queued on the current stream: a hazard when
        the stream still holds work another thread queued (it would wait behind it)."""
        with self._lock:
            stream = self.current_stream()
            me = threading.get_ident()
            behind = [op for op in self._stream(stream).ops if op.thread != me]
            if behind:
                raise self._hazard(f"{what} on {stream}'s stream queues behind {len(behind)} operation(s) another "
                                   f"thread queued there ({behind[0].what}): background work belongs on a stream "
                                   "of its own")
            reads = [span(t) for t in tensors]
            self._check_access(reads, [], what, skip=stream)
            self._enqueue(stream, reads, [], lambda: None, what)

    def record(self, device: str | torch.device) -> Event:
        with self._lock:
            self._progress()
            key = self.current_stream()
            stream = self._stream(key)
            return Event(key, stream.ops[-1].seq if stream.ops else 0, dict(stream.waits))

    def order_after(self, event: Any, device: str | torch.device) -> None:
        if event is None:
            return
        with self._lock:
            waits = self._stream(self.current_stream()).waits
            for key, seq in {**event.after, event.stream: event.seq}.items():
                waits[key] = max(waits.get(key, 0), seq)

    def wait(self, event: Any) -> None:
        with self._lock:
            for key, seq in event.after.items():
                self._complete(key, seq)
            self._complete(event.stream, event.seq)

    def synchronize(self, device: str | torch.device) -> None:
        if self.before_synchronize is not None:  # a test's hook: what runs while this thread's work is pending
            self.before_synchronize()
        with self._lock:
            me = self.process()
            for key, stream in list(self._streams.items()):
                if stream.owner == me:
                    self._complete(key, self._seq)

    def synchronize_all(self) -> None:
        """Complete every stream (what a test does before it looks at the bytes)."""
        with self._lock:
            for key in list(self._streams):
                self._complete(key, self._seq)

    def touch(self, tensor: torch.Tensor, *, write: bool) -> None:
        with self._lock:
            self._progress()
            r = [span(tensor)]
            self._check_access(r, r if write else [], f"the CPU ({self.process()})")

    def dma(self, reads: Sequence[Range], writes: Sequence[Range], who: str) -> None:
        """A NIC reads and writes these ranges now, outside any stream order."""
        with self._lock:
            self._progress()
            self._check_access(reads, writes, who)

    def post_nic(self, reads: Sequence[Range], writes: Sequence[Range], who: str) -> Op:
        """A NIC transfer posted and not complete: its ranges are busy until :meth:`end_nic`."""
        with self._lock:
            self._seq += 1
            op = Op(self._seq, list(reads), list(writes), lambda: None, who)
            self._nic.append(op)
            return op

    def end_nic(self, op: Op) -> None:
        with self._lock:
            self._nic.remove(op)

    def signal(self, words: torch.Tensor, index: int, value: int, *, covers: Sequence[torch.Tensor]) -> None:
        with self._lock:
            self._progress()
            ranges = [span(t) for t in covers]
            # the work it announces: anyone's pending writes there, and this process's reads (a
            # peer acting on the signal writes into memory its queued kernels may still read)
            op = self._pending(ranges, writes_only=True) or next(
                (o for s in self._streams.values() if s.owner == self.process() for o in s.ops
                 if any(overlaps(r, t) for r in ranges for t in o.reads)), None)
            if op is not None:
                raise self._hazard(f"{self.process()} raised a ready signal ({value}) before the work it announces "
                                   f"completed ({op.what})")
            words[index] = value

    def scope(self, device: str | torch.device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    # -- work another engine queues on a stream (a fake NCCL) -------------------------------------
    def queue(self, reads: Sequence[Range], writes: Sequence[Range], run: Callable[[], None], what: str, *,
              stream: str) -> Op:
        """Queue work on ``stream`` (a process's name: its default stream, as NCCL's kernels on the
        current stream): pending until that stream completes it."""
        with self._lock:
            return self._enqueue(stream, list(reads), list(writes), run, what)

    def complete_before(self, op: Op) -> None:
        """Complete what is queued ahead of ``op`` on its stream, leaving ``op`` pending (a NCCL
        receive completing with its send: the sender's stream got that far, and the send itself
        is done for its sender only once that sender's stream or CPU waited for it)."""
        with self._lock:
            for name, stream in self._streams.items():
                if any(o is op for o in stream.ops):
                    self._complete(name, op.seq - 1)
                    return

    # -- completion -------------------------------------------------------------------------
    def pending(self) -> int:
        return sum(len(s.ops) for s in self._streams.values())

    def _complete(self, key: str, upto: int) -> None:
        stream = self._streams.get(key)
        while stream and stream.ops and stream.ops[0].seq <= upto:
            op = stream.ops.pop(0)
            for other, seq in op.after.items():
                self._complete(other, seq)
            op.run()

    def _progress(self) -> None:
        """At random, complete a prefix of a random stream (GPUs finish work when they like)."""
        if self._rng.random() >= self._chance:
            return
        busy = [k for k, s in self._streams.items() if s.ops]
        if busy:
            key = self._rng.choice(busy)
            ops = self._streams[key].ops
            self._complete(key, ops[self._rng.randrange(len(ops))].seq)
