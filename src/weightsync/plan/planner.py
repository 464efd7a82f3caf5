"""The planner: all writers' and readers' regions in, a deterministic list of ops out.

Pure and vectorised. The steps (1-3 depend on the metadata alone: :mod:`weightsync.plan.atoms`):

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

Steps 4 and 5 are this module. Every decision in step 5 depends only on global metadata and
the piece itself, so one rank can compute its own share of the plan (:func:`build_local_plan`)
and get exactly the ops the global plan (:func:`build_plan`) gives it, without building the
global plan.

    plan = build_plan(writer_layouts, reader_layouts)
    mine = build_local_plan(writer_layouts, reader_layouts, role="reader", rank=3)
    assert plan.fingerprint == mine.fingerprint
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from weightsync.plan.atoms import PLANNER_VERSION, Atoms, PlanError, PlanOptions, Side, box_of, ranges
from weightsync.plan.balance import send_lower_bound
from weightsync.plan.ops import OpColumns, Plan, PlanStats, Role

_PAIR_CHUNK = 1 << 21  # candidate (destination, atom) pairs intersected per numpy batch


# -- steps 4 and 5 ------------------------------------------------------------------------------

def iter_ops(ctx: Atoms, dst_rows: np.ndarray, atoms: np.ndarray | None = None
             ) -> Iterator[tuple[list[OpColumns], np.ndarray, np.ndarray]]:
    """Ops for the given destination rows (and only the given atoms), in batches.

    Yields (ops, class of each unsplit piece, bytes of each unsplit piece) so that
    statistics can be gathered without keeping the ops. Restricting ``atoms`` drops
    pieces of other atoms, but never changes the ops of the atoms kept.
    """
    if atoms is None:
        atoms = np.arange(len(ctx.atom_tensor))
    dst_rows = dst_rows[ctx.copy_of[dst_rows] < 0]  # a box a reader holds twice arrives once
    a_tensor = ctx.atom_tensor[atoms]
    a_off0 = ctx.atom_off[atoms, 0]
    start_key = a_tensor * ctx.big + a_off0
    end_prefix = (np.maximum.accumulate(start_key + ctx.atom_size[atoms, 0])
                  if len(start_key) else start_key)
    dst = ctx.dst
    d_key = dst.tensor[dst_rows] * ctx.big
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
        yield _batch(ctx, dst_rows[begin:end], lo[begin:end], counts[begin:end], atoms,
                          check=len(atoms) == len(ctx.atom_tensor))
        begin = end

def _batch(ctx: Atoms, rows: np.ndarray, lo: np.ndarray, counts: np.ndarray, atoms: np.ndarray,
           *, check: bool) -> tuple[list[OpColumns], np.ndarray, np.ndarray]:
    dst = ctx.dst
    d = np.repeat(rows, counts)
    a = atoms[np.repeat(lo, counts) + ranges(counts)]
    p_lo = np.maximum(dst.off[d], ctx.atom_off[a])
    p_hi = np.minimum(dst.off[d] + dst.size[d], ctx.atom_off[a] + ctx.atom_size[a])
    hit = (p_hi > p_lo).all(1)
    d, a, p_lo, p_size = d[hit], a[hit], p_lo[hit], (p_hi - p_lo)[hit]
    vol = np.prod(p_size, axis=1)
    if check:
        _check_coverage(ctx, rows, d, vol)
    n_holders = ctx.holder_ptr[a + 1] - ctx.holder_ptr[a]
    single = n_holders == 1
    src_row = ctx.holder_row[ctx.holder_ptr[a[single]]]
    parts = [_columns(ctx, d[single], src_row, p_lo[single], p_size[single])]
    multi = np.flatnonzero(~single)
    if multi.size:
        parts.append(_split_multi(ctx, d[multi], a[multi], p_lo[multi], p_size[multi]))
    piece_bytes = vol * dst.itemsize[d]
    return parts, ctx.atom_class[a], piece_bytes

def _check_coverage(ctx: Atoms, rows: np.ndarray, d: np.ndarray, vol: np.ndarray) -> None:
    covered = _int_bincount(d, vol, len(ctx.dst))
    short = rows[covered[rows] != ctx.dst.volume[rows]]
    if short.size:
        lines = []
        for r in short[:5].tolist():
            ref = ctx.dst.shards[int(ctx.dst.shard[r])]
            t = int(ctx.dst.tensor[r])
            box = box_of(ctx.dst.off[r], ctx.dst.size[r], ctx.tensor_ndim[t])
            lines.append(f"reader rank {ref.rank} shard {ref.name!r} needs {ctx.tensors[t]!r} "
                         f"{box.offsets}+{box.sizes}, {int(covered[r])} of "
                         f"{int(ctx.dst.volume[r])} elements held by writers")
        raise PlanError(f"{short.size} destination region(s) not fully covered by any writer:\n  "
                        + "\n  ".join(lines))

def _columns(ctx: Atoms, d: np.ndarray, s: np.ndarray, p_lo: np.ndarray, p_size: np.ndarray) -> OpColumns:
    src, dst = ctx.src, ctx.dst
    src_off = src.loff[s] + ((p_lo - src.off[s]) * src.lstride[s]).sum(1)
    dst_off = dst.loff[d] + ((p_lo - dst.off[d]) * dst.lstride[d]).sum(1)
    return OpColumns(
        src_rank=src.rank[s], src_shard=src.shard[s], dst_rank=dst.rank[d], dst_shard=dst.shard[d],
        tensor=dst.tensor[d], off=p_lo, size=p_size, src_off=src_off, src_stride=src.lstride[s],
        dst_off=dst_off, dst_stride=dst.lstride[d],
        nbytes=np.prod(p_size, axis=1) * dst.itemsize[d],
    )

def _split_multi(ctx: Atoms, d: np.ndarray, a: np.ndarray, p_lo: np.ndarray, p_size: np.ndarray) -> OpColumns:
    """Assign pieces held by several ranks, cutting large ones in proportion to shares.

    Small pieces (the vast majority: norms, biases) go whole to one holder picked by a
    stable hash weighted by the shares, vectorised per holder class; large pieces are
    cut in a short Python loop.
    """
    keys = _stable_keys(ctx, d, p_lo)
    cls = ctx.atom_class[a]
    nbytes = np.prod(p_size, axis=1) * ctx.dst.itemsize[d]
    nnz = ctx.class_nnz[cls]
    cut = (nnz > 1) & (nbytes >= nnz * max(ctx.options.min_split_bytes, 1))
    pick = np.flatnonzero(~cut)
    chosen = np.empty(len(pick), dtype=np.int64)
    pick_cls = cls[pick]
    for c in np.unique(pick_cls).tolist():
        sel = np.flatnonzero(pick_cls == c)
        cum = ctx.class_cum[c]
        chosen[sel] = (np.searchsorted(cum, keys[pick[sel]] % cum[-1], side="right") if cum[-1] > 0
                       else keys[pick[sel]] % len(cum))
    src_rows = ctx.holder_row[ctx.holder_ptr[a[pick]] + chosen]
    parts = [_columns(ctx, d[pick], src_rows, p_lo[pick], p_size[pick])]
    cut_idx = np.flatnonzero(cut)
    if cut_idx.size:
        out_d: list[int] = []
        out_s: list[int] = []
        out_lo: list[np.ndarray] = []
        out_size: list[np.ndarray] = []
        for i in cut_idx.tolist():
            atom = int(a[i])
            rows = ctx.holder_row[ctx.holder_ptr[atom]:ctx.holder_ptr[atom + 1]].tolist()
            shares = ctx.class_alloc[int(cls[i])]
            nz = [(r, w) for r, w in zip(rows, shares, strict=True) if w > 0]
            ndim = ctx.tensor_ndim[int(ctx.dst.tensor[d[i]])]
            for row, lo_part, size_part in _proportional_cut(p_lo[i], p_size[i], nz, int(keys[i]), ndim):
                out_d.append(int(d[i]))
                out_s.append(row)
                out_lo.append(lo_part)
                out_size.append(size_part)
        parts.append(_columns(ctx, np.array(out_d, dtype=np.int64), np.array(out_s, dtype=np.int64),
                                   np.array(out_lo, dtype=np.int64).reshape(-1, ctx.ndim),
                                   np.array(out_size, dtype=np.int64).reshape(-1, ctx.ndim)))
    return OpColumns.concat(parts, ctx.ndim)

def local_copies(ctx: Atoms, dst_rows: np.ndarray) -> OpColumns:
    """The local copies that fill destination rows ``dst_rows`` a reader holds twice (see :class:`Plan`)."""
    d = dst_rows[ctx.copy_of[dst_rows] >= 0]
    s = ctx.copy_of[d]
    dst = ctx.dst
    return OpColumns(
        src_rank=dst.rank[s], src_shard=dst.shard[s], dst_rank=dst.rank[d], dst_shard=dst.shard[d],
        tensor=dst.tensor[d], off=dst.off[d], size=dst.size[d], src_off=dst.loff[s], src_stride=dst.lstride[s],
        dst_off=dst.loff[d], dst_stride=dst.lstride[d], nbytes=np.prod(dst.size[d], axis=1) * dst.itemsize[d],
    ).sorted()


def _stable_keys(ctx: Atoms, d: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Hash of (tensor name, reader rank, piece corner) per piece, equal on every machine."""
    h = _mix(ctx.name_hash[ctx.dst.tensor[d]].astype(np.uint64))
    h = _mix(h ^ ctx.dst.rank[d].astype(np.uint64))
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


