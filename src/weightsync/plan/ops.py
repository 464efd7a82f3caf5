"""The planner's output: frozen transfer ops, grouped per (source, destination) pair.

A :class:`TransferOp` moves one box of one canonical tensor from one writer rank's shard
to one reader rank's shard. Both sides see the box through a strided view of their local
storage, so executing an op is::

    src_view = src_flat.as_strided(op.box.sizes, op.src_strides, op.src_offset)
    dst_view = dst_flat.as_strided(op.box.sizes, op.dst_strides, op.dst_offset)
    dst_view.copy_(src_view.to(dst_dtype))   # the sender converts dtypes

Bytes travel in the destination dtype and in row-major order of the box. Ops of a plan
are sorted by (source rank, destination rank, canonical tensor, box), which is the order
every transport packs them in, so sender and receiver agree on message layouts with no
further negotiation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np

from weightsync.layout.box import Box, is_contiguous_view
from weightsync.plan.table import ShardRef

#: The two sides of a sync: writers (training ranks) send, readers (inference ranks) receive.
Role = Literal["writer", "reader"]


@dataclass(frozen=True, slots=True)
class TransferOp:
    """One contiguous-in-canonical-order box moved from a writer rank to a reader rank."""

    src_rank: int
    dst_rank: int
    canonical: str
    box: Box
    src_shard: str
    src_offset: int
    src_strides: tuple[int, ...]
    src_dtype: str
    dst_shard: str
    dst_offset: int
    dst_strides: tuple[int, ...]
    dst_dtype: str
    nbytes: int

    @property
    def numel(self) -> int:
        return self.box.numel

    @property
    def src_contiguous(self) -> bool:
        return is_contiguous_view(self.box.sizes, self.src_strides)

    @property
    def dst_contiguous(self) -> bool:
        """Whether the destination view is one dense run (can be received into directly)."""
        return is_contiguous_view(self.box.sizes, self.dst_strides)

    @property
    def converts(self) -> bool:
        return self.src_dtype != self.dst_dtype


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Aggregate figures of a plan, as ``weightsync plan`` prints them."""

    total_bytes: int
    needed_bytes: int
    sent_bytes: int
    num_ops: int
    num_sources: int
    num_destinations: int
    max_send_bytes: int
    mean_send_bytes: float
    max_recv_bytes: int
    lower_bound_send_bytes: float
    plan_seconds: float
    #: bytes readers copy within their own memory (a box one reader holds twice: EPLB's redundant experts)
    copied_bytes: int = 0

    @property
    def imbalance(self) -> float:
        """max send / mean send over source ranks (1.0 is perfect)."""
        return self.max_send_bytes / self.mean_send_bytes if self.mean_send_bytes else 1.0

    @property
    def balance_ratio(self) -> float:
        """max send / the computed lower bound on it (1.0 is optimal)."""
        return self.max_send_bytes / self.lower_bound_send_bytes if self.lower_bound_send_bytes else 1.0

    def simulated_seconds(self, link_gbps: float) -> float:
        """Time if every rank moves its bytes over one link of ``link_gbps`` gigabit/s."""
        busiest = max(self.max_send_bytes, self.max_recv_bytes)
        return busiest / (link_gbps * 1e9 / 8)

    def to_dict(self, link_gbps: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "total_bytes": self.total_bytes,
            "needed_bytes": self.needed_bytes,
            "sent_bytes": self.sent_bytes,
            "num_ops": self.num_ops,
            "num_sources": self.num_sources,
            "num_destinations": self.num_destinations,
            "max_send_bytes": self.max_send_bytes,
            "mean_send_bytes": self.mean_send_bytes,
            "max_recv_bytes": self.max_recv_bytes,
            "lower_bound_send_bytes": self.lower_bound_send_bytes,
            "imbalance": self.imbalance,
            "balance_ratio": self.balance_ratio,
            "plan_seconds": self.plan_seconds,
            "copied_bytes": self.copied_bytes,
        }
        if link_gbps is not None:
            out["link_gbps"] = link_gbps
            out["simulated_seconds"] = self.simulated_seconds(link_gbps)
        return out


@dataclass(frozen=True, eq=False)
class OpColumns:
    """Ops as parallel numpy arrays (the compact form; ``Plan.ops`` expands it)."""

    src_rank: np.ndarray
    src_shard: np.ndarray
    dst_rank: np.ndarray
    dst_shard: np.ndarray
    tensor: np.ndarray
    off: np.ndarray
    size: np.ndarray
    src_off: np.ndarray
    src_stride: np.ndarray
    dst_off: np.ndarray
    dst_stride: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return int(self.src_rank.shape[0])

    @classmethod
    def concat(cls, parts: list[OpColumns], ndim: int) -> OpColumns:
        if not parts:
            z = np.zeros(0, dtype=np.int64)
            z2 = np.zeros((0, ndim), dtype=np.int64)
            return cls(z, z, z, z, z, z2, z2, z, z2, z, z2, z)
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in _OP_FIELDS))

    def take(self, index: np.ndarray) -> OpColumns:
        return OpColumns(*(getattr(self, f)[index] for f in _OP_FIELDS))

    def sorted(self) -> OpColumns:
        """Sorted by (src rank, dst rank, tensor, box offsets): the wire order."""
        keys = [self.off[:, d] for d in range(self.off.shape[1] - 1, -1, -1)]
        order = np.lexsort([*keys, self.tensor, self.dst_rank, self.src_rank])
        return self.take(order)


