"""The meta server's state directory as files: private to its user, writable, and who wrote them.

Three rules, each kept by one function here:

* **Private.** The store holds every job's endpoints and documents, and its token sits beside it:
  the directory is 0700 and every file in it 0600. A directory the server creates is made so; an
  existing one, and existing files, are tightened (group and other bits removed, never owner bits
  added) with a warning naming each. A shared scratch directory (sticky bit, like ``/tmp``) is
  refused: the server wants a directory of its own.
* **Writable, or said so.** A directory or file the server cannot write is a permission problem,
  not damage: :func:`check_writable` names the path, its mode and owner, and the fix. Nothing is
  moved or discarded.
* **Who wrote it.** :func:`stamp` is the database file's inode and change time (``st_ctime``). Only
  the kernel sets a change time, to "now", whenever a file's bytes or attributes change, so a file
  copied, restored from a backup or rolled back never has the stamp the server recorded after its
  own last write (see :mod:`weightsync.meta.sqlite_store`: a restored store starts as a new
  server instance).

    ensure_private_directory(path)          # StoreAccessError: what is wrong and how to fix it
    check_writable(path, [DATABASE, ...])
    tighten_files(path, [DATABASE, ...])
    recorded = stamp(path / DATABASE)
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from weightsync.meta.store import StoreAccessError

logger = logging.getLogger(__name__)

PRIVATE_DIRECTORY = 0o700
PRIVATE_FILE = 0o600
#: the width of a stamp, fixed so that the ``committed`` mark is rewritten in place
STAMP_WIDTH = 41


def _owner(st: os.stat_result) -> str:
    try:
        import pwd

        return pwd.getpwuid(st.st_uid).pw_name
    except (ImportError, KeyError):
        return str(st.st_uid)


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


def _describe(path: Path) -> str:
    st = path.stat()
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner {_owner(st)}"


def access_error(path: Path, directory: Path) -> StoreAccessError:
    """The error for a state-directory path the server cannot write: names it, says why and the fix."""
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        why = (f"{path} is on a read-only file system. Its data is intact: remount it read-write, or pass "
               "a --state-dir on a writable file system")
    else:
        why = (f"{path} ({_describe(path) if path.exists() else 'missing'}) cannot be written by user {_user()}. "
               f"Its data is intact: give that user read and write access (e.g. `chown -R {_user()} "
               f"{directory}` or `chmod u+rwx {directory}`, and `chmod u+rw` on its files), or start the server "
               "as the directory's owner")
    return StoreAccessError(f"the meta server cannot use its state directory: {why}")


def ensure_private_directory(directory: Path) -> None:
    """Create ``directory`` 0700, or check that an existing one is writable and tighten it to 0700.

    Raises:
        StoreAccessError: it cannot be created, written or searched, or it is a shared (sticky) directory.
    """
    try:
        directory.mkdir(mode=PRIVATE_DIRECTORY, parents=True, exist_ok=True)
    except PermissionError:
        raise access_error(directory.parent if not directory.exists() else directory, directory.parent) from None
    except OSError as exc:
        raise StoreAccessError(f"the meta server cannot create its state directory {directory}: {exc}") from exc
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & stat.S_ISVTX:
        raise StoreAccessError(f"the meta server's state directory {directory} is a shared directory (mode "
                               f"{mode:04o}, sticky like /tmp): pass a directory of its own, e.g. "
                               f"--state-dir {directory / 'weightsync-meta'}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise access_error(directory, directory)
    _tighten(directory, mode, PRIVATE_DIRECTORY)


def check_writable(directory: Path, names: Sequence[str]) -> None:
    """Every existing file ``names`` in ``directory`` can be read and written.

    Raises:
        StoreAccessError: the first one that cannot, with the fix.
    """
    for name in names:
        path = directory / name
        if path.exists() and not os.access(path, os.R_OK | os.W_OK):
            raise access_error(path, directory)


def tighten_files(directory: Path, names: Sequence[str]) -> None:
    """Remove group and other permissions from the existing files ``names`` (warning for each)."""
    for name in names:
        path = directory / name
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            continue
        _tighten(path, mode, PRIVATE_FILE)


def _tighten(path: Path, mode: int, private: int) -> None:
    if not mode & 0o077:
        return
    try:
        os.chmod(path, mode & ~0o077)
    except OSError as exc:
        raise StoreAccessError(f"the meta server's {path} is open to other users (mode {mode:04o}) and cannot be "
                               f"made private ({exc}): `chmod {private:o} {path}`, or start the server as its "
                               "owner") from exc
    logger.warning("meta store: %s was open to other users (mode %04o); it is now %04o", path, mode, mode & ~0o077)


def create_private(path: Path) -> None:
    """Create an empty file ``path`` with mode 0600 if it does not exist (SQLite gives the ``-wal``
    and ``-shm`` files the database file's mode, so creating it first makes all three private)."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE))


def stamp(path: Path) -> str:
    """``path``'s inode and change time, fixed width; ``"-"`` padded when it does not exist."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "-" * STAMP_WIDTH
    return f"{st.st_ino:020d}:{st.st_ctime_ns:020d}"
