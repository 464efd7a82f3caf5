"""Whether a process on this machine still runs, for the sweeps of files named after their creator.

A process that exited but that its parent has not reaped yet (a *zombie*: a trainer killed
under a launcher that has not waited for it) still answers ``kill(pid, 0)``, yet it holds no
file, lock or mapping any more: its files are as stale as those of a process that is gone.
"""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True while process ``pid`` runs here (or belongs to another user, who may still use its
    files); False once it is gone or a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # "pid (comm) state ...": comm may hold spaces and parentheses
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, IndexError):  # gone meanwhile, or no procfs to tell: it answered the signal
        return not os.path.exists("/proc/self/stat")


__all__ = ["process_alive"]
