"""A reference executor of plans in numpy: the ground truth transports are tested against.

It cuts every rank's shards out of full canonical arrays, runs a plan op by op with
``as_strided`` views, and counts how many times each destination element was written.
``weightsync plan --verify`` and the property tests use it; it is not a transport.

    values = random_canonical(spec_tensors, seed=0)
    src = {lay.rank: cut_shards(lay, values) for lay in writers}
    dst = {lay.rank: empty_shards(lay) for lay in readers}
    writes = run_plan(plan, src, dst)
    check_destinations(readers, dst, values)   # raises on the first wrong element
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.lib.stride_tricks import as_strided

from weightsync.layout.types import CanonicalTensor, RankLayout
from weightsync.plan.ops import Plan

#: numpy stand-ins for dtypes; bf16 travels as raw 16-bit words (no conversion possible).
NUMPY_DTYPES = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
    "bool": np.bool_, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8,
}

Buffers = dict[int, dict[str, np.ndarray]]


def np_dtype(dtype: str) -> np.dtype:
    return np.dtype(NUMPY_DTYPES[dtype])


def view(flat: np.ndarray, offset: int, sizes: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """The strided view a region or op describes, over a flat array (writable)."""
    item = flat.itemsize
    return as_strided(flat[offset:], shape=sizes, strides=tuple(s * item for s in strides))


def random_canonical(tensors: Mapping[str, CanonicalTensor], seed: int = 0,
                     dtype: str | None = None) -> dict[str, np.ndarray]:
    """Distinct random values for every canonical tensor (ints fit every numeric dtype)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in tensors.items():
        npd = np_dtype(dtype or t.dtype)
        out[name] = rng.integers(1, 100, size=t.shape).astype(npd)
    return out


def cut_shards(layout: RankLayout, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A writer rank's shards filled from the canonical values (uncovered elements zero)."""
    out = {}
    for shard in layout.shards:
        flat = np.zeros(shard.numel, dtype=np_dtype(shard.dtype))
        for region in shard.regions:
            src = values[region.canonical][region.box.slices()]
            view(flat, region.offset, region.box.sizes, region.strides)[...] = src.astype(flat.dtype)
        out[shard.name] = flat
    return out


def empty_shards(layout: RankLayout, fill: int = 0) -> dict[str, np.ndarray]:
    return {s.name: np.full(s.numel, fill, dtype=np_dtype(s.dtype)) for s in layout.shards}


def run_plan(plan: Plan, src: Buffers, dst: Buffers) -> dict[int, dict[str, np.ndarray]]:
    """Execute every op, then the readers' local copies; returns per destination shard how often
    each element was written."""
    writes = {r: {n: np.zeros(a.size, dtype=np.int32) for n, a in shards.items()} for r, shards in dst.items()}
    for op in plan.ops:
        sizes = op.box.sizes
        s = view(src[op.src_rank][op.src_shard], op.src_offset, sizes, op.src_strides)
        d_flat = dst[op.dst_rank][op.dst_shard]
        view(d_flat, op.dst_offset, sizes, op.dst_strides)[...] = s.astype(d_flat.dtype)
        w = writes[op.dst_rank][op.dst_shard]
        view(w, op.dst_offset, sizes, op.dst_strides)[...] += 1
    for op in plan.copy_ops:
        sizes = op.box.sizes
        shards = dst[op.dst_rank]
        s = view(shards[op.src_shard], op.src_offset, sizes, op.src_strides).copy()
        view(shards[op.dst_shard], op.dst_offset, sizes, op.dst_strides)[...] = s
        w = writes[op.dst_rank][op.dst_shard]
        view(w, op.dst_offset, sizes, op.dst_strides)[...] += 1
    return writes


def check_destinations(layouts: list[RankLayout], dst: Buffers, values: Mapping[str, np.ndarray]) -> None:
    """Every region of every reader holds exactly the canonical values (bitwise)."""
    for layout in layouts:
        for shard in layout.shards:
            flat = dst[layout.rank][shard.name]
            for region in shard.regions:
                got = view(flat, region.offset, region.box.sizes, region.strides)
                want = values[region.canonical][region.box.slices()].astype(flat.dtype)
                if not np.array_equal(got, want):
                    bad = int((got != want).sum())
                    raise AssertionError(
                        f"reader rank {layout.rank} {shard.name}: {bad} wrong elements of "
                        f"{region.canonical} {region.box}"
                    )
