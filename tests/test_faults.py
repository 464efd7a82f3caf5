"""Fault injection over real processes, on every transport: SIGKILL of a writer and of a reader
mid-transfer, SIGSTOP of a writer, a meta server killed and restarted during and between
versions (with and without ``--state-dir``), with resharding (TP2 writers -> TP1 x 2 readers).

After each fault: every surviving reader ends on a complete version, bitwise; the job's
next version (or next attempt of the interrupted one) succeeds with the killed rank
restarted; no process is left and no ``/dev/shm/weightsync-*`` file leaks. Marked
``faults``; the whole file runs in about five minutes on 2 cores with ``-n 2``
(``pytest -m faults tests/test_faults.py``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from meta_proc import MetaServerProcess
from test_sync_e2e import finish
from test_sync_e2e import launch as launch_rank
from weightsync.deadline import Deadline
from weightsync.meta.client import EmbeddedMetaServer
from weightsync.transport import unavailable_reason

pytestmark = pytest.mark.faults

TIMEOUT = 20.0
COMMON = {"source": "megatron:tp=2", "target": "vllm:tp=1,replicas=2", "num_writers": 2, "num_readers": 2,
          "config": "tiny-qwen3-moe", "timeout": TIMEOUT}


def shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("weightsync")} if os.path.isdir("/dev/shm") else set()


#: pids of the rank processes the running test started (segment names carry their creator's pid)
LAUNCHED: set[int] = set()


def launch(*args, **kwargs):
    proc = launch_rank(*args, **kwargs)
    LAUNCHED.add(proc.pid)
    return proc


def creator(name: str) -> int | None:
    """The pid in a segment name (``weightsync-<pid>-...``, nixl's ``weightsync-<who>-e<n>-<pid>-...``)."""
    return next((int(part) for part in name.split("-")[1:] if part.isdigit()), None)


@pytest.fixture
def no_leaks():
    """No segment of this test's rank processes is left once they are gone (tests running beside
    this one under xdist have segments of their own, alive or about to be swept)."""
    LAUNCHED.clear()
    yield
    leaked = {n for n in shm_files() if creator(n) in LAUNCHED}
    assert leaked == set(), f"/dev/shm files leaked: {sorted(leaked)}"


#: every transport, with resharding (TP2 writers -> TP1 x 2 readers); shm both ways it exposes versions
TRANSPORTS = [
    pytest.param({"transport": "torch"}, id="torch"),
    pytest.param({"transport": "shm"}, id="shm-snapshot"),
    pytest.param({"transport": "shm", "shared_source": True}, id="shm-zero-copy"),
    pytest.param({"transport": "file"}, id="file"),
    pytest.param({"transport": "nixl", "transport_options": {"nixl_mode": "pull"}}, id="nixl-pull"),
    pytest.param({"transport": "nixl", "transport_options": {"nixl_mode": "push"}}, id="nixl-push"),
]

def transport_name(options) -> str:
    name = options["transport"]
    if options.get("shared_source"):
        return f"{name} (zero-copy)"
    mode = options.get("transport_options", {}).get("nixl_mode")
    return f"{name} {mode}" if mode else name


@pytest.fixture
def tally(request):
    """Name the fault this test injects: conftest.py counts it (injected / survived / hangs) and
    prints the table at the end of the run, xdist workers included."""
    def record(fault: str, options) -> None:
        request.node.user_properties.append(("fault", f"{fault}|{transport_name(options)}"))

    return record


def skip_unavailable(options) -> None:
    if unavailable_reason(options["transport"]):
        pytest.skip(unavailable_reason(options["transport"]))


def assert_reader_ends_exact(out, rank, version):
    code, records, stderr = out[("reader", rank)]
    assert code == 0, stderr[-3000:]
    last = records[-1]
    assert last["ok"] and last["exact"] and last["version"] == version, (records, stderr[-3000:])
    for r in records[:-1]:
        assert r["ok"] or r["seconds"] < TIMEOUT + 10  # a failure ends within the timeout, never hangs


@pytest.mark.parametrize("options", TRANSPORTS)
def test_writer_sigkilled_mid_transfer_restarts_and_writes_the_version_again(options, no_leaks, tally):
    skip_unavailable(options)
    tally("writer SIGKILL mid-send; both writers restart and write V again", options)
    common = {**COMMON, **options}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1], **common),
                 ("writer", 1): launch(server, "writer", 1, versions=[0, 1], die_at=1, die_how="SIGKILL", **common)}
        procs |= {("reader", r): launch(server, "reader", r, until=1, **common) for r in range(2)}
        first = {rank: procs.pop(("writer", rank)) for rank in range(2)}
        for p in first.values():
            p.communicate(timeout=TIMEOUT * 4)
        assert first[1].returncode == -signal.SIGKILL
        for rank in range(2):
            procs[("writer", rank)] = launch(server, "writer", rank, versions=[1], **common)
        out = finish(procs, TIMEOUT * 8)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 1)
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and records[-1]["ok"], (records, stderr[-3000:])