# -- public entry points ----------------------------------------------------------------------

def _finish(ctx: Atoms, batches: list[OpColumns], scope: str, stats: PlanStats | None,
            copies: OpColumns | None = None) -> Plan:
    cols = OpColumns.concat(batches, ctx.ndim).sorted()
    return Plan(fingerprint=ctx.fingerprint, tensors=ctx.tensors, tensor_ndim=ctx.tensor_ndim,
                src_shards=ctx.src.shards, dst_shards=ctx.dst.shards, columns=cols, stats=stats,
                scope=scope, copies=copies if copies is not None and len(copies) else None)


def build_plan(sources: Side, dests: Side,
               options: PlanOptions | None = None) -> Plan:
    """The global plan: every op between every writer and reader rank, with statistics.

    Raises:
        PlanError: tensors missing on one side, destinations not fully covered, shapes or
            source dtypes that disagree (the message names the tensors, ranks and boxes).
    """
    started = time.perf_counter()
    ctx = Atoms(sources, dests, options or PlanOptions())
    batches = []
    acc = _StatsAccumulator(ctx)
    for parts, classes, piece_bytes in iter_ops(ctx, np.arange(len(ctx.dst))):
        batches.extend(parts)
        acc.add(parts, classes, piece_bytes)
    return _finish(ctx, batches, "global", acc.finish(time.perf_counter() - started),
                   local_copies(ctx, np.arange(len(ctx.dst))))


