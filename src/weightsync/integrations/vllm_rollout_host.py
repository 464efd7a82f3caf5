"""A vLLM rollout engine in a process of its own, and the :class:`~weightsync.roles.rollouts.TurnEngine` that drives it.

An engine that dies takes its process with it; the rollouts it ran go on elsewhere. This module
runs one :class:`~weightsync.integrations.vllm_rollouts.VLLMTurnEngine` per process (``main``)
and gives the driver a handle on it (:class:`HostedTurnEngine`), over a socket pair with
length-prefixed msgpack frames (never pickle)::

    engine = HostedTurnEngine.spawn(model, name="e0", version=1, kv_directory=directory,
                                    llm={"dtype": "float32", "enforce_eager": True})
    engine.wait_ready(timeout=300)
    result = engine.generate(request, timeout=60)        # EngineGoneError once the process is gone
    engine.update(2, weights_path=checkpoint, mode="abort")
    engine.close()

The host reads every command waiting on its socket between two engine steps: an update sent
while turns run lands between two of their steps, as vLLM's ``pause_generation`` would place it.
Nothing of vLLM is imported in the driver's process.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import msgpack

from weightsync.roles.rollouts.engine import EngineGoneError, TurnRequest, TurnResult

_HEADER = struct.Struct(">I")


# -- frames --------------------------------------------------------------------------------------

def _send(sock: socket.socket, *messages: Mapping[str, Any]) -> None:
    """Send ``messages`` in one write (the host sees them together at its next step boundary)."""
    blob = b"".join(_HEADER.pack(len(b)) + b for b in (msgpack.packb(dict(m)) for m in messages))
    sock.sendall(blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> dict[str, Any] | None:
    """The next message; None at end of stream (the peer is gone)."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(header)[0])
    if body is None:
        return None
    msg = msgpack.unpackb(body, raw=False)
    if not isinstance(msg, dict):
        raise ValueError(f"malformed frame: {type(msg).__name__}")
    return msg


# -- the driver's side ---------------------------------------------------------------------------

class HostedTurnEngine:
    """A TurnEngine in its own process (see module docstring). Thread-safe."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket, *, name: str) -> None:
        self.process = process
        self._sock = sock
        self._name = name
        self._version: int | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._ready: Future[dict[str, Any]] = Future()
        self._pending: dict[int, Future[dict[str, Any]]] = {0: self._ready}  # 0: the engine's "ready"
        self._gone: str | None = None
        self._reader = threading.Thread(target=self._read, name=f"engine-{name}", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(cls, model: str, *, name: str, version: int | None, kv_directory: str, budget_bytes: int = 1 << 30,
              block_size: int = 32, llm: Mapping[str, Any] | None = None,
              env: Mapping[str, str] | None = None) -> HostedTurnEngine:
        """Start the engine's process (returns at once; :meth:`wait_ready` waits for the engine)."""
        ours, theirs = socket.socketpair()
        args = {"model": model, "name": name, "version": version, "kv_directory": kv_directory,
                "budget_bytes": budget_bytes, "block_size": block_size, "llm": dict(llm or {})}
        child_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
        process = subprocess.Popen([sys.executable, "-m", __name__, "--fd", str(theirs.fileno()),
                                    "--args", json.dumps(args)], pass_fds=(theirs.fileno(),), env=child_env)
        theirs.close()
        return cls(process, ours, name=name)

    @property
    def name(self) -> str:
        return self._name

    @property
    def weight_version(self) -> int | None:
        return self._version

    def wait_ready(self, timeout: float) -> None:
        """Wait until the engine has started (raises :class:`EngineGoneError` if it died starting)."""
        self._version = self._wait(self._ready, timeout, "start")["version"]

    def generate(self, request: TurnRequest, *, timeout: float) -> TurnResult:
        (future,) = self._call({"op": "generate", "request": request.to_wire()})
        reply = self._wait(future, timeout, f"turn {request.turn} of {request.rollout_id}")
        return TurnResult.from_wire(reply["result"])

    def submit(self, request: TurnRequest, *then: Mapping[str, Any]) -> tuple[Future[dict[str, Any]], ...]:
        """Send a turn and, in the same write, the commands ``then`` (``{"op": "update", ...}``): the
        host reads them together, so they act before the turn's first step. Returns the futures."""
        return self._call({"op": "generate", "request": request.to_wire()}, *then)

    def update(self, version: int, *, weights_path: str, mode: str = "abort", timeout: float = 300) -> int:
        """Load ``weights_path`` in place as ``version``; returns the turns it aborted."""
        reply = self._wait(self._call(self.update_command(version, weights_path=weights_path, mode=mode))[0],
                           timeout, "update")
        self._version = version
        return int(reply["aborted"])

    @staticmethod
    def update_command(version: int, *, weights_path: str, mode: str = "abort") -> dict[str, Any]:
        return {"op": "update", "version": version, "weights_path": weights_path, "mode": mode}

    def result(self, future: Future[dict[str, Any]], timeout: float) -> TurnResult:
        return TurnResult.from_wire(self._wait(future, timeout, "turn")["result"])

    def info(self, timeout: float = 60) -> dict[str, Any]:
        """The engine's version, vLLM's prefill counters (``prefill``: ``prompt_tokens_by_source``) and
        the KV connector's metrics (``kv``: :meth:`VLLMTurnEngine.kv_counters`)."""
        reply = self._wait(self._call({"op": "info"})[0], timeout, "info")
        self._version = reply["version"]
        return reply

    def reset_prefix_cache(self, timeout: float = 60) -> None:
        self._wait(self._call({"op": "reset_prefix_cache"})[0], timeout, "reset")

    def kill(self) -> None:
        """SIGKILL the engine's process (a crash, for tests and benchmarks)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def request_shutdown(self) -> None:
        """Ask the engine to exit (:meth:`close` waits for it): shut several down together."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                _send(self._sock, {"op": "shutdown", "id": 0})

    def close(self, timeout: float = 30) -> None:
        """Shut the engine down (killed if it does not exit within ``timeout``)."""
        if self.process.poll() is None:
            self.request_shutdown()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._sock.close()
        self._reader.join(timeout=5)

    # -- internals -------------------------------------------------------------------------------
    def _call(self, *messages: Mapping[str, Any]) -> tuple[Future[dict[str, Any]], ...]:
        with self._lock:
            if self._gone is not None:
                raise EngineGoneError(f"engine {self.name} is gone: {self._gone}")
            framed, futures = [], []
            for message in messages:
                msg_id = next(self._ids)
                futures.append(self._pending.setdefault(msg_id, Future()))
                framed.append({**message, "id": msg_id})
            try:
                _send(self._sock, *framed)
            except OSError as exc:
                raise EngineGoneError(f"engine {self.name} is gone: {exc}") from exc
        return tuple(futures)

    def _wait(self, future: Future[dict[str, Any]], timeout: float, what: str) -> dict[str, Any]:
        try:
            reply = future.result(timeout=timeout)
        except FutureTimeout:
            raise TimeoutError(f"engine {self.name}: no answer to {what} within {timeout} s") from None
        if "error" in reply:
            raise RuntimeError(f"engine {self.name} failed {what}: {reply['error']}")
        return reply

    def _read(self) -> None:
        reason = "its process exited"
        try:
            while (msg := _recv(self._sock)) is not None:
                with self._lock:
                    future = self._pending.pop(int(msg.get("id", -1)), None)
                if future is not None:
                    future.set_result(msg)
        except (OSError, ValueError) as exc:
            reason = f"its connection broke ({exc})"
        code = self.process.poll()
        with self._lock:
            self._gone = reason if code is None else f"{reason} (exit code {code})"
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            future.set_exception(EngineGoneError(f"engine {self.name} is gone: {self._gone}"))


