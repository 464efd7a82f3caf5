"""One NIXL agent (UCX backend) for one rank: the only module that calls into NIXL.

    agent = NixlAgent("weightsync-reader1-g0-...", who="reader 1", loopback=True)
    agent.register([(addr, nbytes), ...], "DRAM")          # once per plan, before publishing
    doc = agent.metadata()                                  # peers pass it to connect()
    peer = agent.connect(writer_doc, label="writer 0")
    xfer = agent.prepare("READ", peer, Descriptors.of(local, remote, lengths), "DRAM", what="slot 0")
    agent.run(xfer, deadline)                               # every version: repost the same handle
    agent.close()

The settings come from measurements on nixl-cu12 1.5.1 with UCX 1.23 on a 2-core host:

* NIXL's progress thread is off: it never sleeps and takes half a core, which made
  transfers 2-5x slower on a 2-core host. Instead a light poller thread calls
  ``get_new_notifs()`` every millisecond. That also progresses the UCX worker, which a
  *peer's* one-sided operation may need: without it the first READ of a connection
  stalled until this process next called into NIXL (seconds).
* UCX error handling mode ``peer``: a dead peer surfaces as ``nixlRemoteDisconnectError``
  on the next operation, instead of a hang.
* ``NET_DEVICES=lo`` when every rank is on this host, so UCX binds nothing else.

All calls into the agent hold one lock (the poller and the caller share the agent); a
cma transfer copies inside ``transfer()`` with the GIL released.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from weightsync.clock.deadline import Deadline
from weightsync.transport.base import TransportError

logger = logging.getLogger(__name__)

#: Sleep between two polls of a transfer in flight (cma copies inside ``transfer()``, so
#: this mostly matters on RDMA/tcp lanes; never busy-spin on a small host).
_XFER_POLL_S = 5e-5


def load_nixl() -> ModuleType:
    """The NIXL Python package: ``nixl_cu12`` (the wheel we pin) or ``nixl``."""
    try:
        return importlib.import_module("nixl_cu12")
    except ImportError:
        return importlib.import_module("nixl")


def _nixl_errors(nixl: ModuleType) -> tuple[type[BaseException], ...]:
    bindings = getattr(nixl, "_bindings", None) or importlib.import_module(f"{nixl.__name__}._bindings")
    return tuple(obj for name, obj in vars(bindings).items()
                 if name.startswith("nixl") and isinstance(obj, type) and issubclass(obj, Exception))


class Descriptors(NamedTuple):
    """Matching local and remote ranges (addresses and lengths in bytes) of one transfer."""

    local: np.ndarray
    remote: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, local: Sequence[int] | np.ndarray, remote: Sequence[int] | np.ndarray,
           lengths: Sequence[int] | np.ndarray, *, local_starts: Sequence[int] = (),
           remote_starts: Sequence[int] = ()) -> Descriptors:
        """Merge consecutive ranges that continue each other on both sides (each costs ~5 us).

        ``local_starts`` / ``remote_starts``: where a memory registration begins on each side. A
        range that begins there is never joined to the one before: the CUDA caching allocator
        places tensors back to back, and NIXL refuses a descriptor that is not inside one
        registration (``nixlSecDescList::getCoveringIndex``).
        """
        loc, rem, n = (np.asarray(x, dtype=np.int64) for x in (local, remote, lengths))
        if len(n) <= 1:
            return cls(loc, rem, n)
        joins = (loc[:-1] + n[:-1] == loc[1:]) & (rem[:-1] + n[:-1] == rem[1:])
        joins &= ~np.isin(loc[1:], np.asarray(local_starts, dtype=np.int64))
        joins &= ~np.isin(rem[1:], np.asarray(remote_starts, dtype=np.int64))
        starts = np.flatnonzero(np.concatenate([[True], ~joins]))
        return cls(loc[starts], rem[starts], np.add.reduceat(n, starts))


@dataclass(eq=False)
class Xfer:
    """A prepared transfer: one NIXL request handle, reposted every version."""

    op: str
    peer: str
    label: str
    what: str
    nbytes: int
    descriptors: int
    handle: Any
    dlists: tuple[Any, ...]

    def describe(self) -> str:
        direction = "from" if self.op == "READ" else "to"
        size = f"{self.nbytes} bytes" if self.nbytes < 1 << 20 else f"{self.nbytes / 2**20:.1f} MiB"
        return f"{self.op} of {self.what} ({size} in {self.descriptors} descriptors) {direction} {self.label}"


class NixlAgent:
    """A NIXL agent with the UCX backend, a notification poller and ordered teardown."""

    def __init__(self, name: str, *, who: str, loopback: bool, poll_interval: float = 1e-3) -> None:
        nixl = load_nixl()
        self.name = name
        self.who = who
        self._errors = _nixl_errors(nixl)
        self._cond = threading.Condition()
        self._notifs: dict[str, list[bytes]] = {}
        self._labels: dict[str, str] = {}
        self._regs: list[Any] = []
        self._xfers: list[Xfer] = []
        self._stop = threading.Event()
        config = nixl.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[],
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        params = {"ucx_error_handling_mode": "peer"}
        if loopback:
            params["engine_config"] = "NET_DEVICES=lo"
        self._agent: Any = nixl.nixl_agent(name, config)
        try:
            self._agent.create_backend("UCX", params)
        except self._errors as exc:
            self._agent = None
            raise TransportError(f"{who}: NIXL could not create its UCX backend: {exc}") from exc
        self._poll_interval = poll_interval
        self._poller = threading.Thread(target=self._poll, name=f"nixl-poll-{name}", daemon=True)
        self._poller.start()

    # -- setup (once per plan) ------------------------------------------------------------
    def register(self, regions: Sequence[tuple[int, int]], mem: str, device: int = 0) -> None:
        """Register memory ranges (address, bytes) of one memory type ("DRAM" or "VRAM")."""
        if not regions:
            return
        with self._cond:
            self._regs.append(self._agent.register_memory([(a, n, device, "") for a, n in regions], mem))

    def metadata(self) -> bytes:
        with self._cond:
            return bytes(self._agent.get_agent_metadata())

    def connect(self, metadata: bytes, *, label: str, deadline: Deadline | None = None,
                attempts: int = 4) -> str:
        """Load a peer's metadata and open the connection now; returns the peer's agent name.

        Loading connects UCX to the peer's listener, which a loaded host refuses now and then
        ("connect(...) failed", then "loadRemoteMD: error loading connection info"): the load is
        tried ``attempts`` times, backing off, while ``deadline`` allows."""
        for attempt in range(1, attempts + 1):
            try:
                with self._cond:
                    raw = self._agent.add_remote_agent(metadata)
                break
            except self._errors as exc:
                pause = 0.1 * 2 ** (attempt - 1)
                out_of_time = deadline is not None and deadline.remaining(0.0) <= pause
                if attempt == attempts or out_of_time:
                    raise TransportError(f"{self.who}: cannot load the NIXL metadata of {label} "
                                         f"(tried {attempt} time(s)): {exc}") from exc
                logger.warning("%s: loading the NIXL metadata of %s failed (%s); trying again in %.1f s",
                               self.who, label, exc, pause)
                time.sleep(pause)
        peer = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._labels[peer] = label
        try:
            with self._cond:
                self._agent.make_connection(peer)
        except self._errors as exc:
            # The peer may have died since it published; its first transfer reports that,
            # with the transfer's context, where the caller handles failures anyway.
            logger.warning("%s: cannot connect to %s yet: %s", self.who, label, exc)
        return peer

    def prepare(self, op: str, peer: str, descs: Descriptors, mem: str, *, what: str, local_device: int = 0,
                remote_device: int = 0) -> Xfer:
        """A READ (remote -> local) or WRITE (local -> remote) of matching descriptor lists.

        NIXL finds the registration behind each descriptor by (address, device id), so the
        remote list carries the *peer's* device id (see :func:`weightsync.tools.devices.nixl_device_id`).
        """
        n = len(descs.lengths)
        local_d = np.stack([descs.local, descs.lengths, np.full(n, local_device)], axis=1).astype(np.uint64)
        remote_d = np.stack([descs.remote, descs.lengths, np.full(n, remote_device)], axis=1).astype(np.uint64)
        index = np.arange(n, dtype=np.int32)
        label = self._labels[peer]
        try:
            with self._cond:
                lh = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_d, mem)
                rh = self._agent.prep_xfer_dlist(peer, remote_d, mem)
                handle = self._agent.make_prepped_xfer(op, lh, index, rh, index)
        except self._errors as exc:
            raise TransportError(f"{self.who}: cannot prepare a {op} of {what} with {label}: {exc}") from exc
        xfer = Xfer(op, peer, label, what, int(descs.lengths.sum()), n, handle, (lh, rh))
        self._xfers.append(xfer)
        return xfer

    # -- every version --------------------------------------------------------------------
    def run(self, xfer: Xfer, deadline: Deadline, notif: bytes = b"", *,
            alive: Callable[[str], None] | None = None) -> None:
        """Post a prepared transfer and wait until it is done (the notif goes out then).

        ``alive(what)`` is called while it waits and raises if the peer is dead (a stopped
        process never fails a transfer: it only stops progressing it).

        Raises:
            TransportError: the peer died or disconnected, or the deadline passed.
        """
        try:
            with self._cond:
                state = self._agent.transfer(xfer.handle, notif)
            while state == "PROC":
                if deadline.expired:
                    raise TransportError(f"{self.who}: {xfer.describe()} did not complete in time "
                                         f"(is {xfer.label} alive and progressing?)")
                if alive is not None:
                    alive(xfer.describe())
                time.sleep(_XFER_POLL_S)
                with self._cond:
                    state = self._agent.check_xfer_state(xfer.handle)
        except self._errors as exc:
            raise TransportError(f"{self.who}: {xfer.describe()} failed, {xfer.label} died or "
                                 f"disconnected: {type(exc).__name__}: {exc}") from exc
        if state != "DONE":
            raise TransportError(f"{self.who}: {xfer.describe()} ended in state {state}")

    def run_once(self, op: str, peer: str, descs: Descriptors, mem: str, deadline: Deadline, *, what: str,
                 alive: Callable[[str], None] | None = None, notif: bytes = b"") -> int:
        """Prepare, run and release a transfer whose ranges differ every time (a version's
        changes); returns its bytes. Raises as :meth:`run`."""
        xfer = self.prepare(op, peer, descs, mem, what=what)
        try:
            self.run(xfer, deadline, notif, alive=alive)
        finally:
            with self._cond:
                self._xfers.remove(xfer)
                for h in (xfer.handle, *xfer.dlists):
                    with contextlib.suppress(*self._errors):
                        h.release()
        return xfer.nbytes

    def take_notifs(self, timeout: float, *, progress: bool = False) -> dict[str, list[bytes]]:
        """Notifications received since the last call (waits up to ``timeout`` for one).

        ``progress``: first collect what the UCX worker holds now, without waiting for the
        poller (which a loaded host may not have scheduled since): a peer that notified and
        then closed is disconnected, but its notification was delivered before that."""
        with self._cond:
            if progress:
                self._collect()
            if not self._notifs:
                self._cond.wait(timeout)
            out, self._notifs = self._notifs, {}
        return out

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_interval):
            with self._cond:
                self._collect()

    def _collect(self) -> None:
        """Move NIXL's new notifications into ours (holding the lock)."""
        try:
            new = self._agent.get_new_notifs()
        except self._errors as exc:  # a dead peer's error is reported by the next transfer
            logger.debug("%s: polling notifications failed: %s", self.who, exc)
            return
        if new:
            for peer, messages in new.items():
                self._notifs.setdefault(peer, []).extend(messages)
            self._cond.notify_all()

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the poller, release handles, drop peers, deregister, then free the agent.

        Every handle object keeps the C++ agent alive, so they are released and forgotten
        first; the agent (its UCX context, async thread and sockets) goes with the last
        reference. Errors are logged: a dead peer must not stop the rest of the teardown.
        """
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join(timeout=5.0)
        if self._agent is None:
            return
        with self._cond:
            for xfer in self._xfers:
                for h in (xfer.handle, *xfer.dlists):
                    with contextlib.suppress(*self._errors):
                        h.release()
                xfer.handle, xfer.dlists = None, ()
            self._xfers.clear()
            for peer in self._labels:
                try:
                    self._agent.remove_remote_agent(peer)
                except self._errors as exc:
                    logger.debug("%s: removing %s failed: %s", self.who, self._labels[peer], exc)
            self._labels.clear()
            for reg in self._regs:
                try:
                    self._agent.deregister_memory(reg)
                except self._errors as exc:
                    logger.warning("%s: deregistering memory failed: %s", self.who, exc)
            self._regs.clear()
            self._agent = None
