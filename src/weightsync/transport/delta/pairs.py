"""Delta sync between two-sided peers: per pair, only what changed since the version the reader holds.

Enabled by ``TransportOptions(delta_anchor_every=K)``. What does not depend on the transport
lives here: the per-pair state (the version each reader holds and the digests that vouch
for it, the writer's copy of what it last sent, the count since the last full version) and
the exchange below, in the encodings of :mod:`weightsync.tools.codecs.delta`. A transport lends
each pair a :class:`PairLink` for one send or receive (post a tagged send or receive of a
tensor, wait for it, and three staging buffers), and runs :meth:`DeltaSync.send_pair` /
:meth:`DeltaSync.receive_pair` in place of moving the pair's messages itself. The torch
torch transport does, over gloo and over NCCL (:mod:`weightsync.transport.torch.nccl_delta`: the
copies on the GPU, torch-op encodings, sum64 digests); one-sided transports (shared memory,
NIXL pull) publish each version's changes instead (:mod:`weightsync.transport.delta.published`),
and NIXL push WRITEs them into inboxes its readers register
(:mod:`weightsync.transport.nixl.push_changes`)::

    delta = DeltaSync(ctx)                                   # ctx.options.delta_anchor_every = K
    delta.prepared(tensors, phases=len(schedules))           # at the end of every prepare()
    delta.send_pair(link, messages, flats, phase=p, stats=stats, timer=timer)      # writer
    delta.receive_pair(link, messages, flats, phase=p, stats=stats, timer=timer)   # reader
    delta.forget_received()                                  # reader: something else wrote the memory

Per pair and version, both ends run one ordered exchange (no message overlap: the payloads
are small):

1. the reader sends the version it can vouch for, or -1: it holds the version it last
   received from this writer *and* the :func:`base_digest` of every
   message's bytes in its memory equals the digest the writer sent with them. Anything that
   changed the memory since (a ``copy_`` or ``load_state_dict``, a flipped bit, buffers
   reused as scratch) therefore gives -1, and so do a first sync, a failed or missed
   receive, new tensors and :meth:`DeltaSync.forget_received` (a version change the reader
   did not make);
2. the writer sends in full when that is not the version it last sent to this reader, when
   it holds no copy, or when the pair has had K-1 deltas since its last full version;
   otherwise every message goes in the smallest encoding. It compares while the reader's
   message is on its way and reads it before its first batch goes out (a reader on another
   base then gets the version in full: nothing was sent);
3. batches of consecutive messages whose encoded bytes fit a staging buffer: a header block
   with a row ``[kind, changed, nbytes, crc32 or 0, digest]`` (int64) per message of the
   batch (-1 for the others; ``digest``: :func:`base_digest` of the message's new bytes),
   then the batch's payloads back to back (absent when empty).

**Destinations that do not keep what they received** (an engine without
``keeps_received_bytes``, or several phases sharing one staging arena: vLLM with
``layer_phases=True``): the reader keeps its own host copy of every message it received
(the *shadow*), applies deltas to it and writes each message's whole new bytes into the
destination. The wire still carries only what changed; the reader's memory grows by the
bytes it receives per version (its share of the model), counted in ``peak_extra_bytes``,
and device staging stays one phase.

The writer keeps a copy of the bytes it last sent per pair (the ``previous`` buffers, counted
by :meth:`DeltaSync.extra_bytes` in ``peak_extra_bytes``); ``TransferStats.nbytes`` counts the
payload bytes on the wire.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import torch

from weightsync.ports import device as device_port
from weightsync.tools.codecs.delta import Encoded, Kind, element_unit, warm_up
from weightsync.tools.codecs.delta_device import codec_for
from weightsync.tools.codecs.digest import DigestKind, as_signed, tensor_digest
from weightsync.tools.torch_layout import TORCH_DTYPES
from weightsync.transport.base import TransportError
from weightsync.transport.tensors import as_bytes, checksum, direct_source, dst_view, pack, scatter

if TYPE_CHECKING:
    from weightsync.transport.base import PhaseTimer, TransferStats, TransportContext
    from weightsync.transport.schedule import Message

logger = logging.getLogger(__name__)

#: Staging buffers a link lends: two for batches in flight, one for packing (or gathering).
LINK_BUFFERS = 3
#: Columns of a batch's header rows: kind, changed, nbytes, crc32, digest of the new bytes.
HEADER = 5

#: What a link's ``post`` returns and its ``wait`` takes (the transport's own handle).
Posted = TypeVar("Posted")


class PairLink(Protocol[Posted]):
    """One writer-reader pair's connection, as a transport lends it for one send or receive.

    Both ends post in the same order; an operation is matched with the peer's by ``tag``.
    Several operations may be in flight; ``wait`` blocks until one completed and raises
    :class:`TransportError` (naming the peer and ``message``) when it failed or the
    operation's deadline passed.
    """

    @property
    def peer(self) -> int:
        """The other end's writer or reader rank."""
        ...

    @property
    def capacity(self) -> int:
        """Bytes of each staging buffer (a batch's payloads fit one)."""
        ...

    def post(self, op: Literal["send", "recv"], tensor: torch.Tensor, message: Message, *, tag: int) -> Posted:
        """Start sending ``tensor`` to the peer, or receiving into it; ``message`` names it in errors."""
        ...

    def wait(self, posted: Posted) -> None:
        """Block until the operation ``post`` returned completed."""
        ...

    def buffer(self, slot: int) -> torch.Tensor:
        """Staging buffer ``slot`` (``0 <= slot < LINK_BUFFERS``): 1-d uint8 of ``capacity`` bytes,
        this link's own while the send or receive runs."""
        ...


