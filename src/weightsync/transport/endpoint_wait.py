"""How a transport waits for its peers' endpoints of an epoch: a dead peer is named at once.

A peer publishes its endpoint (:mod:`weightsync.transport.endpoints`) once it connects in the
epoch. A *reader* that died, stalled past its lease or left before it published never will: no
version waits for a reader's restart, which registers anew and moves the job to a later epoch.
So the wait asks the leases between slices of at most half a second and names such a reader
within about a second of its lease's end, instead of at the deadline (a NIXL push writer
waiting for a killed reader's metadata). A *writer* that is dead and did not publish is named
as soon as it is out of the epoch (``channel.writers_out_of_epoch``, which closes its seat there
when no restart took it first; the rule of ``JobChannel._gone_from_try`` too): its restart joins
a later epoch. A restart that took the seat first is waited for. Before, such a writer was
waited for until the deadline (issue 36: a stopped NIXL writer named only at the 15 s timeout).

:func:`peer_endpoint` waits for one peer (a writer's segment, writer 0's rendezvous);
:func:`every_endpoint` for every rank of the epoch, watching all of them at each look (the
torch transport's arrivals: a process group forms only once every rank is there, so one dead
rank, arrived or not, fails the wait at once).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
            out = ctx.channel.writers_out_of_epoch(epoch, [rank]).get(rank)
            if out is not None and watch.dead(max_age=0.0):
                raise TransportError(watch.died({rank: out}, what))
            if out is not None:
                raise TransportError(f"{ctx.who}: writer {rank} will not publish {what}: {out}")
        else:
            dead = watch.dead(max_age=0.0)
            if dead:
                raise TransportError(watch.died(dead, what))
            if ctx.role == "writer":  # readers come to the epoch once every writer published the version
                check_writers(ctx, epoch, f"reader {rank}'s {kind.transport} endpoint")
        time.sleep(min(step.remaining(0.0), LOOK_EVERY))  # a channel that answered before its slice ended


def check_writers(ctx: TransportContext, epoch: int, what: str) -> None:
    """A writer waiting for readers in ``epoch`` (for their endpoints, or to copy a version it
    exposes): raise if another writer will never take part in it, or (writer 0) writes a newer
    version than this one's: the version is then never published there, and no reader comes."""
    out = ctx.channel.writers_out_of_epoch(epoch, [w for w in range(ctx.num_writers) if w != ctx.rank])
    if out:
        w, why = min(out.items())
        raise TransportError(f"{ctx.who}: stopped waiting for {what}: writer {w} will not take part in epoch "
                             f"{epoch}: {why}")


def every_endpoint(ctx: TransportContext, kind: type[E], epoch: int, *, deadline: Deadline,
                   what: str) -> dict[tuple[Role, int], E]:
    """Every other rank's endpoint of ``kind`` in ``epoch`` (writers ``0..W-1``, readers
    ``0..R-1``), once all are published. ``what``: where the ranks meet, for messages ("the
    process group of epoch 3").

    The ranks are read in turn, one read per step (a long poll on the first missing one), so a
    world of N ranks costs each of them about N reads, not N per look. At each look (every
    :data:`LOOK_EVERY` seconds) every rank is watched, read yet or not: a dead one is named
    (confirmed on fresh leases: a cached answer may show a restart that registered and published
    since as its dead predecessor), and so is a writer that is out of the epoch, alive or dead
    (``channel.writers_out_of_epoch``).

    Raises:
        TransportError: a rank dead or out of the epoch, a malformed endpoint (named), or the
            deadline (naming how many were there, and the dead).
    """
    ranks: list[tuple[Role, int]] = [("writer", w) for w in range(ctx.num_writers)]
    ranks += [("reader", r) for r in range(ctx.num_readers)]
    waiting = [(role, r) for role, r in ranks if (role, r) != (ctx.role, ctx.rank)]
    watches = [PeerWatch(ctx, "writer", range(ctx.num_writers)), PeerWatch(ctx, "reader", range(ctx.num_readers))]
    found: dict[tuple[Role, int], E] = {}
    leases = ctx.channel.lease_seconds > 0
    look = time.monotonic() + LOOK_EVERY
    while waiting:
        peer = waiting[0]  # one read per step, whatever the world's size: the others are read in turn
        step = Deadline.after(min(deadline.remaining(0.0), LOOK_EVERY) if leases else deadline.remaining(0.0))
        endpoint = _read(ctx, kind, epoch, peer, step)
        if endpoint is not None:
            found[peer] = endpoint
            waiting.pop(0)
            continue
        if deadline.expired:
            there = len(found) + 1 + sum(_read(ctx, kind, epoch, p, Deadline.after(0.0)) is not None for p in waiting)
            missing = "".join(w.describe() for w in watches)
            raise TransportError(f"{ctx.who}: only {there} of {len(ranks)} ranks joined {what} in time{missing}")
        time.sleep(step.remaining(0.0))  # a channel that answered before its slice ended
        if leases and time.monotonic() >= look:
            look = time.monotonic() + LOOK_EVERY
            _check_every(ctx, epoch, watches, [r for role, r in waiting if role == "writer"], what)
    return found


def _read(ctx: TransportContext, kind: type[E], epoch: int, peer: tuple[Role, int], deadline: Deadline) -> E | None:
    try:
        return ctx.channel.wait_endpoint(kind, epoch, peer[0], peer[1], deadline=deadline)
    except WireError as exc:
        raise TransportError(str(exc)) from exc


def _check_every(ctx: TransportContext, epoch: int, watches: Sequence[PeerWatch], absent: Sequence[int],
                 what: str) -> None:
    """One look of :func:`every_endpoint`: raise if a watched rank is dead (a reader, or a writer
    that is there), or if a writer, there or not, alive or dead, is out of the epoch (one that is
    there and left it will not form the group: it saw the epoch fail). A dead writer of
    ``absent`` (not there yet) whose restart took its seat first is on its way."""
    for watch in watches:
        dead = watch.dead()
        if dead:  # cached leases may show a restart that registered and arrived since as its dead predecessor
            dead = {r: why for r, why in watch.dead(max_age=0.0).items() if r in dead}
        if watch.role == "writer":
            others = [w for w in range(ctx.num_writers) if (ctx.role, ctx.rank) != ("writer", w)]
            out = ctx.channel.writers_out_of_epoch(epoch, others) if others else {}
            for r, why in sorted(out.items()):
                if r not in dead:  # alive, but it left the epoch
                    raise TransportError(f"{ctx.who}: writer {r} will not come to {what}: {why}")
            dead = {r: why for r, why in dead.items() if r not in absent} | out
        if dead:
            raise TransportError(watch.died(dead, f"every rank to join {what}"))


__all__ = ["check_writers", "every_endpoint", "peer_endpoint"]
