"""The embedded meta server's state directory as an operator meets it, and what clients are told.

A restored or rolled-back store starts as a new server instance (clients that pinned the old one
see ServerStateLostError); a directory the server cannot write is a permission problem, never
"damage"; the store is private to its user; a client that gives up on a refusing server quotes
the server's reason. In process, no sleeps; one subprocess, only to run without root's override
of file permissions.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys

import pytest

from weightsync.meta import EmbeddedMetaServer, MetaClient, ServerStateLostError, calls
from weightsync.meta.client_base import Answer, exchange
from weightsync.meta.reducer import replay
from weightsync.meta.sqlite_store import COMMITTED, DATABASE, SqliteStore
from weightsync.meta.state import MetaState
from weightsync.meta.store import StoreAccessError

pytestmark = pytest.mark.timeout(60)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _open(directory) -> tuple[str, int | None]:
    """The instance a server on ``directory`` would be, and the job's latest version there."""
    store = SqliteStore(directory)
    try:
        opened = store.open("fresh-instance")
    finally:
        store.close()
    job = replay(opened.events).jobs.get("j")
    return opened.instance, job.latest.version if job is not None and job.latest is not None else None


def _backup(directory, to) -> None:
    """A backup as docs/meta-server.md describes it: SQLite's online backup of the running
    server's database (what `sqlite3 meta.sqlite3 ".backup ..."` does), with `committed` copied
    at the same time."""
    to.mkdir()
    src, dst = sqlite3.connect(directory / DATABASE), sqlite3.connect(to / DATABASE)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    shutil.copy2(directory / COMMITTED, to / COMMITTED)


