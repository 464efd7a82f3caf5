"""``--state-dir``: a crashed and restarted meta server carries on, and so do its clients."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from meta_proc import MetaServerProcess, wait_for_long_polls
from weightsync.meta import MetaClient, Participant

pytestmark = pytest.mark.timeout(90)


def _populate(c: MetaClient) -> None:
    for rank in range(2):
        c.register(Participant("writer", rank, "train", f"h{rank}", {"tcp": f"10.0.0.{rank}:1"}, b"megatron"))
    c.register(Participant("reader", 0, "rollout", "h9", {"tcp": "10.0.0.9:1"}, b"vllm"))
    c.put_document("model/abc", b"{config}")
    c.publish_version(1, "fp1", writer_rank=0, num_writers=2)
    c.publish_version(1, "fp1", writer_rank=1, num_writers=2)
    c.publish_version(2, "fp2", writer_rank=0, num_writers=2)  # pending: writer 1 has not reported
    c.report_applied(0, 1, nbytes=42, seconds=0.1)


def test_crash_restart_reloads_everything_and_clients_carry_on(tmp_path):
    server = MetaServerProcess(tmp_path, "--state-dir", str(tmp_path / "state"), "--max-wait", "2")
    waiter_result: list[object] = []
    with server, MetaClient(server.address, job="j", token=server.token, timeout=20) as c, \
            MetaClient(server.address, job="j", token=server.token, timeout=20) as c2:
        _populate(c)
        before = (c.participants(), c.latest_version(), c.status()["pending_versions"])
        waiter = threading.Thread(target=lambda: waiter_result.append(c2.wait_version(after=1, timeout=40)))
        waiter.start()
        wait_for_long_polls(c)  # the waiter is now inside a long-poll on the old process

        server.kill()  # SIGKILL: nothing flushed at exit; acknowledged changes must already be on disk
        during: list[object] = []
        caller = threading.Thread(target=lambda: during.append(c.latest_version()))
        caller.start()  # a call while the server is down: retried with backoff
        time.sleep(0.5)  # the server stays down a while (not an ordering: the call retries either way)
        server.start()  # same port, same state directory

        caller.join(20)
        assert during == [before[1]]
        assert (c.participants(), c.latest_version(), c.status()["pending_versions"]) == before
        assert c.get_document("model/abc") == b"{config}"
        assert c.reader_versions() == {0: 1}
        assert c.status()["reader_state"][0]["nbytes"] == 42
        assert waiter.is_alive()  # still waiting for version 2, across the restart
        info = c.publish_version(2, "fp2", writer_rank=1, num_writers=2)  # writer 0's report survived
        assert info is not None and info.version == 2
        waiter.join(20)
        assert waiter_result == [info]
        with pytest.raises(ValueError, match="already registered with different data"):
            c.register(Participant("writer", 0, "train", "other-host", {}, b"megatron"))

        c.report_failed(0, 2, "peer died")  # the failed version survives the snapshot too

        # a clean restart compacts the store's log into a snapshot; the state is unchanged
        server.restart()
        assert c.latest_version() == info and len(c.participants()) == 3
        assert c.wait_readers(min_version=2, readers=1, timeout=5) == {0: None}
        assert c.status()["reader_state"][0]["failed_version"] == 2
    files = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert files == ["committed", "lock", "meta.sqlite3"], files


def test_sigterm_answers_waiting_long_polls_and_exits(tmp_path):
    with MetaServerProcess(tmp_path, "--max-wait", "30") as server, \
            MetaClient(server.address, token=server.token, timeout=1) as c:
        result: list[object] = []
        started = time.monotonic()
        waiter = threading.Thread(target=lambda: result.append(_swallow(c.wait_version, after=0, timeout=60)))
        waiter.start()
        wait_for_long_polls(c)
        proc = server.proc
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)  # a 30 s long-poll does not hold the shutdown
        waiter.join(10)
        assert not waiter.is_alive() and time.monotonic() - started < 10
        assert isinstance(result[0], ConnectionError) and server.address in str(result[0])


def _swallow(fn, **kw):
    try:
        return fn(**kw)
    except Exception as exc:
        return exc


def test_two_servers_cannot_share_a_state_dir(tmp_path):
    with MetaServerProcess(tmp_path, "--state-dir", str(tmp_path / "state")):
        proc = subprocess.run([sys.executable, "-m", "weightsync.cli", "meta-server", "--state-dir",
                               str(tmp_path / "state"), "--token-file", str(tmp_path / "token")],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "is in use by another meta server" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "70000"], "--port 70000 is not a TCP port"),
    (["--host", "203.0.113.1"], "cannot listen on 203.0.113.1:0"),
    (["--max-wait", "0"], "max_wait=0.0 must be in (0, 3600]"),
])
def test_cli_errors_are_one_line(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "weightsync.cli", "meta-server", "--token-file",
                           str(tmp_path / "token"), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_rejects_a_short_token_file(tmp_path):
    (tmp_path / "token").write_text("short\n")
    proc = subprocess.run([sys.executable, "-m", "weightsync.cli", "meta-server", "--token-file",
                           str(tmp_path / "token")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "at least 8 characters" in proc.stderr
