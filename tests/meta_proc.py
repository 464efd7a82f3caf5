"""A real ``weightsync meta-server`` process for tests: free port, token file, clean shutdown.

    with MetaServerProcess(tmp_path, "--max-wait", "2") as server:
        client = MetaClient(server.address, token=server.token)

The port is chosen by the OS (``--port 0``) and read from the server's first line; a restart
(``server.restart()``) reuses that port so clients carry on. Every wait has a timeout and the
process is always ended, killed if it ignores SIGTERM.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from weightsync.meta.config import ensure_token_file

START_TIMEOUT = 30.0


class MetaServerProcess:
    def __init__(self, directory: Path, *args: str, port: int = 0, prefix: Sequence[str] = ()) -> None:
        self.directory = directory
        self.prefix = list(prefix)  # e.g. nsenter into a mount namespace
        self.token_file = directory / "token"
        self.token = ensure_token_file(self.token_file)
        self.args = list(args)
        self.port = port
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.log = directory / "server.log"

    def start(self) -> MetaServerProcess:
        cmd = [*self.prefix, sys.executable, "-m", "weightsync.cli", "meta-server", "--port", str(self.port),
               "--token-file", str(self.token_file), *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(START_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"meta server did not start: {line!r}\n{self.log.read_text()[-2000:]}")
        self.address = line.rsplit(" ", 1)[1].strip()
        self.port = int(self.address.rsplit(":", 1)[1])
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def kill(self) -> None:
        """Crash it (SIGKILL): no graceful shutdown, no final flush."""
        self.stop(signal.SIGKILL)

    def restart(self) -> MetaServerProcess:
        """Start again on the same port with the same arguments."""
        self.stop()
        return self.start()

    def __enter__(self) -> MetaServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for_long_polls(client, count: int = 1, timeout: float = 20.0) -> None:
    """Until the server holds ``count`` long-polls (a waiter thread's call has reached it): an
    event to order a test on, instead of a sleep that fails under load."""
    from weightsync.clock.deadline import Deadline

    deadline = Deadline.after(timeout)
    while client.server_status()["waiting"] < count:
        if deadline.expired:
            raise TimeoutError(f"the server did not hold {count} long-poll(s) within {timeout} s")
        time.sleep(0.01)  # a bounded poll of the server's own count