def _restore(backup, directory, *, committed: bool) -> None:
    for name in (DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm", COMMITTED):
        (directory / name).unlink(missing_ok=True)
    shutil.copy2(backup / DATABASE, directory / DATABASE)
    if committed:
        shutil.copy2(backup / COMMITTED, directory / COMMITTED)


def test_a_restored_backup_starts_as_a_new_instance_and_pinned_clients_learn_it(tmp_path):
    state_dir, backup = tmp_path / "state", tmp_path / "backup"
    with EmbeddedMetaServer(state_dir=state_dir) as server, \
            MetaClient(server.address, job="j", token=server.token, timeout=5) as client:
        instance = client.pin_instance()
        for version in range(1, 11):
            client.publish_version(version, "fp", writer_rank=0, num_writers=1, epoch=version)
            if version == 5:
                _backup(state_dir, backup)
        port = int(server.address.rsplit(":", 1)[1])
        server.stop()
        assert _open(state_dir) == (instance, 10)  # a plain restart keeps the instance: clients carry on

        _restore(backup, state_dir, committed=True)
        with EmbeddedMetaServer(state_dir=state_dir, port=port, token=server.token):
            with pytest.raises(ServerStateLostError, match="restored or rolled back to an earlier state"):
                client.latest_version()
            assert client.pin_instance() != instance  # what a rejoining client does: version 5 is the truth now
            assert client.latest_version().version == 5  # type: ignore[union-attr]
        renewed, latest = _open(state_dir)
        assert latest == 5 and renewed not in (instance, "fresh-instance")  # kept from now on

    # the restore the docs now describe (the backup alone, `committed` deleted): a new instance too
    _restore(backup, state_dir, committed=False)
    assert _open(state_dir)[0] not in (instance, renewed)


def test_a_store_that_lost_its_wal_and_committed_together_starts_as_a_new_instance(tmp_path):
    async def run() -> str:
        state = MetaState(SqliteStore(tmp_path))
        state.load()
        await state.register("j", "writer", 0, group="g", host="h", endpoints={}, layout=b"W")
        for v in range(1, 8):
            await state.report_version("j", v, "fp", writer_rank=0, num_writers=1, epoch=v)
        # the process dies here (no close): the changes since the start live in the -wal only
        shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-crashed")
        instance = state.instance
        await state.close()
        return instance

    instance = asyncio.run(run())
    crashed = tmp_path.parent / f"{tmp_path.name}-crashed"
    (crashed / "lock").unlink()
    assert (crashed / f"{DATABASE}-wal").stat().st_size > 0
    (crashed / f"{DATABASE}-wal").unlink()
    (crashed / COMMITTED).unlink()
    renewed, latest = _open(crashed)
    assert latest is None  # every version is gone with the -wal ...
    assert renewed != instance  # ... and clients are told, not left believing the counters


def _no_root_override(cmd: list[str]) -> list[str]:
    """``cmd`` run without root's override of file permissions (root bypasses them)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("running as root, and setpriv (util-linux) is missing to drop CAP_DAC_OVERRIDE")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", *cmd]


_TRY_OPEN = """
import sys
from weightsync.meta.sqlite_store import SqliteStore
for directory in sys.argv[1:]:
    try:
        SqliteStore(directory).open("x").instance
        print("opened", directory)
    except ValueError as exc:
        print(type(exc).__name__, exc)
"""


def test_a_read_only_state_directory_is_a_permission_problem_not_damage(tmp_path):
    asyncio.run(_register(tmp_path / "directory"))
    shutil.copytree(tmp_path / "directory", tmp_path / "file")
    cases = ((tmp_path / "directory", 0o500), (tmp_path / "file" / DATABASE, 0o400))
    os.chmod(tmp_path, 0o755)  # the unprivileged run must reach the state directories
    for path, mode in cases:
        os.chmod(path, mode)
    proc = subprocess.run(_no_root_override([sys.executable, "-c", _TRY_OPEN, str(tmp_path / "directory"),
                                             str(tmp_path / "file")]),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for (path, mode), out in zip(cases, proc.stdout.strip().splitlines(), strict=True):
        assert out.startswith(f"StoreAccessError the meta server cannot use its state directory: {path} "
                              f"(mode {mode:04o}, owner "), out
        assert "cannot be written by user" in out and "Its data is intact" in out and "chmod u+rwx" in out
        assert "damaged" not in out and "move" not in out, out
        os.chmod(path, 0o700 if path.is_dir() else 0o600)
        assert _open(path if path.is_dir() else path.parent)[1] == 1  # nothing was moved or lost


async def _register(directory) -> None:
    state = MetaState(SqliteStore(directory))
    state.load()
    await state.register("j", "writer", 0, group="g", host="h", endpoints={}, layout=b"W")
    await state.report_version("j", 1, "fp", writer_rank=0, num_writers=1, epoch=0)
    await state.close()


def test_the_store_is_private_to_its_user(tmp_path):
    state_dir = tmp_path / "state"

    async def run() -> None:
        state = MetaState(SqliteStore(state_dir))
        state.load()
        await state.register("j", "writer", 0, group="g", host="h", endpoints={}, layout=b"W")
        names = sorted(p.name for p in state_dir.iterdir())
        assert names == [COMMITTED, "lock", DATABASE, f"{DATABASE}-shm", f"{DATABASE}-wal"], names
        assert {n: _mode(state_dir / n) for n in names} == dict.fromkeys(names, 0o600)
        await state.close()

    asyncio.run(run())
    assert _mode(state_dir) == 0o700
    instance, _ = _open(state_dir)

    # a directory of an earlier release (0755, files 0644, `committed` without a stamp) is
    # tightened at start, and its clients carry on
    mark = (state_dir / COMMITTED).read_text().split()
    (state_dir / COMMITTED).write_text(f"{mark[0]} {mark[1]}\n")
    os.chmod(state_dir, 0o755)
    for name in (DATABASE, COMMITTED):
        os.chmod(state_dir / name, 0o644)
    assert _open(state_dir)[0] == instance
    assert _mode(state_dir) == 0o700 and _mode(state_dir / DATABASE) == _mode(state_dir / COMMITTED) == 0o600

    shared = tmp_path / "scratch"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(StoreAccessError, match=r"is a shared directory \(mode 1777, sticky like /tmp\): pass a "
                                               r"directory of its own, e.g. --state-dir .*scratch/weightsync-meta"):
        SqliteStore(shared).open("x")
    assert _mode(shared) == 0o1777


def test_a_client_that_gives_up_on_503s_quotes_the_servers_reason():
    client = MetaClient("http://127.0.0.1:9", job="j", token="t" * 16, timeout=1e-3)
    reason = ("the meta server cannot store the change: /var/lib/weightsync-meta is full (database or disk is "
              "full); nothing was changed. Free space there: the same request then succeeds")
    try:
        steps = exchange(client, calls.put_document("j", "k", b"v"))
        next(steps)
        with pytest.raises(ConnectionError) as refused:
            steps.send(Answer(503, json.dumps({"detail": reason}).encode()))
        assert "kept refusing PUT /v1/jobs/j/documents/k" in str(refused.value)
        assert str(refused.value).endswith(f"its last answer: HTTP 503: {reason}")
        assert "unreachable" not in str(refused.value)
    finally:
        client.close()
