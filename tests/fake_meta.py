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


class FakeChannel:
    """A :class:`weightsync.ports.channel.TransportChannel` for a transport tested without a job.

    Endpoints are kept in this object (one process); ``dead`` names the peers the test has
    declared dead, by rank, for the role other than this rank's (``{0: "its lease expired"}``
    on a writer's channel: reader 0 died). ``lease_seconds`` > 0 makes the transport behave as
    under leases (it waits for one to name a peer that broke a connection).
    """

    def __init__(self, role: str = "writer", rank: int = 0, *, lease_seconds: float = 0.0) -> None:
        self.role, self.rank, self.lease_seconds = role, rank, lease_seconds
        self.dead: dict[int, str] = {}
        #: dead writers whose restart took their seat in every epoch (writer_out_of_epoch: on its way)
        self.seated: set[int] = set()
        self.epoch = 0  # the job's epoch, as current_epoch() answers it
        self.incarnation = f"fake-{role}{rank}"
        self._endpoints: dict[tuple[str, int, str, int], object] = {}

    @property
    def who(self) -> str:
        return f"{self.role} {self.rank}"

    def publish_endpoint(self, epoch, endpoint) -> None:
        self._endpoints[(endpoint.transport, epoch, self.role, self.rank)] = endpoint

    def wait_endpoint(self, kind, epoch, role, rank, *, deadline):
        return self._endpoints.get((kind.transport, epoch, role, rank))

    def peer_publishes(self, epoch, role, rank, endpoint) -> None:
        """The test's stand-in for a peer publishing ``endpoint`` in ``epoch``."""
        self._endpoints[(endpoint.transport, epoch, role, rank)] = endpoint

    def dead_peers(self, role, ranks, *, max_age=0.25, known=None, departed=True) -> dict[int, str]:
        if role == self.role:
            return {}
        return {r: why for r, why in self.dead.items() if r in set(ranks)}

    def lease_holders(self, *, max_age=0.25) -> dict:
        return {}

    def writers_out_of_epoch(self, epoch, ranks) -> dict[int, str]:
        """A writer the test declared dead (on a reader's channel) is out of every epoch: the
        fake has no seats, so its restart never takes one the test did not give it."""
        if self.role == "writer":
            return {}
        return {r: f"it has no live process ({self.dead[r]}) and never joined epoch {epoch}"
                for r in ranks if r in self.dead and r not in self.seated}

    def writer_writes(self, rank) -> int | None:
        """No writer recorded a version (a test overrides it)."""
        return None

    def current_epoch(self) -> int:
        return self.epoch
