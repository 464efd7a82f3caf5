"""The planner: all writers' and readers' regions in, a deterministic list of ops out.

Pure and vectorised. The steps:

1. number the canonical tensors and flatten every rank's regions into a
   :class:`RegionTable` (one per side); check that both sides agree on shapes, that every
   needed tensor has a source, and that sources of a tensor agree on dtype;
2. cut the source side into disjoint *atoms* (identical boxes merged, partial overlaps
   refined) and give each atom its *holder class* (the ranks holding it);
3. estimate how many bytes each class must send and water-fill them over its ranks
   (:mod:`weightsync.plan.balance`), giving each rank a share of each class;
4. join destination regions with the atoms they overlap (a sorted sweep on dim 0),
   intersect, and check every destination region is covered exactly;
5. give each piece to a holder: a single holder sends it; a piece held by several is cut
   along its outermost large dimension in proportion to the holders' shares (or, when
   small, sent whole by one holder picked by a stable hash weighted by the shares).

Every decision in step 5 depends only on global metadata and the piece itself, so one
rank can compute its own share of the plan (:func:`build_local_plan`) and get exactly
the ops the global plan (:func:`build_plan`) gives it, without building the global plan.

    plan = build_plan(writer_layouts, reader_layouts)
    mine = build_local_plan(writer_layouts, reader_layouts, role="reader", rank=3)
    assert plan.fingerprint == mine.fingerprint
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.layout.box import Box
from weightsync.layout.columns import DTYPE_CODES
from weightsync.layout.types import RankLayout
from weightsync.plan.balance import send_lower_bound, water_fill
from weightsync.plan.ops import OpColumns, Plan, PlanStats, Role
from weightsync.plan.table import RegionTable

#: Bump when the planner's decisions change, so mixed versions fail the fingerprint check.
PLANNER_VERSION = "1"

_PAIR_CHUNK = 1 << 21  # candidate (destination, atom) pairs intersected per numpy batch


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


class _Context:
    """Everything derived from the full metadata; shared by global and local planning."""

    def __init__(self, sources: Sequence[RankLayout], dests: Sequence[RankLayout],
                 options: PlanOptions) -> None:
        if not sources:
            raise PlanError("no writer layouts given")
        if not dests:
            raise PlanError("no reader layouts given")
        _check_unique_ranks(sources, "writer")
        _check_unique_ranks(dests, "reader")
        # Input order must not matter: every rank may list the layouts differently.
        sources = sorted(sources, key=lambda lay: lay.rank)
        dests = sorted(dests, key=lambda lay: lay.rank)
        self.options = options
        shapes = _canonical_shapes(sources, dests)
        self.tensors = tuple(sorted(shapes))
        self.shapes = tuple(shapes[n] for n in self.tensors)
        self.tensor_ndim = tuple(len(s) for s in self.shapes)
        self.ndim = max(max(self.tensor_ndim, default=1), 1)
        ids = {n: i for i, n in enumerate(self.tensors)}
        self.src = _nonempty(RegionTable.build(sources, ids, self.ndim))
        self.dst = _nonempty(RegionTable.build(dests, ids, self.ndim))
        self.num_sources = len(sources)
        self.num_dests = len(dests)
        self.big = max((max(s) if s else 1) for s in self.shapes) + 1 if self.shapes else 2
        self.name_hash = np.array([zlib.crc32(n.encode()) for n in self.tensors], dtype=np.int64)
        self._check_names()
        self._check_source_dtypes()
        self._build_atoms()
        self._balance()
        self.fingerprint = self._fingerprint()

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
        j = i + 1 + _ranges(counts)
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
            new.append((int(self.atom_tensor[a]), _box(self.atom_off[a], self.atom_size[a]), rows))
        for tensor in sorted(tensors):
            pieces: list[tuple[Box, set[int]]] = []
            for row in np.flatnonzero(self.src.tensor == tensor).tolist():
                box = _box(self.src.off[row], self.src.size[row])
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
    def _balance(self) -> None:
        """Holder classes, their estimated demand, and each rank's share of each class."""
        n_atoms = len(self.atom_tensor)
        ranks = self.src.rank[self.holder_row]
        class_index: dict[tuple[int, ...], int] = {}
        atom_class = np.empty(n_atoms, dtype=np.int64)
        ptr = self.holder_ptr.tolist()
        rank_list = ranks.tolist()
        for a in range(n_atoms):
            cls = tuple(rank_list[ptr[a]:ptr[a + 1]])
            atom_class[a] = class_index.setdefault(cls, len(class_index))
        self.atom_class = atom_class
        self.classes = list(class_index)
        # Demand estimate: each atom is needed as often as its tensor is, on average.
        need = np.zeros(len(self.tensors), dtype=np.int64)
        np.add.at(need, self.dst.tensor, self.dst.volume * self.dst.itemsize)
        numel = np.array([max(int(np.prod(s)), 1) for s in self.shapes], dtype=np.float64)
        atom_vol = np.prod(self.atom_size, axis=1).astype(np.float64)
        per_elem = need.astype(np.float64) / numel
        atom_demand = np.floor(atom_vol * per_elem[self.atom_tensor]).astype(np.int64)
        class_demand = np.zeros(len(self.classes), dtype=np.int64)
        np.add.at(class_demand, atom_class, atom_demand)
        alloc = water_fill({cls: int(class_demand[i]) for i, cls in enumerate(self.classes)})
        self.class_alloc = [alloc[cls] for cls in self.classes]
        self.class_cum = [np.cumsum(np.array(a, dtype=np.int64)) for a in self.class_alloc]
        self.class_nnz = np.array([sum(1 for x in a if x > 0) for a in self.class_alloc], dtype=np.int64)

    def _fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(f"weightsync-plan-v{PLANNER_VERSION}|{self.options}\n".encode())
        for name, shape in zip(self.tensors, self.shapes, strict=True):
            h.update(f"{name}{shape}\n".encode())
        self.src.digest_update(h)
        h.update(b"|readers|")
        self.dst.digest_update(h)
        return h.hexdigest()

    # -- planning -------------------------------------------------------------------------
    def iter_ops(self, dst_rows: np.ndarray, atoms: np.ndarray | None = None
                 ) -> Iterator[tuple[list[OpColumns], np.ndarray, np.ndarray]]:
        """Ops for the given destination rows (and only the given atoms), in batches.

        Yields (ops, class of each unsplit piece, bytes of each unsplit piece) so that
        statistics can be gathered without keeping the ops. Restricting ``atoms`` drops
        pieces of other atoms, but never changes the ops of the atoms kept.
        """
        if atoms is None:
            atoms = np.arange(len(self.atom_tensor))
        a_tensor = self.atom_tensor[atoms]
        a_off0 = self.atom_off[atoms, 0]
        start_key = a_tensor * self.big + a_off0
        end_prefix = (np.maximum.accumulate(start_key + self.atom_size[atoms, 0])
                      if len(start_key) else start_key)
        dst = self.dst
        d_key = dst.tensor[dst_rows] * self.big
        lo = np.searchsorted(end_prefix, d_key + dst.off[dst_rows, 0], side="right")
        hi = np.searchsorted(start_key, d_key + dst.off[dst_rows, 0] + dst.size[dst_rows, 0], side="left")
        counts = np.maximum(hi - lo, 0)
        # Batch destination rows so each batch has at most _PAIR_CHUNK candidate pairs.
        cum = np.cumsum(counts)
        begin = 0
        while begin < len(dst_rows):
            base = cum[begin - 1] if begin else 0
            end = int(np.searchsorted(cum, base + _PAIR_CHUNK, side="right"))
            end = max(end, begin + 1)
            yield self._batch(dst_rows[begin:end], lo[begin:end], counts[begin:end], atoms,
                              check=len(atoms) == len(self.atom_tensor))
            begin = end

    def _batch(self, rows: np.ndarray, lo: np.ndarray, counts: np.ndarray, atoms: np.ndarray,
               *, check: bool) -> tuple[list[OpColumns], np.ndarray, np.ndarray]:
        dst = self.dst
        d = np.repeat(rows, counts)
        a = atoms[np.repeat(lo, counts) + _ranges(counts)]
        p_lo = np.maximum(dst.off[d], self.atom_off[a])
        p_hi = np.minimum(dst.off[d] + dst.size[d], self.atom_off[a] + self.atom_size[a])
        hit = (p_hi > p_lo).all(1)
        d, a, p_lo, p_size = d[hit], a[hit], p_lo[hit], (p_hi - p_lo)[hit]
        vol = np.prod(p_size, axis=1)
        if check:
            self._check_coverage(rows, d, vol)
        n_holders = self.holder_ptr[a + 1] - self.holder_ptr[a]
        single = n_holders == 1
        src_row = self.holder_row[self.holder_ptr[a[single]]]
        parts = [self._columns(d[single], src_row, p_lo[single], p_size[single])]
        multi = np.flatnonzero(~single)
        if multi.size:
            parts.append(self._split_multi(d[multi], a[multi], p_lo[multi], p_size[multi]))
        piece_bytes = vol * dst.itemsize[d]
        return parts, self.atom_class[a], piece_bytes

    def _check_coverage(self, rows: np.ndarray, d: np.ndarray, vol: np.ndarray) -> None:
        covered = _int_bincount(d, vol, len(self.dst))
        short = rows[covered[rows] != self.dst.volume[rows]]
        if short.size:
            lines = []
            for r in short[:5].tolist():
                ref = self.dst.shards[int(self.dst.shard[r])]
                t = int(self.dst.tensor[r])
                box = _box(self.dst.off[r], self.dst.size[r], self.tensor_ndim[t])
                lines.append(f"reader rank {ref.rank} shard {ref.name!r} needs {self.tensors[t]!r} "
                             f"{box.offsets}+{box.sizes}, {int(covered[r])} of "
                             f"{int(self.dst.volume[r])} elements held by writers")
            raise PlanError(f"{short.size} destination region(s) not fully covered by any writer:\n  "
                            + "\n  ".join(lines))

    def _columns(self, d: np.ndarray, s: np.ndarray, p_lo: np.ndarray, p_size: np.ndarray) -> OpColumns:
        src, dst = self.src, self.dst
        src_off = src.loff[s] + ((p_lo - src.off[s]) * src.lstride[s]).sum(1)
        dst_off = dst.loff[d] + ((p_lo - dst.off[d]) * dst.lstride[d]).sum(1)
        return OpColumns(
            src_rank=src.rank[s], src_shard=src.shard[s], dst_rank=dst.rank[d], dst_shard=dst.shard[d],
            tensor=dst.tensor[d], off=p_lo, size=p_size, src_off=src_off, src_stride=src.lstride[s],
            dst_off=dst_off, dst_stride=dst.lstride[d],
            nbytes=np.prod(p_size, axis=1) * dst.itemsize[d],
        )

    def _split_multi(self, d: np.ndarray, a: np.ndarray, p_lo: np.ndarray, p_size: np.ndarray) -> OpColumns:
        """Assign pieces held by several ranks, cutting large ones in proportion to shares.

        Small pieces (the vast majority: norms, biases) go whole to one holder picked by a
        stable hash weighted by the shares, vectorised per holder class; large pieces are
        cut in a short Python loop.
        """
        keys = self._stable_keys(d, p_lo)
        cls = self.atom_class[a]
        nbytes = np.prod(p_size, axis=1) * self.dst.itemsize[d]
        nnz = self.class_nnz[cls]
        cut = (nnz > 1) & (nbytes >= nnz * max(self.options.min_split_bytes, 1))
        pick = np.flatnonzero(~cut)
        chosen = np.empty(len(pick), dtype=np.int64)
        pick_cls = cls[pick]
        for c in np.unique(pick_cls).tolist():
            sel = np.flatnonzero(pick_cls == c)
            cum = self.class_cum[c]
            if cum[-1] > 0:
                j = np.searchsorted(cum, keys[pick[sel]] % cum[-1], side="right")
            else:
                j = keys[pick[sel]] % len(cum)
            chosen[sel] = j
        src_rows = self.holder_row[self.holder_ptr[a[pick]] + chosen]
        parts = [self._columns(d[pick], src_rows, p_lo[pick], p_size[pick])]
        cut_idx = np.flatnonzero(cut)
        if cut_idx.size:
            out_d: list[int] = []
            out_s: list[int] = []
            out_lo: list[np.ndarray] = []
            out_size: list[np.ndarray] = []
            for i in cut_idx.tolist():
                atom = int(a[i])
                rows = self.holder_row[self.holder_ptr[atom]:self.holder_ptr[atom + 1]].tolist()
                shares = self.class_alloc[int(cls[i])]
                nz = [(r, w) for r, w in zip(rows, shares, strict=True) if w > 0]
                ndim = self.tensor_ndim[int(self.dst.tensor[d[i]])]
                for row, lo_part, size_part in _proportional_cut(p_lo[i], p_size[i], nz, int(keys[i]), ndim):
                    out_d.append(int(d[i]))
                    out_s.append(row)
                    out_lo.append(lo_part)
                    out_size.append(size_part)
            parts.append(self._columns(np.array(out_d, dtype=np.int64), np.array(out_s, dtype=np.int64),
                                       np.array(out_lo, dtype=np.int64).reshape(-1, self.ndim),
                                       np.array(out_size, dtype=np.int64).reshape(-1, self.ndim)))
        return OpColumns.concat(parts, self.ndim)

    def _stable_keys(self, d: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Hash of (tensor name, reader rank, piece corner) per piece, equal on every machine."""
        h = _mix(self.name_hash[self.dst.tensor[d]].astype(np.uint64))
        h = _mix(h ^ self.dst.rank[d].astype(np.uint64))
        for dim in range(lo.shape[1]):
            h = _mix(h ^ lo[:, dim].astype(np.uint64))
        return (h >> np.uint64(2)).astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping integer arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _proportional_cut(lo: np.ndarray, size: np.ndarray, holders: list[tuple[int, int]], key: int,
                      true_ndim: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Cut a box along one dim into parts proportional to the holders' shares."""
    k = len(holders)
    dims = range(max(true_ndim, 1))
    dim = next((x for x in dims if size[x] >= k), max(dims, key=lambda x: (size[x], -x)))
    n = int(size[dim])
    total = sum(w for _, w in holders)
    counts = [n * w // total for _, w in holders]
    rest = n - sum(counts)
    rot = key % k
    by_fraction = sorted(range(k), key=lambda j: (-(n * holders[j][1] % total), (j - rot) % k))
    for j in by_fraction[:rest]:
        counts[j] += 1
    cursor = int(lo[dim])
    for j in sorted(range(k), key=lambda j: (j - rot) % k):
        if counts[j] == 0:
            continue
        part_lo = lo.copy()
        part_size = size.copy()
        part_lo[dim] = cursor
        part_size[dim] = counts[j]
        cursor += counts[j]
        yield holders[j][0], part_lo, part_size


def _int_bincount(index: np.ndarray, weights: np.ndarray, length: int) -> np.ndarray:
    """Exact integer sums per index (float64 bincount is exact below 2**53 per bin)."""
    out = np.bincount(index, weights=weights, minlength=length)
    if out.size and out.max() >= 2.0**53:
        exact = np.zeros(length, dtype=np.int64)
        np.add.at(exact, index, weights)
        return exact
    return out.astype(np.int64)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(c)`` for each c in counts."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def _box(off: np.ndarray, size: np.ndarray, ndim: int | None = None) -> Box:
    n = len(off) if ndim is None else ndim
    return Box(tuple(int(x) for x in off[:n]), tuple(int(x) for x in size[:n]))


def _nonempty(table: RegionTable) -> RegionTable:
    vol = table.volume
    return table if (vol > 0).all() else table.take(np.flatnonzero(vol > 0))


def _preview(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _check_unique_ranks(layouts: Sequence[RankLayout], role: str) -> None:
    ranks = [lay.rank for lay in layouts]
    if len(set(ranks)) != len(ranks):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        raise PlanError(f"{role} rank(s) {dup[:8]} appear more than once")


def _canonical_shapes(sources: Sequence[RankLayout], dests: Sequence[RankLayout]) -> dict[str, tuple[int, ...]]:
    """Union of the canonical tensors all layouts declare; shapes must agree."""
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, str] = {}
    seen: set[int] = set()
    for role, layouts in (("writer", sources), ("reader", dests)):
        for layout in layouts:
            if id(layout.canonical) in seen:
                continue
            seen.add(id(layout.canonical))
            for name, tensor in layout.canonical.items():
                prev = shapes.get(name)
                if prev is None:
                    shapes[name] = tensor.shape
                    owner[name] = f"{role} rank {layout.rank}"
                elif prev != tensor.shape:
                    raise PlanError(
                        f"canonical tensor {name!r} has shape {prev} in {owner[name]}'s layout and {tensor.shape} "
                        f"in {role} rank {layout.rank}'s: the two sides were built from different model configs"
                    )
    return shapes


# -- public entry points ----------------------------------------------------------------------

def _finish(ctx: _Context, batches: list[OpColumns], scope: str, stats: PlanStats | None) -> Plan:
    cols = OpColumns.concat(batches, ctx.ndim).sorted()
    return Plan(fingerprint=ctx.fingerprint, tensors=ctx.tensors, tensor_ndim=ctx.tensor_ndim,
                src_shards=ctx.src.shards, dst_shards=ctx.dst.shards, columns=cols, stats=stats,
                scope=scope)


def build_plan(sources: Sequence[RankLayout], dests: Sequence[RankLayout],
               options: PlanOptions | None = None) -> Plan:
    """The global plan: every op between every writer and reader rank, with statistics.

    Raises:
        PlanError: tensors missing on one side, destinations not fully covered, shapes or
            source dtypes that disagree (the message names the tensors, ranks and boxes).
    """
    started = time.perf_counter()
    ctx = _Context(sources, dests, options or PlanOptions())
    batches = []
    acc = _StatsAccumulator(ctx)
    for parts, classes, piece_bytes in ctx.iter_ops(np.arange(len(ctx.dst))):
        batches.extend(parts)
        acc.add(parts, classes, piece_bytes)
    return _finish(ctx, batches, "global", acc.finish(time.perf_counter() - started))


def build_local_plan(sources: Sequence[RankLayout], dests: Sequence[RankLayout], *,
                     role: Role, rank: int,
                     options: PlanOptions | None = None) -> Plan:
    """One rank's ops only (those it sends, or those it receives), without the global plan.

    The result equals the global plan filtered to that rank, op for op.
    """
    ctx = _Context(sources, dests, options or PlanOptions())
    if role == "reader":
        rows = np.flatnonzero(ctx.dst.rank == rank)
        return _finish(ctx, [c for parts, _, _ in ctx.iter_ops(rows) for c in parts], f"reader:{rank}", None)
    if role != "writer":
        raise ValueError(f"role must be 'writer' or 'reader', got {role!r}")
    mine = np.unique(ctx.src.tensor[ctx.src.rank == rank])
    rows = np.flatnonzero(np.isin(ctx.dst.tensor, mine))
    held = np.zeros(len(ctx.atom_tensor), dtype=bool)
    holder_atom = np.repeat(np.arange(len(ctx.atom_tensor)), np.diff(ctx.holder_ptr))
    held[holder_atom[ctx.src.rank[ctx.holder_row] == rank]] = True
    batches: list[OpColumns] = []
    for parts, _, _ in ctx.iter_ops(rows, np.flatnonzero(held)):
        batches.extend(cols.take(np.flatnonzero(cols.src_rank == rank)) for cols in parts)
    return _finish(ctx, batches, f"writer:{rank}", None)


def plan_statistics(sources: Sequence[RankLayout], dests: Sequence[RankLayout],
                    options: PlanOptions | None = None) -> PlanStats:
    """The global plan's statistics, streaming (ops are counted, never all kept)."""
    started = time.perf_counter()
    ctx = _Context(sources, dests, options or PlanOptions())
    acc = _StatsAccumulator(ctx)
    for parts, classes, piece_bytes in ctx.iter_ops(np.arange(len(ctx.dst))):
        acc.add(parts, classes, piece_bytes)
    return acc.finish(time.perf_counter() - started)


class _StatsAccumulator:
    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        n_src = int(ctx.src.rank.max()) + 1 if len(ctx.src) else 1
        n_dst = int(ctx.dst.rank.max()) + 1 if len(ctx.dst) else 1
        self.send = np.zeros(n_src, dtype=np.int64)
        self.recv = np.zeros(n_dst, dtype=np.int64)
        self.class_bytes = np.zeros(len(ctx.classes), dtype=np.int64)
        self.num_ops = 0

    def add(self, parts: list[OpColumns], classes: np.ndarray, piece_bytes: np.ndarray) -> None:
        for cols in parts:
            self.send += _int_bincount(cols.src_rank, cols.nbytes, len(self.send))
            self.recv += _int_bincount(cols.dst_rank, cols.nbytes, len(self.recv))
            self.num_ops += len(cols)
        self.class_bytes += _int_bincount(classes, piece_bytes, len(self.class_bytes))

    def finish(self, seconds: float) -> PlanStats:
        ctx = self.ctx
        needed = int((ctx.dst.volume * ctx.dst.itemsize).sum())
        sent = int(self.send.sum())
        dst_itemsize = np.zeros(len(ctx.tensors), dtype=np.int64)
        dst_itemsize[ctx.dst.tensor] = ctx.dst.itemsize
        total = sum(int(np.prod(ctx.shapes[t])) * int(dst_itemsize[t])
                    for t in np.unique(ctx.dst.tensor).tolist())
        lb = send_lower_bound({cls: int(b) for cls, b in zip(ctx.classes, self.class_bytes, strict=True)
                               if b}, ctx.num_sources)
        return PlanStats(
            total_bytes=total,
            needed_bytes=needed,
            sent_bytes=sent,
            num_ops=self.num_ops,
            num_sources=ctx.num_sources,
            num_destinations=ctx.num_dests,
            max_send_bytes=int(self.send.max()) if self.send.size else 0,
            mean_send_bytes=sent / ctx.num_sources,
            max_recv_bytes=int(self.recv.max()) if self.recv.size else 0,
            lower_bound_send_bytes=lb,
            plan_seconds=seconds,
        )