@dataclass
class SentState:
    """What a writer last sent to one reader (per phase): the base of the next delta."""

    version: int
    deltas_since_full: int
    previous: list[torch.Tensor]  # per message, the bytes the reader now holds


@dataclass
class HeldState:
    """What a reader last received from one writer (per phase): the version and, per message,
    the writer's digest of the bytes it should hold now."""

    version: int
    digests: list[int]


class DeltaSync:
    """One transport's delta state for every pair it serves, and the exchange (module docstring)."""

    def __init__(self, ctx: TransportContext, *, allocate: Callable[[int, str], torch.Tensor] | None = None) -> None:
        #: where the writer's copies and the reader's shadows live (host memory unless a
        #: transport on device memory passes its own: ``allocate(nbytes, what)``)
        self.allocate = allocate or (lambda nbytes, what: torch.empty(nbytes, dtype=torch.uint8))
        self.anchor_every = ctx.options.delta_anchor_every
        self.checksum = ctx.options.checksum
        self.rank = ctx.rank
        self.keeps_received_bytes = ctx.keeps_received_bytes
        self.sent: dict[tuple[int, int], SentState] = {}  # writer: (phase, reader) -> sent
        self.held: dict[tuple[int, int], HeldState] = {}  # reader: (phase, writer) -> held
        self.shadow: dict[tuple[int, int], list[torch.Tensor]] = {}  # reader: its copy (see module docstring)
        self._one_phase = True
        self._pointers: dict[str, int] = {}

    def prepared(self, tensors: Mapping[str, torch.Tensor], *, phases: int) -> None:
        """The transport was (re)prepared for ``tensors`` cut in ``phases``."""
        pointers = {name: t.data_ptr() for name, t in tensors.items()}
        if pointers != self._pointers or (phases == 1) != self._one_phase:
            self.held.clear()  # other memory, or other messages: nothing to build on
            self.shadow.clear()
        self._pointers = pointers
        self._one_phase = phases == 1
        warm_up()  # not in the first delta version's time

    def forget_received(self) -> None:
        """The reader's destination may no longer hold what arrived (its version changed
        outside the reader): the next receive of every pair is full."""
        self.held.clear()

    @property
    def holds_versions(self) -> bool:
        """Whether the destination keeps each received version until the next receive."""
        return self.keeps_received_bytes and self._one_phase

    def extra_bytes(self) -> int:
        """Host memory the writer's copies of sent bytes, and the reader's shadows, take."""
        copies = [b for state in self.sent.values() for b in state.previous]
        copies += [b for shadow in self.shadow.values() for b in shadow]
        return sum(int(b.numel()) for b in copies)

    def close(self) -> None:
        self.sent.clear()
        self.held.clear()
        self.shadow.clear()
        self._pointers = {}

    # -- writer -------------------------------------------------------------------------------
    def send_pair(self, link: PairLink[Any], messages: list[Message], flats: Mapping[str, torch.Tensor], *,
                  phase: int, stats: TransferStats, timer: PhaseTimer) -> None:
        """Writer side of one pair's exchange (see module docstring).

        A delta is computed while the reader's base version is still on its way (the reader
        states it only once it has woken up, armed and checked its memory); the base decides,
        before the first batch goes out, whether the delta is sent or the version goes in
        full after all.
        """
        if not messages:
            return
        base = torch.empty(1, dtype=torch.int64)
        with timer("transfer"):
            base_posted = link.post("recv", base, messages[0], tag=0)
        key = (phase, link.peer)
        sent = self.sent.pop(key, None)  # dropped until this send completes: a failure means full next time
        previous = sent.previous if sent else [self.allocate(m.nbytes, f"the delta copy of {m.describe()}")
                                                for m in messages]
        base_known = False

        def reader_holds(version: int) -> bool:
            nonlocal base_known
            if not base_known:
                link.wait(base_posted)
                base_known = True
            return int(base.item()) == version

        full = sent is None or sent.deltas_since_full + 1 >= self.anchor_every
        if sent is not None and not full:
            version = sent.version
            try:
                nbytes = self._send_messages(link, messages, flats, previous, timer, full=False,
                                             confirm=lambda: reader_holds(version))
            except _StaleBaseError:  # nothing went out; every `previous` already holds the new bytes
                full = True
        if full:
            reader_holds(-1)  # the reader's message is read either way
            nbytes = self._send_messages(link, messages, flats, previous, timer, full=True, confirm=None)
        stats.nbytes += nbytes
        stats.messages += len(messages)
        self.sent[key] = SentState(stats.version, 0 if full or sent is None else sent.deltas_since_full + 1,
                                   previous)

    def _send_messages(self, link: PairLink[Any], messages: list[Message], flats: Mapping[str, torch.Tensor],
                       previous: list[torch.Tensor], timer: PhaseTimer, *, full: bool,
                       confirm: Callable[[], bool] | None) -> int:
        """Encode and send every message of the pair; each ``previous`` becomes what the reader holds after.

        Returns the payload bytes sent. Raises _StaleBaseError, before anything is sent, when
        ``confirm`` (called before the first batch goes out) says the reader's base is not the
        one compared with.
        """
        nbytes = 0
        batch = _Batch(link, messages, timer, confirm)
        for index, (message, old) in enumerate(zip(messages, previous, strict=True)):
            new = direct_source(message, flats) if message.direct else None
            if new is None:
                with timer("pack"):
                    new = pack(message, flats, link.buffer(2))
            with timer("encode"):
                if full:
                    enc = Encoded(Kind.DENSE, 0, (new,))
                    old.copy_(new)
                else:
                    enc = codec_for(new.device).encode(new, old, unit=message_unit(message))
            with timer("digest"):
                new_digest = base_digest(new)
            crc = 0
            if self.checksum:
                with timer("checksum"):
                    crc = checksum(new)
            batch.add(index, enc, crc, new_digest)
            nbytes += enc.nbytes
        batch.close()
        return nbytes

    # -- reader -------------------------------------------------------------------------------
    def receive_pair(self, link: PairLink[Any], messages: list[Message], flats: Mapping[str, torch.Tensor], *,
                     phase: int, stats: TransferStats, timer: PhaseTimer) -> None:
        """Reader side of one pair's exchange: state the version it vouches for, then apply what arrives."""
        if not messages:
            return
        key = (phase, link.peer)
        held = self.held.pop(key, None)  # dropped until every message landed
        shadow = None if self.holds_versions else self._shadow(key, messages)
        with timer("vouch"):
            base = self._vouch(link, messages, flats, held, shadow)
        _exchange(link, "send", torch.tensor([base], dtype=torch.int64), messages[0], tag=0)
        digests = [0] * len(messages)
        index, tag = 0, 1
        while index < len(messages):
            headers = torch.empty(len(messages), HEADER, dtype=torch.int64)
            _exchange(link, "recv", headers, messages[index], tag=tag)
            rows = torch.nonzero(headers[:, 0] >= 0).reshape(-1).tolist()
            total = int(headers[rows, 2].sum()) if rows else 0
            if not rows or rows != list(range(index, index + len(rows))) or total > link.capacity:
                raise TransportError(f"reader {self.rank}: malformed delta batch from writer {link.peer} "
                                     f"(messages {rows[:3]}..., {total} bytes, expected message {index} first)")
            data = link.buffer(0)[:total]
            if total:
                _exchange(link, "recv", data, messages[index], tag=tag + 1)
            at = 0
            for row in rows:
                message = messages[row]
                kind, changed, nbytes, crc, digests[row] = (int(x) for x in headers[row].tolist())
                self._check_header(link, message, kind=kind, nbytes=nbytes, base=base)
                payload, at = data[at: at + nbytes], at + nbytes
                with timer("unpack"):
                    result = self._apply(link, message, flats, kind=Kind(kind), payload=payload, changed=changed,
                                         shadow=None if shadow is None else shadow[row])
                if self.checksum:
                    with timer("checksum"):
                        if checksum(result) != crc:
                            raise TransportError(f"reader {self.rank}: checksum mismatch in version "
                                                 f"{stats.version} from writer {link.peer}: {message.describe()}")
                stats.nbytes += nbytes
                stats.messages += 1
            index, tag = rows[-1] + 1, tag + 2
        self.held[key] = HeldState(stats.version, digests)

    def _shadow(self, key: tuple[int, int], messages: list[Message]) -> list[torch.Tensor]:
        shadow = self.shadow.get(key)
        if shadow is None or [int(s.numel()) for s in shadow] != [m.nbytes for m in messages]:
            shadow = self.shadow[key] = [self.allocate(m.nbytes, f"the delta shadow of {m.describe()}")
                                         for m in messages]
        return shadow

    def _vouch(self, link: PairLink[Any], messages: list[Message], flats: Mapping[str, torch.Tensor],
               held: HeldState | None, shadow: list[torch.Tensor] | None) -> int:
        """The version this reader's memory holds for the pair, checked byte for byte, or -1."""
        if held is None:
            return -1
        for index, message in enumerate(messages):
            if shadow is not None:
                data = shadow[index]
            elif message.direct:
                data = as_bytes(dst_view(flats, message.pieces[0]))
            else:
                data = gather(message, flats, link.buffer(1))
            if base_digest(data) != held.digests[index]:
                logger.info("reader %d: %s no longer holds what writer %d sent as version %d (it was written "
                            "since); this version comes in full", self.rank, message.describe(), link.peer,
                            held.version)
                return -1
        return held.version

    def _apply(self, link: PairLink[Any], message: Message, flats: Mapping[str, torch.Tensor], *, kind: Kind,
               payload: torch.Tensor, changed: int, shadow: torch.Tensor | None) -> torch.Tensor:
        """Bring the message's destination to the new bytes; returns them (for the checksum)."""
        if shadow is not None:  # the reader's own copy takes the change; the destination all of it
            self._apply_bytes(link, message, kind, payload, dest=shadow, changed=changed)
            payload, kind = shadow, Kind.DENSE
        if kind == Kind.DENSE:
            if message.direct:
                as_bytes(dst_view(flats, message.pieces[0])).copy_(payload)
            else:
                scatter(message, flats, payload)
            return payload
        if message.direct:
            dest = as_bytes(dst_view(flats, message.pieces[0]))
        else:
            dest = gather(message, flats, link.buffer(1))
        self._apply_bytes(link, message, kind, payload, dest=dest, changed=changed)
        if not message.direct:
            scatter(message, flats, dest)
        return dest

    def _apply_bytes(self, link: PairLink[Any], message: Message, kind: Kind, payload: torch.Tensor, *,
                     dest: torch.Tensor, changed: int) -> None:
        try:
            codec_for(dest.device).apply(kind, payload, dest, unit=message_unit(message), changed=changed)
        except ValueError as exc:
            raise TransportError(f"reader {self.rank}: malformed delta from writer {link.peer} "
                                 f"({message.describe()}): {exc}") from exc

    def _check_header(self, link: PairLink[Any], message: Message, *, kind: int, nbytes: int, base: int) -> None:
        if kind not in (Kind.DENSE, Kind.SPARSE, Kind.BITMAP) or not 0 <= nbytes <= message.nbytes or (
                kind == Kind.DENSE and nbytes != message.nbytes):
            raise TransportError(f"reader {self.rank}: bad delta header (kind {kind}, {nbytes} bytes) from writer "
                                 f"{link.peer} for {message.describe()}")
        if kind != Kind.DENSE and base < 0:
            raise TransportError(f"reader {self.rank}: writer {link.peer} sent a delta although this reader holds "
                                 f"no base version ({message.describe()}); writers and readers disagree on "
                                 f"delta_anchor_every")


