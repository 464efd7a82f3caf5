"""Benchmark weights: random, deterministic, and computable for any box of any rank.

Every benchmark process must hold its own shards of the *same* model, and every reader
must be able to check what it received, without any process ever materialising the full
model (at 2B parameters that would be a second full copy per process). So canonical
tensor ``T`` is defined row by row from one shared pool of random rows::

    T[r, c] = pool[(r * STRIDE + seed(T)) % POOL_ROWS, c]      (1-d tensors: row 0 of that rule)

**Every version is different.** ``pool.at(version)`` keeps the rows and moves every
tensor's start row (``seed(T, version)``), so consecutive versions differ in (almost) every
element: a method that skips a copy, or resends the previous version, fails the bitwise
check of that version. The bench fills the trainers with ``pool.at(v)`` before sync ``v``
and checks every reader against it after.

The pool is ``POOL_ROWS`` x (widest row) ``torch.randn`` values, a few MB. Any box of any
tensor is then one gather of pool rows (``index_select``), i.e. memcpy speed, and boxes
computed by different processes for the same element always agree. Rows repeat only
every ``POOL_ROWS`` rows and start at a per-tensor offset, so a transfer that puts bytes in
the wrong row, column or tensor is caught by the bitwise check.

The same module holds the two region walks the baselines need: copying a canonical
tensor into an engine rank's shards (what an engine's ``load_weights`` does) and deciding
which writer contributes which box when the trainer gathers a full tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from weightsync.layout import RankLayout
from weightsync.layout.types import CanonicalTensor, Region
from weightsync.tools.torch_layout import TORCH_DTYPES

POOL_ROWS = 1031  # prime: rows of different tensors interleave with no short period
STRIDE = 613


def tensor_seed(name: str, seed: int, version: int = 0) -> int:
    """The pool row tensor ``name`` starts at in ``version``: never the previous version's."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + version * (STRIDE + 1)) % POOL_ROWS


class WeightPool:
    """The random rows every process derives the model from (see module docstring)."""

    def __init__(self, canonical: Mapping[str, object], *, width: int, dtype: str, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rows = torch.randn((POOL_ROWS, width), generator=gen).to(TORCH_DTYPES[dtype]).to(device)
        self.seed = seed
        self.dtype = dtype
        self.version = 0
        self._seeds = {name: tensor_seed(name, seed) for name in canonical}

    def at(self, version: int) -> WeightPool:
        """The weights of ``version``: the same rows, every tensor starting elsewhere."""
        other = object.__new__(WeightPool)
        other.rows, other.seed, other.dtype, other.version = self.rows, self.seed, self.dtype, version
        other._seeds = {name: tensor_seed(name, self.seed, version) for name in self._seeds}
        return other

    @classmethod
    def for_layout(cls, layout: RankLayout, *, seed: int = 0, device: str | torch.device = "cpu") -> WeightPool:
        width = max(t.shape[-1] for t in layout.canonical.values())
        dtypes = {t.dtype for t in layout.canonical.values()}
        if len(dtypes) != 1:
            raise ValueError(f"benchmark models have one dtype, got {sorted(dtypes)}")
        return cls(layout.canonical, width=width, dtype=dtypes.pop(), seed=seed, device=device)

    def box(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The values of box ``offsets + sizes`` of canonical tensor ``name`` (a new tensor)."""
        base = self._seeds[name]
        if len(sizes) == 1:
            return self.rows[base, offsets[0]: offsets[0] + sizes[0]].clone()
        if len(sizes) != 2:
            raise ValueError(f"{name}: benchmark weights support 1-d and 2-d tensors, got {len(sizes)}-d")
        idx = torch.arange(offsets[0], offsets[0] + sizes[0], dtype=torch.int64, device=self.rows.device)
        idx = (idx * STRIDE + base) % POOL_ROWS
        return self.rows[:, offsets[1]: offsets[1] + sizes[1]].index_select(0, idx)

    def full(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.box(name, (0,) * len(shape), shape)


def region_view(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    """The strided view of a contiguous shard tensor that holds ``region``'s box."""
    flat = tensor.detach().view(-1)
    return flat.as_strided(region.box.sizes, region.strides, flat.storage_offset() + region.offset)


def fill(layout: RankLayout, tensors: Mapping[str, torch.Tensor], pool: WeightPool) -> None:
    """Write the benchmark weights into every region of this rank's shards."""
    for shard, region in layout.regions():
        region_view(tensors[shard.name], region).copy_(pool.box(region.canonical, region.box.offsets,
                                                                region.box.sizes))


def mismatches(layout: RankLayout, tensors: Mapping[str, torch.Tensor], pool: WeightPool) -> list[str]:
    """Canonical names whose regions on this rank differ bitwise from the benchmark weights."""
    bad = []
    for shard, region in layout.regions():
        got = region_view(tensors[shard.name], region)
        want = pool.box(region.canonical, region.box.offsets, region.box.sizes)
        if not torch.equal(_bits(got), _bits(want)):
            bad.append(region.canonical)
    return bad


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the same bits (NaN-safe, -0.0-safe bitwise comparison)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints)


class CanonicalLoader:
    """Copies whole canonical tensors into an engine rank's shards (an engine's ``load_weights``).

    This is what the baselines' receiving side does for every tensor it gets: narrow the
    full tensor to the boxes this rank holds and copy each into its (possibly fused) shard.
    """

    def __init__(self, layout: RankLayout, tensors: Mapping[str, torch.Tensor]) -> None:
        self.targets: dict[str, list[tuple[torch.Tensor, Region]]] = {}
        for shard, region in layout.regions():
            self.targets.setdefault(region.canonical, []).append((region_view(tensors[shard.name], region), region))

    def needs(self, name: str) -> bool:
        return name in self.targets

    def load(self, name: str, full: torch.Tensor) -> int:
        """Copy the boxes of ``full`` this rank holds; returns the bytes written."""
        n = 0
        for view, region in self.targets.get(name, ()):
            view.copy_(full[region.box.slices()])
            n += view.numel() * view.element_size()
        return n


@dataclass(frozen=True, slots=True)
class Contribution:
    """One box of a canonical tensor that writer ``rank`` sends when the trainer gathers it."""

    rank: int
    shard: str
    region: Region


def gather_contributions(writers: Iterable[RankLayout]) -> dict[str, list[Contribution]]:
    """For each canonical tensor, which writer provides which box to a full-tensor gather.

    Writers are taken in rank order; a box already provided by a lower rank (a replicated
    tensor, say) is not sent again. Raises if the boxes do not cover a tensor exactly once,
    since the baselines would then gather a wrong tensor.
    """
    out: dict[str, list[Contribution]] = {}
    seen: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    canonical: Mapping[str, CanonicalTensor] = {}
    for layout in writers:
        canonical = layout.canonical
        for shard, region in layout.regions():
            key = (region.box.offsets, region.box.sizes)
            boxes = seen.setdefault(region.canonical, set())
            if key in boxes:
                continue
            boxes.add(key)
            out.setdefault(region.canonical, []).append(Contribution(layout.rank, shard.name, region))
    for name, contributions in out.items():
        covered = sum(c.region.box.numel for c in contributions)
        want = canonical[name].numel
        if covered != want:
            raise ValueError(f"writers' boxes of {name} cover {covered} of {want} elements (overlapping "
                             "partial shards are not supported by the baseline gather)")
    missing = sorted(set(canonical) - set(out))
    if missing:
        raise ValueError(f"no writer holds {missing[:5]}")
    return out
