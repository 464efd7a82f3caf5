"""One port for device effects: every copy, event, synchronise, CUDA IPC handle, ready signal and
device allocation weightsync makes goes through it.

A CPU has no streams, no IPC rules and no device memory budget, so CPU tests cannot see the
mistakes that matter on a GPU: a ready word raised before the copies it announces completed, a
NIC writing into memory that queued kernels still read, an IPC handle opened by the process that
made it, an allocation past what vLLM left free. The test model of this port
(``tests/device_model.py``) enforces those rules on CPU tensors, against the same code that runs
on a GPU; :class:`TorchDevices` is the real one. Transports and engines take the current port
once and make their device decisions through it::

    dev = device_port.current()
    buf = dev.empty(nbytes, device, what="staging arena")   # within the device's budget
    dev.copy(dst, src)                                       # queued on the current stream
    dev.synchronize(device)                                  # everything queued so far is done
    dev.signal(words, 3, version, covers=[buf])              # a ready word, after what it announces
    handle = dev.share(buf)                                  # a CUDA IPC share (msgpack-able): one per consumer
    with dev.on_stream(dev.new_stream(device)):              # background work, off the engine's stream
        ...; done = dev.record(device)
    dev.order_after(done, device)                            # the current stream waits for it (not the CPU)

What the real port relies on (torch 2.13): ``Tensor.copy_(non_blocking=True)`` is ordered on the
current stream and asynchronous for device memory and pinned host memory;
``torch.cuda.Event(blocking=True).synchronize()`` blocks the CPU without spinning;
``UntypedStorage._share_cuda_()`` / ``_new_shared_cuda(*fields)`` are what
``torch.multiprocessing.reductions`` uses for CUDA tensors (the first field is the device index
the handle is opened on, under a ``CUDAGuard``; the caching allocator opens it with
``cudaIpcOpenMemHandle(..., cudaIpcMemLazyEnablePeerAccess)``, which maps the memory into the
*current* device's context, reaching another GPU by peer access). CUDA refuses to open a handle
in the process that exported it: torch's own reductions hand such a tensor over from their
cache instead, and so must weightsync (:mod:`weightsync.transport.shm.snapshot`). Each
``_share_cuda_`` starts a reference counter at 1 that the consumer's free of what it opened
decrements (``torch/csrc/StorageSharing.cpp``; ``_release_ipc_counter_cuda`` decrements it
without an open), and the exporter's block is freed only once every counter is 0: so a share
is consumed exactly once, by one reader.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceMemoryError", "DevicePort", "IpcHandle", "TorchDevices", "allocatable_bytes", "allocate",
           "cached_blocks", "check_fits", "current", "gib", "gpu_identity", "ipc_allocator_settings", "parse_device",
           "use"]

logger = logging.getLogger(__name__)


def parse_device(device: str) -> tuple[str, int | None]:
    """``"cuda:3"`` -> ``("cuda", 3)``; ``"cpu"`` -> ``("cpu", None)``; ValueError otherwise."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return kind, int(index) if index else None


def gpu_identity(device: str) -> str:
    """The physical identity of a CUDA device (its UUID), comparable across processes; "" for
    host memory. vLLM's and SGLang's own CUDA IPC paths identify GPUs the same way."""
    kind, index = parse_device(device)
    if kind != "cuda":
        return ""
    import torch

    return str(torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).uuid)


#: What a process's CUDA context takes on a device, as weightsync accounts for it before making
#: one: an upper estimate for CUDA 12 with lazy module loading on data-center GPUs (not measured
#: on this project's machines, which have no GPU; ``weightsync doctor`` on a GPU reports it).
CUDA_CONTEXT_BYTES = 512 << 20


class DeviceMemoryError(ValueError):
    """What a rank needs does not fit in a device's free memory: refused before anything is allocated,
    with the figure and the setting to change (never an out-of-memory error in the middle of a sync)."""


@dataclass(frozen=True, slots=True)
class IpcHandle:
    """A CUDA IPC handle of one allocation, as it crosses processes (msgpack through a segment header).

    ``fields`` are the port's own (torch: ``UntypedStorage._share_cuda_()``, whose first field is
    the exporter's device index); ``device`` and ``gpu`` are the exporter's device in its own
    numbering and its GPU's UUID; ``process`` the exporter (:meth:`DevicePort.process`).
    """

    fields: tuple[Any, ...]
    device: str
    gpu: str
    process: str

    def to_wire(self) -> dict[str, Any]:
        return {"fields": list(self.fields), "device": self.device, "gpu": self.gpu, "process": self.process}

    @classmethod
    def from_wire(cls, doc: dict[str, Any]) -> IpcHandle:
        return cls(tuple(doc["fields"]), str(doc["device"]), str(doc.get("gpu", "")), str(doc["process"]))