def base_digest(data: torch.Tensor) -> int:
    """What a reader vouches for its base with: a digest (:mod:`weightsync.tools.codecs.digest`) of a
    payload's bytes (1-d uint8), as the int64 a header or table row holds. XXH3-64 in host
    memory; sum64 (torch kernels and one reduction, no host copy) in device memory. Both ends of
    a pair hold their bytes on the same kind of memory, so they compute the same kind."""
    kind: DigestKind = "sum64" if device_port.current().is_gpu(data.device) else "xxh3"
    return as_signed(tensor_digest(data, kind).value)


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


class _StaleBaseError(Exception):
    """The reader does not hold the version a delta was computed against (it gets the version in full)."""


class _Batch:
    """Consecutive encoded messages sent as one header block (rows of other messages: -1) and one payload.

    Payloads collect in one of two staging buffers (the link's slots 0 and 1) while the other
    one is on the wire, so a delta version costs a round trip or two per pair instead of one
    per message. (Sending smaller batches sooner, so that the reader applies while the writer
    compares, was slower on a 2-core machine: three busy processes share two cores;
    docs/benchmarks.md.)
    """

    def __init__(self, link: PairLink[Any], messages: list[Message], timer: PhaseTimer,
                 confirm: Callable[[], bool] | None) -> None:
        self.link, self.messages, self.timer, self.confirm = link, messages, timer, confirm
        self.slot, self.at, self.tag = 0, 0, 1
        self.headers = self._fresh_headers()
        self.in_flight: deque[tuple[Any, int, torch.Tensor]] = deque()  # keeps posted tensors alive

    def _fresh_headers(self) -> torch.Tensor:
        return torch.full((len(self.messages), HEADER), -1, dtype=torch.int64)

    def add(self, index: int, enc: Encoded, crc: int, new_digest: int) -> None:
        if self.at + enc.nbytes > self.link.capacity:
            self.flush()
        buffer = self.link.buffer(self.slot)
        for part in enc.parts:
            buffer[self.at: self.at + part.numel()].copy_(part)
            self.at += part.numel()
        self.headers[index] = torch.tensor([int(enc.kind), enc.changed, enc.nbytes, crc, new_digest])

    def flush(self) -> None:
        if self.confirm is not None:
            confirm, self.confirm = self.confirm, None
            if not confirm():
                raise _StaleBaseError
        message = self.messages[int(torch.nonzero(self.headers[:, 0] >= 0)[0])]
        parts = [self.headers] + ([self.link.buffer(self.slot)[: self.at]] if self.at else [])
        for offset, tensor in enumerate(parts):
            with self.timer("transfer"):
                posted = self.link.post("send", tensor, message, tag=self.tag + offset)
            self.in_flight.append((posted, self.slot, tensor))
        self.slot, self.at, self.tag, self.headers = 1 - self.slot, 0, self.tag + 2, self._fresh_headers()
        while any(item[1] == self.slot for item in self.in_flight):  # the next buffer must be free
            self._finish()

    def close(self) -> None:
        if bool((self.headers[:, 0] >= 0).any()):
            self.flush()
        while self.in_flight:
            self._finish()

    def _finish(self) -> None:
        posted, _, _ = self.in_flight.popleft()
        self.link.wait(posted)


def _exchange(link: PairLink[Any], op: Literal["send", "recv"], tensor: torch.Tensor, message: Message, *,
              tag: int) -> None:
    link.wait(link.post(op, tensor, message, tag=tag))
