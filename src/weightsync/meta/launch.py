"""Finding the job's meta server under a launcher (torchrun, accelerate), with no configuration.

A job started by torchrun or accelerate already has a coordinator: torch's TCPStore (torchrun's
agent store, or the store of the default process group). Without ``WEIGHTSYNC_META_ADDR``, rank
0 starts an embedded meta server on a port the OS picks and puts its address and a fresh token
in that store; every other rank waits for them there. A multi-process job with neither a meta
address nor a store fails at once, naming the variable to set: its ranks would otherwise each
start a server of their own and wait for each other until the timeout::

    launch = LaunchEnv.from_env()                      # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    address, token, server = shared_meta_server("grpo", launch, timeout=60)   # rank 0: server
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.meta.config import ENV_ADDR, ENV_TOKEN

if TYPE_CHECKING:
    from weightsync.meta.embedded import EmbeddedMetaServer

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchEnv:
    """What the launcher says about this process, read once from the environment.

    Attributes:
        rank / world_size: this process's rank and the job's size (torch.distributed's once it is
            initialised, else ``RANK`` / ``WORLD_SIZE``; 0 and 1 when neither is set).
        master_addr / master_port: ``MASTER_ADDR`` / ``MASTER_PORT`` (rank 0's host and its store).
        agent_store: torchrun's agent runs the store at MASTER_ADDR:MASTER_PORT
            (``TORCHELASTIC_USE_AGENT_STORE``), so a rank can join it before any process group exists.
    """

    rank: int = 0
    world_size: int = 1
    master_addr: str = ""
    master_port: int = 0
    agent_store: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if environ is None else environ
        rank, world = int(env.get("RANK", "0") or 0), int(env.get("WORLD_SIZE", "1") or 1)
        group = _default_group()
        if group is not None:
            rank, world = group
        return cls(rank=rank, world_size=world, master_addr=env.get("MASTER_ADDR", ""),
                   master_port=int(env.get("MASTER_PORT", "0") or 0),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")

    @property
    def launched(self) -> bool:
        """Several processes of one job: they must share one meta server."""
        return self.world_size > 1


def _default_group() -> tuple[int, int] | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def launcher_store(launch: LaunchEnv, timeout: float) -> Any:
    """The job's TCPStore: the default process group's, else torchrun's agent store; None if neither."""
    import torch.distributed as dist

    if _default_group() is not None:
        return dist.distributed_c10d._get_default_store()
    if launch.agent_store and launch.master_addr and launch.master_port:
        return dist.TCPStore(launch.master_addr, launch.master_port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout))
    return None


def no_store_error(launch: LaunchEnv) -> ValueError:
    return ValueError(
        f"this process is rank {launch.rank} of a job of {launch.world_size} processes (WORLD_SIZE) and no meta "
        f"server is set: set {ENV_ADDR} (and {ENV_TOKEN}) to a `weightsync meta-server` every rank reaches, or "
        "launch with torchrun, or initialise torch.distributed first: rank 0 then starts one and the others find "
        "it through torch's store")


def shared_meta_server(job: str, launch: LaunchEnv, *, timeout: float,
                       host: str | None = None) -> tuple[str, str, EmbeddedMetaServer | None]:
    """(address, token, the server if this rank started it) of the job's meta server, found
    through the launcher's store (module docstring).

    Rank 0 listens on ``host`` (default: loopback when MASTER_ADDR is a loopback address, else every
    interface) on a port the OS picks, and the others reach it at MASTER_ADDR.

    Raises:
        ValueError: a multi-process job without a store (names ``WEIGHTSYNC_META_ADDR``).
        TimeoutError: rank 0 did not publish its server within ``timeout``.
    """
    store = launcher_store(launch, timeout)
    if store is None:
        raise no_store_error(launch)
    key = f"weightsync/meta-server/{job}"
    if launch.rank == 0:
        from weightsync.meta.embedded import EmbeddedMetaServer

        loopback = not launch.master_addr or launch.master_addr in LOOPBACK
        server = EmbeddedMetaServer(host=host or ("127.0.0.1" if loopback else "0.0.0.0")).start()
        port = server.address.rsplit(":", 1)[1]
        address = server.address if loopback else f"http://{launch.master_addr}:{port}"
        store.set(key, json.dumps({"address": address, "token": server.token}))
        return address, server.token or "", server
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except Exception as exc:  # torch raises DistStoreError (a RuntimeError) at the timeout
        raise TimeoutError(f"rank {launch.rank}: rank 0 did not publish job {job!r}'s meta server in torch's store "
                           f"at {launch.master_addr}:{launch.master_port} within {timeout:g} s: {exc}") from exc
    shared = json.loads(store.get(key))
    return str(shared["address"]), str(shared["token"]), None
