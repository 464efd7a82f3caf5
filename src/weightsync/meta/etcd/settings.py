"""Which job on which etcd cluster a client serves, checked once: what the sync client
(:class:`~weightsync.meta.etcd.client.EtcdMetaClient`) and the asyncio one
(:class:`~weightsync.meta.etcd.async_client.AsyncEtcdMetaClient`) share before any connection,
and the pinned store instance both compare in every change.
"""

from __future__ import annotations

from typing import Any

from weightsync.meta.etcd import ops
from weightsync.meta.etcd.address import EtcdAddress
from weightsync.meta.etcd.ops import TxnAnswer
from weightsync.meta.etcd.schema import JobKeys
from weightsync.meta.etcd.steps import Txn
from weightsync.meta.records import check_job


class EtcdSettings:
    """Where a client's job lives on which cluster, checked: what the sync and the asyncio client share."""

    def __init__(self, address: str | EtcdAddress, *, job: str = "default", timeout: float = 30.0,
                 password: str | None = None) -> None:
        etcd = address if isinstance(address, EtcdAddress) else EtcdAddress.parse(address)
        self.etcd = etcd.with_password(password)
        self.address = str(self.etcd)
        self.job = check_job(job)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.keys = JobKeys(self.etcd.prefix, self.job)
        #: the store instance this client pinned (None: any); see either client's ``pin_instance``
        self.instance: str | None = None

    def pinned(self, step: Txn) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | None]:
        """``step``'s compare and failure, also comparing the pinned instance, and that instance.

        The instance is read once here and handed to :meth:`unpinned` with the answer: a client
        shared by threads (a reader's in-flight loop beside its caller) may pin while another
        thread's transaction is in flight, and that answer must be read as it was asked.
        """
        instance = self.instance
        compare, failure = ops.pinned(step.compare, step.failure, self.keys.instance, instance)
        return compare, failure, instance

    def unpinned(self, answer: TxnAnswer, instance: str | None) -> TxnAnswer:
        """The answer of a :meth:`pinned` transaction asked with ``instance``;
        ServerStateLostError if the store was replaced."""
        return ops.check_pinned(answer, instance, address=self.address, job=self.job)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r}, job={self.job!r})"
