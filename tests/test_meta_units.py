"""Meta server pieces without a server process: records, wire, config, state, store, embedded server."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import threading

import msgpack
import pytest

from meta_proc import wait_for_long_polls
from weightsync.meta import EmbeddedMetaServer, MetaClient, MetaEnv, Participant, ParticipantTable, connect, wire
from weightsync.meta.config import ensure_token_file, new_token, normalize_address, read_token_file
from weightsync.meta.records import encode_columns, run_length
from weightsync.meta.sqlite_store import DATABASE, SqliteStore
from weightsync.meta.state import ConflictError, MetaState

pytestmark = pytest.mark.timeout(60)


# --- records and wire --------------------------------------------------------------------------

def test_a_new_token_can_follow_token_on_a_command_line():
    """One URL-safe token in 64 starts with ``-``, which argparse reads as an option: ``weightsync
    status --token <token>`` then failed ("argument --token: expected one argument"), 1 run in 64
    of tests/test_version_readback.py."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--token")
    tokens = [new_token() for _ in range(2000)]  # without the rule, some 31 of them start with "-"
    assert not [t for t in tokens if t.startswith("-")]
    assert parser.parse_args(["--token", tokens[0]]).token == tokens[0]


def test_participant_validates_and_freezes():
    p = Participant("writer", 3, "train", "h", {"tcp": "a:1"}, bytearray(b"x"))
    assert p.layout == b"x" and isinstance(p.layout, bytes)
    with pytest.raises(TypeError):
        p.endpoints["tcp"] = "b:2"  # type: ignore[index]
    assert hash(p) == hash(Participant("writer", 3, "train", "h", {"tcp": "a:1"}, b"x"))
    with pytest.raises(ValueError, match="role must be 'writer' or 'reader', not 'trainer'"):
        Participant("trainer", 0)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\*\*31\)"):
        Participant("reader", -1)
    with pytest.raises(TypeError, match=r"layout must be bytes \(e.g. msgpack.packb"):
        Participant("reader", 0, layout={"layout": "hf"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="endpoints must map transport names"):
        Participant("reader", 0, endpoints={"tcp": 1})  # type: ignore[dict-item]


def _roster(rows_by_role, blobs, documents=None):
    obj = {"job": "j", "roster_revision": 5, "blobs": blobs,
           "participants": {role: encode_columns(rows) for role, rows in rows_by_role.items()}}
    if documents is not None:
        obj["documents"] = documents
    return ParticipantTable.from_wire(msgpack.unpackb(msgpack.packb(obj)))


def test_participant_table_round_trip_is_compact_and_lazy():
    hw, hr = "w" * 32, "r" * 32
    writers = [(r, "train", f"node-{r // 8}", {"nixl": f"10.0.{r // 8}.{r % 8}:5555"}, hw) for r in range(1024)]
    readers = [(r, "rollout", f"gpu-{r // 8}", {"nixl": f"10.1.{r // 8}.{r % 8}:5555", "tcp": "x:1"} if r % 2 else
                {"nixl": f"10.1.{r // 8}.{r % 8}:5555"}, hr) for r in range(256)]
    encoded = msgpack.packb({"blobs": {hw: b"W" * 100, hr: b"R" * 100},
                             "participants": {"writer": encode_columns(writers), "reader": encode_columns(readers)}})
    assert len(encoded) < 45_000  # 1280 ranks: the endpoints are nearly all of it
    table = _roster({"writer": writers, "reader": readers}, {hw: b"W" * 100, hr: b"R" * 100}, {"model/x": b"{}"})
    assert (table.count("writer"), table.count("reader"), len(table)) == (1024, 256, 1280)
    assert table.layouts("writer") == {b"W" * 100: list(range(1024))}
    assert table.get("writer", 17) == Participant("writer", 17, "train", "node-2", {"nixl": "10.0.2.1:5555"},
                                                  b"W" * 100)
    assert table.get("reader", 3).endpoints == {"nixl": "10.1.0.3:5555", "tcp": "x:1"}
    assert table.get("reader", 4).endpoints == {"nixl": "10.1.0.4:5555"}
    assert table.get("reader", 256) is None and table.documents == {"model/x": b"{}"}
    everyone = table.participants()
    assert [(p.role, p.rank) for p in everyone] == sorted((p.role, p.rank) for p in everyone)
    assert everyone[300] == table.get("writer", 44)
    assert table.missing("writer", 1026) == [1024, 1025]


def test_participant_table_rejects_malformed_rosters():
    with pytest.raises(ValueError, match="malformed roster"):
        ParticipantTable.from_wire({"job": "j"})
    bad = {"job": "j", "roster_revision": 1, "blobs": {},
           "participants": {"writer": {"rank": [0, 1], "group": [["g", 3]], "host": [["h", 2]],
                                       "layout": [["x", 2]], "endpoints": {}}}}
    with pytest.raises(ValueError, match="column 'group' does not cover 2 rows"):
        ParticipantTable.from_wire(bad).participants()


def test_run_length_and_extend_map():
    assert run_length("aabccc") == [["a", 2], ["b", 1], ["c", 3]] and run_length([]) == []
    for n in (0, 14, 15, 16, 70_000):
        base = {f"k{i}": i for i in range(n)}
        extended = wire.extend_map(wire.pack(base), {"documents": {"a": b"x", "b": None}}, msgpack_=True)
        assert msgpack.unpackb(extended) == {**base, "documents": {"a": b"x", "b": None}}
        as_json = wire.extend_map(wire.to_json(base), {"documents": {"a": b"x"}}, msgpack_=False)
        assert json.loads(as_json) == {**base, "documents": {"a": "eA=="}}


@pytest.mark.parametrize(("data", "message"), [
    (b"\x85\xa4role", "not valid msgpack"), (b"\xc1", "not valid msgpack"), (b"\x01\x02", "after its msgpack object"),
])
def test_unpack_errors_name_the_problem(data, message):
    with pytest.raises(wire.BodyError, match=message):
        wire.unpack(data)


# --- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "expected"), [
    ("127.0.0.1:7700", "http://127.0.0.1:7700"), ("http://host:1/", "http://host:1"),
    ("https://meta.example:443", "https://meta.example:443"), ("[::1]:80", "http://[::1]:80"),
])
def test_normalize_address(given, expected):
    assert normalize_address(given) == expected


