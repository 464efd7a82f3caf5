"""``Prefetch``: receive the next version into staging while the engine serves, apply it on demand.

Kept beside :mod:`weightsync.roles.reader`, whose two halves (``receive`` and ``apply``) it runs
on two threads; see the class for when an engine can overlap its transfer this way.
"""

from __future__ import annotations

import threading
from typing import Any

from weightsync.ports import device as device_port
from weightsync.roles.reader import Received, UpdateResult, WeightReader, live_receives


class Prefetch:
    """Receive the next version in the background while the engine serves; apply it on demand.

        prefetch = Prefetch(reader)      # reader of an engine that stages (vLLM, SGLang)
        prefetch.start()                 # a thread receives the next version into staging
        llm.generate(...)                # the engine serves its current version meanwhile
        prefetch.apply(version=7)        # the pause: the engine's own load, and the cache reset

    The engine's pause is then its apply alone, plus whatever of the transfer had not ended
    when :meth:`apply` was called. That needs an engine whose receive buffers the model never
    reads: staging, with nothing received straight into the model (``in_place_names``
    empty, e.g. ``VLLMEngine(llm, in_place=False)``), and no ``layer_phases`` (a phased engine
    loads each phase into the model as it arrives, so its transfer cannot overlap generation:
    only the wait for the version could). An engine that receives into its live weights
    overlaps through :class:`~weightsync.roles.inflight.InflightReader` instead, with one more copy.

    **Streams.** The receive runs on a stream of its own (``DevicePort.new_stream``): on torch's
    current stream, which a background thread shares with the engine's forward (the device's
    default stream), every decode step would queue behind the whole transfer, and the overlap
    would be lost on a GPU. The apply, on the caller's stream, is ordered after the receive by
    an event, and the next receive (into the same staging) after the apply by another.

    A prefetch that fails leaves the engine serving its version (only staging was written); an
    apply that fails leaves it invalid until a later version is applied in full.
    """

    def __init__(self, reader: WeightReader) -> None:
        what = live_receives(reader.engine)
        if what is not None:
            raise ValueError(f"prefetch needs an engine that receives into staging only; "
                             f"{type(reader.engine).__name__} receives {what}: create it with in_place=False "
                             "(VLLMEngine), or use InflightReader")
        if reader.config.layer_phases:
            raise ValueError("prefetch with SyncConfig(layer_phases=True): each phase is loaded into the model as "
                             "it arrives, so the transfer cannot overlap generation; use one or the other")
        self.reader = reader
        self._thread: threading.Thread | None = None
        self._received: Received | None = None
        self._error: BaseException | None = None
        self._timeout = reader.config.timeout
        self._dev = device_port.current()
        self._stream: Any = None  # the receives' own stream (made at the first start)
        self._received_at: Any = None  # an event after the last receive, on its stream
        self._applied_at: Any = None  # an event after the last apply, on the caller's stream

    @property
    def pending(self) -> bool:
        """A receive was started and not applied yet."""
        return self._thread is not None

    @property
    def received(self) -> int | None:
        """The version fully received and checked, waiting for :meth:`apply` (None: none yet)."""
        thread, received = self._thread, self._received
        return received.version if thread is not None and not thread.is_alive() and received is not None else None

    def start(self, version: int | None = None, *, timeout: float | None = None) -> None:
        """Start receiving the newest version (or at least ``version``) in the background; a
        receive already started and not applied is kept."""
        if self._thread is not None:
            return
        self._received, self._error = None, None
        self._timeout = timeout if timeout is not None else self.reader.config.timeout
        device = self.reader.session.device()
        if self._stream is None:
            self._stream = self._dev.new_stream(device)
        applied = self._applied_at

        def receive() -> None:
            try:
                with self._dev.on_stream(self._stream):
                    self._dev.order_after(applied, device)  # the last apply read the staging we write
                    received = self.reader.receive(version, timeout=self._timeout)
                    self._received_at = self._dev.record(device)
                self._received = received
            except BaseException as exc:  # handed to apply(), in the caller's thread
                self._error = exc

        self._thread = threading.Thread(target=receive, name=f"weightsync-prefetch-{self.reader.rank}", daemon=True)
        self._thread.start()

    def apply(self, version: int | None = None, *, timeout: float | None = None) -> UpdateResult:
        """Apply the prefetched version, once its receive ended; without one (or if it is older than
        ``version``, or none was published in time), receive ``version`` now and apply it.

        Raises:
            As :meth:`WeightReader.update`; a failed prefetch raises its own error here.
        """
        received = self._join()
        device = self.reader.session.device()
        if received is None or (version is not None and received.version < version):
            result = self.reader.update(version, timeout=timeout)
        else:
            self._dev.order_after(self._received_at, device)  # the engine's loads come after the receive
            result = self.reader.apply(received)
        self._applied_at = self._dev.record(device)
        return result

    def _join(self) -> Received | None:
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join(self._timeout + 30)  # the receive ends by its own deadline; this is a backstop
        if thread.is_alive():
            raise TimeoutError(f"reader {self.reader.rank}: the prefetch did not end within {self._timeout:.0f}s")
        if isinstance(self._error, TimeoutError):
            return None  # nothing was published meanwhile: receive what the caller asks for now
        if self._error is not None:
            raise self._error
        return self._received

    def close(self) -> None:
        """Wait for a receive under way to end (by its deadline at worst); nothing is applied."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self._timeout + 30)
