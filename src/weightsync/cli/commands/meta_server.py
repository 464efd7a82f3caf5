"""``weightsync meta-server``: run the standalone meta server.

    weightsync meta-server --host 0.0.0.0 --port 7700 --token-file /shared/ws.token --state-dir /var/lib/ws

Binds 127.0.0.1 unless told otherwise; a server reachable from other machines (``--host
0.0.0.0``) refuses to start without a token they can share (``--token-file``,
WEIGHTSYNC_META_TOKEN or ``--state-dir``). The token comes from ``--token-file`` (created with a
random token if it does not exist, so one shared file serves the server and every client), else
from WEIGHTSYNC_META_TOKEN, else from ``<state-dir>/token`` (created likewise), else a random
one is generated and printed. With ``--state-dir`` a
restarted server carries on where it stopped. Once listening it prints one line,
``weightsync meta-server: listening on http://HOST:PORT``, and serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

from weightsync.meta.config import ENV_ADDR, ENV_TOKEN, check_token, ensure_token_file, new_token


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 for a multi-node job)")
    p.add_argument("--port", type=int, default=0, help="port to bind (default 0: a free port, printed)")
    p.add_argument("--token-file", help="file holding the shared token; created (mode 0600) if missing")
    p.add_argument("--state-dir", help="directory for durable state (an SQLite store, see docs/meta-server.md); "
                                       "memory only if unset")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20,
                   help="largest request body accepted (default 64 MiB); larger ones get 413")
    p.add_argument("--max-wait", type=float, default=30.0,
                   help="longest a long-poll is held before it answers with the current state (default 30 s)")
    p.add_argument("--compact-bytes", type=int, default=64 << 20,
                   help="compact the store's log of changes into a snapshot once it exceeds this size "
                        "(default 64 MiB)")


def _token(args: argparse.Namespace) -> tuple[str, str]:
    """The shared secret and where it came from (for the startup message)."""
    if args.token_file:
        return ensure_token_file(args.token_file), f"token file {args.token_file}"
    env = os.environ.get(ENV_TOKEN, "").strip()
    if env:
        return check_token(env, ENV_TOKEN), ENV_TOKEN
    if args.state_dir:  # a restarted server must keep its token, or its clients cannot carry on
        path = Path(args.state_dir) / "token"
        path.parent.mkdir(parents=True, exist_ok=True)
        return ensure_token_file(path), f"token file {path}"
    if not is_loopback(getattr(args, "host", "127.0.0.1")):
        # A token printed to a terminal is not a shared secret other hosts can be given safely.
        raise ValueError(f"--host {args.host} accepts connections from other machines: give the server a token "
                         f"they share (--token-file FILE on a shared disk, or {ENV_TOKEN}), or bind 127.0.0.1")
    token = new_token()
    return token, f"token {token} (generated; pass --token-file to keep one)"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from weightsync.meta.embedded import prepare_server, raise_open_file_limit

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port (0-65535)")
    token, token_source = _token(args)
    raise_open_file_limit()  # one connection per rank of every job
    prepared = prepare_server(host=args.host, port=args.port, token=token, state_dir=args.state_dir,
                              max_body_bytes=args.max_body_bytes, max_wait=args.max_wait,
                              compact_bytes=args.compact_bytes, log_level="info" if args.verbose else "warning")
    shown = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host
    shown = f"[{shown}]" if ":" in shown else shown
    address = f"http://{shown}:{prepared.port}"
    print(f"weightsync meta-server: listening on {address}", flush=True)
    print(f"  clients: {ENV_ADDR}={address} with {token_source}", file=sys.stderr, flush=True)
    try:
        prepared.server.run(sockets=[prepared.sock])
    finally:
        prepared.sock.close()
        prepared.state.store.close()
    return 0