# -- the engine's side ---------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--args", required=True, help="JSON: model, name, version, kv_directory, ...")
    ns = parser.parse_args(argv)
    sock = socket.socket(fileno=ns.fd)
    args = json.loads(ns.args)
    from weightsync.integrations.vllm_rollouts import VLLMTurnEngine, start_llm

    llm = start_llm(args["model"], kv_directory=args["kv_directory"], budget_bytes=args["budget_bytes"],
                    block_size=args["block_size"], **args["llm"])
    engine = VLLMTurnEngine(llm, name=args["name"], version=args["version"])
    _send(sock, {"id": 0, "version": engine.weight_version})
    turns: dict[str, int] = {}  # vLLM request id -> message id
    while True:
        for msg in _available(sock, block=not turns):
            if msg is None or msg["op"] == "shutdown":
                return 0
            _handle(engine, sock, msg, turns)
        if turns:
            for rid, result in engine.step().items():
                if (msg_id := turns.pop(rid, None)) is not None:
                    _send(sock, {"id": msg_id, "result": result.to_wire()})


def _available(sock: socket.socket, *, block: bool) -> list[dict[str, Any] | None]:
    """Every message waiting (at least one if ``block``); a trailing None means end of stream."""
    out: list[dict[str, Any] | None] = []
    while True:
        ready, _, _ = select.select([sock], [], [], None if block and not out else 0)
        if not ready:
            return out
        msg = _recv(sock)
        out.append(msg)
        if msg is None:
            return out


def _handle(engine: Any, sock: socket.socket, msg: dict[str, Any], turns: dict[str, int]) -> None:
    op, msg_id = msg["op"], msg["id"]
    try:
        if op == "generate":
            turns[engine.submit(TurnRequest.from_wire(msg["request"]))] = msg_id
            return
        if op == "update":
            aborted = engine.update(int(msg["version"]), weights_path=msg["weights_path"], mode=msg["mode"])
            reply: dict[str, Any] = {"aborted": len(aborted)}
        elif op == "info":
            reply = {"version": engine.weight_version, "prefill": engine.prefill_counters(),
                     "kv": engine.kv_counters()}
        elif op == "reset_prefix_cache":
            reply = {"ok": engine.llm.reset_prefix_cache()}
        else:
            reply = {"error": f"unknown op {op!r}"}
    except Exception as exc:  # the driver gets the error; the engine stays up
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    _send(sock, {"id": msg_id, **reply})


if __name__ == "__main__":
    sys.exit(main())
