"""The job's coordinator on an etcd v3 cluster (``WEIGHTSYNC_META_ADDR=etcd://h1:2379,h2:2379,h3:2379``).

:class:`EtcdMetaClient` provides the :class:`~weightsync.ports.coordinator.MetaPort` that the
embedded meta server's :class:`~weightsync.meta.client.MetaClient` provides, over etcd's
HTTP/JSON gateway (``pip install weightsync[etcd]``: the ``etcd3gw`` client);
:class:`AsyncEtcdMetaClient` does what a joining rank does with asyncio (``aiohttp``, no etcd3gw).
Its modules, one per concern: ``address`` (parsing, no etcd needed), ``ops`` (the gateway's
requests, answers and errors as plain data), ``kv`` and ``gateway`` (the sync and the asyncio
connection: failover, auth, watches), ``schema`` (what is stored where), ``settings`` (the job and
cluster a client serves), ``steps`` (operations written once for both clients, sans I/O),
``barrier`` (registration and the barrier, as steps), ``base`` (the sync client's transactions
and waits), ``roster``, ``versions``, ``leases`` and ``client`` (the sync client's calls),
``async_client``, ``cluster`` (a local 3-member cluster for tests and benchmarks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.meta.etcd.address import EtcdAddress, is_etcd_address

if TYPE_CHECKING:
    from weightsync.meta.etcd.async_client import AsyncEtcdMetaClient
    from weightsync.meta.etcd.client import EtcdMetaClient

__all__ = ["AsyncEtcdMetaClient", "EtcdAddress", "EtcdMetaClient", "is_etcd_address"]

INSTALL = "pip install 'weightsync[etcd]' (the etcd3gw client)"


def __getattr__(name: str) -> Any:
    if name == "AsyncEtcdMetaClient":  # aiohttp only: no etcd3gw needed
        from weightsync.meta.etcd.async_client import AsyncEtcdMetaClient

        return AsyncEtcdMetaClient
    if name == "EtcdMetaClient":  # imported lazily: etcd3gw is an optional dependency
        try:
            from weightsync.meta.etcd.client import EtcdMetaClient
        except ModuleNotFoundError as exc:
            if exc.name != "etcd3gw":
                raise
            raise ModuleNotFoundError(f"an etcd:// meta address needs the etcd3gw package: {INSTALL}") from exc
        return EtcdMetaClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
