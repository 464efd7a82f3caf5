"""Whole-or-nothing files for the rollout state: write aside, then rename over.

A reader sees a file's old content or its new content, never a part: :func:`write_atomic` writes
a hidden temporary file next to the target and renames it over the target once every byte is
out (``rename`` within a directory is atomic on POSIX file systems, ``/dev/shm`` and network
file systems alike). A process killed mid-write leaves only its temporary file, which no reader
looks at and :func:`sweep_temporaries` removes once its writer is gone.

    write_atomic(path, blob)               # readers of ``path`` see all of blob or the old file
    with locked(directory):                # one writer at a time per directory, across processes
        ...
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import socket
from collections.abc import Iterator

from weightsync.tools.processes import process_alive

#: temporaries start with this, then ``<host>-<pid>-``: readers skip dot-files
TMP_PREFIX = ".tmp-"
#: bytes per write call
CHUNK = 1 << 20


def _tmp_name(target: str) -> str:
    return f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}-{os.path.basename(target)}"


def write_atomic(path: str, data: bytes | memoryview, *, durable: bool = True) -> None:
    """Replace ``path`` by ``data``, whole or not at all, as every reader sees it.

    Args:
        durable: also flush the bytes to the device before the rename (a machine that loses
            power keeps the old or the new file); ``/dev/shm`` needs no flush.
    """
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, _tmp_name(path))
    view = memoryview(data).cast("B")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done: done + CHUNK])
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@contextlib.contextmanager
def locked(directory: str) -> Iterator[None]:
    """Hold the exclusive lock of ``directory`` (its ``.lock`` file) across processes of this host."""
    fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def sweep_temporaries(directory: str) -> list[str]:
    """Remove the temporaries that writers of this host left when they died mid-write."""
    removed = []
    host = socket.gethostname()
    for root, _, names in os.walk(directory):
        for name in names:
            if not name.startswith(f"{TMP_PREFIX}{host}-"):
                continue
            try:
                pid = int(name[len(TMP_PREFIX) + len(host) + 1:].split("-", 1)[0])
            except ValueError:
                continue
            if pid != os.getpid() and not process_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(root, name))
                    removed.append(os.path.join(root, name))
    return removed

