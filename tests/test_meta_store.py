"""The meta server's SQLite store: acknowledged changes are never lost, damage is refused, never replayed.

In process and fast: a state built through the service (so through the same events a server
journals), then its files damaged at every position a test can afford: each open either refuses
with a message that names the damage and the way to recover, or rebuilds exactly the state that
was acknowledged. The full disk is SQLite's own SQLITE_FULL (``PRAGMA max_page_count``); the
fault suite (tests/test_faults.py) does the same with a real full tmpfs and a server process.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import subprocess
import sys

import msgpack
import pytest

from weightsync.meta.legacy import MIGRATED
from weightsync.meta.reducer import replay
from weightsync.meta.sqlite_store import COMMITTED, DATABASE, SqliteStore
from weightsync.meta.state import MetaState
from weightsync.meta.store import StoreDamagedError, StoreFullError

#: every how many bytes a flip is tried (WEIGHTSYNC_STORE_FLIP_STEP=1: every byte, minutes)
FLIP_STEP = int(os.environ.get("WEIGHTSYNC_STORE_FLIP_STEP", "0"))
pytestmark = pytest.mark.timeout(3600 if FLIP_STEP else 120)


async def _changes(state: MetaState, versions: int = 6) -> None:
    await state.register("j", "writer", 0, group="g", host="h", endpoints={"device": "cpu"}, layout=b"W" * 300)
    await state.register("j", "reader", 0, group="g", host="h", endpoints={"device": "cpu"}, layout=b"R" * 300)
    await state.put_document("j", "model/x", b"config " * 50)
    for v in range(1, versions + 1):
        await state.compare_and_set("j", "epoch", expected=v - 1, value=v)
        await state.report_version("j", v, "fp", writer_rank=0, num_writers=1, epoch=v)
        await state.report_reader("j", 0, v, nbytes=v, seconds=0.5)


def _build(directory, *, close: bool = True, versions: int = 6):
    """A store holding a few dozen acknowledged changes; returns the state they built. Without
    ``close`` the process that made them crashes (``os._exit``): its -wal file holds them."""
    if not close:
        code = ("import asyncio, os, sys; sys.path.insert(0, sys.argv[1]); from test_meta_store import _crash; "
                "_crash(sys.argv[2], int(sys.argv[3]))")
        subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), str(directory), str(versions)],
                       check=True, timeout=60)
        copy = directory.parent / f"{directory.name}-reference"
        shutil.copytree(directory, copy)
        data = _open(copy)
        assert data.jobs["j"].latest.version == versions and data.jobs["j"].counters["epoch"] == versions
        return data

    async def run() -> MetaState:
        state = MetaState(SqliteStore(directory))
        state.load()
        await _changes(state, versions)
        await state.close()
        return state

    return asyncio.run(run()).data


def _crash(directory: str, versions: int) -> None:
    async def run() -> None:
        state = MetaState(SqliteStore(directory))
        state.load()
        await _changes(state, versions)
        os._exit(0)  # no close: what SIGKILL leaves

    asyncio.run(run())


def _open(directory):
    store = SqliteStore(directory)
    try:
        return replay(store.open("fresh").events)
    finally:
        store.close()


def test_the_store_rebuilds_the_state_after_a_clean_stop_and_after_a_crash(tmp_path):
    for close in (True, False):
        directory = tmp_path / f"close-{close}"
        data = _build(directory, close=close)
        assert (directory / f"{DATABASE}-wal").stat().st_size > 0 if not close else \
            not (directory / f"{DATABASE}-wal").exists()
        assert _open(directory) == data
        assert sorted(p.name for p in directory.iterdir()) == [COMMITTED, "lock", DATABASE]


def _every(directory, file: str, step: int):
    size = (directory / file).stat().st_size
    return range(0, size, max(1, step))


@pytest.mark.parametrize(("file", "close"), [(DATABASE, True), (f"{DATABASE}-wal", False)])
def test_a_flipped_byte_anywhere_is_refused_or_harmless(tmp_path, file, close):
    data = _build(tmp_path / "good", close=close)
    refused = harmless = 0
    for at in _every(tmp_path / "good", file, FLIP_STEP or (211 if close else 401)):
        directory = tmp_path / f"flip{at}"
        shutil.copytree(tmp_path / "good", directory)
        blob = bytearray((directory / file).read_bytes())
        blob[at] ^= 0x10
        (directory / file).write_bytes(bytes(blob))
        try:
            assert _open(directory) == data, f"a flipped byte at {at} of {file} changed the state"
            harmless += 1
        except StoreDamagedError as exc:
            assert "is damaged" in str(exc) and "move" in str(exc), exc
            refused += 1
        shutil.rmtree(directory)
    print(f"{file}: {refused + harmless} flips, {harmless} harmless, {refused} refused")  # pytest -s shows it
    assert refused > 0 and refused + harmless > 20, (refused, harmless)


@pytest.mark.parametrize(("file", "close"), [(DATABASE, True), (f"{DATABASE}-wal", False)])
def test_a_truncated_file_is_refused_or_loses_nothing(tmp_path, file, close):
    data = _build(tmp_path / "good", close=close)
    size = (tmp_path / "good" / file).stat().st_size
    for length in sorted({0, 1, 100, size // 3, size // 2, size - 4096 - 24, size - 100, size - 1}):
        directory = tmp_path / f"cut{length}"
        shutil.copytree(tmp_path / "good", directory)
        with open(directory / file, "r+b") as f:
            f.truncate(max(0, length))
        try:
            assert _open(directory) == data, f"{file} cut to {length} bytes changed the state"
        except StoreDamagedError as exc:
            assert "is damaged" in str(exc), exc
        shutil.rmtree(directory)


def test_a_deleted_file_is_refused(tmp_path):
    _build(tmp_path / "good", close=False)
    for gone, expect in ((DATABASE, f"{DATABASE} is missing"), (f"{DATABASE}-wal", "acknowledged change.* lost")):
        directory = tmp_path / gone
        shutil.copytree(tmp_path / "good", directory)
        (directory / gone).unlink()
        with pytest.raises(StoreDamagedError, match=expect):
            _open(directory)
    # the mark alone gone: nothing is lost, the store opens (and writes it again)
    directory = tmp_path / "mark"
    shutil.copytree(tmp_path / "good", directory)
    (directory / COMMITTED).unlink()
    assert _open(directory).jobs["j"].latest.version == 6
    assert (directory / COMMITTED).exists()


def test_a_full_disk_stores_nothing_and_the_same_change_succeeds_once_space_returns(tmp_path):
    """SQLITE_FULL (the database may not grow): the change is refused whole, nothing in memory
    or on disk changes, and the same request succeeds once space returns."""
    async def run():
        state = MetaState(SqliteStore(tmp_path))
        state.load()
        await _changes(state, versions=2)
        db = state.store._db  # type: ignore[attr-defined]
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count={pages}")
        revision = state.jobs["j"].roster_revision
        with pytest.raises(StoreFullError, match=r"is full .*nothing was changed"):
            await state.put_document("j", "big", b"x" * 200_000)
        with pytest.raises(StoreFullError):
            await state.register("j", "writer", 1, group="g", host="h", endpoints={}, layout=b"L" * 200_000)
        assert state.document("j", "big") is None and 1 not in state.jobs["j"].rows["writer"]
        assert state.jobs["j"].roster_revision == revision and "is full" in (state.broken() or "")
        db.execute("PRAGMA max_page_count=1073741823")  # space returns
        assert await state.register("j", "writer", 1, group="g", host="h", endpoints={}, layout=b"L" * 200_000)
        assert not await state.register("j", "writer", 1, group="g", host="h", endpoints={}, layout=b"L" * 200_000)
        assert state.jobs["j"].roster_revision == revision + 1  # applied once
        await state.put_document("j", "big", b"x" * 200_000)
        assert state.broken() is None
        await state.close()
        return state.data

    data = asyncio.run(run())
    assert _open(tmp_path) == data and data.jobs["j"].documents["big"] == b"x" * 200_000


def test_counters_never_go_backwards_across_restarts_and_compactions(tmp_path):
    async def run(expected: int) -> None:
        state = MetaState(SqliteStore(tmp_path, compact_bytes=512))  # compacts while running, too
        state.load()
        assert state.counter("j", "epoch") == expected
        assert await state.compare_and_set("j", "epoch", expected=expected, value=expected + 1) == (True, expected + 1)
        await state.close()

    for n in range(4):
        asyncio.run(run(n))


def _legacy_directory(directory, *, torn: bool = False) -> None:
    """A state directory of a release before the SQLite store (snapshot + journal, no checksums)."""
    directory.mkdir()
    records = [{"op": "register", "job": "j", "role": "reader", "rank": 0, "group": "g", "host": "h",
                "endpoints": {}, "layout": "x" * 32, "at": 1.0},
               {"op": "blob", "job": "j", "hash": "x" * 32, "data": b"L", "at": 1.0},
               {"op": "version", "job": "j", "version": 3, "fingerprint": "fp@2", "at": 2.0, "attempt": 2}]
    (directory / "snapshot.msgpack").write_bytes(
        msgpack.packb({"format": 1, "snapshot": 4, "instance": "0123456789abcdef"})
        + b"".join(msgpack.packb(r) for r in records))
    journal = msgpack.packb({"op": "counter", "job": "j", "name": "epoch", "value": 3, "at": 3.0})
    (directory / "journal-4.msgpack").write_bytes(journal[:-2] if torn else journal)


def test_a_state_directory_of_an_earlier_release_is_migrated_once(tmp_path):
    _legacy_directory(tmp_path / "old")
    store = SqliteStore(tmp_path / "old")
    opened = store.open("fresh")
    store.close()
    data = replay(opened.events)
    assert opened.instance == "0123456789abcdef"  # clients that pinned the old server carry on
    assert data.jobs["j"].latest.epoch == 2 and data.jobs["j"].counters["epoch"] == 3
    assert sorted(p.name for p in (tmp_path / "old" / MIGRATED).iterdir()) == ["journal-4.msgpack",
                                                                               "snapshot.msgpack"]
    assert _open(tmp_path / "old") == data  # the next start reads the store only


def test_an_earlier_releases_directory_that_does_not_decode_whole_is_refused_naming_the_format(tmp_path):
    _legacy_directory(tmp_path / "old", torn=True)
    with pytest.raises(StoreDamagedError, match=r"journal-4.msgpack \(ends with .* bytes that are not a whole "
                                                r"record.*journal format of weightsync releases before the SQLite"):
        SqliteStore(tmp_path / "old").open("fresh")
    assert not (tmp_path / "old" / DATABASE).exists()


def test_two_servers_cannot_share_a_store(tmp_path):
    first = SqliteStore(tmp_path)
    first.open("a")
    try:
        with pytest.raises(StoreDamagedError, match="is in use by another meta server"):
            SqliteStore(tmp_path).open("b")
    finally:
        first.close()


def test_the_database_is_wal_with_full_sync(tmp_path):
    _build(tmp_path, versions=1)
    store = SqliteStore(tmp_path)
    store.open("x")
    try:
        db = store._db
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    finally:
        store.close()
    assert isinstance(sqlite3.sqlite_version, str)