def build_local_plan(sources: Side, dests: Side, *,
                     role: Role, rank: int,
                     options: PlanOptions | None = None, previous: Plan | None = None) -> Plan:
    """One rank's ops only (those it sends, or those it receives), without the global plan.

    The result equals the global plan filtered to that rank, op for op. ``previous``: this
    rank's plan of the same writers (the same roster object) before readers changed (an EPLB
    placement): the writers' side of planning is reused, not recomputed.
    """
    before = previous._cache.get("atoms") if previous is not None else None
    ctx = Atoms(sources, dests, options or PlanOptions(), previous=before)
    plan = _local(ctx, role, rank)
    plan._cache["atoms"] = ctx
    return plan


def _local(ctx: Atoms, role: Role, rank: int) -> Plan:
    if role == "reader":
        rows = np.flatnonzero(ctx.dst.rank == rank)
        return _finish(ctx, [c for parts, _, _ in iter_ops(ctx, rows) for c in parts], f"reader:{rank}", None,
                       local_copies(ctx, rows))
    if role != "writer":
        raise ValueError(f"role must be 'writer' or 'reader', got {role!r}")
    mine = np.unique(ctx.src.tensor[ctx.src.rank == rank])
    rows = np.flatnonzero(np.isin(ctx.dst.tensor, mine))
    held = np.zeros(len(ctx.atom_tensor), dtype=bool)
    holder_atom = np.repeat(np.arange(len(ctx.atom_tensor)), np.diff(ctx.holder_ptr))
    held[holder_atom[ctx.src.rank[ctx.holder_row] == rank]] = True
    batches: list[OpColumns] = []
    for parts, _, _ in iter_ops(ctx, rows, np.flatnonzero(held)):
        batches.extend(cols.take(np.flatnonzero(cols.src_rank == rank)) for cols in parts)
    return _finish(ctx, batches, f"writer:{rank}", None)


def plan_statistics(sources: Side, dests: Side,
                    options: PlanOptions | None = None) -> PlanStats:
    """The global plan's statistics, streaming (ops are counted, never all kept)."""
    started = time.perf_counter()
    ctx = Atoms(sources, dests, options or PlanOptions())
    acc = _StatsAccumulator(ctx)
    for parts, classes, piece_bytes in iter_ops(ctx, np.arange(len(ctx.dst))):
        acc.add(parts, classes, piece_bytes)
    return acc.finish(time.perf_counter() - started)


class _StatsAccumulator:
    def __init__(self, ctx: Atoms) -> None:
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
        row_bytes = ctx.dst.volume * ctx.dst.itemsize
        copied = ctx.copy_of >= 0
        needed = int(row_bytes[~copied].sum())
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
            copied_bytes=int(row_bytes[copied].sum()),
        )


__all__ = ["PLANNER_VERSION", "PlanError", "PlanOptions", "build_local_plan", "build_plan", "plan_statistics"]