_OP_FIELDS = ("src_rank", "src_shard", "dst_rank", "dst_shard", "tensor", "off", "size",
              "src_off", "src_stride", "dst_off", "dst_stride", "nbytes")


@dataclass(frozen=True, eq=False)
class Plan:
    """A deterministic set of transfer ops (global, or one rank's share of it).

    ``fingerprint`` hashes the planner's inputs and options: two ranks holding the same
    fingerprint computed the same plan, which is what writers and readers compare before
    any byte moves.

    ``copies`` are a reader's *local* copies: a box a reader holds in several places (an
    expert on several EPLB slots of one rank) arrives once, into the first, and the reader
    copies it into the others after the ops of its phase arrived (``src_*`` and ``dst_*``
    both address the reader's own shards; ``src_rank == dst_rank``). Transports never see them.
    """

    fingerprint: str
    tensors: tuple[str, ...]
    tensor_ndim: tuple[int, ...]
    src_shards: Sequence[ShardRef]
    dst_shards: Sequence[ShardRef]
    columns: OpColumns
    stats: PlanStats | None = None
    scope: str = "global"
    copies: OpColumns | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.columns)

    def subset(self, index: np.ndarray, *, tag: str, copies: np.ndarray | None = None) -> Plan:
        """The plan of the ops at ``index`` (kept in order): same shards, fingerprint ``<fp>/<tag>``;
        with the local copies at ``copies`` (none otherwise)."""
        kept = self.copies.take(copies) if self.copies is not None and copies is not None else None
        return Plan(fingerprint=f"{self.fingerprint}/{tag}", tensors=self.tensors, tensor_ndim=self.tensor_ndim,
                    src_shards=self.src_shards, dst_shards=self.dst_shards, columns=self.columns.take(index),
                    stats=None, scope=self.scope, copies=kept)

    @property
    def num_copies(self) -> int:
        return len(self.copies) if self.copies is not None else 0

    @cached_property
    def ops(self) -> tuple[TransferOp, ...]:
        """Every op as a frozen dataclass, in wire order."""
        return self._expand(self.columns, self.src_shards)

    @cached_property
    def copy_ops(self) -> tuple[TransferOp, ...]:
        """The local copies (see class docstring) as ops whose source is the reader's own shard."""
        return self._expand(self.copies, self.dst_shards) if self.copies is not None else ()

    def _expand(self, c: OpColumns, src_shards: Sequence[ShardRef]) -> tuple[TransferOp, ...]:
        out = []
        for i in range(len(c)):
            t = int(c.tensor[i])
            n = self.tensor_ndim[t]
            src = src_shards[int(c.src_shard[i])]
            dst = self.dst_shards[int(c.dst_shard[i])]
            sizes = tuple(int(x) for x in c.size[i, :n])
            out.append(TransferOp(
                src_rank=int(c.src_rank[i]),
                dst_rank=int(c.dst_rank[i]),
                canonical=self.tensors[t],
                box=Box(tuple(int(x) for x in c.off[i, :n]), sizes),
                src_shard=src.name,
                src_offset=int(c.src_off[i]),
                src_strides=tuple(int(x) for x in c.src_stride[i, :n]),
                src_dtype=src.dtype,
                dst_shard=dst.name,
                dst_offset=int(c.dst_off[i]),
                dst_strides=tuple(int(x) for x in c.dst_stride[i, :n]),
                dst_dtype=dst.dtype,
                nbytes=int(c.nbytes[i]),
            ))
        return tuple(out)

    @property
    def total_bytes(self) -> int:
        return int(self.columns.nbytes.sum())

    def ops_between(self, src_rank: int, dst_rank: int) -> list[TransferOp]:
        """Ops from one writer rank to one reader rank, in wire order."""
        return self.pairs().get((src_rank, dst_rank), [])

    def pairs(self) -> dict[tuple[int, int], list[TransferOp]]:
        """Ops grouped by (src rank, dst rank), each group in wire order."""
        cached = self._cache.get("pairs")
        if cached is None:
            cached = {}
            for op in self.ops:
                cached.setdefault((op.src_rank, op.dst_rank), []).append(op)
            self._cache["pairs"] = cached
        return cached
