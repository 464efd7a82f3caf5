"""Delta sync over the gloo transport: per pair, only what changed since the reader's version.

Enabled by ``TransportOptions(delta_anchor_every=K)``. Per pair and version, both ends run
one ordered exchange (no message overlap: the payloads are small):

1. the reader sends the version its destination memory holds for this pair, or -1 when it
   cannot vouch for it (first sync, a failed or missed receive, new tensors, phases that
   reuse a staging arena, or ``delta_in_place`` switched off by whoever stages);
2. the writer sends in full when that is not the version it last sent to this reader, when
   it holds no copy, or when the pair has had K-1 deltas since its last full version;
   otherwise every message goes in the smallest encoding of :mod:`weightsync.delta`. It
   compares while the reader's message is on its way and reads it before its first batch
   goes out (a reader on another base then gets the version in full: nothing was sent);
3. batches of consecutive messages whose encoded bytes fit a staging buffer: a header block
   with a row ``[kind, changed, nbytes, crc32 or 0]`` (int64) per message of the batch (-1 for
   the others), then the batch's payloads back to back (absent when empty).

The writer keeps a copy of the bytes it last sent per pair (the ``previous`` buffers, counted
in ``peak_extra_bytes``); ``TransferStats.nbytes`` counts the payload bytes on the wire.

    t = create_transport("torch", ctx)        # ctx.options.delta_anchor_every = 8
    t.prepare(plan, tensors, epoch=0, timeout=60)
    t.send(version, timeout=60)               # or t.receive(version, timeout=60)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.codecs.delta import Encoded, Kind, apply, diff, element_unit
from weightsync.torch_layout import TORCH_DTYPES
from weightsync.transport.base import TransportError
from weightsync.transport.schedule import Message
from weightsync.transport.tensors import as_bytes, checksum, direct_source, dst_view, pack, scatter

if TYPE_CHECKING:
    from weightsync.transport.torch_dist import Pair
    from weightsync.transport.torch_gloo import GlooTransport, _LaneRun


@dataclass
class SentState:
    """What a writer last sent to one reader (per phase): the base of the next delta."""

    version: int
    deltas_since_full: int
    previous: list[torch.Tensor]  # per message, the bytes the reader now holds


def message_unit(message: Message) -> int:
    """The element size deltas of this message compare in (the gcd of its dtypes and offsets)."""
    sizes = []
    for piece in message.pieces:
        sizes += [TORCH_DTYPES[piece.op.dst_dtype].itemsize, piece.at, piece.nbytes]
    return element_unit(sizes)


def gather(message: Message, dst_flats: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """The inverse of ``scatter``: the bytes the destination pieces hold now, packed into ``buffer``."""
    for piece in message.pieces:
        out = buffer[piece.at: piece.at + piece.nbytes].view(TORCH_DTYPES[piece.op.dst_dtype])
        out.view(piece.box.sizes).copy_(dst_view(dst_flats, piece))
    return buffer[: message.nbytes]


def send_pair(t: GlooTransport, phase: int, pair: Pair, run: _LaneRun) -> None:
    """Writer side of one pair's exchange (see module docstring).

    A delta is computed while the reader's base version is still on its way (the reader
    states it only once it has woken up and armed); the base decides, before the first
    batch goes out, whether the delta is sent or the version goes in full after all.
    """
    messages, stats = pair.messages, run.stats
    if not messages:
        return
    base = torch.empty(1, dtype=torch.int64)
    with run.timer("transfer"):
        base_work = t._post(run.pg, "recv", base, pair, messages[0], tag=0)
    key = (phase, pair.peer)
    sent = t.delta_sent.pop(key, None)  # dropped until this send completes: a failure means full next time
    previous = sent.previous if sent else [torch.empty(m.nbytes, dtype=torch.uint8) for m in messages]
    base_known = False

    def reader_holds(version: int) -> bool:
        nonlocal base_known
        if not base_known:
            t._wait((base_work, messages[0], -1), run.deadline, pair.peer, run.timer)
            base_known = True
        return int(base.item()) == version

    full = sent is None or sent.deltas_since_full + 1 >= t.ctx.options.delta_anchor_every
    if sent is not None and not full:
        version = sent.version
        try:
            nbytes = _send_messages(t, run, pair, previous, full=False, confirm=lambda: reader_holds(version))
        except _StaleBaseError:  # nothing went out; every `previous` already holds the new bytes
            full = True
    if full:
        reader_holds(-1)  # the reader's message is read either way
        nbytes = _send_messages(t, run, pair, previous, full=True, confirm=None)
    stats.nbytes += nbytes
    stats.messages += len(messages)
    t.delta_sent[key] = SentState(stats.version, 0 if full or sent is None else sent.deltas_since_full + 1,
                                  previous)


class _StaleBaseError(Exception):
    """The reader does not hold the version a delta was computed against (it gets the version in full)."""


def _send_messages(t: GlooTransport, run: _LaneRun, pair: Pair, previous: list[torch.Tensor], *, full: bool,
                   confirm: Callable[[], bool] | None) -> int:
    """Encode and send every message of the pair; each ``previous`` becomes what the reader holds after.

    Returns the payload bytes sent. Raises _StaleBaseError, before anything is sent, when ``confirm``
    (called before the first batch goes out) says the reader's base is not the one compared with.
    """
    timer, nbytes = run.timer, 0
    batch = _Batch(t, run, pair, confirm)
    for index, (message, old) in enumerate(zip(pair.messages, previous, strict=True)):
        new = direct_source(message, t._flats) if message.direct else None
        if new is None:
            with timer("pack"):
                new = pack(message, t._flats, t._buffer(run.lane, 2))
        with timer("encode"):
            if full:
                enc = Encoded(Kind.DENSE, 0, (new,))
                old.copy_(new)
            else:
                enc = diff(new, old, unit=message_unit(message), update_old=True).encode()
        crc = 0
        if t.ctx.options.checksum:
            with timer("checksum"):
                crc = checksum(new)
        batch.add(index, enc, crc)
        nbytes += enc.nbytes
    batch.close()
    return nbytes


def receive_pair(t: GlooTransport, phase: int, pair: Pair, run: _LaneRun) -> None:
    """Reader side of one pair's exchange: state the held version, then apply what arrives."""
    messages, stats, timer = pair.messages, run.stats, run.timer
    if not messages:
        return
    key = (phase, pair.peer)
    held = t.delta_held.pop(key, None)  # dropped until every message landed
    base = held if held is not None and t.holds_versions() else -1
    _exchange(t, run, "send", torch.tensor([base], dtype=torch.int64), pair=pair, message=messages[0], tag=0)
    index, tag = 0, 1
    while index < len(messages):
        headers = torch.empty(len(messages), 4, dtype=torch.int64)
        _exchange(t, run, "recv", headers, pair=pair, message=messages[index], tag=tag)
        rows = torch.nonzero(headers[:, 0] >= 0).reshape(-1).tolist()
        total = int(headers[rows, 2].sum()) if rows else 0
        if not rows or rows != list(range(index, index + len(rows))) or total > t._message_bytes:
            raise TransportError(f"reader {t.ctx.rank}: malformed delta batch from writer {pair.peer} "
                                 f"(messages {rows[:3]}..., {total} bytes, expected message {index} first)")
        data = t._buffer(run.lane, 0)[:total]
        if total:
            _exchange(t, run, "recv", data, pair=pair, message=messages[index], tag=tag + 1)
        at = 0
        for row in rows:
            message = messages[row]
            kind, changed, nbytes, crc = (int(x) for x in headers[row].tolist())
            _check_header(t, pair, message, kind=kind, nbytes=nbytes, base=base)
            payload, at = data[at: at + nbytes], at + nbytes
            with timer("unpack"):
                result = _apply(t, run, message, kind=Kind(kind), payload=payload, changed=changed, pair=pair)
            if t.ctx.options.checksum:
                with timer("checksum"):
                    if checksum(result) != crc:
                        raise TransportError(f"reader {t.ctx.rank}: checksum mismatch in version {stats.version} "
                                             f"from writer {pair.peer}: {message.describe()}")
            stats.nbytes += nbytes
            stats.messages += 1
        index, tag = rows[-1] + 1, tag + 2
    t.delta_held[key] = stats.version


