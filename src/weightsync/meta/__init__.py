"""The meta server and its client: the rendezvous of a weightsync job.

Writers (training ranks) and readers (inference ranks) register here with their endpoints and
layout descriptors, wait for each other, publish weight versions and report what they applied.
The server holds only metadata, never weights.

    from weightsync.meta import Participant, connect

    client, server = connect(job="grpo")          # WEIGHTSYNC_META_ADDR, else an embedded server
    client.register(Participant("reader", 0, "rollout", "node-3", {"tcp": "10.0.0.3:6000"}, layout))
    info = client.wait_version(after=-1, timeout=600)

Modules: ``records`` (data model and the compact roster), ``client``/``async_client``/``client_base``
(sync and async clients, one retry and poll loop), ``calls`` (the API as data), ``server`` (FastAPI
app), ``state`` (the service), ``events`` and ``reducer`` (the state as a pure reducer of typed
events), ``watch`` (long-polls), ``views`` (status), ``store``/``sqlite_store`` (durable state;
``legacy`` reads earlier releases' journals to migrate them), ``embedded`` (running it),
``config`` (environment).
Importing this package does not import the server stack (FastAPI, uvicorn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.meta.calls import ServerStateLostError
from weightsync.meta.client import AsyncMetaClient, MetaClient, connect
from weightsync.meta.config import MetaEnv
from weightsync.meta.records import ParticipantTable
from weightsync.ports.records import Participant, VersionInfo

if TYPE_CHECKING:
    from weightsync.meta.embedded import EmbeddedMetaServer

__all__ = ["AsyncMetaClient", "EmbeddedMetaServer", "MetaClient", "MetaEnv", "Participant", "ParticipantTable",
           "ServerStateLostError", "VersionInfo", "connect"]


def __getattr__(name: str) -> Any:
    if name == "EmbeddedMetaServer":
        from weightsync.meta.embedded import EmbeddedMetaServer

        return EmbeddedMetaServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
