"""Hypothesis strategies: random models, random layout pairs, random raw layouts."""

from __future__ import annotations

import itertools
import math

from hypothesis import assume
from hypothesis import strategies as st

from weightsync.layout import Box, CanonicalTensor, ModelSpec, RankLayout, Region, Shard, parse_layout
from weightsync.layout.box import contiguous_strides


@st.composite
def model_specs(draw, *, scale: int = 1):
    family = draw(st.sampled_from(["llama", "qwen2", "qwen3", "qwen3_moe"]))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([2, 4])) * scale
    moe = family == "qwen3_moe"
    return ModelSpec(
        family=family,
        hidden_size=draw(st.sampled_from([4, 8, 12])) * scale,
        intermediate_size=draw(st.sampled_from([4, 8, 12])) * scale,
        num_layers=draw(st.integers(1, 3)),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=draw(st.integers(5, 70)) * scale,
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=family == "qwen2",
        num_experts=draw(st.sampled_from([2, 4])) if moe else 0,
        moe_intermediate_size=draw(st.sampled_from([2, 4, 6])) * scale if moe else 0,
        dense_layers=frozenset({0}) if moe and draw(st.booleans()) else frozenset(),
        dtype="float32",
    )


def layout_kinds(num_layers: int, moe: bool):
    ep = st.sampled_from([1, 2]) if moe else st.just(1)
    return st.one_of(
        st.builds(lambda r: f"hf:replicas={r}", st.integers(1, 3)),
        st.builds(lambda d, t: f"fsdp:dp={d},tp={t}", st.integers(1, 3), st.sampled_from([1, 2])),
        st.builds(lambda d: f"deepspeed:dp={d}", st.integers(1, 4)),
        # expert TP: 1 (whole experts) or Megatron-core's default, tp
        st.builds(lambda t, p, d, e, whole: f"megatron:tp={t},pp={p},dp={d},ep={e},etp={1 if whole else t}",
                  st.sampled_from([1, 2]), st.integers(1, min(num_layers, 3)), st.integers(1, 2), ep,
                  st.booleans()),
        # vLLM's EP spans every TP and DP rank (ep = tp x dp), or there is none
        st.builds(lambda t, d, r, e: f"vllm:tp={t},dp={d},replicas={r},ep={t * d if e > 1 else 1}",
                  st.sampled_from([1, 2, 4]), st.integers(1, 2), st.integers(1, 2), ep),
    )


@st.composite
def layout_pairs(draw, *, scale: int = 1):
    """(spec, writer layouts, reader layouts) for two random valid layout kinds."""
    spec = draw(model_specs(scale=scale))
    kinds = layout_kinds(spec.num_layers, spec.is_moe)
    layouts = []
    for _ in range(2):
        text = draw(kinds)
        kind = parse_layout(text)
        try:
            kind.validate(spec)
        except ValueError:
            assume(False)
        layouts.append(kind.all_rank_layouts(spec))
    return spec, layouts[0], layouts[1]


def _grid(draw, shape):
    """Random split points per dim -> list of boxes tiling the shape."""
    cuts = []
    for size in shape:
        points = sorted(draw(st.sets(st.integers(1, max(size - 1, 1)), max_size=2))) if size > 1 else []
        bounds = [0, *[p for p in points if 0 < p < size], size]
        cuts.append(list(zip(bounds[:-1], bounds[1:])))
    return [Box(tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell))
            for cell in itertools.product(*cuts)]


def _local_shard(draw, name, tensor, box, dtype):
    """A local tensor holding ``box``: contiguous, transposed, or inside a padded buffer."""
    style = draw(st.sampled_from(["plain", "transposed", "padded"]))
    sizes = box.sizes
    if style == "transposed" and len(sizes) >= 2:
        perm = list(range(len(sizes)))[::-1]
        local_shape = tuple(sizes[p] for p in perm)
        ls = contiguous_strides(local_shape)
        strides = [0] * len(sizes)
        for local_dim, canon_dim in enumerate(perm):
            strides[canon_dim] = ls[local_dim]
        return Shard(name, local_shape, dtype, (Region(tensor.name, box, 0, tuple(strides)),))
    if style == "padded":
        pad = draw(st.integers(1, 3))
        local_shape = (sizes[0] + pad, *sizes[1:]) if sizes else (pad + 1,)
        lead = draw(st.integers(0, pad))
        ls = contiguous_strides(local_shape)
        offset = lead * ls[0] if sizes else lead
        strides = ls if sizes else ()
        return Shard(name, local_shape, dtype, (Region(tensor.name, box, offset, strides),))
    return Shard(name, sizes, dtype, (Region(tensor.name, box, 0, contiguous_strides(sizes)),))


@st.composite
def raw_layout_pairs(draw):
    """Arbitrary canonical tensors cut into random grids on both sides, with replication."""
    n_tensors = draw(st.integers(1, 3))
    canonical = {}
    for i in range(n_tensors):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        canonical[f"t{i}"] = CanonicalTensor(f"t{i}", shape, "float32")
    n_src = draw(st.integers(1, 4))
    n_dst = draw(st.integers(1, 3))
    src_dtype = draw(st.sampled_from(["float32", "float64"]))
    src_shards: dict[int, list[Shard]] = {r: [] for r in range(n_src)}
    dst_shards: dict[int, list[Shard]] = {r: [] for r in range(n_dst)}
    for tensor in canonical.values():
        for k, box in enumerate(_grid(draw, tensor.shape)):
            holders = draw(st.sets(st.integers(0, n_src - 1), min_size=1))
            for r in holders:
                src_shards[r].append(_local_shard(draw, f"{tensor.name}.s{k}", tensor, box, src_dtype))
        for k, box in enumerate(_grid(draw, tensor.shape)):
            needers = draw(st.sets(st.integers(0, n_dst - 1), min_size=1))
            for r in needers:
                dst_shards[r].append(_local_shard(draw, f"{tensor.name}.d{k}", tensor, box, "float32"))
    sources = [RankLayout(r, tuple(s), canonical) for r, s in src_shards.items()]
    dests = [RankLayout(r, tuple(s), canonical) for r, s in dst_shards.items()]
    return canonical, sources, dests


def nbytes(layouts):
    return sum(r.numel * 4 for lay in layouts for s in lay.shards for r in s.regions)


def numel(shape):
    return math.prod(shape)
