"""Every rank of a layout kind as columns, from pieces built once and renamed for each layer.

A kind that describes a rank as a list of :class:`Piece` s (the embedding; each layer, or a
layer's experts; the head) lets :func:`assemble` build all its ranks' columns without an object
per rank. A piece's shards depend on its layer only through the layer's roles and names: a
layer's layout follows its kind, not its index (vLLM's recording relies on the same fact).
So the pieces of one kind and one set of roles are built as objects once, for the first layer
that has them, turned into columns, and *renamed* for every other layer: canonical names by
role, shard names by their prefix. A 1024-rank Megatron job's 105k regions (1T MoE) come from
1.3k built as objects; ``tests/test_roster.py`` checks the result against the objects.

    pieces = kind.pieces(spec, rank)        # [Piece("dense", (t,), layer=3, prefix=...), ...]
    shards = kind.piece_shards(spec, rank)  # one rank, as objects
    roster = assemble(kind, spec, ranks, canonical)   # every rank, as columns
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from weightsync.layout.columns import DTYPE_CODES, layout_columns
from weightsync.layout.model import ModelSpec
from weightsync.layout.quant_block import derived_bases
from weightsync.layout.roster import Roster, ShardColumns, shape_array
from weightsync.layout.types import CanonicalTensor, RankLayout, Shard


class PieceKind(Protocol):
    """What :func:`assemble` asks of a layout kind (``LayoutKind`` provides it; named here so
    that this module does not import the kinds' base, which imports it)."""

    def shard_key(self, rank: int) -> Hashable: ...

    def pieces(self, spec: ModelSpec, rank: int) -> list[Piece] | None: ...

    def build_piece(self, spec: ModelSpec, piece: Piece) -> list[Shard]: ...


@dataclass(frozen=True, slots=True)
class Piece:
    """A part of a rank's shards (see module docstring).

    ``what`` and ``args`` say what the piece holds apart from its layer (``"dense", (tp_rank,)``);
    pieces that agree on them, in layers with the same roles, hold the same boxes of their own
    layer's tensors. Every shard name of the piece starts with ``prefix`` (the layer's path).
    """

    what: str
    args: tuple[int, ...] = ()
    layer: int | None = None
    prefix: str = ""


@dataclass(frozen=True, eq=False)
class _Block:
    """One piece built as objects, in columns: rows and shards ``[lo, hi)`` of the assembly.

    When ``renamable`` (every shard name starts with the prefix, every layer-bound canonical
    name is of ``layer``), ``names`` are the shard names after the prefix; else whole names,
    and the block serves its own layer only.
    """

    index: int
    layer: int | None
    prefix: str
    rows: tuple[int, int]
    shards: tuple[int, int]
    names: list[str]
    renamable: bool


class _Renames:
    """Canonical name indices of one layer mapped to another layer's, by role (cached)."""

    def __init__(self, spec: ModelSpec, names: Sequence[str]) -> None:
        roles = spec.roles()
        derived = derived_bases(names, spec)
        self.layer_of = np.full(len(names), -1, dtype=np.int64)
        self._by_layer: dict[int, list[tuple[int, str, str]]] = {}
        self._index: dict[tuple[str, str, int], int] = {}
        for i, name in enumerate(names):
            tag = ""
            found = roles.get(name)
            if found is None and name in derived:  # a quantized reader's values or scales
                base, tag = derived[name]
                found = roles.get(base)
            if found is None or found[1] is None:
                continue
            role, layer = found[0], found[1]
            self.layer_of[i] = layer
            self._by_layer.setdefault(layer, []).append((i, role, tag))
            self._index[role, tag, layer] = i
        self._maps: dict[tuple[int, int], np.ndarray | None] = {}

    def between(self, old: int, new: int) -> np.ndarray | None:
        """Index map from ``old``'s names to ``new``'s (identity elsewhere); None if a role is missing."""
        key = (old, new)
        if key not in self._maps:
            out: np.ndarray | None = np.arange(len(self.layer_of), dtype=np.int64)
            for i, role, tag in self._by_layer.get(old, []):
                j = self._index.get((role, tag, new))
                if j is None:
                    out = None
                    break
                out[i] = j  # type: ignore[index]
            self._maps[key] = out
        return self._maps[key]


def assemble(kind: PieceKind, spec: ModelSpec, ranks: Sequence[int], canonical: Mapping[str, CanonicalTensor],
             transform: Callable[[list[Shard]], list[Shard]] | None = None) -> Roster:
    """The roster of ``ranks`` (ascending) of ``kind``, whose ranks are pieces, without objects per rank.

    ``transform`` turns a piece's shards into what the ranks hold (an FP8 reader's quantized
    shards); it must work shard by shard.
    """
    asm = _Assembly(kind, spec, canonical, transform)
    by_key: dict[Hashable, list[int]] = {}
    per_rank = []
    for rank in ranks:
        key = kind.shard_key(rank)
        if key not in by_key:  # replicas hold the same pieces
            by_key[key] = [asm.instance(p) for p in kind.pieces(spec, rank) or ()]
        per_rank.append(by_key[key])
    return asm.roster(np.asarray(ranks, dtype=np.int64), per_rank)


class _Assembly:
    """The blocks, and their instances (a block at a layer), of one :func:`assemble` call."""

    def __init__(self, kind: PieceKind, spec: ModelSpec, canonical: Mapping[str, CanonicalTensor],
                 transform: Callable[[list[Shard]], list[Shard]] | None) -> None:
        self.kind, self.spec, self.canonical, self.transform = kind, spec, canonical, transform
        self.names = tuple(canonical)
        self.ids = {n: i for i, n in enumerate(self.names)}
        self.renames = _Renames(spec, self.names)
        self.blocks: dict[Hashable, _Block] = {}
        self.block_list: list[_Block] = []
        #: per block: shard, name, off, size, loff, stride, ndim, dtype (rows); its shards' columns
        self.rows: list[tuple[np.ndarray, ...]] = []
        self.shards: list[ShardColumns] = []
        self.n_rows = self.n_shards = 0
        self.instances: dict[tuple[int, int | None, str], int] = {}
        self.inst_block: list[int] = []
        self.inst_map: list[np.ndarray | None] = []  # None: the block's own names
        self.inst_names: list[list[str]] = []

    def instance(self, piece: Piece) -> int:
        """The instance (a block renamed for ``piece``'s layer) that ``piece`` is."""
        roles = self.spec.layer_roles(piece.layer) if piece.layer is not None else ()
        block = self.blocks.get((piece.what, piece.args, roles))
        if block is None:
            block = self.blocks[piece.what, piece.args, roles] = self._build(piece)
        mapping = None
        if (block.layer, block.prefix) != (piece.layer, piece.prefix):
            if block.renamable and block.layer is not None and piece.layer is not None:
                mapping = self.renames.between(block.layer, piece.layer)
            if mapping is None:  # build the piece for its own layer
                exact = (piece.what, piece.args, roles, piece.layer, piece.prefix)
                block = self.blocks.get(exact) or self.blocks.setdefault(exact, self._build(piece))
        key = (block.index, piece.layer, piece.prefix)
        found = self.instances.get(key)
        if found is None:
            found = self.instances[key] = len(self.inst_block)
            self.inst_block.append(block.index)
            self.inst_map.append(mapping)
            self.inst_names.append([piece.prefix + n for n in block.names] if block.renamable else block.names)
        return found

    def _build(self, piece: Piece) -> _Block:
        shards = self.kind.build_piece(self.spec, piece)
        if self.transform is not None:
            shards = self.transform(shards)
        cols = layout_columns(RankLayout(0, tuple(shards), self.canonical))  # validates the piece
        local = np.array([self.ids[n] for n in cols.names], dtype=np.int64)
        name_idx = local[cols.name_idx] if len(local) else cols.name_idx
        layers = set(self.renames.layer_of[name_idx].tolist()) - {-1}
        renamable = (piece.layer is not None and layers <= {piece.layer}
                     and all(s.name.startswith(piece.prefix) for s in shards))
        cut = len(piece.prefix) if renamable else 0
        rows, first = self.n_rows, self.n_shards
        self.n_rows += len(cols)
        self.n_shards += len(shards)
        block = _Block(len(self.block_list), piece.layer, piece.prefix, (rows, self.n_rows),
                       (first, self.n_shards), [s.name[cut:] for s in shards], renamable)
        self.rows.append((cols.shard_idx, name_idx, cols.off, cols.size, cols.loff, cols.stride, cols.ndim,
                          cols.dtype))
        self.shards.append(ShardColumns(
            np.zeros(len(shards), dtype=np.int64), [],
            np.array([DTYPE_CODES.index(s.dtype) for s in shards], dtype=np.int64),
            shape_array([s.shape for s in shards]), np.array([len(s.shape) for s in shards], dtype=np.int64)))
        self.block_list.append(block)
        return block

    def roster(self, ranks: np.ndarray, per_rank: list[list[int]]) -> Roster:
        """Every rank's instances expanded into rows and shards, all at once."""
        entry_inst = np.array([i for insts in per_rank for i in insts], dtype=np.int64)  # in rank order
        entry_rank = np.repeat(ranks, [len(insts) for insts in per_rank])
        e_block = np.array(self.inst_block, dtype=np.int64)[entry_inst]
        rows, row_entry = _expand(np.array([b.rows for b in self.block_list], dtype=np.int64).reshape(-1, 2), e_block)
        shard_rows, shard_entry = _expand(np.array([b.shards for b in self.block_list], dtype=np.int64).reshape(-1, 2),
                                          e_block)
        width = max((r[2].shape[1] for r in self.rows), default=1)
        b_shard, b_name, b_off, b_size, b_loff, b_stride, b_ndim, b_dtype = _stack(self.rows, width)
        name_idx = b_name[rows]
        renamed = [i for i, m in enumerate(self.inst_map) if m is not None]
        if renamed:
            maps = np.stack([np.arange(len(self.names), dtype=np.int64)]
                            + [m for m in self.inst_map if m is not None])
            slot = np.zeros(len(self.inst_block), dtype=np.int64)
            slot[renamed] = np.arange(1, len(renamed) + 1)
            name_idx = maps[slot[entry_inst[row_entry]], name_idx]
        first_shard = np.searchsorted(shard_entry, np.arange(len(entry_inst)))  # each entry's first shard
        shards = ShardColumns.concat(self.shards) if self.shards else ShardColumns.empty()
        return Roster(
            ranks=ranks, canonical=(self.canonical,), rank_canonical=np.zeros(len(ranks), dtype=np.int64),
            names=self.names, rank=entry_rank[row_entry], shard=first_shard[row_entry] + b_shard[rows],
            name_idx=name_idx, off=b_off[rows], size=b_size[rows], loff=b_loff[rows], stride=b_stride[rows],
            ndim=b_ndim[rows], dtype=b_dtype[rows],
            shards=ShardColumns(entry_rank[shard_entry], [n for i in entry_inst.tolist() for n in self.inst_names[i]],
                                shards.dtype[shard_rows], shards.shape[shard_rows], shards.ndim[shard_rows]),
        )


def _expand(spans: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indices ``[lo, hi)`` of each block in ``blocks`` (``spans``: per block), concatenated,
    and the entry (position in ``blocks``) each index comes from."""
    lo = spans[blocks, 0] if len(blocks) else np.zeros(0, dtype=np.int64)
    count = spans[blocks, 1] - lo if len(blocks) else lo
    starts = np.cumsum(count) - count
    return np.repeat(lo - starts, count) + np.arange(int(count.sum())), np.repeat(np.arange(len(blocks)), count)


def _stack(rows: list[tuple[np.ndarray, ...]], width: int) -> tuple[np.ndarray, ...]:
    """The blocks' row columns concatenated, boxes padded with unit dims to ``width``."""
    if not rows:
        z, z2 = np.zeros(0, dtype=np.int64), np.zeros((0, width), dtype=np.int64)
        return z, z, z2, z2, z, z2, z, z
    out = []
    for k in range(8):
        parts = [r[k] for r in rows]
        if k in (2, 3, 5):  # off, size, stride
            fill = 1 if k == 3 else 0
            parts = [np.hstack([p, np.full((len(p), width - p.shape[1]), fill, dtype=np.int64)])
                     if p.shape[1] < width else p for p in parts]
        out.append(np.concatenate(parts))
    return tuple(out)
