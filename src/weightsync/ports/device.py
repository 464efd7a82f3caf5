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
    handle = dev.share(buf)                                  # a CUDA IPC handle (msgpack-able)

What the real port relies on (torch 2.13): ``Tensor.copy_(non_blocking=True)`` is ordered on the
current stream and asynchronous for device memory and pinned host memory;
``torch.cuda.Event(blocking=True).synchronize()`` blocks the CPU without spinning;
``UntypedStorage._share_cuda_()`` / ``_new_shared_cuda(*fields)`` are what
``torch.multiprocessing.reductions`` uses for CUDA tensors (the first field is the device index
the handle is opened on, under a ``CUDAGuard``; the caching allocator opens it with
``cudaIpcOpenMemHandle(..., cudaIpcMemLazyEnablePeerAccess)``, which maps the memory into the
*current* device's context, reaching another GPU by peer access). CUDA refuses to open a handle
in the process that exported it: torch's own reductions hand such a tensor over from their
cache instead, and so must weightsync (:mod:`weightsync.transport.shm.snapshot`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceMemoryError", "DevicePort", "IpcHandle", "TorchDevices", "allocate", "check_fits", "current", "gib",
           "gpu_identity", "parse_device", "use"]


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

    def empty(self, nbytes: int, device: str | torch.device, *, what: str, pinned: bool = False) -> torch.Tensor:
        """``nbytes`` uninitialised bytes (uint8) on ``device``; ``pinned``: page-locked host memory."""
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

    def wait(self, event: Any) -> None:
        """Block the CPU until ``event`` completed."""
        ...

    def synchronize(self, device: str | torch.device) -> None:
        """Block the CPU until everything queued on ``device`` completed."""
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
        handle only)."""
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

    def empty(self, nbytes: int, device: str | torch.device, *, what: str, pinned: bool = False) -> torch.Tensor:
        import torch

        d = torch.device(device)
        return torch.empty(nbytes, dtype=torch.uint8, device=d,
                           pin_memory=pinned and d.type == "cpu" and torch.cuda.is_available())

    def free_bytes(self, device: str | torch.device) -> int | None:
        import torch

        d = torch.device(device)
        if d.type != "cuda":
            return None
        # what the driver has free, plus what torch's caching allocator holds unused (staging
        # freed and laid out again reuses it without the driver seeing it free)
        return int(torch.cuda.mem_get_info(d)[0]) + torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d)

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
        dst.copy_(src, non_blocking=True)

    def record(self, device: str | torch.device) -> Any:
        import torch

        d = torch.device(device)
        if d.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(d))
        return event

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

    def scope(self, device: str | torch.device) -> contextlib.AbstractContextManager[Any]:
        import torch

        d = torch.device(device)
        return torch.cuda.device(d) if d.type == "cuda" else contextlib.nullcontext()


_installed: list[DevicePort] = [TorchDevices()]  # the last one is in use


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


def allocate(port: DevicePort, nbytes: int, device: str | torch.device, *, what: str, fix: str) -> torch.Tensor:
    """``port.empty`` after :func:`check_fits`: what a rank keeps on a device is refused at
    prepare time with its figure and ``fix``, never an out-of-memory error inside a sync."""
    check_fits(port, nbytes, device, what=what, fix=fix)
    return port.empty(nbytes, device, what=what)
