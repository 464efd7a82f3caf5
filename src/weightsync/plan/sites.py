"""A two-level plan across sites: each byte crosses a slow link once per site, then is forwarded.

Ranks carry a *site* (a datacenter, a region, any level of a topology whose links between
sites are slower than inside them). A flat plan sends every reader its bytes from a writer,
so a site of 16 readers that each serve a replica pulls the model across the slow link 16
times. Here the bytes a site needs cross once:

1. **across** (writers -> readers): every byte a site's readers need goes to *one* reader of
   that site that needs it (atoms of the site's needs, each assigned to one of the readers
   holding it, largest first to the least loaded: :func:`plan_sites`); readers in a site with
   writers take all of their bytes from the writers directly;
2. **inside** (readers -> readers of the same site): each reader takes the rest of its layout
   from the readers that received it, re-planned by the ordinary planner with their layouts
   (what they received as sources, what they still need as destinations).

Both levels are ordinary plans (:func:`weightsync.plan.build_plan`), so whatever applies to a
plan applies on the slow link: FP8 readers make writers quantize what crosses (their regions
keep their dtypes), deltas send only what changed. Pure: numpy and the core only.

    sites = Sites(writers=("a",) * 2, readers=("b",) * 4 + ("c",) * 4)
    split = plan_sites(writer_layouts, reader_layouts, sites)
    across = split.across_plan(writer_layouts)                     # the slow links carry this
    inside = split.inside_plan("b")                                # readers of b among themselves
    split.report(writer_layouts, inside_gbps=400, across_gbps=10)   # bytes per link class, seconds
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from weightsync.layout.box import Box
from weightsync.layout.roster import Roster
from weightsync.layout.types import RankLayout, Region, Shard
from weightsync.plan.atoms import Atoms, PlanOptions
from weightsync.plan.ops import Plan
from weightsync.plan.planner import build_plan
from weightsync.plan.table import ShardRef


@dataclass(frozen=True)
class Sites:
    """The site of every writer rank and every reader rank (``writers[i]``: writer rank i's)."""

    writers: tuple[str, ...]
    readers: tuple[str, ...]

    def __post_init__(self) -> None:
        for role, names in (("writer", self.writers), ("reader", self.readers)):
            if not names or any(not isinstance(n, str) or not n for n in names):
                raise ValueError(f"every {role} rank needs a site (a non-empty name), got {list(names)[:8]}")

    @classmethod
    def parse(cls, writers: str, readers: str, *, num_writers: int, num_readers: int) -> Sites:
        """``"a"`` (every rank in site a) or ``"b*4,c*4"`` (ranks in order), one spec per side.

        Raises:
            ValueError: a spec that does not name one site per rank (says how many it names).
        """
        return cls(_expand(writers, num_writers, "writer"), _expand(readers, num_readers, "reader"))

    def reader_sites(self) -> list[str]:
        return sorted(set(self.readers))

    def remote(self, site: str) -> bool:
        """Whether readers of ``site`` are away from every writer (their bytes cross a slow link)."""
        return site not in self.writers


def _expand(spec: str, count: int, role: str) -> tuple[str, ...]:
    names: list[str] = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, _, times = item.partition("*")
        names += [name] * (int(times) if times else (count if spec.strip() == item else 1))
    if len(names) != count:
        raise ValueError(f"{role} sites {spec!r} name {len(names)} rank(s), the job has {count}: give one site for "
                         f"all ({role}s=a) or one per rank in order (b*4,c*4)")
    return tuple(names)


@dataclass(frozen=True)
class SitePlan:
    """What each reader takes from the writers (``first``) and from its own site (``second``)."""

    sites: Sites
    first: tuple[RankLayout, ...]
    second: tuple[RankLayout, ...]
    options: PlanOptions = field(default_factory=PlanOptions)

    def across_plan(self, writers: Sequence[RankLayout]) -> Plan:
        """Writers -> readers: each remote site's bytes once, the writers' sites' readers in full."""
        return build_plan(list(writers), list(self.first), self.options)

    def site_readers(self, site: str) -> list[int]:
        return [r for r, s in enumerate(self.sites.readers) if s == site]

    def inside_plan(self, site: str) -> Plan | None:
        """Readers of ``site`` -> readers of ``site`` (sources and destinations by reader rank);
        None when none of them takes anything from the others."""
        ranks = self.site_readers(site)
        if not any(self.second[r].shards for r in ranks):
            return None
        # a reader received more than its peers need from it (what only it holds): not an error here
        options = dataclasses.replace(self.options, allow_unneeded_sources=True)
        return build_plan([self.first[r] for r in ranks], [self.second[r] for r in ranks], options)

    def report(self, writers: Sequence[RankLayout], *, inside_gbps: float, across_gbps: float) -> dict[str, float]:
        """Bytes per link class (``across`` sites, ``inside`` one) and the simulated seconds, this
        plan's (the two levels one after the other) and a flat plan's, for the given link rates:
        each reader site reaches the writers' over a link of its own at ``across_gbps``, every
        rank has ``inside_gbps`` to its own site."""
        across = self.across_plan(writers)
        level1 = _link_loads(across, self.sites.writers, self.sites.readers)
        level2 = [_link_loads(plan, self.sites.readers, self.sites.readers)  # ranks: reader ranks
                  for site in self.sites.reader_sites() if (plan := self.inside_plan(site)) is not None]
        flat = _link_loads(build_plan(list(writers), _full(self), self.options), self.sites.writers,
                           self.sites.readers)
        inside_bps, across_bps = inside_gbps * 1e9 / 8, across_gbps * 1e9 / 8
        return {"across_bytes": level1.across, "inside_bytes": level1.inside + sum(x.inside for x in level2),
                "flat_across_bytes": flat.across, "flat_inside_bytes": flat.inside,
                "seconds": level1.seconds(inside_bps, across_bps) + max((x.seconds(inside_bps, across_bps)
                                                                        for x in level2), default=0.0),
                "flat_seconds": flat.seconds(inside_bps, across_bps)}


@dataclass(frozen=True)
class _Loads:
    """What one plan puts on each link: bytes across and inside sites, the busiest rank's
    bytes (sent or received) and each remote site's incoming bytes."""

    across: int
    inside: int
    per_rank: int
    per_site: Mapping[str, int]

    def seconds(self, inside_bps: float, across_bps: float) -> float:
        return max(self.per_rank / inside_bps, max(self.per_site.values(), default=0) / across_bps)


def _link_loads(plan: Plan, src_sites: Sequence[str], dst_sites: Sequence[str]) -> _Loads:
    c = plan.columns
    src = np.asarray(c.src_rank, dtype=np.int64)
    dst = np.asarray(c.dst_rank, dtype=np.int64)
    names = sorted(set(src_sites) | set(dst_sites))
    code = {n: i for i, n in enumerate(names)}
    s_site = np.array([code[x] for x in src_sites], dtype=np.int64)[src]
    d_site = np.array([code[x] for x in dst_sites], dtype=np.int64)[dst]
    crossing = s_site != d_site
    nbytes = np.asarray(c.nbytes, dtype=np.int64)
    sent = np.bincount(src, weights=nbytes) if len(src) else np.zeros(1)
    got = np.bincount(dst, weights=nbytes) if len(dst) else np.zeros(1)
    per_site = np.bincount(d_site[crossing], weights=nbytes[crossing], minlength=len(names))
    return _Loads(int(nbytes[crossing].sum()), int(nbytes[~crossing].sum()), int(max(sent.max(), got.max())),
                  {names[i]: int(b) for i, b in enumerate(per_site.tolist()) if b})


def _full(split: SitePlan) -> list[RankLayout]:
    """Every reader's whole layout (what it takes across and from its site, together)."""
    out = []
    for a, b in zip(split.first, split.second, strict=True):
        regions: dict[str, list[Region]] = {}
        shapes = {}
        for layout in (a, b):
            for shard in layout.shards:
                regions.setdefault(shard.name, []).extend(shard.regions)
                shapes[shard.name] = shard
        out.append(RankLayout(a.rank, tuple(Shard(n, shapes[n].shape, shapes[n].dtype, tuple(rs))
                                            for n, rs in regions.items()), a.canonical))
    return out


def plan_sites(writers: Sequence[RankLayout], readers: Sequence[RankLayout], sites: Sites,
               options: PlanOptions | None = None) -> SitePlan:
    """Split every remote site's needs among its readers (see module docstring).

    Raises:
        ValueError: ``sites`` does not give one site per writer and per reader rank.
    """
    options = options or PlanOptions()
    if len(sites.writers) != len(writers) or len(sites.readers) != len(readers):
        raise ValueError(f"sites name {len(sites.writers)} writer(s) and {len(sites.readers)} reader(s), the layouts "
                         f"{len(writers)} and {len(readers)}")
    by_rank = sorted(readers, key=lambda layout: layout.rank)
    first: list[RankLayout] = list(by_rank)
    second: list[RankLayout] = [RankLayout(r.rank, (), r.canonical) for r in by_rank]
    for site in sites.reader_sites():
        ranks = [r for r, s in enumerate(sites.readers) if s == site]
        if not sites.remote(site) or len(ranks) < 2:
            continue  # beside a writer, or alone: everything from the writers
        took, rest = _split_site([by_rank[r] for r in ranks], options)
        for r, a, b in zip(ranks, took, rest, strict=True):
            first[r], second[r] = a, b
    return SitePlan(sites, tuple(first), tuple(second), options)


def _split_site(layouts: list[RankLayout], options: PlanOptions) -> tuple[list[RankLayout], list[RankLayout]]:
    """Atoms of a site's needs, each given to one reader holding it; per reader, the layout of
    what it takes across and of what it takes from the others."""
    ctx = Atoms(Roster.of(layouts), Roster.of(layouts), PlanOptions(allow_unneeded_sources=True,
                                                                    min_split_bytes=options.min_split_bytes))
    src, n = ctx.src, len(ctx.atom_tensor)
    itemsize = src.itemsize[ctx.holder_row[ctx.holder_ptr[:-1]]]
    nbytes = np.prod(ctx.atom_size, axis=1) * itemsize
    load: dict[int, int] = {layout.rank: 0 for layout in layouts}
    owner = np.empty(n, dtype=np.int64)
    for a in sorted(range(n), key=lambda i: (-int(nbytes[i]), int(ctx.atom_tensor[i]), ctx.atom_off[i].tolist())):
        rows = ctx.holder_row[ctx.holder_ptr[a]: ctx.holder_ptr[a + 1]]
        ranks = sorted(set(src.rank[rows].tolist()))
        pick = min(ranks, key=lambda r: (load[r], r))
        owner[a] = pick
        load[pick] += int(nbytes[a])
    took: dict[int, dict[int, list[Region]]] = {layout.rank: {} for layout in layouts}
    rest: dict[int, dict[int, list[Region]]] = {layout.rank: {} for layout in layouts}
    for a in range(n):
        t = int(ctx.atom_tensor[a])
        ndim = ctx.tensor_ndim[t]
        lo, size = ctx.atom_off[a], ctx.atom_size[a]
        for row in ctx.holder_row[ctx.holder_ptr[a]: ctx.holder_ptr[a + 1]].tolist():
            rank, shard = int(src.rank[row]), int(src.shard[row])
            offset = int(src.loff[row] + ((lo - src.off[row]) * src.lstride[row]).sum())
            region = Region(ctx.tensors[t], Box(tuple(int(x) for x in lo[:ndim]), tuple(int(x) for x in size[:ndim])),
                            offset, tuple(int(x) for x in src.lstride[row][:ndim]))
            (took if owner[a] == rank else rest)[rank].setdefault(shard, []).append(region)
    return ([_restricted(layout, took[layout.rank], src.shards) for layout in layouts],
            [_restricted(layout, rest[layout.rank], src.shards) for layout in layouts])


def _restricted(layout: RankLayout, regions: Mapping[int, list[Region]], shards: Sequence[ShardRef]) -> RankLayout:
    """``layout``'s shards holding only ``regions`` (by shard index of the site's table); shards
    left with none are dropped."""
    names = {shards[i].name: sorted(rs, key=lambda r: (r.canonical, r.box.offsets))
             for i, rs in regions.items()}
    kept = tuple(Shard(s.name, s.shape, s.dtype, tuple(names[s.name])) for s in layout.shards if names.get(s.name))
    return RankLayout(layout.rank, kept, layout.canonical)


__all__ = ["SitePlan", "Sites", "plan_sites"]
