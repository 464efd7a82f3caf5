"""The meta server's durable store: SQLite (stdlib ``sqlite3``) in the state directory.

``meta.sqlite3`` holds a log: one row per acknowledged change (its events, msgpack), numbered by
``seq`` and sealed with a BLAKE2b digest of (seq, events); a compaction replaces the rows by a
snapshot in one transaction. Each change is one transaction, committed with ``journal_mode=WAL``
and ``synchronous=FULL`` (fsynced) before the server applies it and answers; a change that cannot
be committed (a full disk) is rolled back, answered 503, and leaves nothing behind.

What SQLite does not check, this store does, so that damage is refused rather than replayed:

* every row's digest (a flipped byte in a record), and that rows run from the snapshot's first
  ``seq`` to the last without a gap;
* ``PRAGMA integrity_check`` (the B-trees) and, after a clean stop, the page count its header
  claims against the file's size (a truncated file);
* ``committed``, a small file beside it holding the last acknowledged ``seq`` (written after every
  commit, fsynced at close): SQLite replays a write-ahead log only up to its first damaged or
  missing frame, so a deleted, truncated or garbled ``-wal`` would otherwise lose acknowledged
  changes without a word. A store that holds fewer changes than ``committed`` names is refused.

The server instance stored in the database names one unbroken history of acknowledged changes;
clients pin it. The store keeps it only when ``committed`` shows that the database is the very file
the server last wrote (its inode and change time, :func:`weightsync.meta.state_dir.stamp`,
recorded after every write) and holds every change the server acknowledged. A database restored
from a backup, copied or rolled back (whatever ``committed`` was restored with it), or one whose
``committed`` is gone, starts as a **new instance**: clients that pinned the old one get
``ServerStateLostError`` and register again, so counters never go backwards unseen.

The directory is 0700 and every file in it 0600 (:mod:`weightsync.meta.state_dir`); one the
server cannot write is refused as a permission problem (StoreAccessError), never as damage.

A lock file keeps a second server out. State directories of earlier releases (``snapshot.msgpack``,
``journal-<n>.msgpack``) are migrated on the first start (:mod:`weightsync.meta.legacy`).

    store = SqliteStore("/var/lib/weightsync-meta")
    opened = store.open(new_instance)     # StoreDamagedError: what is damaged and how to recover
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar, NamedTuple

import msgpack

from weightsync.meta import legacy, state_dir
from weightsync.meta.events import Event, EventError, encode_events, event_from_wire
from weightsync.meta.store import Opened, StoreDamagedError, StoreError, StoreFullError, StoreStats

logger = logging.getLogger(__name__)

DATABASE = "meta.sqlite3"
COMMITTED = "committed"
#: the store's files, each private to the server's user (0600)
FILES = (DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm", COMMITTED, "lock")
#: SQLite's answers that mean "not allowed to write", not damage
_ACCESS_CODES = frozenset({sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM})
FORMAT = 2
#: snapshot rows hold at most this many bytes of events each
SNAPSHOT_ROW_BYTES = 1 << 20
_SCHEMA = """
CREATE TABLE info (id INTEGER PRIMARY KEY CHECK (id = 1), format INTEGER NOT NULL, instance TEXT NOT NULL,
                   base INTEGER NOT NULL, migrated TEXT NOT NULL, digest BLOB NOT NULL);
CREATE TABLE log (seq INTEGER PRIMARY KEY, events BLOB NOT NULL, digest BLOB NOT NULL);
"""


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=b"weightsync-meta")
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.digest()


def _row_digest(seq: int, events: bytes) -> bytes:
    return _digest(seq.to_bytes(8, "big", signed=True), events)


def _info_digest(fmt: int, instance: str, base: int, migrated: str) -> bytes:
    return _digest(f"{fmt}|{instance}|{base}|{migrated}".encode())


class Mark(NamedTuple):
    """What ``committed`` says: the instance, its last acknowledged change, and the database file's
    stamp after the server's last write to it (None in the marks of earlier releases)."""

    instance: str
    seq: int  # -1: unreadable
    stamp: str | None


