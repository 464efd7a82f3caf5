"""The one launcher of the suite's multi-process tests: ``launch([sys.executable, script, ...])``.

A rank started as a fresh interpreter spends about 3 s of CPU importing torch before it does
anything; the fault and transport tests start hundreds of them, which on two cores was a third
of the suite. ``launch`` forks each rank from a warm process (``_zygote.py``) that has imported
torch once, and hands back an object that behaves as :class:`subprocess.Popen` does for what the
tests use: ``pid``, ``poll``, ``wait``, ``communicate`` (stdout and stderr captured),
``kill``, ``terminate``, ``send_signal``, ``returncode`` (negative for a signal) and
:class:`subprocess.TimeoutExpired`.

A rank is still a process of its own (its pid can be SIGKILLed or SIGSTOPped, its shared memory
is its own) with the environment, working directory and arguments it was given; only the
imports of torch, numpy, msgpack and httpx are inherited. ``WEIGHTSYNC_TEST_FRESH_PROCESSES=1``
starts every rank as a fresh interpreter instead, to rule the launcher out when a test fails.

``launch(..., warm="vllm")`` forks from a warm process that has also imported vLLM's ``LLM`` and
transformers (17 s of CPU per process here), for the processes that start engines or TRL. Those
libraries read settings from the environment when they are imported (vLLM's logging,
huggingface_hub's offline switch, OpenMP's threads), so such a warm process is started with
the child's environment and notes every variable its imports looked up. It serves only the
children that agree with it on those and on :data:`NATIVE_ENV`; a child that does not gets a
warm process of its own.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PIPE = subprocess.PIPE


#: The warm processes a rank can be forked from, and what each imports beyond torch.
WARM = {"torch": (), "vllm": ("vllm.entrypoints.llm", "transformers")}
#: Prefixes of the variables that native code reads at import with ``getenv`` (OpenMP, BLAS), and
#: that Python code finds by listing the environment (tqdm, networkx): a child of a ``vllm`` warm
#: process has the warm process's values of these too.
NATIVE_ENV = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "LD_", "TQDM_", "NETWORKX_")
#: Thread counts: every warm process runs without them, and each child applies its own
#: (``torch.set_num_threads``), so that children of different thread counts share one.
THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


class _Zygote:
    """A warm process of this test process (per pytest-xdist worker and kind), started on first use."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str]) -> None:
        self.directory = tempfile.mkdtemp(prefix="weightsync-zygote-")
        self.path = os.path.join(self.directory, "socket")
        self.env = env
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_zygote.py"), self.path,
                                      "--preload", ",".join(preload)], stdin=PIPE, stdout=PIPE, env=env, text=True)
        ready = _readline_within(self.proc.stdout, 300.0)
        try:
            #: the variables the warm process's imports looked up
            self.read: list[str] = json.loads(ready)["read"]
        except (ValueError, KeyError, TypeError):
            self.close()
            raise RuntimeError(f"the test launcher's warm process did not start (said {ready!r})") from None
        self.count = 0

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a child of ``env`` would have imported what this process imported, as it did."""
        if self.proc.poll() is not None:
            return False
        native = {k for k in (*env, *self.env) if k.startswith(NATIVE_ENV)} - set(THREADS)
        return all(env.get(k) == self.env.get(k) for k in (*self.read, *native))

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        shutil.rmtree(self.directory, ignore_errors=True)


_zygotes: dict[str, list[_Zygote]] = {warm: [] for warm in WARM}
_lock = threading.Lock()


def _the_zygote(warm: str, env: dict[str, str]) -> _Zygote:
    """A live warm process of kind ``warm`` for a child of environment ``env``, started if need be.

    The torch one serves every child (torch reads nothing the tests set)."""
    with _lock:
        live = _zygotes[warm]
        for zygote in [z for z in live if z.proc.poll() is not None]:
            live.remove(zygote)
            zygote.close()
        if warm == "torch":
            if not live:
                live.append(_Zygote((), {k: v for k, v in os.environ.items() if k not in THREADS}))
            return live[0]
        for zygote in live:
            if zygote.serves(env):
                return zygote
        live.append(_Zygote(WARM[warm], {k: v for k, v in env.items() if k not in THREADS}))
        return live[-1]


@atexit.register
def _close_zygotes() -> None:
    with _lock:
        for live in _zygotes.values():
            while live:
                live.pop().close()


def _readline_within(stream: Any, seconds: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    try:
        if not selector.select(timeout=seconds):
            return ""
        return stream.readline()
    finally:
        selector.close()


class Launched:
    """A rank forked from the warm process, used as a :class:`subprocess.Popen`."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None, cwd: str | None, text: bool,
                 warm: str) -> None:
        env = dict(os.environ if env is None else env)
        zygote = _the_zygote(warm, env)
        zygote.count += 1
        self.args = args
        self.returncode: int | None = None
        self._text = text
        stem = os.path.join(zygote.directory, f"{os.getpid()}-{zygote.count}")
        fds = []
        for name in ("stdout", "stderr"):
            os.mkfifo(f"{stem}.{name}")
            fds.append(os.open(f"{stem}.{name}", os.O_RDONLY | os.O_NONBLOCK))
        request = {"argv": args[1:], "env": env,
                   "cwd": cwd or os.getcwd(), "stdout": f"{stem}.stdout", "stderr": f"{stem}.stderr"}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(120.0)
        self._sock.connect(zygote.path)
        self._sock.sendall(json.dumps(request).encode() + b"\n")
        self._lines = b""
        first = self._next_message(120.0)
        if first is None or "pid" not in first:
            raise RuntimeError(f"the test launcher could not start {args!r}")
        self.pid: int = first["pid"]
        for name in ("stdout", "stderr"):
            os.unlink(f"{stem}.{name}")
        for fd in fds:
            os.set_blocking(fd, True)
        self._fds = fds
        self._chunks: dict[int, list[bytes]] = {fd: [] for fd in fds}
        self._open = set(fds)

    def _next_message(self, seconds: float | None) -> dict | None:
        """The next JSON line from the zygote, or None when none came within ``seconds``."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while b"\n" not in self._lines:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError("the test launcher's warm process went away")
            self._lines += chunk
        line, self._lines = self._lines.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            message = self._next_message(0.0)
            if message is not None:
                self._finish(message["status"])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            message = self._next_message(timeout)
            if message is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish(message["status"])
        assert self.returncode is not None
        return self.returncode

    def _finish(self, status: int) -> None:
        self.returncode = status
        self._sock.close()

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Reads both pipes to their end and waits for the exit, as Popen.communicate does; a
        timeout keeps what was read, so a later call goes on from there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        selector = selectors.DefaultSelector()
        for fd in self._open:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while self._open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(timeout=left):
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        self._chunks[key.fd].append(chunk)
                    else:
                        selector.unregister(key.fd)
                        self._open.discard(key.fd)
                        os.close(key.fd)
        finally:
            selector.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out, err = (b"".join(self._chunks[fd]) for fd in self._fds)
        return (out.decode(errors="replace"), err.decode(errors="replace")) if self._text else (out, err)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def terminate(self) -> None:
        self.send_signal(15)

    def __del__(self) -> None:
        for fd in getattr(self, "_open", ()):
            try:
                os.close(fd)
            except OSError:
                pass


def launch(args: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None, text: bool = True,
           stdout: Any = PIPE, stderr: Any = PIPE, warm: str = "torch") -> Any:
    """Starts ``[sys.executable, script | -m module | -c code, *arguments]``, forked from the warm
    process ``warm`` (a key of :data:`WARM`); see the module doc.

    stdout and stderr (PIPE) are read by ``communicate``. Anything else (another executable, a
    file for stdout) starts a fresh process with Popen."""
    fresh = os.environ.get("WEIGHTSYNC_TEST_FRESH_PROCESSES") == "1"
    if fresh or args[0] != sys.executable or stdout != PIPE or stderr != PIPE:
        return subprocess.Popen(args, env=env, cwd=cwd, text=text, stdout=stdout, stderr=stderr)
    if warm not in WARM:
        raise ValueError(f"no warm process {warm!r}: one of {sorted(WARM)}")
    return Launched(args, env=env, cwd=cwd, text=text, warm=warm)


def run(args: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None, timeout: float | None = None,
        text: bool = True, check: bool = False, warm: str = "torch") -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=text, timeout=timeout)``, forked as
    :func:`launch` does; on timeout the process is killed and :class:`subprocess.TimeoutExpired`
    raised, as ``subprocess.run`` does."""
    proc = launch(args, env=env, cwd=cwd, text=text, warm=warm)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args, out, err)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
