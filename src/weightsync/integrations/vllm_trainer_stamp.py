"""Stamping a vLLM engine invalid from the trainer side, after a failed version.

A worker of the ``"weightsync"`` backend whose weights a failed version touched is invalid
until the next full version. vLLM labels every output with the engine core's weight version,
which a worker in its own process (vLLM's CPU build, any executor but ``uni``) cannot set: the
driver must, right after the failed update, or the mixed weights generate under the old
version's name. The trainer side (``WeightSyncTrainerEngine.send_weights``) does it through its
control plane::

    stamp = invalid_stamper(client, timeout)   # at trainer_init, beside the prefix-cache reset
    ...update failed...
    stamp()    # asks the workers (WORKER_INVALID); if one is invalid, sets 'invalid:<version>'

``vllm serve``: ``POST /collective_rpc {"method": "weightsync_invalid"}`` answers each worker's
state, ``POST /update_weight_version {"new_version": "invalid:7"}`` sets the stamp (dev-mode
routes, like the weight-transfer routes themselves).

The same control plane reads back which version each engine serves (:func:`serving_reader`):
the workers' :data:`~weightsync.engines.vllm_version.WORKER_VERSION` answers, combined per engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightsync.engines.vllm import WORKER_INVALID, invalid_stamp_of
from weightsync.engines.vllm_version import WORKER_VERSION, engine_serving
from weightsync.ports.engine import ServingVersion


def invalid_stamper(client: Any, timeout: float) -> Callable[[], str | None] | None:
    """How to stamp the engine(s) behind ``client`` invalid after a failed version, if a worker is;
    None for a client that cannot (the meta server's status page still shows the reader invalid).

    A client with ``stamp_if_invalid()`` (ours, ``LLMClient``) uses it; vLLM's HTTP client (or
    anything with its ``base_url``) uses the server's ``/collective_rpc`` and
    ``/update_weight_version``; its Ray client (or anything with actor ``handles``) asks and stamps
    each actor, an engine of its own. The stamper returns the stamp set (None: all valid).
    """
    if callable(getattr(client, "stamp_if_invalid", None)):
        return client.stamp_if_invalid  # type: ignore[no-any-return]
    base_url = getattr(client, "base_url", None)
    if isinstance(base_url, str):
        def over_http() -> str | None:
            import httpx

            base = base_url.rstrip("/")
            answer = httpx.post(f"{base}/collective_rpc", json={"method": WORKER_INVALID}, timeout=timeout)
            answer.raise_for_status()
            stamp = invalid_stamp_of(answer.json().get("results") or [])
            if stamp is not None:
                httpx.post(f"{base}/update_weight_version", json={"new_version": stamp},
                           timeout=timeout).raise_for_status()
            return stamp
        return over_http
    handles = getattr(client, "handles", None)
    if handles is not None:
        def over_ray() -> str | None:
            import ray

            stamps = []
            for handle in handles:
                stamp = invalid_stamp_of(ray.get(handle.collective_rpc.remote(WORKER_INVALID), timeout=timeout))
                if stamp is not None:
                    ray.get(handle.update_weight_version.remote(stamp), timeout=timeout)
                    stamps.append(stamp)
            return stamps[0] if stamps else None
        return over_ray
    return None


def serving_reader(client: Any, timeout: float) -> Callable[[], list[ServingVersion]] | None:
    """How to ask the engine(s) behind ``client`` which version each serves (one
    :class:`ServingVersion` per engine); None for a client that cannot.

    A client with ``serving()`` (ours, ``LLMClient``) uses it; vLLM's HTTP client (anything with
    its ``base_url``) asks the server's dev-mode ``/collective_rpc``; its Ray client (anything with
    actor ``handles``) asks each actor, an engine of its own.
    """
    if callable(getattr(client, "serving", None)):
        return lambda: [client.serving()]
    base_url = getattr(client, "base_url", None)
    if isinstance(base_url, str):
        def over_http() -> list[ServingVersion]:
            import httpx

            answer = httpx.post(f"{base_url.rstrip('/')}/collective_rpc", json={"method": WORKER_VERSION},
                                timeout=timeout)
            answer.raise_for_status()
            return [engine_serving(answer.json().get("results") or [])]
        return over_http
    handles = getattr(client, "handles", None)
    if handles is not None:
        def over_ray() -> list[ServingVersion]:
            import ray

            return [engine_serving(ray.get(h.collective_rpc.remote(WORKER_VERSION), timeout=timeout))
                    for h in handles]
        return over_ray
    return None
