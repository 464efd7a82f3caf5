"""Message schedules: how a pair's ops are cut into messages, and the order of pairs.

Sender and receiver derive the same schedule from the same ops and options, so no
per-message header ever crosses the wire. A message is either

* **direct**: one (piece of an) op whose destination view is a dense run; the receiver
  receives straight into the parameter, or
* **staged**: several small or strided ops packed back to back into a staging buffer of at
  most ``message_bytes``; the receiver scatters them into their views.

Large ops are cut along their outermost dimension into pieces of at most
``message_bytes``, so staging memory stays bounded whatever the tensor sizes.

Pairs are visited in one global order (``pair_order``); since every process walks its own
pairs in that order, a chain of waiting processes always ends, so there is no deadlock,
and the rotation spreads the first messages over different peers.

    for pair in pair_order(my_pairs, num_writers, num_readers):
        for message in build_messages(plan.ops_between(*pair), options.message_bytes, ...): ...
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from weightsync.layout.box import Box, is_contiguous_view
from weightsync.layout.types import itemsize
from weightsync.plan.ops import TransferOp


@dataclass(frozen=True, slots=True)
class Piece:
    """An op, or a slab of one, that travels inside one message."""

    op: TransferOp
    box: Box
    src_offset: int
    dst_offset: int
    nbytes: int
    #: Byte offset of this piece inside its message payload.
    at: int

    @property
    def src_contiguous(self) -> bool:
        return is_contiguous_view(self.box.sizes, self.op.src_strides)

    @property
    def dst_contiguous(self) -> bool:
        return is_contiguous_view(self.box.sizes, self.op.dst_strides)


@dataclass(frozen=True, slots=True)
class Message:
    pieces: tuple[Piece, ...]
    nbytes: int
    direct: bool

    def describe(self) -> str:
        names = sorted({p.op.canonical for p in self.pieces})
        shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
        return f"{self.nbytes} bytes of {shown}"


def slabs(op: TransferOp, max_bytes: int) -> Iterator[tuple[Box, int, int]]:
    """Cut an op's box into row-major slabs of at most ``max_bytes`` (one element minimum).

    Yields (sub-box, src offset, dst offset). Slabs are unions of consecutive indices
    along one dimension with all later dimensions whole, so a slab of a dense view is dense.
    """
    elem = itemsize(op.dst_dtype)
    sizes = op.box.sizes
    if op.nbytes <= max_bytes or not sizes:
        yield op.box, op.src_offset, op.dst_offset
        return
    # Find the outermost dim whose trailing block fits; iterate the dims before it one by one.
    inner = [math.prod(sizes[d + 1:]) * elem for d in range(len(sizes))]
    split_dim = next((d for d in range(len(sizes)) if inner[d] <= max_bytes), len(sizes) - 1)
    step = max(1, max_bytes // inner[split_dim])
    outer_ranges = [range(sizes[d]) for d in range(split_dim)]
    for prefix in _product(outer_ranges):
        for lo in range(0, sizes[split_dim], step):
            n = min(step, sizes[split_dim] - lo)
            rel = (*prefix, lo) + (0,) * (len(sizes) - split_dim - 1)
            sub_sizes = (1,) * split_dim + (n,) + sizes[split_dim + 1:]
            box = Box(tuple(o + r for o, r in zip(op.box.offsets, rel, strict=True)), sub_sizes)
            src = op.src_offset + sum(r * s for r, s in zip(rel, op.src_strides, strict=True))
            dst = op.dst_offset + sum(r * s for r, s in zip(rel, op.dst_strides, strict=True))
            yield box, src, dst


def _product(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (head, *rest)


def build_messages(ops: Iterable[TransferOp], *, message_bytes: int, direct_min_bytes: int) -> list[Message]:
    """The message sequence for one (writer, reader) pair, in wire order."""
    out: list[Message] = []
    staged: list[Piece] = []
    staged_bytes = 0

    def flush() -> None:
        nonlocal staged, staged_bytes
        if staged:
            out.append(Message(tuple(staged), staged_bytes, direct=False))
            staged, staged_bytes = [], 0

    for op in ops:
        direct = op.dst_contiguous and op.nbytes >= direct_min_bytes
        for box, src_off, dst_off in slabs(op, message_bytes):
            nbytes = box.numel * itemsize(op.dst_dtype)
            if direct:
                flush()
                out.append(Message((Piece(op, box, src_off, dst_off, nbytes, 0),), nbytes, direct=True))
                continue
            elem = itemsize(op.dst_dtype)
            at = -(-staged_bytes // elem) * elem  # each piece aligned to its dtype (FP8 beside fp32)
            if at + nbytes > message_bytes and staged:
                flush()
                at = 0
            staged.append(Piece(op, box, src_off, dst_off, nbytes, at))
            staged_bytes = at + nbytes
    flush()
    return out


def pair_order(pairs: Iterable[tuple[int, int]], num_writers: int, num_readers: int) -> list[tuple[int, int]]:
    """Sort (writer, reader) pairs by one global key: rotated rounds, then ranks."""
    span = max(num_writers, num_readers, 1)
    return sorted(pairs, key=lambda p: ((p[1] - p[0]) % span, p[0], p[1]))
