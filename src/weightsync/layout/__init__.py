"""The unified layout layer: canonical tensors and the regions every rank holds of them.

Pure: this package imports neither torch.distributed, nor a transport, nor an engine.
"""

from weightsync.layout.box import Box, chunk_bounds, contiguous_strides, even_bounds
from weightsync.layout.kinds import LayoutKind, parse_layout
from weightsync.layout.model import ModelSpec
from weightsync.layout.provider import LayoutProvider
from weightsync.layout.types import (
    DTYPE_ITEMSIZE,
    CanonicalTensor,
    RankLayout,
    Region,
    Shard,
    box_region,
    expert_name,
    flat_range_regions,
    is_expert_stack,
    itemsize,
)

__all__ = [
    "DTYPE_ITEMSIZE",
    "Box",
    "CanonicalTensor",
    "LayoutKind",
    "LayoutProvider",
    "ModelSpec",
    "RankLayout",
    "Region",
    "Shard",
    "box_region",
    "chunk_bounds",
    "contiguous_strides",
    "even_bounds",
    "expert_name",
    "flat_range_regions",
    "is_expert_stack",
    "itemsize",
    "parse_layout",
]