class SqliteStore:
    """The state directory's SQLite store (see module docstring)."""

    durable: ClassVar[bool] = True

    def __init__(self, directory: str | os.PathLike[str], *, compact_bytes: int = 64 << 20) -> None:
        if compact_bytes <= 0:
            raise ValueError(f"compact_bytes must be positive, got {compact_bytes}")
        self.directory = Path(directory)
        self.path = self.directory / DATABASE
        self.compact_bytes = compact_bytes
        self.stats = StoreStats()
        self.instance = ""
        self._db: sqlite3.Connection | None = None
        self._seq = 0  # the last committed seq
        self._lock_fd: int | None = None
        self._mark_fd: int | None = None
        self._error: str | None = None

    # --- opening -----------------------------------------------------------------------------
    def open(self, instance: str) -> Opened:
        state_dir.ensure_private_directory(self.directory)
        state_dir.check_writable(self.directory, FILES)
        self._lock_directory()
        try:
            found = state_dir.stamp(self.path)  # before anything here touches it
            state_dir.tighten_files(self.directory, FILES)
            if self._never_written():
                self.path.unlink()
            events = self._open_existing(instance, found) if self.path.exists() else self._create(instance)
            self._checkpoint()
            self._write_mark(sync=True)  # the stamp after the checkpoint's write
        except BaseException:
            self.close()
            raise
        logger.info("meta store %s: %d events, last change #%d", self.path, len(events), self._seq)
        return Opened(self.instance, events)

    def _lock_directory(self) -> None:
        import fcntl

        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreDamagedError(f"state directory {self.directory} is in use by another meta server; "
                                    "stop it first or pass a different --state-dir") from None
        self._lock_fd = fd

    def _never_written(self) -> bool:
        """An empty database file and nothing else: a first start stopped before it wrote anything."""
        return (self.path.exists() and self.path.stat().st_size == 0 and self._read_mark() is None
                and not (self.directory / f"{DATABASE}-wal").exists())

    def _damaged(self, what: str) -> StoreDamagedError:
        return StoreDamagedError(
            f"the meta server's store in {self.directory} is damaged: {what}. It refuses to start rather than "
            f"lose changes it acknowledged. Restore {DATABASE} from a backup and delete {DATABASE}-wal, "
            f"{DATABASE}-shm and {COMMITTED} (it then starts as a new server instance), or move {self.directory} "
            "away to start empty; either way clients see a new server instance and register again")

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            # Normal locking (not EXCLUSIVE): `sqlite3 meta.sqlite3 ".backup ..."` can copy it while
            # the server runs; the lock file keeps out a second server.
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"SQLite refused journal_mode=WAL for {self.path} (got {mode!r})")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA cell_size_check=ON")
        except BaseException:
            db.close()
            raise
        return db

    def _create(self, instance: str) -> list[Event]:
        mark = self._read_mark()
        if mark is not None or (self.directory / f"{DATABASE}-wal").exists():
            seq = f" (it names change #{mark.seq} of instance {mark.instance})" if mark else ""
            raise self._damaged(f"{DATABASE} is missing, but {COMMITTED if mark else DATABASE + '-wal'} "
                                f"shows that this directory held a store{seq}")
        found = legacy.read_legacy(self.directory)
        migrated = ""
        events: list[Event] = []
        if found is not None:
            old_instance, events = found
            instance = old_instance or instance
            migrated = f"{len(events)} events from {', '.join(p.name for p in legacy.legacy_files(self.directory))}"
        self.instance = instance
        state_dir.create_private(self.path)  # SQLite gives -wal and -shm the database file's mode
        self._db = self._connect()
        try:
            self._db.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA.strip().split(";"):
                if statement.strip():
                    self._db.execute(statement)
            self._db.execute("INSERT INTO info VALUES (1, ?, ?, 1, ?, ?)",
                             (FORMAT, instance, migrated, _info_digest(FORMAT, instance, 1, migrated)))
            self._seq = self._insert_snapshot(events, first=1) if events else 0
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise self._failure(exc) from exc
        self._fsync_directory()
        if found is not None:
            moved = legacy.move_away(self.directory)
            logger.warning("meta store %s: migrated the state directory of an earlier release (%s); its files "
                           "are kept in %s", self.path, migrated, moved)
        self._open_mark()
        return events

    def _open_existing(self, instance: str, found: str) -> list[Event]:
        """Read and check the store; ``found``: the database file's stamp before this start touched it."""
        wal = self.directory / f"{DATABASE}-wal"
        if not wal.exists() or wal.stat().st_size == 0:
            self._check_size()
        try:
            self._db = self._connect()
            problems = [row[0] for row in self._db.execute("PRAGMA integrity_check(20)")]
            if problems != ["ok"]:
                raise self._damaged(f"SQLite's integrity check of {DATABASE} failed: {'; '.join(problems)}")
            tables = self._db.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0]
            if tables == 0 and self._read_mark() is None:
                return self._recreate(instance)  # a first start that crashed before its first commit
            info = self._db.execute("SELECT format, instance, base, migrated, digest FROM info").fetchall()
            rows = self._db.execute("SELECT seq, events, digest FROM log ORDER BY seq").fetchall()
        except (sqlite3.DatabaseError, StoreError) as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF in _ACCESS_CODES:
                raise state_dir.access_error(self.path, self.directory) from exc
            raise self._damaged(f"SQLite cannot read {DATABASE} ({exc})") from exc
        if len(info) != 1:
            raise self._damaged(f"{DATABASE} has {len(info)} info rows, not 1")
        fmt, stored, base, migrated, digest = info[0]
        if digest != _info_digest(fmt, stored, base, migrated):
            raise self._damaged(f"the info row of {DATABASE} does not match its digest")
        if fmt != FORMAT:
            raise self._damaged(f"{DATABASE} is of format {fmt}, this release reads format {FORMAT}")
        self.instance = stored
        events = list(self._decode(rows, base))
        self._seq = rows[-1][0] if rows else base - 1
        self._check_mark(instance, found)
        if legacy.legacy_files(self.directory):
            if not migrated:
                raise self._damaged(f"the directory holds both {DATABASE} and files of the earlier journal format "
                                    f"({', '.join(p.name for p in legacy.legacy_files(self.directory))}), which it "
                                    "never migrated")
            legacy.move_away(self.directory)  # a migration that stopped before it moved them
        self.stats.log_bytes = sum(len(row[1]) for row in rows)
        return events

    def _recreate(self, instance: str) -> list[Event]:
        """Nothing was ever committed here (no table, no mark): create the store afresh."""
        assert self._db is not None
        self._db.close()
        self._db = None
        for name in (DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm"):
            (self.directory / name).unlink(missing_ok=True)
        logger.warning("meta store %s: a first start stopped before its first commit; creating it again", self.path)
        return self._create(instance)

    def _check_size(self) -> None:
        """After a clean stop: the page count in the header fits in the file (a truncated file does not)."""
        with open(self.path, "rb") as f:
            header = f.read(100)
        size = self.path.stat().st_size
        if size == 0:
            raise self._damaged(f"{DATABASE} is empty and {DATABASE}-wal, which would hold its changes, is missing")
        if len(header) < 100 or not header.startswith(b"SQLite format 3\x00"):
            raise self._damaged(f"{DATABASE} is not an SQLite database (its first {len(header)} bytes)")
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages, valid = int.from_bytes(header[28:32], "big"), header[92:96] == header[24:28]
        if valid and pages * page_size > size:
            raise self._damaged(f"{DATABASE} is truncated: its header counts {pages} pages of {page_size} bytes "
                                f"({pages * page_size} bytes), the file has {size}")

    def _decode(self, rows: list[tuple[int, bytes, bytes]], base: int) -> Iterator[Event]:
        for expected, (seq, blob, digest) in enumerate(rows, start=base):
            if seq != expected:
                raise self._damaged(f"change #{expected} is missing from {DATABASE} (the next row is #{seq})")
            if digest != _row_digest(seq, blob):
                raise self._damaged(f"change #{seq} in {DATABASE} does not match its digest (a damaged byte)")
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(blob), 1 << 20))
            unpacker.feed(blob)
            try:
                for obj in unpacker:
                    yield event_from_wire(obj)
            except (ValueError, msgpack.UnpackException, EventError) as exc:
                raise self._damaged(f"change #{seq} in {DATABASE} cannot be read ({exc})") from exc

    # --- the committed mark ------------------------------------------------------------------
    def _read_mark(self) -> Mark | None:
        path = self.directory / COMMITTED
        if not path.exists():
            return None
        text = path.read_text(errors="replace").split()
        if len(text) not in (2, 3) or not text[1].isdigit():
            return Mark(text[0] if text else "?", -1, None)
        return Mark(text[0], int(text[1]), text[2] if len(text) == 3 else None)

    def _check_mark(self, instance: str, found: str) -> None:
        """Keep the stored instance only if ``committed`` shows that this is the file the server last
        wrote and that it holds every change the server acknowledged; refuse a store that lost
        acknowledged changes; start anything else as a new instance (``instance``)."""
        mark = self._read_mark()
        if mark is None or mark.seq < 0:
            self._renew(instance, f"{COMMITTED} is {'missing' if mark is None else 'unreadable'}, so nothing shows "
                                  "that the store holds every change the server acknowledged")
        elif mark.instance != self.instance:
            raise self._damaged(f"{DATABASE} holds the state of server instance {self.instance}, but {COMMITTED} "
                                f"was written by instance {mark.instance}: the database was replaced by another one")
        elif mark.seq > self._seq:
            raise self._damaged(f"the server acknowledged changes up to #{mark.seq} ({COMMITTED}), but the store "
                                f"holds changes up to #{self._seq} only: {mark.seq - self._seq} acknowledged "
                                f"change(s) are lost ({DATABASE}-wal deleted or truncated, or {DATABASE} "
                                "replaced by an older copy)")
        elif mark.stamp is not None and mark.stamp != found:
            self._renew(instance, f"{DATABASE} is not the file the server last wrote (inode and change time "
                                  f"{found}, {COMMITTED} recorded {mark.stamp}): it was restored from a backup, "
                                  "copied or rolled back, and may be older than what the server acknowledged")
        self._open_mark()

    def _renew(self, instance: str, why: str) -> None:
        """Start this store as a new server instance: clients that pinned the old one are told
        (ServerStateLostError) and register again, so counters never go backwards unseen."""
        if instance == self.instance:
            instance = secrets.token_hex(8)
        db = self._connection()
        try:
            db.execute("BEGIN IMMEDIATE")
            fmt, base, migrated = db.execute("SELECT format, base, migrated FROM info").fetchone()
            db.execute("UPDATE info SET instance = ?, digest = ? WHERE id = 1",
                       (instance, _info_digest(fmt, instance, base, migrated)))
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise self._failure(exc) from exc
        logger.warning("meta store %s: %s. It starts as a new server instance %s (was %s): clients that knew the "
                       "old one see ServerStateLostError and register again", self.path, why, instance, self.instance)
        self.instance = instance

    def _open_mark(self) -> None:
        self._mark_fd = os.open(self.directory / COMMITTED, os.O_RDWR | os.O_CREAT, state_dir.PRIVATE_FILE)

    def _write_mark(self, *, sync: bool = False) -> None:
        """Record the last committed seq and the database file's stamp after this write. Not
        fsynced per commit: it only has to survive the process (the page cache does); a power loss
        leaves it at or below the truth (an older stamp: the next start is a new instance)."""
        if self._mark_fd is None:
            return
        data = f"{self.instance} {self._seq:020d} {state_dir.stamp(self.path)}\n".encode()
        os.pwrite(self._mark_fd, data, 0)  # same length every time: overwrites, never allocates
        if sync:
            os.ftruncate(self._mark_fd, len(data))
            os.fsync(self._mark_fd)
            self._fsync_directory()

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # --- changes -----------------------------------------------------------------------------
    def commit(self, events: Sequence[Event], encoded: bytes) -> None:
        db = self._connection()
        seq = self._seq + 1
        t0 = time.perf_counter()
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO log VALUES (?, ?, ?)", (seq, encoded, _row_digest(seq, encoded)))
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise self._failure(exc) from exc
        self._seq = seq
        self._error = None
        self.stats.commits += 1
        self.stats.commit_seconds += time.perf_counter() - t0
        self.stats.log_bytes += len(encoded)
        try:
            self._write_mark()
        except OSError as exc:  # the change is committed: answer it; only the loss check is weaker
            logger.error("meta store %s: cannot update %s: %s", self.path, COMMITTED, exc)

    def _insert_snapshot(self, snapshot: Sequence[Event], *, first: int) -> int:
        """Insert ``snapshot`` as rows ``first, first + 1, ...``; returns the last seq."""
        assert self._db is not None
        seq, size = first, 0
        chunk: list[bytes] = []
        for event in snapshot:
            encoded = encode_events([event])
            if chunk and size + len(encoded) > SNAPSHOT_ROW_BYTES:
                blob = b"".join(chunk)
                self._db.execute("INSERT INTO log VALUES (?, ?, ?)", (seq, blob, _row_digest(seq, blob)))
                seq, chunk, size = seq + 1, [], 0
            chunk.append(encoded)
            size += len(encoded)
        blob = b"".join(chunk)
        self._db.execute("INSERT INTO log VALUES (?, ?, ?)", (seq, blob, _row_digest(seq, blob)))
        return seq

    def compact(self, snapshot: Sequence[Event]) -> None:
        db = self._connection()
        first = self._seq + 1
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM log")
            last = self._insert_snapshot(snapshot, first=first)
            (_, instance, _, migrated) = db.execute("SELECT format, instance, base, migrated FROM info").fetchone()
            db.execute("UPDATE info SET base = ?, digest = ? WHERE id = 1",
                       (first, _info_digest(FORMAT, instance, first, migrated)))
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise self._failure(exc) from exc
        self._seq = last
        self._write_mark()
        self.stats.compactions += 1
        self.stats.log_bytes = 0
        logger.info("meta store %s compacted: %d events in changes #%d-#%d", self.path, len(snapshot), first, last)

    def _checkpoint(self) -> None:
        """Copy the write-ahead log into the database file: at rest right after a start, the file
        alone holds everything (best effort: a full disk leaves the log as it is, still valid)."""
        try:
            self._connection().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            logger.warning("meta store %s: checkpoint failed (%s); the write-ahead log keeps the changes", self.path,
                           exc)

    @property
    def needs_compaction(self) -> bool:
        return self.stats.log_bytes > self.compact_bytes

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"the meta server's store {self.path} is closed")
        return self._db

    def _rollback(self) -> None:
        if self._db is not None and self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error as exc:  # SQLite may have rolled back already
                logger.debug("rollback: %s", exc)

    def _failure(self, exc: sqlite3.Error) -> StoreError:
        code = getattr(exc, "sqlite_errorcode", None)
        if code == sqlite3.SQLITE_FULL or "full" in str(exc):
            self._error = f"{self.directory} is full ({exc})"
            return StoreFullError(f"the meta server cannot store the change: {self._error}; nothing was changed. "
                                  "Free space there: the same request then succeeds (clients retry by themselves)")
        self._error = f"{self.path}: {exc}"
        return StoreError(f"the meta server cannot store the change ({self._error}); nothing was changed")

    def broken(self) -> str | None:
        return None if self._error is None else f"the last change could not be stored: {self._error}"

    def close(self) -> None:
        """Close the database (SQLite checkpoints its log into the file), then sync and release."""
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except sqlite3.Error as exc:
                logger.error("meta store %s: closing failed: %s", self.path, exc)
        if self._mark_fd is not None:
            try:
                self._write_mark(sync=True)
            except OSError as exc:
                logger.error("meta store %s: cannot sync %s: %s", self.path, COMMITTED, exc)
            os.close(self._mark_fd)
            self._mark_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
