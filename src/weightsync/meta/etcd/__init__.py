"""The job's coordinator on an etcd v3 cluster (``WEIGHTSYNC_META_ADDR=etcd://h1:2379,h2:2379,h3:2379``).

:class:`EtcdMetaClient` provides the :class:`~weightsync.ports.coordinator.MetaPort` that the
embedded meta server's :class:`~weightsync.meta.client.MetaClient` provides, over etcd's
HTTP/JSON gateway (``pip install weightsync[etcd]``: the ``etcd3gw`` client). Its modules, one
per concern: ``address`` (parsing, no etcd needed), ``kv`` (the connection: failover, auth,
watches), ``schema`` (what is stored where), ``base`` (transactions, waits, the store
instance), ``versions``, ``leases`` and ``client`` (the port's calls), ``cluster`` (a local
3-member cluster for tests and benchmarks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.meta.etcd.address import EtcdAddress, is_etcd_address

if TYPE_CHECKING:
    from weightsync.meta.etcd.client import EtcdMetaClient

__all__ = ["EtcdAddress", "EtcdMetaClient", "is_etcd_address"]

INSTALL = "pip install 'weightsync[etcd]' (the etcd3gw client)"


def __getattr__(name: str) -> Any:
    if name == "EtcdMetaClient":  # imported lazily: etcd3gw is an optional dependency
        try:
            from weightsync.meta.etcd.client import EtcdMetaClient
        except ModuleNotFoundError as exc:
            if exc.name != "etcd3gw":
                raise
            raise ModuleNotFoundError(f"an etcd:// meta address needs the etcd3gw package: {INSTALL}") from exc
        return EtcdMetaClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
