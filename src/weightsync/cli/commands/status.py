"""``weightsync status``: every member of a job with its version, state and lag, from the meta server.

    weightsync status --job grpo                        # WEIGHTSYNC_META_ADDR / _TOKEN from the environment
    weightsync status --job grpo --meta http://10.0.0.7:8470 --token T --json

States (valid, behind, none, invalid, left, dead) are :mod:`weightsync.meta.members`'. Exit
status 0 when every member is valid, 1 otherwise (a script can wait on it), 2 on a user error.
"""

from __future__ import annotations

import argparse
import json
import time

from weightsync.meta.members import Member


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default="default", help="the job's name (default: default)")
    p.add_argument("--meta", metavar="URL", help="the meta server's address (default: WEIGHTSYNC_META_ADDR)")
    p.add_argument("--token", help="the meta server's token (default: WEIGHTSYNC_META_TOKEN or _TOKEN_FILE)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the meta server")
    p.add_argument("--json", action="store_true", help="print the members as JSON")


def run(args: argparse.Namespace) -> int:
    from weightsync.cli import UserError
    from weightsync.meta.client import MetaClient
    from weightsync.meta.config import MetaEnv
    from weightsync.meta.members import job_members

    env = MetaEnv.from_env()
    address, token = args.meta or env.address, args.token or env.token
    if not address:
        raise UserError("no meta server: pass --meta URL or set WEIGHTSYNC_META_ADDR")
    with MetaClient(address, job=args.job, token=token, timeout=args.timeout) as meta:
        rows = job_members(meta)
    if args.json:
        print(json.dumps({"job": args.job, "members": [m.to_wire() for m in rows]}, indent=2))
    else:
        show(args.job, rows, now=time.time())
    return 0 if rows and all(m.state == "valid" for m in rows) else 1


STYLES = {"valid": "green", "behind": "yellow", "none": "dim", "invalid": "bold red", "left": "dim", "dead": "red"}


def show(job: str, rows: list[Member], *, now: float) -> None:
    """The members as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"job {job}: {len(rows)} member(s)")
    for column in ("role", "rank", "host", "version", "state", "lag", "since", "error"):
        table.add_column(column, justify="right" if column in ("rank", "version", "lag") else "left")
    for m in rows:
        since = "" if m.since is None else f"{max(0.0, now - m.since):.1f}s ago"
        table.add_row(m.role, str(m.rank), m.host, "-" if m.version is None else str(m.version),
                      f"[{STYLES.get(m.state, '')}]{m.state}[/]", "-" if m.lag is None else str(m.lag), since,
                      (m.error or "")[:60])
    Console().print(table)
