"""``engine_kwargs.weightsync`` of verl's checkpoint-engine config, without importing verl.

Its own fields (``device``, ``meta_name``) and every job setting of ``SyncConfig``'s wire form
(:mod:`weightsync.session.config`) but those the backend fills itself: the job's size comes from
verl's topology (a writer per actor worker, a reader per rollout worker) and each worker's node and address
from its Ray node. Defaults as ``SyncConfig``'s, except ``job="verl"`` and ``timeout=600``::

    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.transport=shm
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightsync.session.config import (
    UNKNOWN_READERS,
    SyncConfig,
    check_value,
    from_fields,
    job_config,
    job_wire,
    with_job_settings,
)

#: What ``engine_kwargs.weightsync`` errors are named after.
WHERE = "engine_kwargs.weightsync"


@dataclass(frozen=True, slots=True, kw_only=True)
@with_job_settings(exclude=("num_writers", "num_readers", "host", "transport_host"),
                   defaults={"job": "verl", "timeout": 600.0})
class VerlSyncSettings:
    """``engine_kwargs.weightsync``: the staging ``device`` (default ``cuda`` when available), the
    meta server's Ray actor name (``meta_name``; "" is :mod:`weightsync.integrations.ray`'s
    ``weightsync-meta``; not with ``meta_address``, which names the coordinator instead), and the
    job settings (module docstring)."""

    device: str = ""
    meta_name: str = ""

    def __post_init__(self) -> None:
        check_value(self.device, str, f"{WHERE}.device")
        check_value(self.meta_name, str, f"{WHERE}.meta_name")
        address = job_wire(self)["meta_address"]  # a job setting: with_job_settings declares it
        if self.meta_name and address:
            raise ValueError(f"{WHERE}.meta_name={self.meta_name!r} with meta_address={address!r}: the job uses the "
                             "coordinator at meta_address, not a Ray actor; give one of the two")
        self.sync_config(num_readers=UNKNOWN_READERS)  # every job setting checked now, named

    @classmethod
    def from_engine_kwargs(cls, kwargs: dict[str, Any]) -> VerlSyncSettings:
        """What verl passes the backend (``engine_kwargs.weightsync``), checked field by field."""
        return from_fields(cls, kwargs, WHERE)

    def sync_config(self, *, num_readers: int, num_writers: int = 1) -> SyncConfig:
        """The job's settings: verl's actor workers (every one a writer) and ``num_readers``."""
        return job_config(self, WHERE, num_writers=num_writers, num_readers=num_readers)

    @property
    def staging_device(self) -> str:
        import torch

        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")
