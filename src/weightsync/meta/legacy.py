"""Reading a state directory of weightsync releases before the SQLite store, to migrate it.

Those releases kept ``snapshot.msgpack`` (a header ``{"format": 1, "snapshot": n, "instance": ...}``
then msgpack records) and ``journal-<n>.msgpack`` (records appended since). Their records have no
checksums, so a damaged byte and a torn write cannot be told apart: this reader accepts the
files only when every byte of them decodes to a whole, well-formed record, and otherwise refuses,
naming the file and the byte, instead of dropping what it cannot read.

    found = read_legacy(directory)       # None: no old files here
    if found is not None:
        instance, events = found         # the new store starts from these
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack

from weightsync.meta.events import Event, EventError, event_from_wire
from weightsync.meta.store import StoreDamagedError

SNAPSHOT = "snapshot.msgpack"
FORMAT = 1
#: where migrated files are moved (kept, never deleted: the evidence of what was migrated)
MIGRATED = "migrated-journal"


def legacy_files(directory: Path) -> list[Path]:
    """The old format's files in ``directory`` (snapshot and journals)."""
    return sorted(p for p in directory.glob("*.msgpack") if p.name == SNAPSHOT or p.name.startswith("journal-"))


def _refuse(path: Path, what: str) -> StoreDamagedError:
    return StoreDamagedError(
        f"{path} ({what}) is a state file of the journal format of weightsync releases before the SQLite store, "
        "and cannot be migrated: records in that format carry no checksums, so a damaged byte cannot be told from "
        "a torn write. If that release's server crashed while writing, start that release once on this directory "
        "(it drops the torn record and compacts the rest) and then this one; otherwise restore the directory from "
        f"a backup, or move {path.parent} away to start empty (clients then see a new server instance and "
        "register again)")


def _read(path: Path) -> list[Any]:
    data = path.read_bytes()
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1 << 20))
    unpacker.feed(data)
    items: list[Any] = []
    try:
        for item in unpacker:
            items.append(item)
    except (ValueError, msgpack.UnpackException) as exc:
        raise _refuse(path, f"undecodable near byte {unpacker.tell()}: {exc}") from None
    if unpacker.tell() != len(data):
        raise _refuse(path, f"ends with {len(data) - unpacker.tell()} bytes that are not a whole record, "
                            f"from byte {unpacker.tell()} of {len(data)}")
    return items


def read_legacy(directory: Path) -> tuple[str | None, list[Event]] | None:
    """The instance and the events of an old-format state directory; None when it holds none.

    Raises:
        StoreDamagedError: a file does not decode whole (see module docstring).
    """
    files = legacy_files(directory)
    if not files:
        return None
    records: list[tuple[Path, Any]] = []
    instance, number = None, 0
    snapshot = directory / SNAPSHOT
    if snapshot.exists():
        items = _read(snapshot)
        header = items[0] if items else None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise _refuse(snapshot, f"its header {header!r:.60} is not that of format {FORMAT}")
        number = int(header.get("snapshot") or header.get("generation") or 0)
        instance = header.get("instance") if isinstance(header.get("instance"), str) else None
        records.extend((snapshot, r) for r in items[1:])
    journal = directory / f"journal-{number}.msgpack"
    if journal.exists():
        records.extend((journal, r) for r in _read(journal))
    events = []
    for i, (path, record) in enumerate(records):
        try:
            events.append(event_from_wire(record))
        except EventError as exc:
            raise _refuse(path, f"record {i}: {exc}") from None
    return instance, events


def move_away(directory: Path) -> Path:
    """Move the old files into ``directory/migrated-journal`` (kept as evidence); returns that folder."""
    target = directory / MIGRATED
    target.mkdir(exist_ok=True)
    for path in legacy_files(directory):
        path.replace(target / path.name)
    return target
