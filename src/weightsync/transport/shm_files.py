"""Files in ``/dev/shm`` named after the process that made them, and their clean-up.

Everything weightsync keeps in shared memory (shared-memory transport segments, the
trainer's zero-copy parameters, TensorStore arenas) is a file named
``weightsync-<pid>-<random>-<what>``. The pid is what makes a crash harmless: the next
weightsync process on the machine removes the files of processes that no longer exist
(:func:`sweep_stale_segments`), so memory is never pinned for longer than that.

    shared = share_tensors(dict(model.named_parameters()))   # zero-copy trainer weights
    path = os.path.join(SHM_DIR, segment_name("w0"))        # a transport segment
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping

import torch

SHM_DIR = "/dev/shm"
_PREFIX = "weightsync-"


def segment_name(what: str, *, token_bytes: int = 6) -> str:
    """A fresh file name owned by this process: ``weightsync-<pid>-<random>-<what>``."""
    return f"{_PREFIX}{os.getpid()}-{secrets.token_hex(token_bytes)}-{what}"


def sweep_stale_segments() -> list[str]:
    """Unlink segments whose writer process no longer exists (it was killed, say).

    Segment names carry the creator's pid, so a crash never leaves memory pinned in
    /dev/shm for longer than the next writer start on the machine.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        try:
            pid = int(name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


class SharedTensors:
    """Tensors that live in one ``/dev/shm`` file, for the shared-memory transport's zero-copy mode.

    A co-located trainer that keeps its parameters here lets readers copy straight from them
    (one copy per byte instead of two)::

        shared = share_tensors(dict(model.named_parameters()))
        for name, param in model.named_parameters():
            param.data = shared.tensors[name]
        ...  # WeightWriter(...) over transport="shm", syncs
        shared.close()  # after the last sync: unlinks the file (the trainer's tensors stay valid)

    The file is named after this process, so if it dies the next writer on the machine
    removes it (:func:`sweep_stale_segments`).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        layout: dict[str, int] = {}
        cursor = 0
        for name, t in tensors.items():
            if t.device.type != "cpu":
                raise ValueError(f"share_tensors: {name} is on {t.device}; only CPU tensors can live in /dev/shm")
            cursor = -(-cursor // 64) * 64  # 64-byte aligned, like an allocator would
            layout[name] = cursor
            cursor += t.numel() * t.element_size()
        self.path: str | None = os.path.join(SHM_DIR, segment_name("params"))
        mem = torch.from_file(self.path, shared=True, size=max(cursor, 64), dtype=torch.uint8)
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            out = mem[layout[name]: layout[name] + nbytes].view(t.dtype).view(t.shape)
            out.copy_(t.detach())
            self.tensors[name] = out

    def close(self) -> None:
        """Unlink the file. The tensors stay usable; readers can no longer attach to them."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_tensors(tensors: Mapping[str, torch.Tensor]) -> SharedTensors:
    """Copies of ``tensors`` in one ``/dev/shm`` file (see :class:`SharedTensors`)."""
    return SharedTensors(tensors)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