def _apply(t: GlooTransport, run: _LaneRun, message: Message, *, kind: Kind, payload: torch.Tensor,
           changed: int, pair: Pair) -> torch.Tensor:
    """Bring the message's destination to the new bytes; returns them (for the checksum)."""
    if kind == Kind.DENSE:
        if message.direct:
            as_bytes(dst_view(t._flats, message.pieces[0])).copy_(payload)
        else:
            scatter(message, t._flats, payload)
        return payload
    if message.direct:
        dest = as_bytes(dst_view(t._flats, message.pieces[0]))
    else:
        dest = gather(message, t._flats, t._buffer(run.lane, 1))
    try:
        apply(kind, payload, dest, unit=message_unit(message), changed=changed)
    except ValueError as exc:
        raise TransportError(f"reader {t.ctx.rank}: malformed delta from writer {pair.peer} "
                             f"({message.describe()}): {exc}") from exc
    if not message.direct:
        scatter(message, t._flats, dest)
    return dest


def _check_header(t: GlooTransport, pair: Pair, message: Message, *, kind: int, nbytes: int, base: int) -> None:
    if kind not in (Kind.DENSE, Kind.SPARSE, Kind.BITMAP) or not 0 <= nbytes <= message.nbytes or (
            kind == Kind.DENSE and nbytes != message.nbytes):
        raise TransportError(f"reader {t.ctx.rank}: bad delta header (kind {kind}, {nbytes} bytes) from writer "
                             f"{pair.peer} for {message.describe()}")
    if kind != Kind.DENSE and base < 0:
        raise TransportError(f"reader {t.ctx.rank}: writer {pair.peer} sent a delta although this reader holds "
                             f"no base version ({message.describe()}); writers and readers disagree on "
                             f"delta_anchor_every")