class DevicePort(Protocol):
    """Device effects (see module docstring). Memory is "device memory" when :meth:`is_gpu` says so:
    its copies complete asynchronously, it is shared by IPC handle, and it has a budget."""

    def is_gpu(self, device: str | torch.device) -> bool:
        """Whether memory on ``device`` follows GPU rules (asynchronous, IPC-shared, budgeted)."""
        ...

    def process(self) -> str:
        """This process's identity: an IPC handle it exported must not be opened by it."""
        ...

    def empty(self, nbytes: int, device: str | torch.device, *, what: str, pinned: bool = False,
              shareable: bool = False) -> torch.Tensor:
        """``nbytes`` uninitialised bytes (uint8) on ``device``; ``pinned``: page-locked host memory;
        ``shareable``: device memory that :meth:`share` will export (see :func:`ipc_allocator_settings`)."""
        ...

    def free_bytes(self, device: str | torch.device) -> int | None:
        """Bytes still free on ``device`` (None: no budget is known, as for host memory)."""
        ...

    def context_bytes(self, device: str | torch.device) -> int:
        """Device memory this process's first use of ``device`` takes there (a CUDA context, as a
        CUDA IPC reader creates on the writer's GPU); 0 once it has one, or for host memory."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, queued on the current stream: complete only once synchronised."""
        ...

    def record(self, device: str | torch.device) -> Any:
        """An event after everything queued so far on the current stream."""
        ...

    def order_after(self, event: Any, device: str | torch.device) -> None:
        """Work queued on the current stream from now on runs after ``event`` (the GPU waits; the
        CPU does not)."""
        ...

    def new_stream(self, device: str | torch.device) -> Any:
        """A stream of this process's own on ``device``, for work that must not queue behind (or
        ahead of) the engine's (None for host memory)."""
        ...

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` (from :meth:`new_stream`) the current stream of this thread for the block."""
        ...

    def wait(self, event: Any) -> None:
        """Block the CPU until ``event`` completed."""
        ...

    def synchronize(self, device: str | torch.device) -> None:
        """Block the CPU until everything this process queued on ``device`` completed, on every stream."""
        ...

    def touch(self, tensor: torch.Tensor, *, write: bool) -> None:
        """The CPU or a NIC is about to read (or write) this memory now, outside stream order."""
        ...

    def signal(self, words: torch.Tensor, index: int, value: int, *, covers: Sequence[torch.Tensor]) -> None:
        """Raise ready word ``words[index] = value`` (host memory), announcing that the work on
        ``covers`` has completed: peers act on the memory once they see it."""
        ...

    def share(self, tensor: torch.Tensor) -> IpcHandle:
        """An IPC handle of ``tensor``'s allocation (device memory)."""
        ...

    def open(self, handle: IpcHandle, device: str) -> torch.Tensor:
        """The exported allocation as a uint8 tensor, mapped on local ``device`` (another process's
        handle only). Freeing the tensor consumes the share (torch decrements its counter)."""
        ...

    def release(self, handle: IpcHandle) -> None:
        """Consume a share without opening it (torch: ``_release_ipc_counter_cuda``, what its own
        reductions do for a storage they already hold)."""
        ...

    def scope(self, device: str | torch.device) -> contextlib.AbstractContextManager[Any]:
        """Make ``device`` the current device for the block (CUDA calls that take no device)."""
        ...


class TorchDevices:
    """The real port: torch and CUDA (see module docstring for what each call relies on)."""

    def is_gpu(self, device: str | torch.device) -> bool:
        import torch

        return torch.device(device).type == "cuda"

    def process(self) -> str:
        return f"{socket.gethostname()}/{os.getpid()}"

    def empty(self, nbytes: int, device: str | torch.device, *, what: str, pinned: bool = False,
              shareable: bool = False) -> torch.Tensor:
        import torch

        d = torch.device(device)
        if not (shareable and d.type == "cuda"):
            return torch.empty(nbytes, dtype=torch.uint8, device=d,
                               pin_memory=pinned and d.type == "cpu" and torch.cuda.is_available())
        switch = ipc_allocator_settings(torch._C._accelerator_getAllocatorSettings(),
                                        torch.cuda.get_allocator_backend())
        if switch is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=d)
        with _ALLOCATOR_SETTINGS:
            torch.cuda.empty_cache()  # no mapped free block of an expandable segment may serve it
            torch._C._accelerator_setAllocatorSettings(switch)
            try:
                return torch.empty(nbytes, dtype=torch.uint8, device=d)
            finally:
                torch._C._accelerator_setAllocatorSettings("expandable_segments:True")

    def free_bytes(self, device: str | torch.device) -> int | None:
        import torch

        d = torch.device(device)
        if d.type != "cuda":
            return None
        index = d.index if d.index is not None else torch.cuda.current_device()
        if not torch._C._cuda_hasPrimaryContext(index):  # type: ignore[attr-defined]
            # cudaMemGetInfo would create the very context a caller checks room for: ask NVML
            return _free_without_context(index)
        free = int(torch.cuda.mem_get_info(index)[0])
        return allocatable_bytes(free, cached_blocks(torch.cuda.memory_snapshot(include_traces=False), index))

    def context_bytes(self, device: str | torch.device) -> int:
        import torch

        d = torch.device(device)
        if d.type != "cuda":
            return 0
        index = d.index if d.index is not None else torch.cuda.current_device()
        # torch's binding of at::cuda::detail::hasPrimaryContext (torch/csrc/cuda/Module.cpp); absent
        # from CPU builds' stubs, hence the ignore
        has_context = torch._C._cuda_hasPrimaryContext(index)  # type: ignore[attr-defined]
        return 0 if has_context else CUDA_CONTEXT_BYTES

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if _host_copy is not None and _host_copy(dst, src):
            return
        dst.copy_(src, non_blocking=True)

    def record(self, device: str | torch.device) -> Any:
        import torch

        d = torch.device(device)
        if d.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(d))
        return event

    def order_after(self, event: Any, device: str | torch.device) -> None:
        import torch

        if event is not None:
            torch.cuda.current_stream(torch.device(device)).wait_event(event)

    def new_stream(self, device: str | torch.device) -> Any:
        import torch

        d = torch.device(device)
        return torch.cuda.Stream(device=d) if d.type == "cuda" else None

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        import torch

        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def synchronize(self, device: str | torch.device) -> None:
        import torch

        d = torch.device(device)
        if d.type == "cuda":
            torch.cuda.synchronize(d)

    def touch(self, tensor: torch.Tensor, *, write: bool) -> None:
        pass

    def signal(self, words: torch.Tensor, index: int, value: int, *, covers: Sequence[torch.Tensor]) -> None:
        words[index] = value

    def share(self, tensor: torch.Tensor) -> IpcHandle:
        device = str(tensor.device)
        return IpcHandle(tuple(tensor.untyped_storage()._share_cuda_()), device, gpu_identity(device), self.process())

    def open(self, handle: IpcHandle, device: str) -> torch.Tensor:
        import torch

        home = torch.device(device)
        fields = list(handle.fields)
        fields[0] = home.index  # _share_cuda_'s first field: the device the handle is opened on, here
        with torch.cuda.device(home):
            storage = torch.UntypedStorage._new_shared_cuda(*fields)
            return torch.empty(0, dtype=torch.uint8, device=home).set_(storage)

    def release(self, handle: IpcHandle) -> None:
        import torch

        # _share_cuda_'s fields 4 and 5: the share's reference counter file and offset
        torch.UntypedStorage._release_ipc_counter_cuda(handle.fields[4], handle.fields[5])

    def scope(self, device: str | torch.device) -> contextlib.AbstractContextManager[Any]:
        import torch

        d = torch.device(device)
        return torch.cuda.device(d) if d.type == "cuda" else contextlib.nullcontext()


#: Switching torch's allocator settings to allocate shareable memory is process-wide.
_ALLOCATOR_SETTINGS = threading.Lock()


def ipc_allocator_settings(settings: str, backend: str) -> str | None:
    """The allocator setting to allocate memory that CUDA IPC will share under (None: as it is).

    With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``settings`` as
    ``torch._C._accelerator_getAllocatorSettings()`` gives them), torch maps large blocks into
    expandable segments, which ``_share_cuda_`` exports as POSIX file descriptors a reader
    must fetch with ``pidfd_getfd`` (ptrace rights that containers usually withhold), or not
    at all where ``TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC`` is off. A plain ``cudaMalloc``
    segment shares with ``cudaIpcGetMemHandle`` everywhere, so weightsync allocates its IPC
    slots with expandable segments off (and turns them on again at once).

    Raises:
        ValueError: the ``cudaMallocAsync`` backend, which cannot share CUDA IPC handles.
    """
    if backend == "cudaMallocAsync":
        raise ValueError("CUDA IPC needs torch's native caching allocator, and PYTORCH_CUDA_ALLOC_CONF selects "
                         "backend:cudaMallocAsync, which cannot share IPC handles: drop it from the trainer's "
                         "PYTORCH_CUDA_ALLOC_CONF, or use transport='torch' (NCCL)")
    options = dict(part.split(":", 1) for part in settings.replace(" ", "").split(",") if ":" in part)
    if options.get("expandable_segments", "").lower() in ("true", "1"):
        return "expandable_segments:False"
    return None


def allocatable_bytes(driver_free: int, cached: Iterable[tuple[int, bool]]) -> int:
    """How large one allocation on a device may be: what the driver has free plus the cached
    segments torch's allocator would give back for it (wholly free ones, of the default pool),
    or the largest free block it already holds, if larger.

    Reserved-but-unallocated memory is not free as a whole: free blocks inside partly used
    segments (fragments) serve only requests they fit, and CUDA graph pools serve only their
    graphs (``cached``: :func:`cached_blocks`).
    """
    blocks = list(cached)
    releasable = sum(size for size, whole in blocks if whole)
    return max(driver_free + releasable, max((size for size, _ in blocks), default=0))


def cached_blocks(segments: Iterable[Mapping[str, Any]], device: int) -> list[tuple[int, bool]]:
    """Free blocks torch's allocator holds on CUDA device ``device``, from
    ``torch.cuda.memory_snapshot()``: ``(bytes, whether it is a whole free segment)``, of the
    default pool only (a segment whose ``segment_pool_id`` is not ``(0, 0)`` belongs to a CUDA
    graph's private pool)."""
    out: list[tuple[int, bool]] = []
    for segment in segments:
        if segment.get("device") != device or tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        if int(segment.get("allocated_size", 0)) == 0 and int(segment.get("active_size", 0)) == 0:
            out.append((int(segment["total_size"]), True))
            continue
        out += [(int(b["size"]), False) for b in segment.get("blocks", ()) if b.get("state") == "inactive"]
    return out


def _free_without_context(index: int) -> int | None:
    """Free memory on CUDA device ``index`` by NVML (what nvidia-smi shows), which needs no context
    there; None, with a warning, where NVML (nvidia-ml-py, which vLLM installs) is missing."""
    import torch

    try:
        used = torch.cuda.device_memory_used(index)
    except Exception as exc:  # nvidia-ml-py missing, or any NVMLError: the figure is unknown, not wrong
        logger.warning("cannot tell the free memory of cuda:%d without creating a CUDA context there (%s); "
                       "its check is skipped", index, exc)
        return None
    return int(torch.cuda.get_device_properties(index).total_memory) - int(used)


_installed: list[DevicePort] = [TorchDevices()]  # the last one is in use
#: A faster copy between host tensors (False: it does not apply), installed by whoever has one.
_host_copy: Callable[[torch.Tensor, torch.Tensor], bool] | None = None


def use_host_copy(copy: Callable[[torch.Tensor, torch.Tensor], bool] | None) -> None:
    """Have :meth:`TorchDevices.copy` try ``copy`` first for every copy (it returns False for the
    copies it does not make). The copy kernels install theirs when a process loads them
    (:mod:`weightsync.tools.codecs.digest_jit`: non-temporal stores, 1.3-1.5x torch's copy
    for large host pieces); this port cannot import them, as they build on it."""
    global _host_copy  # noqa: PLW0603 (one per process, like the installed ports)
    _host_copy = copy


def current() -> DevicePort:
    """The device port in use (the real one, unless a test installed its model with :func:`use`)."""
    return _installed[-1]


@contextlib.contextmanager
def use(port: DevicePort) -> Iterator[DevicePort]:
    """Install ``port`` for the block (tests: the CPU device model), then restore the previous one."""
    _installed.append(port)
    try:
        yield port
    finally:
        _installed.remove(port)


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def check_fits(port: DevicePort, nbytes: int, device: str | torch.device, *, what: str, fix: str) -> None:
    """Refuse ``nbytes`` of ``what`` on ``device`` unless they fit in its free memory.

    Raises:
        DeviceMemoryError: naming what needs the memory, the figure, what is free, and ``fix``
            (the setting to change).
    """
    free = port.free_bytes(device)
    if free is not None and nbytes > free:
        raise DeviceMemoryError(f"{what} needs {gib(nbytes)} on {device}, and only {gib(free)} of it is free: {fix}")


def allocate(port: DevicePort, nbytes: int, device: str | torch.device, *, what: str, fix: str,
             shareable: bool = False) -> torch.Tensor:
    """``port.empty`` after :func:`check_fits`: what a rank keeps on a device is refused at
    prepare time with its figure and ``fix``, never an out-of-memory error inside a sync."""
    check_fits(port, nbytes, device, what=what, fix=fix)
    return port.empty(nbytes, device, what=what, shareable=shareable)