@pytest.mark.parametrize("bad", ["", "host", "http://host", "ftp://h:1", "h:1/path", "h:notaport"])
def test_normalize_address_rejects(bad):
    with pytest.raises(ValueError, match="must be 'http://host:port' or 'host:port'"):
        normalize_address(bad)


def test_env_and_token_files(tmp_path):
    token_file = tmp_path / "t"
    token = ensure_token_file(token_file)
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600 and len(token) >= 32
    assert ensure_token_file(token_file) == token == read_token_file(token_file)
    env = MetaEnv.from_env({"WEIGHTSYNC_META_ADDR": "h:1", "WEIGHTSYNC_META_TOKEN_FILE": str(token_file)})
    assert env == MetaEnv(address="http://h:1", token=token)
    assert MetaEnv.from_env({"WEIGHTSYNC_META_TOKEN": "abcdefgh", "WEIGHTSYNC_META_TOKEN_FILE": "/nope"}).token == \
        "abcdefgh"
    assert MetaEnv.from_env({}) == MetaEnv()
    with pytest.raises(ValueError, match="token file /nope does not exist"):
        MetaEnv.from_env({"WEIGHTSYNC_META_TOKEN_FILE": "/nope"})
    with pytest.raises(ValueError, match="at least 8 characters"):
        MetaEnv.from_env({"WEIGHTSYNC_META_TOKEN": "short"})


