"""The meta server as a named, detached Ray actor that every rank finds by name.

    conn = meta_server()                 # the driver: get or create, then read its address
    client = conn.client(job="default")  # any actor: a MetaClient (token from the actor, not env)

The actor runs :class:`weightsync.meta.EmbeddedMetaServer` on its node's IP address with a
random token; :func:`meta_server` asks the actor for both, and the resulting
:class:`MetaConnection` travels to trainer and rollout actors as an argument of a Ray call,
so no secret is ever placed in an environment variable. It is detached (outlives the driver
that created it) and, by default, pinned to the head node, which outlives worker nodes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from weightsync.meta.client import AnyMetaClient

logger = logging.getLogger(__name__)

DEFAULT_NAME = "weightsync-meta"
NAMESPACE = "weightsync"
#: Ray's built-in resource of the head node: a tiny share of it pins an actor there.
HEAD_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True, slots=True)
class MetaConnection:
    """How to reach the coordinator: the meta server's HTTP address and token (plain strings), or an
    etcd cluster's ``etcd://host1:2379,...`` address (token ``""``; an etcd user's password comes
    from ``WEIGHTSYNC_ETCD_PASSWORD`` in the actors' environment): ``MetaConnection("etcd://...", "")``
    in place of :func:`meta_server` runs the job on etcd (docs/distributed.md says when to)."""

    address: str
    token: str

    def client(self, *, job: str = "default") -> AnyMetaClient:
        from weightsync.meta.client import open_meta

        return open_meta(self.address, job=job, token=self.token or None)


class MetaServerActor:
    """Hosts an embedded meta server in a Ray actor process (see module docstring)."""

    def __init__(self, state_dir: str | None = None) -> None:
        from weightsync.meta.embedded import EmbeddedMetaServer

        host = ray.util.get_node_ip_address()
        self.state_dir = state_dir
        self.server = EmbeddedMetaServer(host=host, state_dir=state_dir).start()

    def connection(self) -> dict[str, str]:
        return {"address": self.server.address, "token": self.server.token, "state_dir": self.state_dir or ""}

    def stop(self) -> None:
        self.server.stop()


def meta_server(*, name: str = DEFAULT_NAME, namespace: str = NAMESPACE, state_dir: str | None = None,
                on_head: bool = True, timeout: float = 60.0, **actor_options: Any) -> MetaConnection:
    """The job's meta server: the named actor if it exists, else a new detached one.

    Args:
        name / namespace: the actor's Ray name; every driver and actor using the same name
            shares one server.
        state_dir: the store's directory (SQLite), so a restarted server keeps the job's state.
        on_head: pin the actor to the head node (worker nodes may go away).
        timeout: bound on creating the actor and reading its address.
        actor_options: further ``.options(...)`` for the actor (resources, runtime_env).

    Raises:
        ray.exceptions.GetTimeoutError: the server did not answer within ``timeout``.
        ValueError: a server of that name runs already, with another ``state_dir`` (or none).
    """
    options: dict[str, Any] = {"name": name, "namespace": namespace, "lifetime": "detached",
                               "get_if_exists": True, "num_cpus": 0, **actor_options}
    if on_head:
        options.setdefault("resources", {})[HEAD_RESOURCE] = 0.001
    # Ray's stubs type a decorated class as its constructor; the handle is dynamic.
    actor_class: Any = ray.remote(MetaServerActor)
    actor = actor_class.options(**options).remote(state_dir)
    info: dict[str, str] = ray.get(actor.connection.remote(), timeout=timeout)
    check_state_dir(info.get("state_dir", ""), state_dir, f"{namespace}/{name}")
    logger.info("weightsync meta server %s/%s at %s", namespace, name, info["address"])
    return MetaConnection(info["address"], info["token"])


def check_state_dir(running: str, asked: str | None, actor: str) -> None:
    """Refuse a ``state_dir`` that the server found by name does not use: it was created
    earlier (by this or another driver) and would keep the job's state elsewhere, or nowhere.

    Raises:
        ValueError: naming the actor, the directory asked for and the one it uses.
    """
    if asked is None or os.path.abspath(asked) == (os.path.abspath(running) if running else ""):
        return
    uses = f"state_dir={running!r}" if running else "no state_dir (its state is lost when it stops)"
    raise ValueError(f"the meta server {actor} already runs with {uses}, not state_dir={asked!r}: stop it first "
                     "(stop_meta_server()) or pass the same state_dir, or another name")


def stop_meta_server(*, name: str = DEFAULT_NAME, namespace: str = NAMESPACE, timeout: float = 30.0) -> bool:
    """Stop and kill the named meta server actor; False when there is none."""
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    try:
        ray.get(actor.stop.remote(), timeout=timeout)
    finally:
        ray.kill(actor)
    return True
