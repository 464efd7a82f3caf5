"""A CPU model of the device port that *enforces* GPU rules (tests only).

Installed with ``weightsync.ports.device.use(DeviceModel())``, it makes CPU tensors behave like
tensors on a GPU as far as these rules go, against the same transport and engine code that runs
on a GPU (:mod:`weightsync.ports.device` is the port; each rule has a negative test in
``tests/test_device_model.py``):

* **Asynchronous completion.** ``copy`` only queues the copy on the calling process's stream; it
  runs at a ``synchronize``, at a ``wait`` on an event recorded after it, or at a point chosen at
  random (seeded). Reading the destination before then reads old bytes, as on a GPU.
* **Hazards.** Memory with pending work is touched by something not ordered after that work: a
  copy on another process's stream, the CPU or a NIC (``touch``, NIXL transfers), or a ready
  signal announcing it (``signal``). Each is a :class:`HazardError`, raised and recorded.
* **IPC handles.** A handle cannot be opened by the process that exported it (CUDA refuses;
  torch's own reductions hand such tensors over from a cache instead).
* **A device memory budget.** ``reserve`` takes an engine's share (as vLLM takes its KV cache out
  of ``gpu_memory_utilization`` once it has measured what it uses); an allocation past what is
  left raises ``torch.OutOfMemoryError``, and ``free_bytes`` reports the rest.
* **Registration bounds** (NIXL): :class:`NixlModel` refuses a descriptor that is not inside one
  memory registration, as ``nixlSecDescList::getCoveringIndex`` does in NIXL's
  ``src/infra/nixl_descriptors.cpp``.

Processes are simulated per thread (``with model.as_process("engine"): ...``): a thread outside
any ``as_process`` belongs to the real process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.ports.device import IpcHandle

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


@dataclass
class Event:
    process: str
    seq: int


@dataclass
class Stream:
    ops: list[Op] = field(default_factory=list)


class DeviceModel:
    """The device port on CPU tensors, with GPU rules enforced (module docstring).

    Args:
        gpu_types: device types treated as GPU memory (default: ``cpu``, i.e. every tensor).
        budget: bytes of "device memory" (None: unlimited).
        context: bytes a process's first use of the device takes from the budget (a CUDA
            context): made by its first allocation there, or by opening an IPC handle there.
        seed: of the random completion points.
        chance: probability that a port call first completes a random prefix of a stream.
    """

    def __init__(self, *, gpu_types: Sequence[str] = ("cpu",), budget: int | None = None, seed: int = 0,
                 chance: float = 0.3, context: int = 0) -> None:
        self.gpu_types = frozenset(gpu_types)
        self.budget = budget
        self.context = context
        #: (process, device) pairs with a "CUDA context": made by an allocation or an IPC open there
        self.contexts: set[tuple[str, str]] = set()
        self.violations: list[str] = []
        self.reserved: dict[str, int] = {}
        self.used = 0
        self.peak = 0
        self.allocations: dict[int, tuple[int, str]] = {}  # id -> (bytes, what)
        self.pinned: list[tuple[int, str]] = []  # page-locked host buffers asked for: (bytes, what)
        self._streams: dict[str, Stream] = {}
        self._seq = 0
        self._rng = random.Random(seed)
        self._chance = chance
        self._lock = threading.RLock()
        self._local = threading.local()
        self._exports: dict[int, tuple[torch.Tensor, str]] = {}
        self._tokens = 0
        self._keys = 0  # allocations, by number

    # -- processes --------------------------------------------------------------------------
    def process(self) -> str:
        return getattr(self._local, "process", None) or f"pid{os.getpid()}"

    @contextlib.contextmanager
    def as_process(self, name: str) -> Iterator[None]:
        """Run the block as process ``name`` (its own stream, its own IPC identity)."""
        before = getattr(self._local, "process", None)
        self._local.process = name
        try:
            yield
        finally:
            self._local.process = before

    # -- rules ------------------------------------------------------------------------------
    def _hazard(self, message: str) -> HazardError:
        self.violations.append(message)
        return HazardError(message)

    def _pending(self, ranges: Sequence[Range], *, writes_only: bool, skip: str | None = None) -> Op | None:
        """A pending op (of any stream but ``skip``'s) writing (or, unless ``writes_only``, also
        reading) one of ``ranges``."""
        for process, stream in self._streams.items():
            if process == skip:
                continue
            for op in stream.ops:
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

    # -- the port -----------------------------------------------------------------------------
    def is_gpu(self, device: str | torch.device) -> bool:
        return torch.device(device).type in self.gpu_types

    def empty(self, nbytes: int, device: str | torch.device, *, what: str, pinned: bool = False) -> torch.Tensor:
        if pinned:  # page-locked host memory: outside the device budget, and recorded
            self.pinned.append((nbytes, what))
            return torch.empty(nbytes, dtype=torch.uint8)
        if not self.is_gpu(device):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        with self._lock:
            self._progress()
            free = self.free_bytes(device)
            if free is not None and nbytes > free:
                raise torch.OutOfMemoryError(f"device model: {what} needs {nbytes} bytes, {free} free "
                                             f"(reserved: {self.reserved})")
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.contexts.add((self.process(), str(torch.device(device))))
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self._keys += 1
            key = self._keys
            self.allocations[key] = (nbytes, what)
            # device memory lives as long as its storage (views of other dtypes included)
            weakref.finalize(t.untyped_storage(), self._free, key)
            return t

    def _free(self, key: int) -> None:
        with self._lock:
            nbytes, _ = self.allocations.pop(key, (0, ""))
            self.used -= nbytes

    def reserve(self, nbytes: int, owner: str) -> None:
        """``owner`` (an engine) takes ``nbytes`` of the budget for itself."""
        with self._lock:
            free = self.free_bytes("cpu")
            if free is not None and nbytes > free:
                raise torch.OutOfMemoryError(f"device model: {owner} cannot reserve {nbytes} bytes, {free} free")
            self.reserved[owner] = self.reserved.get(owner, 0) + nbytes

    def reserve_rest(self, owner: str) -> int:
        """``owner`` takes everything still free (vLLM sizing its KV cache); returns how much."""
        with self._lock:
            rest = self.free_bytes("cpu") or 0
            self.reserved[owner] = self.reserved.get(owner, 0) + rest
            return rest

    def free_bytes(self, device: str | torch.device) -> int | None:
        if self.budget is None or not self.is_gpu(device):
            return None
        return self.budget - self.used - sum(self.reserved.values())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._lock:
            self._progress()
            process = self.process()
            reads, writes = [span(src)], [span(dst)]
            self._check_access(reads, writes, f"a copy on {process}'s stream", skip=process)
            self._seq += 1
            self._streams.setdefault(process, Stream()).ops.append(
                Op(self._seq, reads, writes, lambda: dst.copy_(src), f"a copy queued by {process}"))

    def record(self, device: str | torch.device) -> Event:
        with self._lock:
            self._progress()
            stream = self._streams.get(self.process())
            return Event(self.process(), stream.ops[-1].seq if stream and stream.ops else 0)

    def wait(self, event: Any) -> None:
        with self._lock:
            self._complete(event.process, event.seq)

    def synchronize(self, device: str | torch.device) -> None:
        with self._lock:
            self._complete(self.process(), self._seq)

    def synchronize_all(self) -> None:
        """Complete every stream (what a test does before it looks at the bytes)."""
        with self._lock:
            for process in list(self._streams):
                self._complete(process, self._seq)

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

    def signal(self, words: torch.Tensor, index: int, value: int, *, covers: Sequence[torch.Tensor]) -> None:
        with self._lock:
            self._progress()
            op = self._pending([span(t) for t in covers], writes_only=False)
            if op is not None:
                raise self._hazard(f"{self.process()} raised a ready signal ({value}) before the work it announces "
                                   f"completed ({op.what})")
            words[index] = value

    def share(self, tensor: torch.Tensor) -> IpcHandle:
        with self._lock:
            self._tokens += 1
            self._exports[self._tokens] = (tensor, self.process())
            return IpcHandle((self._tokens,), str(tensor.device), "model-gpu", self.process())

    def open(self, handle: IpcHandle, device: str) -> torch.Tensor:
        with self._lock:
            tensor, exporter = self._exports[int(handle.fields[0])]
            if exporter == self.process() or handle.process == self.process():
                self.violations.append(f"{self.process()} opened an IPC handle it exported itself")
                raise RuntimeError("CUDA error: invalid device context (device model: cudaIpcOpenMemHandle of a "
                                   f"handle exported by this process, {self.process()})")
            need = self.context_bytes(device)
            if need:  # the open creates this process's context on the device, out of its budget
                free = self.free_bytes(device)
                if free is not None and need > free:
                    raise torch.OutOfMemoryError(f"CUDA error: out of memory (device model: {self.process()}'s "
                                                 f"context on {device} needs {need} bytes, {free} free)")
                owner = f"{self.process()}'s context on {device}"
                self.reserved[owner] = self.reserved.get(owner, 0) + need
                self.contexts.add((self.process(), str(torch.device(device))))
            return tensor

    def context_bytes(self, device: str | torch.device) -> int:
        if not self.is_gpu(device) or (self.process(), str(torch.device(device))) in self.contexts:
            return 0
        return self.context

    def scope(self, device: str | torch.device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    # -- work another engine queues on a stream (a fake NCCL) -------------------------------------
    def queue(self, reads: Sequence[Range], writes: Sequence[Range], run: Callable[[], None], what: str, *,
              stream: str) -> Op:
        """Queue work on ``stream`` (a process's own stream, as NCCL's kernels on the current
        stream): pending until that stream completes it."""
        with self._lock:
            self._seq += 1
            op = Op(self._seq, list(reads), list(writes), run, what)
            self._streams.setdefault(stream, Stream()).ops.append(op)
            return op

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

    def _complete(self, process: str, upto: int) -> None:
        stream = self._streams.get(process)
        while stream and stream.ops and stream.ops[0].seq <= upto:
            stream.ops.pop(0).run()

    def _progress(self) -> None:
        """At random, complete a prefix of a random stream (GPUs finish work when they like)."""
        if self._rng.random() >= self._chance:
            return
        busy = [p for p, s in self._streams.items() if s.ops]
        if busy:
            process = self._rng.choice(busy)
            ops = self._streams[process].ops
            self._complete(process, ops[self._rng.randrange(len(ops))].seq)


# -- NIXL --------------------------------------------------------------------------------------

class NixlModel:
    """The slice of the ``nixl`` Python API :mod:`weightsync.transport.nixl.agent` uses, in one
    process: agents find each other by name, transfers are memory copies reported to the device
    model as NIC accesses, and every descriptor must lie inside one registration of its agent.

        monkeypatch.setattr(nixl_agent, "load_nixl", NixlModel(model).module)
    """

    def __init__(self, model: DeviceModel | None = None) -> None:
        self.model = model
        self.agents: dict[str, _Agent] = {}
        self.lock = threading.RLock()
        bindings = types.ModuleType("nixl_model._bindings")
        bindings.nixlNotFoundError = type("nixlNotFoundError", (Exception,), {})  # type: ignore[attr-defined]
        bindings.nixlInvalidParamError = type("nixlInvalidParamError", (Exception,), {})  # type: ignore[attr-defined]
        self.bindings = bindings
        mod = types.ModuleType("nixl_model")
        mod._bindings = bindings  # type: ignore[attr-defined]
        mod.nixl_agent_config = lambda **kw: kw  # type: ignore[attr-defined]
        mod.nixl_thread_sync_t = types.SimpleNamespace(NIXL_THREAD_SYNC_STRICT=1)  # type: ignore[attr-defined]
        mod.nixl_agent = lambda name, config: _Agent(self, name)  # type: ignore[attr-defined]
        self._module = mod

    def module(self) -> types.ModuleType:
        return self._module

    def refuse(self, message: str) -> Exception:
        if self.model is not None:
            self.model.violations.append(message)
        return self.bindings.nixlNotFoundError(message)  # type: ignore[no-any-return]


class _Handle:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)

    def release(self) -> None:
        pass


class _Agent:
    def __init__(self, nixl: NixlModel, name: str) -> None:
        self.nixl, self.name = nixl, name
        self.regs: list[tuple[str, int, int, int]] = []  # (mem, device, start, end)
        self.notifs: dict[str, list[bytes]] = {}
        with nixl.lock:
            nixl.agents[name] = self

    def create_backend(self, kind: str, params: Any) -> None:
        pass

    def register_memory(self, regions: list[tuple[int, int, int, str]], mem: str) -> _Handle:
        new = [(mem, int(dev), int(a), int(a) + int(n)) for a, n, dev, _ in regions]
        self.regs += new
        return _Handle(regs=new)

    def deregister_memory(self, handle: _Handle) -> None:
        for reg in handle.regs:
            self.regs.remove(reg)

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return bytes(metadata)

    def make_connection(self, peer: Any) -> None:
        pass

    def remove_remote_agent(self, peer: Any) -> None:
        pass

    def prep_xfer_dlist(self, agent: str, descs: Any, mem: str) -> _Handle:
        owner = self if agent == "NIXL_INIT_AGENT" else self.nixl.agents[agent if isinstance(agent, str)
                                                                          else agent.decode()]
        rows = [(int(a), int(n), int(d)) for a, n, d in descs]
        for a, n, d in rows:
            if not any(m == mem and dev == d and s <= a and a + n <= e for m, dev, s, e in owner.regs):
                raise self.nixl.refuse(f"NIXL: descriptor ({a:#x}, {n} bytes, dev {d}) of {owner.name} is not "
                                       "inside one memory registration (nixlSecDescList::getCoveringIndex)")
        return _Handle(owner=owner, rows=rows)

    def make_prepped_xfer(self, op: str, local: _Handle, li: Any, remote: _Handle, ri: Any) -> _Handle:
        return _Handle(op=op, local=local, remote=remote, pairs=list(zip(li, ri, strict=True)))

    def transfer(self, handle: _Handle, notif: bytes = b"") -> str:
        pairs = [(handle.local.rows[int(i)], handle.remote.rows[int(j)]) for i, j in handle.pairs]
        local = [(a, a + n) for (a, n, _), _ in pairs]
        remote = [(a, a + n) for _, (a, n, _) in pairs]
        reads, writes = (remote, local) if handle.op == "READ" else (local, remote)
        if self.nixl.model is not None:
            self.nixl.model.dma(reads, writes, f"a NIXL {handle.op} of {self.name}")
        for (la, n, _), (ra, _, _) in pairs:
            src, dst = (ra, la) if handle.op == "READ" else (la, ra)
            ctypes.memmove(dst, src, n)
        if notif:
            peer = handle.remote.owner
            with self.nixl.lock:
                peer.notifs.setdefault(self.name, []).append(bytes(notif))
        return "DONE"

    def check_xfer_state(self, handle: _Handle) -> str:
        return "DONE"

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self.nixl.lock:
            out, self.notifs = self.notifs, {}
        return out