def test_client_needs_a_token(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_META_TOKEN", raising=False)
    monkeypatch.delenv("WEIGHTSYNC_META_TOKEN_FILE", raising=False)
    with pytest.raises(ValueError, match="no meta server token: pass token=, or set WEIGHTSYNC_META_TOKEN"):
        MetaClient("127.0.0.1:1")
    monkeypatch.delenv("WEIGHTSYNC_META_ADDR", raising=False)
    with pytest.raises(ValueError, match="no meta server address: pass address= or set WEIGHTSYNC_META_ADDR"):
        MetaClient.from_env(token="abcdefgh")
    with pytest.raises(ValueError, match="invalid job name 'a b'"):
        MetaClient("127.0.0.1:1", job="a b", token="abcdefgh")


# --- state and store ---------------------------------------------------------------------------

async def _exercise(state: MetaState) -> None:
    await state.start()
    assert await state.register("j", "writer", 0, group="g", host="h", endpoints={"tcp": "a:1"}, layout=b"L")
    assert not await state.register("j", "writer", 0, group="g", host="h", endpoints={"tcp": "a:1"}, layout=b"L")
    with pytest.raises(ConflictError, match="writer rank 0 of job 'j'"):
        await state.register("j", "writer", 0, group="g", host="h2", endpoints={}, layout=b"L")
    await state.register("j", "reader", 0, group="g", host="h", endpoints={}, layout=b"R")
    await state.put_document("j", "model/x", b"cfg")
    assert await state.report_version("j", 1, "fp", writer_rank=0, num_writers=1) is not None
    assert await state.report_version("j", 2, "fp2", writer_rank=0, num_writers=2) is None
    await state.report_reader("j", 0, 1, nbytes=5, seconds=0.5)
    await state.register("j", "reader", 1, group="g", host="h", endpoints={}, layout=b"R")
    await state.report_reader("j", 1, 1, error="boom")
    with pytest.raises(ConflictError, match="reader rank 2 is not registered in job 'j'"):
        await state.report_reader("j", 2, 1)
    # version 2 in a later epoch (writers restarted) supersedes the pending one, and survives a replay
    assert (await state.report_version("j", 2, "fp2@1", writer_rank=0, num_writers=1, epoch=1)).epoch == 1
    await state.register("other", "reader", 0, group="", host="", endpoints={}, layout=b"")
    assert await state.delete_job("other")


def test_a_new_attempt_of_a_version_supersedes_it_and_readers_failures_of_the_old_one():
    """Writers restarted in version 2 publish it again in a later epoch: readers waiting past
    the failed epoch wake, their failure of it no longer counts for the writers' barrier, and a
    late report of the earlier epoch is refused."""
    async def run() -> None:
        state = MetaState()
        await state.start()
        await state.register("j", "reader", 0, group="g", host="h", endpoints={}, layout=b"R")
        assert await state.report_version("j", 2, "fp@3", writer_rank=0, num_writers=1, epoch=3)
        await state.report_reader("j", 0, 2, error="writer 1 died")
        assert await state.wait_readers("j", min_version=2, count=1, wait=0.0)  # failed: done with 2
        waiter = asyncio.ensure_future(state.wait_version("j", 2, 30.0, after_epoch=3))
        assert (await state.wait_version("j", 2, 0.0)).epoch == 3  # nothing newer than version 2
        assert not waiter.done()
        assert await state.report_version("j", 2, "fp@4", writer_rank=0, num_writers=1, epoch=4)
        assert (await asyncio.wait_for(waiter, 10.0)).epoch == 4
        assert not await state.wait_readers("j", min_version=2, count=1, wait=0.0)  # must apply epoch 4
        await state.report_reader("j", 0, 2, error="late news of epoch 3", epoch=3)  # superseded: ignored
        assert not await state.wait_readers("j", min_version=2, count=1, wait=0.0)
        with pytest.raises(ConflictError, match="epoch 3 of version 2, but epoch 4 of it is published"):
            await state.report_version("j", 2, "fp@3", writer_rank=0, num_writers=1, epoch=3)
        await state.close()

    asyncio.run(run())


def _view(state: MetaState) -> dict:
    status = state.status()
    for job in status["jobs"]:
        job.pop("updated_at")
    status.pop("server")
    return {"status": status, "rosters": {n: state.roster(n, msgpack_=True) for n in state.jobs}}


def test_the_store_replays_to_the_same_state_and_compacts(tmp_path):
    async def live() -> dict:
        state = MetaState(SqliteStore(tmp_path, compact_bytes=200))  # compacts while running, too
        state.load()
        await _exercise(state)
        view = _view(state)
        await state.close()
        return view

    before = asyncio.run(live())
    state = MetaState(SqliteStore(tmp_path))
    assert state.load() > 0
    assert _view(state) == before
    assert state.store.stats.compactions == 1  # at start
    state.store.close()


def test_a_store_that_is_not_a_database_is_refused(tmp_path):
    """A crash never leaves half a change in the store (one SQLite transaction each), so there is
    no torn tail to cut off: what does not read back whole is damage, and is refused."""
    async def live() -> None:
        state = MetaState(SqliteStore(tmp_path))
        state.load()
        await state.put_document("j", "a", b"1")
        await state.close()

    asyncio.run(live())
    (tmp_path / DATABASE).write_bytes(b"\x93garbage")
    with pytest.raises(ValueError, match=rf"store in {tmp_path} is damaged: {DATABASE} is not an SQLite database"):
        MetaState(SqliteStore(tmp_path)).load()


def test_long_polls_wake_only_when_satisfied():
    async def scenario() -> None:
        state = MetaState()
        await state.start()
        barrier = asyncio.ensure_future(state.wait_registered("j", writers=2, readers=0, wait=5))
        other_job = asyncio.ensure_future(state.wait_registered("k", writers=1, readers=0, wait=0.2))
        await asyncio.sleep(0)
        assert state.watch.waiting == 2
        await state.register("j", "writer", 0, group="", host="", endpoints={}, layout=b"")
        await asyncio.sleep(0)
        assert not barrier.done()
        await state.register("j", "writer", 1, group="", host="", endpoints={}, layout=b"")
        assert await asyncio.wait_for(barrier, 1) is True
        assert await asyncio.wait_for(other_job, 1) is False  # timed out: the 'j' registrations did not wake it
        assert state.watch.waiting == 0
        waiting = asyncio.ensure_future(state.wait_version("j", after=0, wait=30))
        await asyncio.sleep(0)
        await state.close()  # shutdown answers waiting long-polls at once
        assert await asyncio.wait_for(waiting, 1) is None

    asyncio.run(scenario())


# --- embedded server and connect() -------------------------------------------------------------

def _server_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("weightsync-meta-server")]


