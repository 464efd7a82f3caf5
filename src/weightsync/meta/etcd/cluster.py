"""A local etcd cluster on loopback, for tests, benchmarks and trying the etcd backend on one machine.

Each member is an ``etcd`` process (Debian's ``etcd-server``: ``apt-get install etcd-server``)
on free loopback ports, with its data in a directory of its own; :meth:`LocalEtcdCluster.stop`
kills every member it started. By default members elect faster than etcd's defaults (heartbeat
50 ms, election 500 ms) so that fault tests see an election within a second; a benchmark that
loads the machine passes etcd's own (``heartbeat_ms=100, election_ms=1000``), with which a
busy member is not taken for a dead leader.

    with LocalEtcdCluster(tmp_path, members=3) as cluster:
        meta = EtcdMetaClient(cluster.address, job="j")
        cluster.kill(cluster.leader())      # an election follows
        cluster.start(0)                    # a member returns with its data

With ``tls`` (:class:`EtcdTLS`: a CA, the members' certificate and a client's), the members
serve clients over HTTPS only and require a client certificate signed by that CA
(``--client-cert-auth``); :attr:`LocalEtcdCluster.address` is then an ``etcds://`` address that
carries the CA and the client certificate, as a user's would.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from weightsync.clock.deadline import Deadline

INSTALL = "apt-get install -y etcd-server (as root; it provides /usr/bin/etcd)"


def etcd_binary() -> str | None:
    """The etcd binary on this machine, or None."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").is_file() else None)


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class EtcdTLS:
    """PEM files for a cluster that speaks TLS to its clients: the CA that signed everything, the
    members' certificate (valid for 127.0.0.1) and key, and a client's certificate and key."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def context(self) -> ssl.SSLContext:
        """What a client of the members verifies them with, presenting the client certificate."""
        context = ssl.create_default_context(cafile=self.ca)
        context.load_cert_chain(self.client_cert, self.client_key)
        return context


class LocalEtcdCluster:
    """``members`` etcd processes on loopback (see module docstring)."""

    def __init__(self, directory: str | Path, *, members: int = 3, start_timeout: float = 30.0,
                 tls: EtcdTLS | None = None, heartbeat_ms: int = 50, election_ms: int = 500) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError(f"etcd is not installed: {INSTALL}")
        self.binary, self.directory, self.size, self.tls = binary, Path(directory), members, tls
        ports = _free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self.start_timeout = start_timeout
        if not 0 < heartbeat_ms * 5 <= election_ms:
            raise ValueError(f"election_ms ({election_ms}) must be at least 5 heartbeats ({heartbeat_ms} ms each), "
                             "as etcd requires (its docs advise about 10)")
        self.timing = (heartbeat_ms, election_ms)

    @property
    def urls(self) -> list[str]:
        scheme = "https" if self.tls else "http"
        return [f"{scheme}://127.0.0.1:{p}" for p in self.client_ports]

    @property
    def address(self) -> str:
        members = ",".join(f"127.0.0.1:{p}" for p in self.client_ports)
        if self.tls is None:
            return f"etcd://{members}"
        query = urllib.parse.urlencode({"ca": self.tls.ca, "cert": self.tls.client_cert, "key": self.tls.client_key})
        return f"etcds://{members}?{query}"

    def _command(self, i: int, state: str) -> list[str]:
        peers = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.peer_ports))
        tls = [] if self.tls is None else ["--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key,
                                           "--trusted-ca-file", self.tls.ca, "--client-cert-auth"]
        return [self.binary, "--name", f"m{i}", "--data-dir", str(self.directory / f"m{i}"), *tls,
                "--listen-client-urls", self.urls[i], "--advertise-client-urls", self.urls[i],
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", peers, "--initial-cluster-state", state,
                "--initial-cluster-token", f"weightsync-{self.peer_ports[0]}",
                "--heartbeat-interval", str(self.timing[0]), "--election-timeout", str(self.timing[1]),
                "--logger", "zap", "--log-outputs", str(self.directory / f"m{i}.log"), "--log-level", "warn"]

    def start(self, i: int | None = None) -> LocalEtcdCluster:
        """Start every member (or member ``i`` again, with its data) and wait until it is healthy."""
        self.directory.mkdir(parents=True, exist_ok=True)
        first = all(p is None for p in self.procs)
        for j in range(self.size) if i is None else [i]:
            state = "new" if first and not (self.directory / f"m{j}").exists() else "existing"
            self.procs[j] = subprocess.Popen(self._command(j, state), stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = Deadline.after(self.start_timeout)
        for j in range(self.size) if i is None else [i]:
            self._wait_healthy(j, deadline)
        return self

    def _wait_healthy(self, i: int, deadline: Deadline) -> None:
        while True:
            proc = self.procs[i]
            if proc is not None and proc.poll() is not None:
                log = (self.directory / f"m{i}.log")
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"etcd member m{i} exited with {proc.returncode}: {tail}")
            if self.healthy(i):
                return
            if deadline.expired:
                raise TimeoutError(f"etcd member m{i} ({self.urls[i]}) not healthy within {self.start_timeout:g} s")
            time.sleep(min(0.1, deadline.remaining(0.0)))  # a starting process has no event to watch

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"{self.urls[i]}/health", timeout=1.0, context=self._context()) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _status(self, i: int) -> dict[str, object] | None:
        request = urllib.request.Request(f"{self.urls[i]}/v3/maintenance/status", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=1.0, context=self._context()) as r:
                answer: dict[str, object] = json.loads(r.read())
                return answer
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def _context(self) -> ssl.SSLContext | None:
        return None if self.tls is None else self.tls.context()

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the current leader (waiting up to ``timeout`` for one to be elected)."""
        deadline = Deadline.after(timeout)
        while True:
            ids: dict[str, int] = {}
            leader = None
            for i in range(self.size):
                status = self._status(i) if self.procs[i] is not None else None
                if status is not None:
                    ids[str(status["header"]["member_id"])] = i  # type: ignore[index]
                    leader = str(status.get("leader", "")) or leader
            if leader in ids and leader != "0":
                return ids[leader]
            if deadline.expired:
                raise TimeoutError(f"no etcd leader elected within {timeout:g} s")
            time.sleep(0.05)  # an election has no event to watch from outside

    def kill(self, i: int) -> None:
        """Kill member ``i`` (SIGKILL: no goodbye to its peers)."""
        proc, self.procs[i] = self.procs[i], None
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        for i in range(self.size):
            self.kill(i)

    def __enter__(self) -> LocalEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
