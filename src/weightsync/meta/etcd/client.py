"""The job's coordinator on an etcd v3 cluster: :class:`EtcdMetaClient`, the job channel's
:class:`~weightsync.ports.coordinator.MetaPort` over etcd.

The same calls, answers and errors as :class:`~weightsync.meta.client.MetaClient` (the embedded
meta server's client), so the job channel runs unchanged on either. What is stored where:
:mod:`weightsync.meta.etcd.schema`; versions and reader reports: :mod:`weightsync.meta.etcd.versions`;
leases: :mod:`weightsync.meta.etcd.leases`; the fleet coordinator (the record that
``decide`` keeps, docs/fleet.md): :mod:`weightsync.meta.etcd.fleet`; the connection (failover, auth, watches):
:mod:`weightsync.meta.etcd.kv`. Operations that the asyncio client
(:class:`~weightsync.meta.etcd.async_client.AsyncEtcdMetaClient`) has too are written once, as
steps (:mod:`weightsync.meta.etcd.steps`, :mod:`weightsync.meta.etcd.barrier`).

    meta = EtcdMetaClient("etcd://n1:2379,n2:2379,n3:2379", job="grpo")
    meta.register(Participant("writer", 0, "train", "n1", {"tcp": "n1:29500"}, layout))
    everyone = meta.wait_registered(writers=8, readers=2, timeout=300)
    meta.publish_version(step, fingerprint, writer_rank=0, num_writers=8)

Registration and the barrier: :mod:`weightsync.meta.etcd.roster`.
"""

from __future__ import annotations

from typing import Any

from weightsync.meta import calls, views
from weightsync.meta.etcd import ops, steps
from weightsync.meta.etcd.fleet import Fleet
from weightsync.meta.etcd.leases import Leases
from weightsync.meta.etcd.roster import Roster
from weightsync.meta.etcd.schema import load_job
from weightsync.meta.etcd.versions import Versions

__all__ = ["EtcdMetaClient"]


class EtcdMetaClient(Roster, Versions, Leases, Fleet):
    """A job's coordinator on etcd (see module docstring). Thread-safe; close() or use as a context manager.

    Args:
        address: ``etcd://host1:2379,host2:2379,...`` (see :mod:`weightsync.meta.etcd.address`).
        job: the job's namespace.
        timeout: how long a call keeps failing over between members before it raises.
        password: the etcd user's password (``WEIGHTSYNC_ETCD_PASSWORD``), if the address names a user.
        clock: the time of the fleet coordinator's decisions (a test passes a ``ManualClock``).
    """

    def __enter__(self) -> EtcdMetaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- documents and counters ---------------------------------------------------------------------
    def put_document(self, key: str, value: bytes) -> None:
        """Store a job-level document under ``key``; overwrites."""
        self.run(steps.put_document(self.keys, key, value))

    def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        """The document ``key``; with ``wait > 0``, watched for until it exists. None if absent."""
        return self.run(steps.get_document(self.keys, key, wait))

    def counter(self, name: str, *, at_least: int = 0, wait: float = 0.0) -> int:
        """The job's counter ``name`` (0 until set); with ``wait``, watched until it reaches ``at_least``."""
        calls.counter(self.job, name, at_least=at_least)  # checks the name and the bound
        return self.wait(self.keys.counter(name), lambda: self._counter(name)[::2], lambda v: v >= at_least, wait)

    def _counter(self, name: str) -> tuple[int, int, int]:
        """(value, its key's mod revision, the read's revision)."""
        rows, revision = self.rows(ops.read(self.keys.counter(name)))
        return (int(rows[0].value), rows[0].mod_revision, revision) if rows else (0, 0, revision)

    def compare_and_set(self, name: str, *, expected: int, value: int) -> tuple[bool, int]:
        """Set counter ``name`` to ``value`` if it holds ``expected``, atomically (one transaction).
        Returns (whether it was set, the value it holds now)."""
        calls.compare_and_set(self.job, name, expected=expected, value=value)  # checks the arguments
        key = self.keys.counter(name)
        while True:
            held, mod, _ = self._counter(name)
            if held != expected:
                return False, held
            ok, _ = self.txn([ops.unchanged(key, mod)], [ops.put(key, str(value).encode())],
                             what=f"set counter {name}")
            if ok:
                return True, value

    # --- jobs ---------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """This job's status (participants, versions, each reader's lag and last sync), as JSON data."""
        rows, _ = self.rows(*(ops.read(self.keys.root + kind, prefix=True)
                              for kind in ("part/writer/", "part/reader/", "blob/", "doc/", "ctr/", "ver/", "reader/")))
        job = load_job(self.keys, rows)
        job.roster_revision = sum(len(r) for r in job.rows.values())
        return views.job_status(job)

    def delete_job(self) -> bool:
        """Forget this job (participants, documents, versions, leases). True if it existed."""
        _, answers = self.txn([], [ops.delete(self.keys.root, prefix=True)], what=f"delete job {self.job}")
        return int(answers[0].get("response_delete_range", {}).get("deleted", 0)) > 0 if answers else False