def test_embedded_server_starts_serves_and_stops_cleanly():
    server = EmbeddedMetaServer().start()
    outcome: list[object] = []
    with MetaClient(server.address, token=server.token, timeout=1) as c:
        assert server.address.startswith("http://127.0.0.1:")
        c.register(Participant("writer", 0))

        def wait() -> None:
            try:
                outcome.append(c.wait_version(after=5, timeout=30))
            except ConnectionError as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_for_long_polls(c)  # the long-poll reached the server
        server.stop()  # a long-poll in flight must not hold up stop(); its client then gives up
        waiter.join(10)
    assert not waiter.is_alive() and isinstance(outcome[0], ConnectionError) and _server_threads() == []


def test_connect_starts_an_embedded_server_without_an_address(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_META_ADDR", raising=False)
    client, server = connect(job="solo")
    try:
        assert server is not None and client.address == server.address
        client.put_document("k", b"v")
        with EmbeddedMetaServer() as other:
            monkeypatch.setenv("WEIGHTSYNC_META_ADDR", other.address)
            monkeypatch.setenv("WEIGHTSYNC_META_TOKEN", other.token)
            remote, none = connect(job="solo")
            with remote:
                assert none is None and remote.address == other.address and remote.get_document("k") is None
    finally:
        client.close()
        if server is not None:
            server.stop()
    assert _server_threads() == []


def test_server_token_sources(tmp_path, monkeypatch):
    from argparse import Namespace

    from weightsync.cli.commands.meta_server import _token

    monkeypatch.delenv("WEIGHTSYNC_META_TOKEN", raising=False)
    token, source = _token(Namespace(token_file=None, state_dir=str(tmp_path / "state")))
    assert source == f"token file {tmp_path / 'state' / 'token'}"
    assert _token(Namespace(token_file=None, state_dir=str(tmp_path / "state")))[0] == token  # kept across restarts
    assert _token(Namespace(token_file=str(tmp_path / "t"), state_dir=None))[0] == read_token_file(tmp_path / "t")
    monkeypatch.setenv("WEIGHTSYNC_META_TOKEN", "from-the-env")
    assert _token(Namespace(token_file=None, state_dir=str(tmp_path / "state"))) == ("from-the-env",
                                                                                      "WEIGHTSYNC_META_TOKEN")
    monkeypatch.delenv("WEIGHTSYNC_META_TOKEN")
    generated, source = _token(Namespace(token_file=None, state_dir=None))
    assert generated != token and "generated" in source


def test_importing_the_client_imports_neither_torch_nor_the_server_stack():
    import subprocess
    import sys

    code = ("import sys, weightsync.meta, weightsync.meta.client; "
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_a_failed_commit_shows_in_healthz_changes_nothing_and_the_store_goes_on(tmp_path):
    from fastapi.testclient import TestClient

    from weightsync.meta.server import ServerConfig, create_app

    state = MetaState(SqliteStore(tmp_path))
    state.load()
    token = "t" * 16
    auth = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(state, ServerConfig(token=token))) as http:
        assert http.get("/healthz").text == "ok"
        db = state.store._db  # type: ignore[attr-defined]
        db.execute(f"PRAGMA max_page_count={db.execute('PRAGMA page_count').fetchone()[0]}")  # the disk is full
        r = http.put("/v1/jobs/j/documents/a", content=b"1" * 100_000, headers=auth)
        assert r.status_code == 503 and "is full" in r.json()["detail"] and "nothing was changed" in r.json()["detail"]
        health = http.get("/healthz")
        assert health.status_code == 503 and "is full" in health.text
        assert http.get("/v1/jobs/j/documents/a", headers=auth).status_code == 404  # not applied
        db.execute("PRAGMA max_page_count=1073741823")
        assert http.put("/v1/jobs/j/documents/a", content=b"1" * 100_000, headers=auth).status_code == 200
        assert http.get("/healthz").text == "ok"


def test_a_server_reachable_from_other_hosts_needs_a_shared_token(monkeypatch, capsys):
    from weightsync.cli import main

    monkeypatch.delenv("WEIGHTSYNC_META_TOKEN", raising=False)
    assert main(["meta-server", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--host 0.0.0.0 accepts connections from other machines" in capsys.readouterr().err


def test_the_meta_server_process_imports_no_torch(tmp_path):
    """cli/__init__.py promises lazy imports: a meta server used to hold torch (250 MB) it never uses."""
    import sys as _sys

    _sys.path.insert(0, os.path.dirname(__file__))
    from meta_proc import MetaServerProcess

    with MetaServerProcess(tmp_path) as server:
        assert server.proc is not None
        with open(f"/proc/{server.proc.pid}/maps") as maps:
            libraries = {line.split()[-1].rsplit("/", 1)[-1] for line in maps if ".so" in line}
        assert not [lib for lib in libraries if "torch" in lib], sorted(libraries)
        with MetaClient(server.address, token=server.token) as c:
            assert c.status()["job"] == "default"


def test_a_writer_waits_for_its_own_attempt_before_it_counts_readers_failures():
    """A restarted writer 0 publishes its part of version 1 in epoch 2 before writer 1 has: the
    readers' failures of epoch 0 are not failures of its epoch. It waits until every writer
    published epoch 2 (a bounded wait naming the epoch), then for the readers on it."""
    from weightsync.clock.deadline import Deadline
    from weightsync.job.channel import JobChannel

    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token, job="j", timeout=5) as c:
        c.register(Participant("reader", 0))
        for w in range(2):
            c.publish_version(1, "fp@0", writer_rank=w, num_writers=2, epoch=0)
        c.report_failed(0, 1, "writer 1 died", epoch=0)
        c.publish_version(1, "fp@2", writer_rank=0, num_writers=2, epoch=2)  # writer 1 restarts slowly
        writer0 = JobChannel(c, role="writer", rank=0)
        with pytest.raises(TimeoutError, match="epoch 2 of version 1 was not published by every writer"):
            writer0.wait_readers(min_version=1, readers=1, deadline=Deadline.after(0.3), epoch=2)
        c.publish_version(1, "fp@2", writer_rank=1, num_writers=2, epoch=2)
        with pytest.raises(TimeoutError):  # the reader has not taken epoch 2 yet
            writer0.wait_readers(min_version=1, readers=1, deadline=Deadline.after(0.3), epoch=2)
        c.report_applied(0, 1, nbytes=8, seconds=0.1)
        assert writer0.wait_readers(min_version=1, readers=1, deadline=Deadline.after(5), epoch=2) == {}


def _protocol_methods(proto: type) -> dict[str, object]:
    from typing import Generic, Protocol

    return {name: value for cls in reversed(proto.__mro__) if cls not in (object, Protocol, Generic)
            for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def _signature(fn) -> list[tuple[str, object, object]]:
    import inspect

    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("pair", ["MetaClient:MetaPort", "EtcdMetaClient:MetaPort", "DirectoryMeta:TransportBoard"])
def test_what_the_job_channel_is_given_has_every_call_of_its_port(tmp_path, pair):
    """``JobChannel`` takes a ``MetaPort`` (a ``TransportBoard`` when only transports use it, as in
    the transport contract tests): every call the port declares exists, with its parameters."""
    from fake_meta import DirectoryMeta
    from weightsync.job import channel as job

    given, port = pair.split(":")
    if given == "EtcdMetaClient":
        from etcd_helpers import require_etcd

        require_etcd()
        from weightsync.meta.etcd.client import EtcdMetaClient
    meta = (MetaClient("127.0.0.1:1", token="abcdefgh") if given == "MetaClient"
            else EtcdMetaClient("etcd://127.0.0.1:1") if given == "EtcdMetaClient" else DirectoryMeta(str(tmp_path)))
    methods = _protocol_methods(getattr(job, port))
    assert "put_document" in methods and (port == "TransportBoard" or "acquire_lease" in methods)
    assert isinstance(meta.job, str)
    for name, declared in methods.items():
        assert _signature(getattr(meta, name)) == _signature(declared), name
    if given != "DirectoryMeta":
        meta.close()
