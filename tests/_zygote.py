"""The warm process that the test launcher forks ranks from (see ``launcher.py``).

It imports the heavy libraries every rank needs (torch above all: about 3 s of CPU per process
on these machines) once, then forks one child per request. ``--preload`` names more modules to
import first (vLLM and transformers: 17 s of CPU per engine process). Nothing of weightsync is
imported here: module-level state (ids, tokens, caches) must be a fresh process's in every rank.
What the preloaded libraries registered with ``atexit`` at import stays registered in a child
and runs at its exit (logging's flush, multiprocessing's joins, Ray's shutdown), as it would in
a fresh process.

Protocol, one request per connection on a Unix socket, JSON lines (no pickle):
    client -> {"argv": [...], "env": {...}, "cwd": str, "stdout": fifo path, "stderr": fifo path}
    child  -> {"pid": int}                    (once its stdio is in place)
    zygote -> {"status": int}                 (when it exits: Popen's convention, -N for signal N)
The zygote ends when its stdin closes (the test process is gone) and kills the children it has
left, so that no rank outlives the suite.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import httpx  # noqa: F401  (preloaded)
import msgpack  # noqa: F401  (preloaded)
import numpy  # noqa: F401  (preloaded)
import torch

_DEFAULT_THREADS = torch.get_num_threads()


def _child(conn: socket.socket, request: dict, inherited: list[int]) -> None:
    """Runs in the forked child: become the process ``argv`` describes, then exit with its code."""
    code = 1
    try:
        for fd in inherited:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # as a fresh interpreter has it: a write to a socket or pipe whose peer died raises EPIPE
        # (BrokenPipeError) instead of killing the process (a surviving gloo rank died with -13)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for entry in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if entry not in sys.path:  # a fresh interpreter would have put it there
                sys.path.insert(1, entry)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", _DEFAULT_THREADS)))
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY)
            os.dup2(target, fd)
            os.close(target)
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        conn.close()
        argv = request["argv"]
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                sys.path[0] = ""
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("--preload", default="", help="modules to import before serving, comma-separated")
    args = parser.parse_args()
    read = _preload(filter(None, args.preload.split(",")))
    path = args.socket
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    print(json.dumps({"ready": True, "read": sorted(read)}), flush=True)
    try:
        while True:
            for key, _ in selector.select(timeout=1.0):
                if key.data == "parent" and not sys.stdin.buffer.read1(4096):
                    return
                if key.data == "accept":
                    conn, _ = server.accept()
                    with conn.makefile("rb") as lines:
                        request = json.loads(lines.readline())
                    pid = os.fork()
                    if pid == 0:
                        selector.close()
                        server.close()
                        _child(conn, request, [wake_r, wake_w, *(c.fileno() for c in waiting.values())])
                    waiting[pid] = conn
                if key.data == "child":
                    os.read(wake_r, 4096)
            _reap(waiting)
    finally:
        for pid, conn in waiting.items():
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
            conn.close()
        server.close()
        os.unlink(path)


class _RecordingEnviron(os._Environ):
    """``os.environ`` as the preloaded modules see it: it notes every variable they look up by
    name. Look-ups made while listing the whole environment (tqdm and networkx pick their
    variables by prefix; ``dict(os.environ)`` copies it for a subprocess) are not noted: they
    would name every variable, and the prefixes they read are compared as :data:`NATIVE_ENV`."""

    def __init__(self, environ: os._Environ, read: set[str]) -> None:
        super().__init__(environ._data, environ.encodekey, environ.decodekey, environ.encodevalue,
                         environ.decodevalue)
        self.read: set[str] | None = read  # None once the imports are done: a plain os.environ then
        self.listing = 0  # iterations under way
        self.copying = 0  # look-ups left of a copy (``dict()`` lists the keys, then looks each up)

    def __iter__(self) -> Iterator[str]:
        if self.read is None:
            yield from super().__iter__()
            return
        self.listing += 1
        try:
            yield from super().__iter__()
        finally:
            self.listing -= 1

    def keys(self) -> Any:
        if self.read is None:
            return super().keys()
        keys = list(super().__iter__())
        self.copying += len(keys)
        return keys

    def __getitem__(self, key: str) -> str:
        if self.read is None:
            pass
        elif self.copying:
            self.copying -= 1
        elif not self.listing and isinstance(key, str):
            self.read.add(key)
        return super().__getitem__(key)


def _preload(modules: Iterable[str]) -> set[str]:
    """Imports ``modules``; the names of the environment variables their imports looked up.

    A library that reads a setting at import (vLLM's logging, huggingface_hub's offline switch)
    keeps the value it read in every child, so the launcher forks a child from this process only
    if the child's environment has the same values for these names. What C code reads with
    ``getenv`` (OpenMP's settings) is not seen here: the launcher compares those by prefix."""
    read: set[str] = set()
    environ = os.environ
    recording = _RecordingEnviron(environ, read)
    os.environ = recording  # os.getenv reads the module's global too
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        os.environ = environ
        recording.read = None  # a module that kept a reference to it keeps a plain environment
    return read


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            conn.sendall(json.dumps({"status": code}).encode() + b"\n")
        except OSError:
            pass
        conn.close()


if __name__ == "__main__":
    main()
