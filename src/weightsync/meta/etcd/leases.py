"""Liveness on etcd: a rank's lease is an etcd lease (TTL), renewed by its heartbeat.

The same contract as the embedded server's (:mod:`weightsync.meta.leases`), in two keys per rank:

- ``lease/<role>/<rank>`` names the holder (incarnation, pid, host, ttl, released) and stays after
  the holder dies, so that peers can name a dead one;
- ``alive/<role>/<rank>`` holds the holder's incarnation and is attached to its etcd lease:
  etcd deletes it once the holder sends no keep-alive for the lease's TTL (rounded up to whole
  seconds, and at least etcd's minimum TTL: about 1.5 election timeouts).

The holder is alive while both agree and it has not released. A new incarnation takes a rank
over only once its holder is dead or released; against a live holder it watches the holder's
``alive`` key (at most ``wait`` seconds) and is then refused, naming the holder. A renewal is
one keep-alive of the etcd lease; a holder whose etcd lease expired (it was cut off from etcd
longer than its TTL) takes a new one, unless another incarnation took the rank over meanwhile.

etcd extends every lease when its leader changes, so after an election a dead peer is named
dead up to one election timeout later than its TTL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from weightsync.clock.deadline import Deadline
from weightsync.meta import calls, wire
from weightsync.meta.etcd import ops
from weightsync.meta.etcd.base import EtcdBase
from weightsync.meta.etcd.ops import Row
from weightsync.ports.records import LeaseRow, check_role


@dataclass(frozen=True, slots=True)
class Holder:
    incarnation: str
    pid: int
    host: str
    ttl: float
    released: bool

    @classmethod
    def from_row(cls, row: Row | None) -> Holder | None:
        if row is None:
            return None
        obj = wire.unpack(row.value)
        return cls(str(obj["incarnation"]), int(obj["pid"]), str(obj["host"]), float(obj["ttl"]),
                   bool(obj["released"]))

    def pack(self) -> bytes:
        return wire.pack({"incarnation": self.incarnation, "pid": self.pid, "host": self.host, "ttl": self.ttl,
                          "released": self.released})

    def describe(self, alive: bool) -> str:
        """Who holds it and what etcd knows of it, worded for a peer's error message."""
        if self.released:
            state = "released its lease: it left the job"
        elif alive:
            state = f"its etcd lease (ttl {self.ttl:g} s) is alive"
        else:
            state = (f"its etcd lease (ttl {self.ttl:g} s) expired: no heartbeat of it reached etcd for "
                     f"{self.ttl:g} s")
        return f"pid {self.pid} on {self.host or 'an unnamed host'}, {state}"


class Leases(EtcdBase):
    """The lease calls of :class:`~weightsync.meta.etcd.client.EtcdMetaClient` (see module docstring)."""

    def acquire_lease(self, role: str, rank: int, *, incarnation: str, ttl: float, pid: int = 0, host: str = "",
                      wait: float = 0.0, release: bool = False) -> bool:
        """Take, renew or release the lease of ``(role, rank)``. Returns True if this incarnation
        took it over from a dead one.

        Raises:
            ValueError: another live process holds it (after ``wait`` seconds), naming it.
        """
        check_role(role)
        calls.lease(self.job, role, rank, incarnation=incarnation, ttl=ttl, pid=pid, host=host)  # checks them
        mine = self._granted.get((role, rank))
        if not release and mine is not None and mine[0] == incarnation and self.kv.keepalive(mine[1]) > 0:
            return False  # renewed: while its etcd lease lives, nobody else can hold the rank
        deadline = Deadline.after(wait)
        while True:
            rows, revision = self.rows(ops.read(self.keys.lease(role, rank)), ops.read(self.keys.alive(role, rank)))
            record = next((r for r in rows if r.key == self.keys.lease(role, rank)), None)
            beat = next((r for r in rows if r.key == self.keys.alive(role, rank)), None)
            held = Holder.from_row(record)
            alive = (held is not None and not held.released and beat is not None
                     and beat.value == held.incarnation.encode())
            if held is not None and held.incarnation != incarnation and alive:
                if deadline.expired:
                    raise ValueError(
                        f"{role} rank {rank} of job {self.job!r} is held by another live process "
                        f"({held.describe(True)}): two processes claim the same rank (pid {pid} on "
                        f"{host or 'an unnamed host'} asked); check the rank each process is given, or stop the "
                        "other one first")
                self.kv.watch(self.keys.alive(role, rank), prefix=False, after=revision, deadline=deadline)
                continue
            took_over = held is not None and held.incarnation != incarnation
            if release:
                if held is not None and not took_over:
                    self._release(role, rank, held, record)
                return False
            if self._take(role, rank, Holder(incarnation, pid, host, float(ttl), False), record, beat):
                return took_over

    def _take(self, role: str, rank: int, holder: Holder, record: Row | None, beat: Row | None) -> bool:
        """Write ``holder`` with a new etcd lease, if neither key changed since read; True if it did."""
        lease = self.kv.grant(max(1, math.ceil(holder.ttl)))
        ok, _ = self.txn([ops.unchanged(self.keys.lease(role, rank), record.mod_revision if record else 0),
                          ops.unchanged(self.keys.alive(role, rank), beat.mod_revision if beat else 0)],
                         [ops.put(self.keys.lease(role, rank), holder.pack()),
                          ops.put(self.keys.alive(role, rank), holder.incarnation.encode(), lease)],
                         what=f"take the lease of {role} {rank}")
        if not ok:
            self.kv.revoke(lease)
            return False
        with self._granted_lock:
            old = self._granted.get((role, rank))
            self._granted[(role, rank)] = (holder.incarnation, lease)
        if old is not None:
            self.forget_lease(old[1])
        return True

    def _release(self, role: str, rank: int, held: Holder, record: Row | None) -> None:
        gone = Holder(held.incarnation, held.pid, held.host, held.ttl, True)
        self.txn([ops.unchanged(self.keys.lease(role, rank), record.mod_revision if record else 0)],
                 [ops.put(self.keys.lease(role, rank), gone.pack()), ops.delete(self.keys.alive(role, rank))],
                 what=f"release the lease of {role} {rank}")
        with self._granted_lock:
            old = self._granted.pop((role, rank), None)
        if old is not None:
            self.forget_lease(old[1])

    def leases(self) -> list[LeaseRow]:
        """Every lease of this job: role, rank, holder, alive (``age`` is 0 while alive, the TTL once dead)."""
        rows, _ = self.rows(ops.read(self.keys.lease(), prefix=True), ops.read(self.keys.alive(), prefix=True))
        beats = {r.key[len(self.keys.alive()):]: r.value for r in rows if r.key.startswith(self.keys.alive())}
        out = []
        for row in rows:
            if not row.key.startswith(self.keys.lease()):
                continue
            name = row.key[len(self.keys.lease()):]
            role, rank = name.split("/")
            held = Holder.from_row(row)
            assert held is not None
            alive = not held.released and beats.get(name) == held.incarnation.encode()
            out.append(LeaseRow(role, int(rank), held.incarnation, held.pid, held.host, held.ttl,
                                0.0 if alive else held.ttl, alive, held.released, held.describe(alive)))
        return sorted(out, key=lambda r: (r.role, r.rank))

    def close(self) -> None:
        self._granted.clear()  # leases run out on their own: a closed client is a process that left or died
        super().close()
