"""Several models in one job: a target and a separately trained draft (EAGLE-style), each under a prefix.

A job moves canonical tensors; two models of one job only need names that do not clash. Each
model's layout keeps its own names under a prefix (``"draft."``), and a rank's layout is the
union of its models' (:func:`merge`); the planner then plans both as one job, each byte once.
A model that no family describes (an EAGLE head: ``fc`` plus a decoder layer) is laid out as
whole tensors by name (:func:`named_layout`).

    target = engine.layout()                                   # e.g. a ModuleEngine's
    draft = named_layout({"fc.weight": ((64, 128), "float32"), ...}, rank=0)
    layout = merge([target, prefixed(draft, "draft.")], rank=0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightsync.layout.box import Box, contiguous_strides
from weightsync.layout.types import CanonicalTensor, RankLayout, Region, Shard


def named_layout(tensors: Mapping[str, tuple[tuple[int, ...], str]], rank: int) -> RankLayout:
    """Whole tensors by name: each is a canonical tensor of its own, held whole in a shard of that name."""
    shards, canonical = [], {}
    for name, (dims, dtype) in tensors.items():
        shape = tuple(int(s) for s in dims)
        canonical[name] = CanonicalTensor(name, shape, dtype)
        shards.append(Shard(name, shape, dtype, (Region(name, Box.full(shape), 0, contiguous_strides(shape)),)))
    return RankLayout(rank, tuple(shards), canonical)


def prefixed(layout: RankLayout, prefix: str) -> RankLayout:
    """``layout`` with every canonical and shard name under ``prefix`` (one model of several)."""
    if not prefix:
        return layout
    shards = tuple(Shard(prefix + s.name, s.shape, s.dtype,
                         tuple(Region(prefix + r.canonical, r.box, r.offset, r.strides) for r in s.regions))
                   for s in layout.shards)
    canonical = {prefix + n: CanonicalTensor(prefix + n, t.shape, t.dtype) for n, t in layout.canonical.items()}
    return RankLayout(layout.rank, shards, canonical)


def merge(layouts: Sequence[RankLayout], rank: int) -> RankLayout:
    """One rank's layout holding every model of ``layouts``.

    Raises:
        ValueError: two models name the same canonical tensor or shard (give one a prefix).
    """
    shards: list[Shard] = []
    canonical: dict[str, CanonicalTensor] = {}
    for layout in layouts:
        clash = sorted(set(layout.canonical) & set(canonical)) or sorted(
            {s.name for s in layout.shards} & {s.name for s in shards})
        if clash:
            raise ValueError(f"two models of one job both name {clash[:3]}: put one under a prefix "
                             "(weightsync.layout.models.prefixed)")
        canonical.update(layout.canonical)
        shards.extend(layout.shards)
    return RankLayout(rank, tuple(shards), canonical)


__all__ = ["merge", "named_layout", "prefixed"]