class _Batch:
    """Consecutive encoded messages sent as one header block (rows of other messages: -1) and one payload.

    Payloads collect in one of two staging buffers (``message_bytes``) while the other one is
    on the wire, so a delta version costs a round trip or two per pair instead of one per message.
    (Sending smaller batches sooner, so that the reader applies while the writer compares, was
    slower on a 2-core machine: three busy processes share two cores; docs/benchmarks.md.)
    """

    def __init__(self, t: GlooTransport, run: _LaneRun, pair: Pair, confirm: Callable[[], bool] | None) -> None:
        self.t, self.run, self.pair, self.confirm = t, run, pair, confirm
        self.slot, self.at, self.tag = 0, 0, 1
        self.headers = self._fresh_headers()
        self.in_flight: deque[tuple[Any, Message, int, torch.Tensor]] = deque()  # keeps posted tensors alive

    def _fresh_headers(self) -> torch.Tensor:
        return torch.full((len(self.pair.messages), 4), -1, dtype=torch.int64)

    def add(self, index: int, enc: Encoded, crc: int) -> None:
        if self.at + enc.nbytes > self.t._message_bytes:
            self.flush()
        buffer = self.t._buffer(self.run.lane, self.slot)
        for part in enc.parts:
            buffer[self.at: self.at + part.numel()].copy_(part)
            self.at += part.numel()
        self.headers[index] = torch.tensor([int(enc.kind), enc.changed, enc.nbytes, crc])

    def flush(self) -> None:
        if self.confirm is not None:
            confirm, self.confirm = self.confirm, None
            if not confirm():
                raise _StaleBaseError
        message = self.pair.messages[int(torch.nonzero(self.headers[:, 0] >= 0)[0])]
        parts = [self.headers] + ([self.t._buffer(self.run.lane, self.slot)[: self.at]] if self.at else [])
        for offset, tensor in enumerate(parts):
            with self.run.timer("transfer"):
                work = self.t._post(self.run.pg, "send", tensor, self.pair, message, tag=self.tag + offset)
            self.in_flight.append((work, message, self.slot, tensor))
        self.slot, self.at, self.tag, self.headers = 1 - self.slot, 0, self.tag + 2, self._fresh_headers()
        while any(item[2] == self.slot for item in self.in_flight):  # the next buffer must be free
            self._finish()

    def close(self) -> None:
        if bool((self.headers[:, 0] >= 0).any()):
            self.flush()
        while self.in_flight:
            self._finish()

    def _finish(self) -> None:
        work, message, slot, _ = self.in_flight.popleft()
        self.t._wait((work, message, slot), self.run.deadline, self.pair.peer, self.run.timer)


def _exchange(t: GlooTransport, run: _LaneRun, kind: str, tensor: torch.Tensor, *, pair: Pair, message: Message,
              tag: int) -> None:
    work = t._post(run.pg, kind, tensor, pair, message, tag=tag)
    t._wait((work, message, -1), run.deadline, pair.peer, run.timer)


def previous_bytes(sent: Mapping[Any, SentState]) -> int:
    """Host memory the writer's copies of previously sent bytes take."""
    return sum(int(b.numel()) for state in sent.values() for b in state.previous)


