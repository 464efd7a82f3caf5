"""The pieces a writer exposes for one-sided transports (shared memory, file, NIXL pull).

A writer lays out every distinct source piece it must provide (ops of its local plan,
deduplicated by canonical box and dtype) back to back, in wire order. The index, piece
key -> (byte offset, bytes), is small and is published once per plan; a reader then
finds each of its ops by key and copies straight from the writer's memory (or file) into
its destination view. Keys are canonical, so writer and reader never need each other's
local plans.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgpack

from weightsync.plan.ops import Plan, TransferOp

ALIGN = 64  # bytes; keeps every piece aligned for vectorised copies


def piece_key(op: TransferOp) -> str:
    """``name@o0,o1+s0,s1:dtype``: the canonical identity of an op's bytes."""
    offs = ",".join(map(str, op.box.offsets))
    sizes = ",".join(map(str, op.box.sizes))
    return f"{op.canonical}@{offs}+{sizes}:{op.dst_dtype}"


@dataclass(frozen=True, slots=True)
class ExposedIndex:
    """key -> (offset, nbytes) within one writer's exposed area, plus the area's size."""

    entries: Mapping[str, tuple[int, int]]
    total_bytes: int

    @classmethod
    def for_writer(cls, plan: Plan, rank: int) -> tuple[ExposedIndex, list[tuple[str, TransferOp]]]:
        """Index and the ops to copy (one per distinct key) for writer ``rank``."""
        return cls.for_ops(op for op in plan.ops if op.src_rank == rank)

    @classmethod
    def for_ops(cls, ops: Iterable[TransferOp]) -> tuple[ExposedIndex, list[tuple[str, TransferOp]]]:
        """Index and the ops to copy (one per distinct key), in the order given."""
        entries: dict[str, tuple[int, int]] = {}
        first_ops: list[tuple[str, TransferOp]] = []
        cursor = 0
        for op in ops:
            key = piece_key(op)
            if key in entries:
                continue
            entries[key] = (cursor, op.nbytes)
            first_ops.append((key, op))
            cursor += -(-op.nbytes // ALIGN) * ALIGN
        return cls(entries, cursor), first_ops

    def encode(self) -> bytes:
        return msgpack.packb({"total": self.total_bytes,
                              "keys": list(self.entries),
                              "at": [v[0] for v in self.entries.values()],
                              "n": [v[1] for v in self.entries.values()]})

    @classmethod
    def decode(cls, data: bytes) -> ExposedIndex:
        obj = msgpack.unpackb(data)
        try:
            entries = {k: (int(a), int(n)) for k, a, n in zip(obj["keys"], obj["at"], obj["n"], strict=True)}
            return cls(entries, int(obj["total"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed exposed-piece index: {exc}") from None

    def locate(self, op: TransferOp, writer: int) -> tuple[int, int]:
        key = piece_key(op)
        try:
            return self.entries[key]
        except KeyError:
            raise ValueError(
                f"writer {writer} does not expose {key}; writer and reader disagree on the plan"
            ) from None
