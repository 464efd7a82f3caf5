"""How a transport waits for a peer's endpoint of an epoch: a dead reader is named at once.

A peer publishes its endpoint (:mod:`weightsync.transport.endpoints`) once it connects in the
epoch. A *reader* that died, stalled past its lease or left before it published never will: no
version waits for a reader's restart, which registers anew and moves the job to a later epoch.
So the wait asks the leases between slices of at most half a second and names such a reader
within about a second of its lease's end, instead of at the deadline (a NIXL push writer
waiting for a killed reader's metadata). A *writer* that is dead and did not publish is named
as soon as it is out of the epoch (``channel.writer_out_of_epoch``, which closes its seat there
when no restart took it first; the rule of the torch rendezvous and of
``JobChannel._gone_from_try``): its restart joins a later epoch. A restart that took the seat
first is waited for. Before, such a writer was waited for until the deadline (issue 36: a
stopped NIXL writer named only at the 15 s timeout).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypeVar

from weightsync.clock.deadline import Deadline
from weightsync.job.wire import WireError
from weightsync.ports.channel import EndpointRecord
from weightsync.transport.base import PeerWatch, TransportContext, TransportError

if TYPE_CHECKING:
    from weightsync.plan.ops import Role

E = TypeVar("E", bound=EndpointRecord)
#: Seconds between two looks at the leases while a peer's endpoint is awaited.
LOOK_EVERY = 0.5


def peer_endpoint(ctx: TransportContext, kind: type[E], epoch: int, role: Role, rank: int, *,
                  deadline: Deadline) -> E | None:
    """A peer's endpoint of ``kind`` in ``epoch`` (None at the deadline), through the job channel.

    Raises:
        TransportError: the peer published a malformed one (named, with the field); it is a
            reader whose lease ended while this rank waited (named, with what the leases say), or
            a writer out of the epoch; or (a writer waiting for a reader) another writer is out of it.
    """
    watch = PeerWatch(ctx, role, [rank]) if ctx.channel.lease_seconds > 0 else None
    while True:
        step = deadline if watch is None else Deadline.after(min(deadline.remaining(0.0), LOOK_EVERY))
        try:
            endpoint = ctx.channel.wait_endpoint(kind, epoch, role, rank, deadline=step)
        except WireError as exc:
            raise TransportError(str(exc)) from exc
        if endpoint is not None or deadline.expired or watch is None:
            return endpoint
        what = f"its {kind.transport} endpoint of epoch {epoch}"
        if role == "writer":  # dead or alive: out of the epoch; or a restart on its way (it took the seat)
            out = ctx.channel.writer_out_of_epoch(epoch, rank)
            if out is not None and watch.dead(max_age=0.0):
                raise TransportError(watch.died({rank: out}, what))
            if out is not None:
                raise TransportError(f"{ctx.who}: writer {rank} will not publish {what}: {out}")
        else:
            dead = watch.dead(max_age=0.0)
            if dead:
                raise TransportError(watch.died(dead, what))
            if ctx.role == "writer":  # readers come to the epoch once every writer published the version
                _check_writers(ctx, epoch, f"reader {rank}'s {kind.transport} endpoint")
        time.sleep(min(step.remaining(0.0), LOOK_EVERY))  # a channel that answered before its slice ended


def _check_writers(ctx: TransportContext, epoch: int, what: str) -> None:
    """A writer waiting for a reader in ``epoch``: raise if another writer will never take part in
    it (the version is then never published there, and no reader comes)."""
    for w in range(ctx.num_writers):
        if w != ctx.rank and (out := ctx.channel.writer_out_of_epoch(epoch, w)) is not None:
            raise TransportError(f"{ctx.who}: stopped waiting for {what}: writer {w} will not take part in epoch "
                                 f"{epoch}: {out}")


__all__ = ["peer_endpoint"]
