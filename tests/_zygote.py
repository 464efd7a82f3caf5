"""The warm process that the test launcher forks ranks from (see ``launcher.py``).

It imports the heavy libraries every rank needs (torch above all: about 3 s of CPU per process
on these machines) once, then forks one child per request. Nothing of weightsync is imported
here: module-level state (ids, tokens, caches) must be a fresh process's in every rank.

Protocol, one request per connection on a Unix socket, JSON lines (no pickle):
    client -> {"argv": [...], "env": {...}, "cwd": str, "stdout": fifo path, "stderr": fifo path}
    child  -> {"pid": int}                    (once its stdio is in place)
    zygote -> {"status": int}                 (when it exits: Popen's convention, -N for signal N)
The zygote ends when its stdin closes (the test process is gone) and kills the children it has
left, so that no rank outlives the suite.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import selectors
import signal
import socket
import sys

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
        atexit._clear()
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
    path = sys.argv[1]
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
    print("ready", flush=True)
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
