"""Building blocks for engine layouts: replicated, split, fused, vocab-parallel, flat.

Each function returns :class:`Shard` objects for one rank and is pure arithmetic on
shapes, so every layout kind (``layout/kinds``) is a short composition of these, and each
block is table-tested on its own against hand-computed slices.

    q = spec.tensor("q", 0); k = spec.tensor("k", 0); v = spec.tensor("v", 0)
    shard = concat_shard("qkv_proj.weight", "bfloat16",
                         [(q, rows(q, 0, 64)), (k, rows(k, 0, 16)), (v, rows(v, 0, 16))])
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.layout.box import Box, chunk_bounds, even_bounds
from weightsync.layout.types import CanonicalTensor, Shard, box_region, flat_range_regions

#: One part of a fused local tensor: a box of a canonical tensor.
Part = tuple[CanonicalTensor, Box]


def rows(tensor: CanonicalTensor, start: int, stop: int, dim: int = 0) -> Box:
    """The box ``[start, stop)`` along ``dim`` of ``tensor``, whole in every other dim."""
    offs = [0] * len(tensor.shape)
    sizes = list(tensor.shape)
    offs[dim] = start
    sizes[dim] = stop - start
    return Box(tuple(offs), tuple(sizes))


def replicated(tensor: CanonicalTensor, name: str, dtype: str | None = None) -> Shard:
    """A local tensor holding the whole canonical tensor."""
    box = Box.full(tensor.shape)
    return Shard(name, tensor.shape, dtype or tensor.dtype, (box_region(tensor.name, box, tensor.shape),))


def split(
    tensor: CanonicalTensor,
    name: str,
    *,
    dim: int,
    parts: int,
    index: int,
    dtype: str | None = None,
    even: bool = True,
) -> Shard:
    """Part ``index`` of ``parts`` along ``dim``: equal parts, or ``torch.chunk`` style.

    ``even=False`` gives FSDP2 ``Shard(dim)`` semantics: chunks of ``ceil(n/parts)``, the
    trailing ones shorter or empty (an empty shard has no region).
    """
    size = tensor.shape[dim]
    bounds = (even_bounds(size, parts, what=f"dim {dim} of {tensor.name}") if even
              else chunk_bounds(size, parts))
    lo, hi = bounds[index]
    return concat_shard(name, dtype or tensor.dtype, [(tensor, rows(tensor, lo, hi, dim))], dim=dim)


def concat_shard(
    name: str,
    dtype: str,
    parts: Sequence[Part],
    *,
    dim: int = 0,
    drop_leading: int = 0,
    local_shape: Sequence[int] | None = None,
) -> Shard:
    """A local tensor made of ``parts`` laid one after another along local ``dim``.

    This is every fused parameter: vLLM ``qkv_proj`` ([q; k; v]), ``gate_up_proj``
    ([gate; up]), Megatron ``linear_qkv`` ([q_g; k_g; v_g] per query group) and
    ``linear_fc1`` ([gate_r; up_r]), stacked MoE ``w13`` ([gate; up] along dim 1).
    ``drop_leading`` drops leading unit dims of the canonical boxes (per-expert tensors
    holding a slice of an expert stack). Empty parts are skipped.
    """
    if not parts:
        raise ValueError(f"fused tensor {name!r} needs at least one part")
    first_sizes = parts[0][1].sizes[drop_leading:]
    regions = []
    cursor = 0
    shape = list(first_sizes)
    shape[dim] = sum(box.sizes[drop_leading + dim] for _, box in parts)
    if local_shape is not None:
        if len(local_shape) != len(shape) or any(
            want < got for want, got in zip(local_shape, shape, strict=True)
        ):
            raise ValueError(f"{name}: local shape {tuple(local_shape)} cannot hold parts of {shape}")
        shape = list(local_shape)
    for tensor, box in parts:
        sizes = box.sizes[drop_leading:]
        for d, (a, b) in enumerate(zip(sizes, first_sizes, strict=True)):
            if d != dim and a != b and not box.empty:
                raise ValueError(
                    f"{name}: cannot concatenate {tensor.name} box {box.sizes} with "
                    f"{first_sizes} along dim {dim}"
                )
        if not box.empty:
            offs = [0] * len(shape)
            offs[dim] = cursor
            regions.append(box_region(tensor.name, box, shape, offs, drop_leading=drop_leading))
        cursor += sizes[dim]
    return Shard(name, tuple(shape), dtype, tuple(regions))


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """KV heads held by TP rank ``rank``; when ``num_kv_heads < tp`` heads are replicated.

    vLLM and Megatron replicate each KV head over ``tp // num_kv_heads`` consecutive ranks.
    """
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by tp={tp}")
        per = num_kv_heads // tp
        return rank * per, (rank + 1) * per
    if tp % num_kv_heads:
        raise ValueError(
            f"tp={tp} is not a multiple of num_key_value_heads={num_kv_heads}, so KV heads "
            "cannot be replicated evenly"
        )
    head = rank // (tp // num_kv_heads)
    return head, head + 1


def padded_size(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def vocab_parallel(
    tensor: CanonicalTensor,
    name: str,
    *,
    tp: int,
    rank: int,
    padded_rows: int,
    dtype: str | None = None,
) -> Shard:
    """Rows ``[r*P/tp, (r+1)*P/tp)`` of a vocabulary padded to ``padded_rows`` rows.

    Rows past the real vocabulary are padding: they belong to the local tensor but map
    to nothing, so no transfer ever touches them.
    """
    if padded_rows % tp:
        raise ValueError(f"{tensor.name}: padded vocabulary {padded_rows} is not divisible by tp={tp}")
    per = padded_rows // tp
    lo = min(rank * per, tensor.shape[0])
    hi = min((rank + 1) * per, tensor.shape[0])
    local_shape = (per, *tensor.shape[1:])
    return concat_shard(name, dtype or tensor.dtype, [(tensor, rows(tensor, lo, hi))], local_shape=local_shape)


def flat_partition(
    tensor: CanonicalTensor,
    name: str,
    *,
    world: int,
    rank: int,
    dtype: str | None = None,
) -> Shard:
    """A ZeRO-3 style 1-D partition: ``ceil(numel/world)`` elements, zero-padded at the end."""
    per = -(-tensor.numel // world)
    lo = min(rank * per, tensor.numel)
    hi = min(lo + per, tensor.numel)
    regions = tuple(flat_range_regions(tensor, lo, hi))
    return Shard(name, (per,), dtype or tensor.dtype, regions)
