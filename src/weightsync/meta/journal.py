"""Durable meta-server state: a msgpack snapshot plus an append-only, fsynced journal.

A state directory holds ``snapshot.msgpack`` (a header ``{"format": 1, "snapshot": n}``
followed by the records that rebuild the state) and ``journal-<g>.msgpack`` (records appended
since that snapshot). Writes use **group commit**: every change submitted while one fsync is
running goes out in the next single write + fsync, so a thousand concurrent registrations cost
a handful of fsyncs rather than a thousand, and no caller is answered before its record is on
disk.

Compaction writes a new snapshot (number ``n + 1``) to a temporary file, fsyncs it, renames
it over the old one and only then starts ``journal-<g+1>``; a crash at any point leaves either
the old snapshot with its journal or the new snapshot with an empty one. A torn record at the
end of the journal (a crash mid-write, never acknowledged) is cut off with a warning.

    store = Journal(Path("state"))
    records = store.load()               # replay these
    store.rewrite(current_records)       # compact
    await store.start(snapshot_fn)       # background group-commit writer
    await store.submit(records)          # resolves once durable
    await store.close()
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from weightsync.meta.events import Event, EventError, encode_events, event_from_wire, event_to_wire

logger = logging.getLogger(__name__)

FORMAT = 1
SNAPSHOT = "snapshot.msgpack"


class JournalError(RuntimeError):
    """The journal cannot store changes (its writer stopped, or the disk failed)."""


class Journal:
    """The files of one state directory. Only one server may use a directory at a time."""

    def __init__(self, directory: str | os.PathLike[str], *, compact_bytes: int = 64 << 20) -> None:
        if compact_bytes <= 0:
            raise ValueError(f"compact_bytes must be positive, got {compact_bytes}")
        self.directory = Path(directory)
        self.compact_bytes = compact_bytes
        self.snapshot_number = 0
        self.journal_bytes = 0
        self.fsyncs = 0
        self.fsync_seconds = 0.0
        self._journal: Any = None  # binary file object
        self._queue: list[tuple[bytes, asyncio.Future[None]]] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._snapshot: Callable[[], list[Event]] | None = None
        self._lock_fd: int | None = None
        self._closing = False
        self._error: str | None = None  # the last write failure, until a write succeeds
        #: the identity of the state kept here (see MetaState.instance), from the snapshot header
        self.instance: str | None = None

    # --- startup ---------------------------------------------------------------------------
    def load(self) -> list[Event]:
        """Lock the directory and return the events to replay (snapshot, then journal)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_directory()
        records: list[Any] = []
        snapshot = self.directory / SNAPSHOT
        if snapshot.exists():
            items = self._read(snapshot, tolerate_torn_tail=False)
            header = items[0] if items else None
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise ValueError(f"{snapshot} is not a weightsync meta snapshot (format {FORMAT}); "
                                 "move the state directory away to start empty")
            self.snapshot_number = int(header.get("snapshot") or header.get("generation") or 0)
            self.instance = header.get("instance") if isinstance(header.get("instance"), str) else None
            records.extend(items[1:])
        journal = self._journal_path(self.snapshot_number)
        if journal.exists():
            records.extend(self._read(journal, tolerate_torn_tail=True))
        events = []
        for i, r in enumerate(records):
            try:
                events.append(event_from_wire(r))
            except EventError as exc:
                self.close_files()
                raise ValueError(f"state directory {self.directory}: record {i} is malformed ({exc}); "
                                 "move the state directory away to start empty") from None
        return events

    def _lock_directory(self) -> None:
        import fcntl

        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ValueError(f"state directory {self.directory} is in use by another meta server; "
                             "stop it first or pass a different --state-dir") from None
        self._lock_fd = fd

    def _read(self, path: Path, *, tolerate_torn_tail: bool) -> list[Any]:
        data = path.read_bytes()
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1 << 20))
        unpacker.feed(data)
        items: list[Any] = []
        try:
            for item in unpacker:
                items.append(item)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ValueError(f"{path} is corrupt near byte {unpacker.tell()} ({exc}); "
                             "move the state directory away to start empty") from exc
        good = unpacker.tell()
        if good != len(data):
            if not tolerate_torn_tail:
                raise ValueError(f"{path} is truncated at byte {good} of {len(data)}; "
                                 "move the state directory away to start empty")
            logger.warning("%s: dropping a torn record at its end (%d bytes; never acknowledged)",
                           path, len(data) - good)
            with open(path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return items

    def _journal_path(self, snapshot_number: int) -> Path:
        return self.directory / f"journal-{snapshot_number}.msgpack"

    def rewrite(self, records: list[Event]) -> None:
        """Compact: a new snapshot holding ``records`` and a new, empty journal."""
        new_number = self.snapshot_number + 1
        tmp = self.directory / (SNAPSHOT + ".tmp")
        with open(tmp, "wb") as f:
            packer = msgpack.Packer(use_bin_type=True)
            f.write(packer.pack({"format": FORMAT, "snapshot": new_number, "instance": self.instance}))
            for r in records:
                f.write(packer.pack(event_to_wire(r)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / SNAPSHOT)
        self._fsync_directory()
        if self._journal is not None:
            self._journal.close()
        for old in self.directory.glob("journal-*.msgpack"):
            if old.name != self._journal_path(new_number).name:
                old.unlink()
        self.snapshot_number = new_number
        self._journal = open(self._journal_path(new_number), "ab")  # noqa: SIM115 (lives until close())
        self.journal_bytes = 0
        self._fsync_directory()

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # --- group commit ----------------------------------------------------------------------
    async def start(self, snapshot: Callable[[], list[Event]]) -> None:
        """Start the writer task; ``snapshot()`` returns the current state's records for compaction."""
        if self._journal is None:
            raise RuntimeError("Journal.start() before load() and rewrite()")
        self._snapshot = snapshot
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._writer(), name="weightsync-meta-journal")

    def broken(self) -> str | None:
        """Why changes cannot be stored right now, or None (``/healthz`` reports it)."""
        if self._task is not None and self._task.done() and not self._closing:
            return f"the journal writer of {self.directory} stopped"
        if self._error is not None:
            return f"the last journal write to {self.directory} failed: {self._error}"
        return None

    def submit(self, records: list[Event], encoded: bytes | None = None) -> asyncio.Future[None]:
        """Queue ``records`` (``encoded``: their msgpack encoding, if the caller has it); the
        future resolves once they (and all before them) are on disk."""
        if self._wakeup is None or self._task is None or self._task.done() or self._closing:
            raise JournalError(f"the meta server's journal in {self.directory} is not running (closed or failed); "
                               "restart the server")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if encoded is None:
            encoded = encode_events(records)
        self._queue.append((encoded, future))
        self._wakeup.set()
        return future

    async def _writer(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._queue:
                if self._closing:
                    return
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            batch, self._queue = self._queue, []
            data = b"".join(encoded for encoded, _ in batch)
            try:
                if data:
                    await asyncio.to_thread(self._append, data)
            except Exception as exc:
                self._error = f"{type(exc).__name__}: {exc}"
                logger.error("meta journal write failed: %s", exc)
                failure = exc if isinstance(exc, OSError) else JournalError(f"the journal write failed: {exc}")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(failure)
                continue
            self._error = None
            for _, future in batch:
                if not future.done():
                    future.set_result(None)
            if self.journal_bytes > self.compact_bytes and self._snapshot is not None:
                try:
                    records = self._snapshot()
                    await asyncio.to_thread(self.rewrite, records)
                except Exception as exc:
                    self._error = f"compaction failed: {exc}"
                    logger.error("meta journal compaction failed: %s", exc)
                    continue
                logger.info("meta journal compacted into snapshot %d (%d records)", self.snapshot_number, len(records))

    def _append(self, data: bytes) -> None:
        t0 = time.perf_counter()
        self._journal.write(data)
        self._journal.flush()
        os.fsync(self._journal.fileno())
        self.journal_bytes += len(data)
        self.fsyncs += 1
        self.fsync_seconds += time.perf_counter() - t0

    async def close(self) -> None:
        """Flush everything queued, stop the writer and release the directory."""
        if self._task is not None and self._wakeup is not None:
            self._closing = True
            self._wakeup.set()
            try:
                await asyncio.wait_for(self._task, timeout=30.0)
            except asyncio.TimeoutError:
                logger.error("meta journal did not flush within 30 s; the last changes may be lost")
                self._task.cancel()
            self._task = None
        self.close_files()

    def close_files(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
