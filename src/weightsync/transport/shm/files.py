"""Files in ``/dev/shm`` named after the process that made them, and their clean-up.

Everything weightsync keeps in shared memory (shared-memory transport segments, the
trainer's zero-copy parameters, TensorStore arenas) is a file named
``weightsync-<pid>-<random>-<what>``, made by :func:`create_shared`, which keeps a shared
``flock`` on it for as long as its creator lives (until :func:`remove_shared`). That is what
makes a crash harmless: the next weightsync process on the machine removes the files that no
live process holds (:func:`sweep_stale_segments`), so memory is never pinned for longer than
that. The lock, not the pid in the name, says who is alive: processes in other pid namespaces
(containers) that share ``/dev/shm`` see other pids, or none, but the same locks.

    shared = share_tensors(dict(model.named_parameters()))   # zero-copy trainer weights
    path = os.path.join(SHM_DIR, segment_name("w0"))        # a transport segment
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Mapping

import torch

from weightsync.tools.processes import process_alive

SHM_DIR = "/dev/shm"
_PREFIX = "weightsync-"


def segment_name(what: str, *, token_bytes: int = 6) -> str:
    """A fresh file name owned by this process: ``weightsync-<pid>-<random>-<what>``."""
    return f"{_PREFIX}{os.getpid()}-{secrets.token_hex(token_bytes)}-{what}"


#: Seconds a new file is spared by the sweep: its creator takes the lock just after creating it.
_YOUNG_S = 1.0
#: path -> the descriptor holding this process's lock on a file it created
_HELD: dict[str, int] = {}


def create_shared(path: str, size: int) -> torch.Tensor:
    """A new file of ``size`` bytes at ``path``, mapped shared, and locked for as long as this
    process lives or until :func:`remove_shared` (see module docstring)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, size)
        mem = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    _HELD[path] = fd
    return mem


def remove_shared(path: str) -> None:
    """Unlink a file of :func:`create_shared` and drop its lock (mappings stay valid)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)


def sweep_stale_segments(*, min_age: float = _YOUNG_S) -> list[str]:
    """Unlink the files that no live process holds (their creator was killed, say).

    A file is kept while its creator holds its lock, while the pid in its name is a live process
    here (files of releases before the lock), and for ``min_age`` seconds after it was made.
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
        if pid == os.getpid() or process_alive(pid):
            continue
        if _unlink_unheld(os.path.join(SHM_DIR, name), min_age):
            removed.append(name)
    return removed


def _unlink_unheld(path: str, min_age: float) -> bool:
    """Unlink ``path`` if no process holds its lock and it is older than ``min_age`` seconds."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if time.time() - os.fstat(fd).st_ctime < min_age:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its creator (or a process it forked) is alive, whatever its pid here
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            return True
        return False
    finally:
        os.close(fd)


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
        mem = create_shared(self.path, max(cursor, 64))
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            out = mem[layout[name]: layout[name] + nbytes].view(t.dtype).view(t.shape)
            out.copy_(t.detach())
            self.tensors[name] = out

    def close(self) -> None:
        """Unlink the file. The tensors stay usable; readers can no longer attach to them."""
        if self.path is not None:
            remove_shared(self.path)
            self.path = None

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_tensors(tensors: Mapping[str, torch.Tensor]) -> SharedTensors:
    """Copies of ``tensors`` in one ``/dev/shm`` file (see :class:`SharedTensors`)."""
    return SharedTensors(tensors)