@pytest.mark.parametrize("options", TRANSPORTS)
def test_reader_sigkilled_mid_transfer_the_other_carries_on_and_the_restarted_one_catches_up(options, no_leaks,
                                                                                              tally):
    skip_unavailable(options)
    tally("reader SIGKILL as it receives V; restarted", options)
    common = {**COMMON, **options}
    with EmbeddedMetaServer() as server:
        # retries: a version in flight when the restarted reader joins fails (the writers'
        # connections do not include it) and the trainer writes it again, as after any failure
        procs = {("writer", r): launch(server, "writer", r, versions=[0, 1, 2], retries=1, **common)
                 for r in range(2)}
        procs[("reader", 0)] = launch(server, "reader", 0, until=2, **common)
        dying = launch(server, "reader", 1, until=2, die_at=1, die_how="SIGKILL", **common)
        dying.communicate(timeout=TIMEOUT * 4)
        assert dying.returncode == -signal.SIGKILL
        procs[("reader", 1)] = launch(server, "reader", 1, until=2, **common)
        out = finish(procs, TIMEOUT * 8)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 2)
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and records[-1]["version"] == 2 and records[-1]["ok"], (records, stderr[-3000:])


@pytest.mark.parametrize("options", TRANSPORTS)
def test_writer_sigstopped_others_fail_in_time_then_a_restart_completes_the_version(options, no_leaks, tally):
    skip_unavailable(options)
    tally("writer SIGSTOP mid-send (others fail in time); killed, both writers restart", options)
    common = {**COMMON, **options}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1], **common)}
        stopped = launch(server, "writer", 1, versions=[0, 1], die_at=1, die_how="SIGSTOP", **common)
        procs |= {("reader", r): launch(server, "reader", r, until=1, **common) for r in range(2)}
        try:
            code, records, _ = finish({"w0": procs.pop(("writer", 0))}, TIMEOUT * 4)["w0"]
            assert code == 0 and not records[-1]["ok"] and records[-1]["seconds"] < TIMEOUT + 10, records
        finally:
            stopped.kill()  # frozen: the operator (or torchrun) kills it
            stopped.communicate(timeout=TIMEOUT)
        for rank in range(2):
            procs[("writer", rank)] = launch(server, "writer", rank, versions=[1], **common)
        out = finish(procs, TIMEOUT * 8)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 1)


@pytest.mark.parametrize("when", ["between", "during"])
@pytest.mark.parametrize("durable", [True, False], ids=["state-dir", "no-state-dir"])
def test_meta_server_killed_and_restarted_the_job_carries_on(tmp_path, durable, when, no_leaks, tally):
    """With ``--state-dir`` the restarted server has everything; without, clients see that it
    lost its state (a new server instance), fail the version in flight naming that, and register
    again. Either way the next versions succeed. Writer 0 pauses (after version 0, or inside
    version 1 just before it sends) while the server is killed and restarted."""
    common = {**COMMON, "transport": "shm"}
    tally(f"meta server SIGKILL + restart {when} versions, " + ("with" if durable else "without") + " --state-dir",
          common)
    flags = tmp_path / "flags"
    flags.mkdir()
    pause = {"pause_before": 1} if when == "between" else {"hold_at": 1}
    args = ("--state-dir", str(tmp_path / "state")) if durable else ()
    with MetaServerProcess(tmp_path, *args) as server:
        procs = {("writer", r): launch(server, "writer", r, versions=[0, 1, 2], retries=1, flag_dir=str(flags),
                                       **(pause if r == 0 else {}), **common) for r in range(2)}
        procs |= {("reader", r): launch(server, "reader", r, until=2, **common) for r in range(2)}
        try:
            deadline = Deadline.after(TIMEOUT * 3)
            while not (flags / "held").exists():
                assert not deadline.expired, "writer 0 did not reach the fault point in time"
                time.sleep(0.02)  # a bounded poll for the worker's flag file
            server.kill()
            server.start()  # same port
            (flags / "go").touch()
            out = finish(procs, TIMEOUT * 8)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    for rank in range(2):
        assert_reader_ends_exact(out, rank, 2)
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and records[-1]["version"] == 2 and records[-1]["ok"], (records, stderr[-3000:])
