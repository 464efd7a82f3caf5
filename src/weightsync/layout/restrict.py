"""A rank layout restricted to the parts of each canonical tensor the rank reads.

An engine worker that stages whole checkpoint tensors for its own loader, but whose loader reads
only a slice of each (a vLLM worker at TP rank ``t`` of ``T`` narrows every sharded tensor to its
``1/T``), needs only those slices to arrive. :func:`restrict` keeps each local tensor whole (the
loader is handed the checkpoint shape) and keeps only the regions that hold what the rank reads:
the rest of the tensor is never written, and no writer sends it::

    boxes = {"model.layers.0.mlp.down_proj.weight": [Box((0, 0), (H, I // 2))], ...}   # read on TP rank 0
    staged = restrict(hf_layout, boxes)            # same shards, half the regions' bytes
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from weightsync.layout.box import Box
from weightsync.layout.types import RankLayout, Region, Shard


def disjoint(boxes: Iterable[Box]) -> list[Box] | None:
    """The distinct boxes, if no two overlap; None if some do (the caller then reads the whole)."""
    distinct = sorted(set(boxes), key=lambda b: (b.offsets, b.sizes))
    for i, a in enumerate(distinct):
        if any(a.intersect(b) is not None for b in distinct[i + 1:]):
            return None
    return distinct


def _sub_region(region: Region, box: Box) -> Region:
    """The part of ``region`` that holds ``box`` (a box inside ``region.box``), in the same storage."""
    corner = box.relative_to(region.box)
    offset = region.offset + sum(c * s for c, s in zip(corner, region.strides, strict=True))
    return Region(region.canonical, box, offset, region.strides)


def restrict(layout: RankLayout, reads: Mapping[str, Iterable[Box]]) -> RankLayout:
    """``layout`` with each region cut to the boxes of its canonical tensor in ``reads``.

    A canonical tensor absent from ``reads`` is read by nobody on this rank: its regions go (the
    local tensor stays, never written). Overlapping boxes of one tensor keep its regions whole.
    Shards, their names, shapes and dtypes are unchanged: only what arrives in them shrinks.
    """
    wanted = {name: disjoint(boxes) for name, boxes in reads.items()}
    shards = []
    for shard in layout.shards:
        regions: list[Region] = []
        for region in shard.regions:
            boxes = wanted.get(region.canonical, [])
            if boxes is None:
                regions.append(region)
                continue
            for box in boxes:
                part = region.box.intersect(box)
                if part is not None and not part.empty:
                    regions.append(region if part == region.box else _sub_region(region, part))
        shards.append(Shard(shard.name, shard.shape, shard.dtype, tuple(regions)))
    return RankLayout(layout.rank, tuple(shards), layout.canonical)
