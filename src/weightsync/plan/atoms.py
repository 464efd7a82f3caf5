"""The planner's first half: every rank's regions in, disjoint source atoms with their holders out.

Steps 1-3 of :mod:`weightsync.plan.planner`, which depend on the metadata alone (never on a
destination piece):

1. number the canonical tensors and flatten every rank's regions into a
   :class:`~weightsync.plan.table.RegionTable` (one per side); check that both sides agree on
   shapes, that every needed tensor has a source, and that sources of a tensor agree on dtype;
2. cut the source side into disjoint *atoms* (identical boxes merged, partial overlaps
   refined) and give each atom its *holder class* (the ranks holding it);
3. estimate how many bytes each class must send and water-fill them over its ranks
   (:mod:`weightsync.plan.balance`), giving each rank a share of each class.

The result, :class:`Atoms`, also carries the plan's fingerprint (a hash of its inputs and
options). The planner then joins destinations with atoms and assigns each piece::

    atoms = Atoms(writer_layouts, reader_layouts, PlanOptions())
    atoms.atom_tensor, atoms.holder_ptr, atoms.class_alloc, atoms.fingerprint
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightsync.layout.box import Box
from weightsync.layout.columns import DTYPE_CODES
from weightsync.layout.roster import Roster
from weightsync.layout.types import RankLayout
from weightsync.plan.balance import water_fill
from weightsync.plan.table import RegionTable

#: One side of a job: its ranks' layouts, or the same as a roster's columns.
Side = Roster | Sequence[RankLayout]

#: Bump when the planner's decisions change, so mixed versions fail the fingerprint check.
PLANNER_VERSION = "2"


class PlanError(ValueError):
    """The metadata cannot be planned (missing tensors, gaps, inconsistent shapes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """Planner options; every rank must use the same (they enter the fingerprint).

    Attributes:
        min_split_bytes: a piece held by ``k`` ranks is cut among them only if each part
            would be at least this large; smaller pieces go whole to one holder.
        allow_unneeded_sources: accept source tensors no destination needs (otherwise
            an error lists them: usually a name-mapping mistake).
    """

    min_split_bytes: int = 1 << 20
    allow_unneeded_sources: bool = False

    def __post_init__(self) -> None:
        if self.min_split_bytes < 0:
            raise ValueError(f"min_split_bytes must be >= 0, got {self.min_split_bytes}")

class Atoms:
    """Everything derived from the full metadata (steps 1-3); shared by global and local planning.

    ``previous``: the atoms of an earlier plan of the same writers (the same roster object) and
    options. Its source side (tables, atoms, holder classes, the writers' part of the
    fingerprint) is reused when the tensors are the same, so a re-plan after readers changed
    (an EPLB placement) costs the readers' side only; the result equals a fresh computation.
    """

    src: RegionTable
    class_alloc: list[tuple[int, ...]]
    class_cum: list[np.ndarray]
    class_nnz: np.ndarray
    _class_demand: np.ndarray
    _src_hasher: Any

    def __init__(self, sources: Side, dests: Side, options: PlanOptions, *, previous: Atoms | None = None) -> None:
        # Input order must not matter: every rank may list the layouts differently (rosters
        # are in rank order).
        src, dst = Roster.of(sources), Roster.of(dests)
        if not src.num_ranks:
            raise PlanError("no writer layouts given")
        if not dst.num_ranks:
            raise PlanError("no reader layouts given")
        _check_unique_ranks(src.ranks, "writer")
        _check_unique_ranks(dst.ranks, "reader")
        self.options = options
        shapes = _canonical_shapes(src, dst)
        self.tensors = tuple(sorted(shapes))
        self.shapes = tuple(shapes[n] for n in self.tensors)
        self.tensor_ndim = tuple(len(s) for s in self.shapes)
        self.ndim = max(max(self.tensor_ndim, default=1), 1)
        ids = {n: i for i, n in enumerate(self.tensors)}
        reuse = (previous is not None and previous.src.roster is src and previous.options == options
                 and previous.tensors == self.tensors and previous.shapes == self.shapes)
        self.dst = _nonempty(RegionTable.build(dst, ids, self.ndim))
        self.num_sources = src.num_ranks
        self.num_dests = dst.num_ranks
        self.copy_of = _copies(self.dst)
        if reuse:
            assert previous is not None
            for name in ("src", "big", "name_hash", "atom_tensor", "atom_off", "atom_size", "holder_ptr", "holder_row",
                         "atom_class", "classes", "_src_hasher"):
                setattr(self, name, getattr(previous, name))
            self._check_names()
            self._allocate(previous)
        else:
            self.src = _nonempty(RegionTable.build(src, ids, self.ndim))
            self.big = max((max(s) if s else 1) for s in self.shapes) + 1 if self.shapes else 2
            self.name_hash = np.array([zlib.crc32(n.encode()) for n in self.tensors], dtype=np.int64)
            self._check_names()
            self._check_source_dtypes()
            self._build_atoms()
            self._classes()
            self._allocate(None)
            self._src_hasher = self._hash_sources()
        h = self._src_hasher.copy()
        h.update(b"|readers|")
        self.dst.digest_update(h)
        self.fingerprint = h.hexdigest()

    # -- validation -----------------------------------------------------------------------
    def _check_names(self) -> None:
        have = set(np.unique(self.src.tensor).tolist())
        need = set(np.unique(self.dst.tensor).tolist())
        missing = sorted(self.tensors[i] for i in need - have)
        if missing:
            raise PlanError(
                f"{len(missing)} tensor(s) needed by readers are held by no writer: "
                f"{_preview(missing)}"
            )
        extra = sorted(self.tensors[i] for i in have - need)
        if extra and not self.options.allow_unneeded_sources:
            raise PlanError(
                f"{len(extra)} tensor(s) held by writers are needed by no reader: "
                f"{_preview(extra)} (pass allow_unneeded_sources=True if that is intended)"
            )

    def _check_source_dtypes(self) -> None:
        order = np.lexsort([self.src.dtype, self.src.tensor])
        t = self.src.tensor[order]
        d = self.src.dtype[order]
        bad = np.flatnonzero((t[1:] == t[:-1]) & (d[1:] != d[:-1]))
        if bad.size:
            tensor = int(t[bad[0]])
            rows = np.flatnonzero(self.src.tensor == tensor)
            found = sorted({f"rank {int(self.src.rank[r])}: {DTYPE_CODES[int(self.src.dtype[r])]}"
                            for r in rows[:64].tolist()})
            raise PlanError(
                f"writers hold {self.tensors[tensor]!r} in different dtypes ({', '.join(found[:6])}); "
                "all sources of a tensor must share one dtype"
            )

    # -- atoms ----------------------------------------------------------------------------
    def _build_atoms(self) -> None:
        src = self.src
        nd = self.ndim
        keys = [src.rank]
        keys += [src.size[:, d] for d in range(nd - 1, -1, -1)]
        keys += [src.off[:, d] for d in range(nd - 1, -1, -1)]
        keys.append(src.tensor)
        order = np.lexsort(keys)
        t = src.tensor[order]
        off = src.off[order]
        size = src.size[order]
        rank = src.rank[order]
        new_atom = np.ones(len(order), dtype=bool)
        if len(order) > 1:
            same = (t[1:] == t[:-1]) & (off[1:] == off[:-1]).all(1) & (size[1:] == size[:-1]).all(1)
            new_atom[1:] = ~same
            # Drop a rank's second region of the same box (keep one holder per rank).
            dup = np.zeros(len(order), dtype=bool)
            dup[1:] = same & (rank[1:] == rank[:-1])
        else:
            dup = np.zeros(len(order), dtype=bool)
        keep = ~dup
        starts = np.flatnonzero(new_atom)
        atom_of_row = np.cumsum(new_atom) - 1
        self.atom_tensor = t[starts]
        self.atom_off = off[starts]
        self.atom_size = size[starts]
        holder_rows = order[keep]
        holder_atom = atom_of_row[keep]
        self.holder_ptr = np.searchsorted(holder_atom, np.arange(len(starts) + 1))
        self.holder_row = holder_rows
        self._refine_overlaps()

    def _refine_overlaps(self) -> None:
        """Split partially overlapping source boxes into disjoint atoms (rare layouts)."""
        n = len(self.atom_tensor)
        if n < 2:
            return
        start_key = self.atom_tensor * self.big + self.atom_off[:, 0]
        end_key = self.atom_tensor * self.big + self.atom_off[:, 0] + self.atom_size[:, 0]
        hi = np.searchsorted(start_key, end_key, side="left")
        counts = np.maximum(hi - np.arange(1, n + 1), 0)
        if not counts.any():
            return
        i = np.repeat(np.arange(n), counts)
        j = i + 1 + ranges(counts)
        lo = np.maximum(self.atom_off[i], self.atom_off[j])
        up = np.minimum(self.atom_off[i] + self.atom_size[i], self.atom_off[j] + self.atom_size[j])
        overlap = (up > lo).all(1)
        if not overlap.any():
            return
        bad_tensors = set(self.atom_tensor[i[overlap]].tolist())
        self._replace_atoms(bad_tensors)

    def _replace_atoms(self, tensors: set[int]) -> None:
        nd = self.ndim
        keep_atoms = [a for a in range(len(self.atom_tensor)) if int(self.atom_tensor[a]) not in tensors]
        new: list[tuple[int, Box, list[int]]] = []
        for a in keep_atoms:
            rows = self.holder_row[self.holder_ptr[a]:self.holder_ptr[a + 1]].tolist()
            new.append((int(self.atom_tensor[a]), box_of(self.atom_off[a], self.atom_size[a]), rows))
        for tensor in sorted(tensors):
            pieces: list[tuple[Box, set[int]]] = []
            for row in np.flatnonzero(self.src.tensor == tensor).tolist():
                box = box_of(self.src.off[row], self.src.size[row])
                pending = [box]
                nxt: list[tuple[Box, set[int]]] = []
                for abox, arows in pieces:
                    inter = abox.intersect(box)
                    if inter is None:
                        nxt.append((abox, arows))
                        continue
                    nxt.append((inter, arows | {row}))
                    nxt.extend((p, set(arows)) for p in abox.subtract(box))
                    pending = [q for p in pending for q in p.subtract(inter)]
                nxt.extend((p, {row}) for p in pending)
                pieces = nxt
            for abox, arows in pieces:
                by_rank: dict[int, int] = {}
                for row in sorted(arows):
                    by_rank.setdefault(int(self.src.rank[row]), row)
                new.append((tensor, abox, [by_rank[r] for r in sorted(by_rank)]))
        new.sort(key=lambda x: (x[0], x[1].offsets, x[1].sizes))
        self.atom_tensor = np.array([x[0] for x in new], dtype=np.int64)
        self.atom_off = np.array([x[1].offsets for x in new], dtype=np.int64).reshape(-1, nd)
        self.atom_size = np.array([x[1].sizes for x in new], dtype=np.int64).reshape(-1, nd)
        counts = [len(x[2]) for x in new]
        self.holder_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.holder_row = np.array([r for x in new for r in x[2]], dtype=np.int64)

    # -- balancing ------------------------------------------------------------------------
    def _classes(self) -> None:
        """Holder classes: the distinct sets of ranks holding an atom, numbered by first appearance."""
        n_atoms = len(self.atom_tensor)
        ranks = self.src.rank[self.holder_row]
        counts = np.diff(self.holder_ptr)
        # a class per distinct holder set, numbered by first appearance; single holders in numpy
        span = int(ranks.max(initial=0)) + 1
        key = np.zeros(n_atoms, dtype=np.int64)
        single = counts == 1
        key[single] = ranks[self.holder_ptr[:-1][single]]
        shared: dict[tuple[int, ...], int] = {}
        ptr = self.holder_ptr.tolist()
        rank_list = ranks.tolist()
        for a in np.flatnonzero(~single).tolist():
            key[a] = span + shared.setdefault(tuple(rank_list[ptr[a]:ptr[a + 1]]), len(shared))
        unique, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        by_first = np.argsort(first, kind="stable")
        number = np.empty(len(unique), dtype=np.int64)
        number[by_first] = np.arange(len(unique))
        atom_class = number[inverse.reshape(-1)]
        tuples = list(shared)
        class_index = {((int(k),) if k < span else tuples[int(k) - span]): i
                       for i, k in enumerate(unique[by_first].tolist())}
        self.atom_class = atom_class
        self.classes = list(class_index)

    def _allocate(self, previous: Atoms | None) -> None:
        """Each class's estimated demand, and each rank's share of it (``previous``'s when the demand
        is the same).

        The demand counts every destination region, a reader's local copies too: a reader that
        moves an expert between its slots (EPLB) then changes no class's demand, so no other
        rank's ops change with it.
        """
        atom_class = self.atom_class
        # Demand estimate: each atom is needed as often as its tensor is, on average.
        need = _sums(self.dst.tensor, self.dst.volume * self.dst.itemsize, len(self.tensors))
        numel = np.array([max(int(np.prod(s)), 1) for s in self.shapes], dtype=np.float64)
        atom_vol = np.prod(self.atom_size, axis=1).astype(np.float64)
        per_elem = need.astype(np.float64) / numel
        atom_demand = np.floor(atom_vol * per_elem[self.atom_tensor]).astype(np.int64)
        class_demand = _sums(atom_class, atom_demand, len(self.classes))
        self._class_demand = class_demand
        if previous is not None and np.array_equal(previous._class_demand, class_demand):
            self.class_alloc, self.class_cum, self.class_nnz = (previous.class_alloc, previous.class_cum,
                                                                previous.class_nnz)
            return
        alloc = water_fill({cls: int(class_demand[i]) for i, cls in enumerate(self.classes)})
        self.class_alloc = [alloc[cls] for cls in self.classes]
        self.class_cum = [np.cumsum(np.array(a, dtype=np.int64)) for a in self.class_alloc]
        self.class_nnz = np.array([sum(1 for x in a if x > 0) for a in self.class_alloc], dtype=np.int64)

    def _hash_sources(self) -> Any:
        """The fingerprint's hasher fed with the options, tensors and writers (readers follow)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"weightsync-plan-v{PLANNER_VERSION}|{self.options}\n".encode())
        for name, shape in zip(self.tensors, self.shapes, strict=True):
            h.update(f"{name}{shape}\n".encode())
        self.src.digest_update(h)
        return h


def _copies(dst: RegionTable) -> np.ndarray:
    """Per destination row, the earlier row of the same rank holding the same box of the same
    tensor in the same dtype (-1: none). Such a row is filled by a local copy of that one.

    Rows are hashed to one key each first (a 700k-row reader side sorts one column, not eleven);
    only rows whose keys collide are compared column by column.
    """
    n = len(dst)
    out = np.full(n, -1, dtype=np.int64)
    if n < 2:
        return out
    with np.errstate(over="ignore"):  # a polynomial hash, wrapping
        key = dst.rank.astype(np.uint64)
        for column in (dst.tensor, dst.dtype, *dst.off.T, *dst.size.T):
            key = key * np.uint64(0x9E3779B97F4A7C15) + column.astype(np.uint64)
    order = np.argsort(_mix(key))
    collide = np.zeros(n, dtype=bool)
    hit = key[order][1:] == key[order][:-1]
    if not hit.any():
        return out
    collide[order[1:][hit]] = True
    collide[order[:-1][hit]] = True
    rows = np.flatnonzero(collide)  # ascending: the first of equal rows is the earliest
    keys = [rows, *dst.size[rows].T[::-1], *dst.off[rows].T[::-1], dst.dtype[rows], dst.tensor[rows], dst.rank[rows]]
    order = rows[np.lexsort(keys)]
    same = np.zeros(len(order), dtype=bool)
    same[1:] = ((dst.rank[order][1:] == dst.rank[order][:-1]) & (dst.tensor[order][1:] == dst.tensor[order][:-1])
                & (dst.dtype[order][1:] == dst.dtype[order][:-1])
                & (dst.off[order][1:] == dst.off[order][:-1]).all(1)
                & (dst.size[order][1:] == dst.size[order][:-1]).all(1))
    head = np.maximum.accumulate(np.where(same, 0, np.arange(len(order))))
    out[order[same]] = order[head[same]]
    return out


def _sums(index: np.ndarray, weights: np.ndarray, length: int) -> np.ndarray:
    """Exact integer sums per index (float64 bincount is exact below 2**53 per bin)."""
    out = np.bincount(index, weights=weights, minlength=length)
    if out.size and out.max() >= 2.0**53:
        exact = np.zeros(length, dtype=np.int64)
        np.add.at(exact, index, weights)
        return exact
    return out.astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping integer arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def ranges(counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(c)`` for each c in counts."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def box_of(off: np.ndarray, size: np.ndarray, ndim: int | None = None) -> Box:
    n = len(off) if ndim is None else ndim
    return Box(tuple(int(x) for x in off[:n]), tuple(int(x) for x in size[:n]))


def _nonempty(table: RegionTable) -> RegionTable:
    vol = table.volume
    return table if (vol > 0).all() else table.take(np.flatnonzero(vol > 0))


def _preview(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _check_unique_ranks(ranks: np.ndarray, role: str) -> None:
    values, counts = np.unique(ranks, return_counts=True)
    if (counts > 1).any():
        raise PlanError(f"{role} rank(s) {values[counts > 1][:8].tolist()} appear more than once")


def _canonical_shapes(sources: Roster, dests: Roster) -> dict[str, tuple[int, ...]]:
    """Union of the canonical tensors all layouts declare; shapes must agree."""
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, str] = {}
    seen: set[int] = set()
    for role, side in (("writer", sources), ("reader", dests)):
        for i, mapping in enumerate(side.canonical):
            if id(mapping) in seen:
                continue
            seen.add(id(mapping))
            rank = int(side.ranks[np.flatnonzero(side.rank_canonical == i)[0]])
            for name, tensor in mapping.items():
                prev = shapes.get(name)
                if prev is None:
                    shapes[name] = tensor.shape
                    owner[name] = f"{role} rank {rank}"
                elif prev != tensor.shape:
                    raise PlanError(
                        f"canonical tensor {name!r} has shape {prev} in {owner[name]}'s layout and {tensor.shape} "
                        f"in {role} rank {rank}'s: the two sides were built from different model configs"
                    )
    return shapes
