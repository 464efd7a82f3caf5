"""What transports use of the meta server (:class:`weightsync.ports.coordinator.TransportBoard`), backed by a directory.

Transport contract tests run transports without the meta server (which has its own
tests); this keeps them fast and isolates failures. Works across processes: writes are
atomic renames, waits poll with short sleeps and always end at their deadline. It holds no
leases, so every peer counts as alive (as it does on a server that knows no lease of it).
"""

from __future__ import annotations

import os
import time
import urllib.parse


class DirectoryMeta:
    job = "directory"

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, urllib.parse.quote(key, safe=""))

    def put_document(self, key: str, value: bytes) -> None:
        path = self._path(key)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, path)

    def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        deadline = time.monotonic() + wait
        while True:
            try:
                with open(self._path(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.005)

    def leases(self) -> list:
        return []

    def close(self) -> None:
        pass
