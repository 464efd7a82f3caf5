"""``RolloutStore``: rollout records in a directory every process of the job can see.

One msgpack file per rollout (``<directory>/records/<rollout id>.rollout``), replaced whole on
every save (:func:`~weightsync.roles.rollouts.files.write_atomic`): a process killed while saving
leaves the previous record visible, never a part of the new one. A record carries the ``seq``
of the save it follows; a save goes through only over that very save (checked under the
directory's lock), so two drivers that both resumed a rollout cannot overwrite each other's
turns silently.

The directory is ``/dev/shm/...`` for the processes of one host, or any directory every host
mounts (shared storage) across hosts, as for the ``file`` transport.

    store = RolloutStore("/dev/shm/weightsync-rl-job7")
    record = store.save(record)                # whole or not at all; returns it with seq + 1
    record = store.load("r-17")
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from weightsync.roles.rollouts.files import locked, read_file, sweep_temporaries, write_atomic
from weightsync.roles.rollouts.record import RolloutRecord, check_rollout_id

SUFFIX = ".rollout"


class StaleRecordError(RuntimeError):
    """A save lost a race: the stored record is not the one this save was made from."""


class RolloutStore:
    """Rollout records under ``directory`` (see module docstring). Safe across processes and threads."""

    def __init__(self, directory: str | os.PathLike[str], *, durable: bool | None = None, sweep: bool = True) -> None:
        """Args:
            directory: made if missing; the same path for every process that shares rollouts.
            durable: flush each record to the device before it replaces the old one (default:
                yes, except under ``/dev/shm``, which has no device).
            sweep: remove the temporaries of this host's writers that died mid-save.
        """
        self.directory = os.fspath(directory)
        self.records = os.path.join(self.directory, "records")
        os.makedirs(self.records, exist_ok=True)
        self.durable = durable if durable is not None else not self.directory.startswith("/dev/shm")
        if sweep:
            sweep_temporaries(self.records)

    def path(self, rollout_id: str) -> str:
        return os.path.join(self.records, check_rollout_id(rollout_id) + SUFFIX)

    def save(self, record: RolloutRecord) -> RolloutRecord:
        """Store ``record`` in place of the save it follows; returns it as stored (``seq + 1``).

        Raises:
            StaleRecordError: the stored record is not save ``record.seq`` (another process
                changed the rollout since, or a new rollout's id is taken).
        """
        path = self.path(record.rollout_id)
        with locked(self.records):
            stored = self._stored_seq(path)
            if stored != record.seq:
                raise StaleRecordError(
                    f"rollout {record.rollout_id}: the store holds save {stored} of it, this record follows save "
                    f"{record.seq}; load the rollout again (another driver changed it) and redo the change")
            saved = dataclasses.replace(record, seq=record.seq + 1)
            write_atomic(path, saved.encode(), durable=self.durable)
        return saved

    def load(self, rollout_id: str) -> RolloutRecord:
        """The stored record of ``rollout_id``.

        Raises:
            KeyError: no such rollout (the message lists how many there are).
            RecordError: the file is not a record of this format.
        """
        try:
            blob = read_file(self.path(rollout_id))
        except FileNotFoundError:
            raise KeyError(f"no rollout {rollout_id!r} in {self.records} ({len(self.ids())} rollouts there)") from None
        return RolloutRecord.decode(blob)

    def ids(self) -> list[str]:
        """Every stored rollout's id, sorted."""
        return sorted(n[: -len(SUFFIX)] for n in os.listdir(self.records)
                      if n.endswith(SUFFIX) and not n.startswith("."))

    def delete(self, rollout_id: str) -> None:
        with locked(self.records), contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(rollout_id))

    def _stored_seq(self, path: str) -> int:
        """The stored record's seq; 0 when there is none."""
        try:
            return RolloutRecord.decode(read_file(path)).seq
        except FileNotFoundError:
            return 0
