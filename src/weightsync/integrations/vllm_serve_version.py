"""``vllm serve``'s version readback: a route that says which version the engine serves, and a
header on every generation response that says which version generated it.

vLLM 0.32 takes ASGI middleware by import path (``--middleware``, any number of times); this one
adds both, with no other change to the server::

    vllm serve MODEL --weight-transfer-config '{"backend": "weightsync"}' \\
        --middleware weightsync.integrations.vllm_serve_version.WeightSyncVersionMiddleware

    GET /weightsync/version  ->  {"version": 7, "since": 1764390000.1, "valid": true, "reason": "",
                                  "failed": null, "label": "7", "workers": [{...}, ...]}
    POST /v1/completions     ->  x-weightsync-version: 7

The route answers the engine's :class:`~weightsync.ports.engine.ServingVersion` (its workers'
:data:`~weightsync.engines.vllm_version.WORKER_VERSION` answers combined), vLLM's weight-version
label (``label``: what outputs are stamped with) and each worker's answer; 503 with the reason
when the engine runs no ``"weightsync"`` backend.

**The header** is vLLM's weight-version label (``"7"``, ``"invalid:7"`` after a failed update)
read when the request arrives and again when its response starts. A request never claims one
version falsely: if the label changed in between, the header is ``mixed`` and
``x-weightsync-versions`` lists both (``"7,8"``), so the trainer drops or reweights the sample.
A non-streaming response starts once generation ended, so the header covers the whole request;
a streaming response starts with its first chunk, so its header covers the request up to that
chunk only (read the span of each token from vLLM's ``weight_versions`` where an API returns
them, e.g. ``/inference/v1/generate``). The label is set by the driver after the workers applied
a version (vLLM's ``finish_weight_update``): pause generation around an update (vLLM's
``/pause``) for labels exact to the step.

Each tagged request costs two reads of the label from the engine core (a utility call each).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from weightsync.engines.vllm_version import WORKER_VERSION, engine_serving

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: the route answering which version the engine serves
ROUTE = "/weightsync/version"
#: the response header naming the version a request was generated under
HEADER = "x-weightsync-version"
#: with ``HEADER: mixed``: the labels at the request's arrival and at its response's start
CHANGED_HEADER = "x-weightsync-versions"
#: the generation routes whose responses are tagged
TAGGED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate"})


#: the tag of a request whose label could not be read
UNKNOWN = "unknown"


def version_headers(start: str, end: str) -> list[tuple[bytes, bytes]]:
    """The headers of a request whose label was ``start`` on arrival and ``end`` when its response
    started: one version, or ``mixed`` with both (module docstring); ``unknown`` if either is."""
    if UNKNOWN in (start, end):
        return [(HEADER.encode(), UNKNOWN.encode())]
    if start == end:
        return [(HEADER.encode(), start.encode())]
    return [(HEADER.encode(), b"mixed"), (CHANGED_HEADER.encode(), f"{start},{end}".encode())]


class WeightSyncVersionMiddleware:
    """Pure ASGI middleware for ``vllm serve`` (``--middleware``; see module docstring)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", ""), scope.get("path", "")
        if path == ROUTE and method == "GET":
            await self._answer(scope, send)
        elif path in TAGGED and method == "POST":
            await self._tagged(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _answer(self, scope: Scope, send: Send) -> None:
        engine = _engine_client(scope)
        try:
            workers = list(await engine.collective_rpc(WORKER_VERSION))
            serving = engine_serving(workers)
            body, status = {**serving.to_wire(), "label": await engine.get_weight_version(), "workers": workers}, 200
        except Exception as exc:  # no weightsync backend in the workers, or an engine that cannot answer
            body, status = {"error": f"the engine cannot say which weightsync version it serves: {exc}; start "
                                     "vllm serve with --weight-transfer-config '{\"backend\": \"weightsync\"}'"}, 503
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def _tagged(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = _engine_client(scope)
        start = await _label(engine)

        async def send_tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                end = await _label(engine)
                message = {**message, "headers": [*message.get("headers", ()), *version_headers(start, end)]}
            await send(message)

        await self.app(scope, receive, send_tagged)


async def _label(engine: Any) -> str:
    """vLLM's weight-version label; ``unknown`` when the engine cannot say (the request is served,
    and its tag claims no version)."""
    try:
        return str(await engine.get_weight_version())
    except Exception as exc:
        logger.warning("weightsync: reading vLLM's weight version for a response header failed: %s", exc)
        return UNKNOWN


def _engine_client(scope: Scope) -> Any:
    """vLLM's engine client of the app serving ``scope`` (vLLM 0.32: ``app.state.engine_client``)."""
    client = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    if client is None:
        raise RuntimeError("WeightSyncVersionMiddleware runs in vllm serve's app (--middleware), whose state holds "
                           "the engine client; this app has none")
    return client
