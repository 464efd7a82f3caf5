"""The FP8 offer derivation (``layout.quant_offers.quantized_sources``) equals the plain mask-painting
one it replaced (``tests/fp8_oracle.py``), field for field: planned writer layouts, shared
tiles, publishers and twins. Scale shards declare the same tiles, cut as ``grid_boxes`` cuts
them (the oracle never joined experts). Layouts come from every layout kind, and from
arbitrary boxes (ragged, overlapping, empty, several per writer) for both FP8 schemes.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fp8_oracle as oracle
from budget import examples
from strategies import layout_kinds, model_specs
from weightsync.layout import Box, CanonicalTensor, RankLayout, Region, Shard, parse_layout
from weightsync.layout.box import contiguous_strides
from weightsync.layout.quant import SCHEMES, quantized_canonical
from weightsync.layout.quant_offers import grid_boxes, quantized_sources
from weightsync.plan import PlanOptions, build_plan
from weightsync.tools.codecs.fp8 import WriterQuantizer


def slow(full: int) -> settings:
    return settings(max_examples=examples(full), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def painted(shard: Shard) -> np.ndarray:
    mask = np.zeros(shard.shape, dtype=int)
    for r in shard.regions:
        mask[r.box.slices()] += 1
    return mask


def joined(shard: Shard) -> Shard:
    """The oracle's scale shard with its tiles cut as ``grid_boxes`` cuts them."""
    strides = contiguous_strides(shard.shape)
    name = shard.regions[0].canonical if shard.regions else ""
    return Shard(shard.name, shard.shape, shard.dtype, tuple(
        Region(name, b, sum(o * s for o, s in zip(b.offsets, strides, strict=True)), strides)
        for b in grid_boxes(painted(shard) > 0)))


def without_empty_boxes(layouts):
    """The layouts without regions of empty boxes: they hold nothing (rosters have no rows for
    them), so they touch no tile. The oracle's painting marks the tile at an empty box's
    corner when that corner is off a tile boundary."""
    return [RankLayout(layout.rank, tuple(Shard(s.name, s.shape, s.dtype, tuple(r for r in s.regions
                                                                              if not r.box.empty))
                                          for s in layout.shards), layout.canonical) for layout in layouts]


def assert_same(writers, readers) -> None:
    got_roster, got = quantized_sources(writers, readers)
    got_layouts = got_roster.layouts()
    want_layouts, want = oracle.quantized_sources(without_empty_boxes(writers), without_empty_boxes(readers))
    assert len(got_layouts) == len(want_layouts)
    for g, w in zip(got_layouts, want_layouts, strict=True):
        assert g.rank == w.rank
        assert [s.name for s in g.shards] == [s.name for s in w.shards], f"writer {w.rank}"
        scales = set(want.scales[w.rank]) if want else set()
        for gs, ws in zip(g.shards, w.shards, strict=True):
            if gs.name in scales:
                assert np.array_equal(painted(gs), painted(ws) > 0), gs.name  # the same tiles, once each
                assert gs == joined(ws), gs.name
            else:
                assert gs == ws, f"writer {w.rank} {gs.name}"
        assert dict(g.canonical) == dict(w.canonical)
        if want:
            assert got.twins(w.rank) == want.twins[w.rank]
            assert got.scales(w.rank) == want.scales[w.rank]
    assert got.tensors.keys() == want.tensors.keys()
    for name, w in want.tensors.items():
        g = got.tensors[name]
        assert g == w, name  # base, scheme, shape, publishers
        assert g.exchanged.shape == w.exchanged.shape and np.array_equal(g.exchanged, w.exchanged), name


@slow(40)
@given(data=st.data())
def test_layout_kinds_derive_what_the_oracle_derives(data):
    spec = data.draw(model_specs(scale=48))
    kind = parse_layout(data.draw(layout_kinds(spec.num_layers, spec.is_moe)))
    try:
        kind.validate(spec)
    except ValueError:
        assume(False)
    readers = [f"hf:quant={data.draw(st.sampled_from(sorted(SCHEMES)))}"]
    readers += data.draw(st.lists(st.sampled_from(["hf", "hf:quant=fp8_block", "hf:quant=fp8_channel"]),
                                  max_size=2))
    reader_layouts = [parse_layout(text).rank_layout(spec, 0).with_rank(r) for r, text in enumerate(readers)]
    assert_same(kind.all_rank_layouts(spec), reader_layouts)


def test_megatron_experts_and_vllm_tp_readers():
    # The 1T shape in miniature: whole experts per rank, vLLM readers at two TP sizes.
    from weightsync.layout import ModelSpec

    spec = ModelSpec(family="qwen3_moe", hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                     num_kv_heads=4, head_dim=128, vocab_size=300, tie_word_embeddings=False, num_experts=8,
                     moe_intermediate_size=256, dtype="bfloat16")
    writers = parse_layout("megatron:tp=2,pp=2,dp=2,ep=4,etp=1").all_rank_layouts(spec)
    for target in ("vllm:tp=2,replicas=2,quant=fp8_block", "vllm:tp=2,quant=fp8_channel"):
        assert_same(writers, parse_layout(target).all_rank_layouts(spec))


def test_writers_that_hold_nothing_of_a_tensor():
    # FSDP over 3 ranks cuts a 2-expert router into 1, 1 and 0 rows: rank 2's shard is empty.
    from weightsync.layout import ModelSpec

    spec = ModelSpec(family="qwen3_moe", hidden_size=192, intermediate_size=192, num_layers=1, num_heads=1,
                     num_kv_heads=1, head_dim=96, vocab_size=240, tie_word_embeddings=False, num_experts=2,
                     moe_intermediate_size=96, dtype="float32")
    writers = parse_layout("fsdp:dp=3").all_rank_layouts(spec)
    assert any(not s.regions for s in writers[2].shards)
    assert_same(writers, [parse_layout("hf:quant=fp8_block").rank_layout(spec, 0)])


@st.composite
def raw_fp8_layouts(draw):
    """Weights (2-d, and 3-d expert stacks) held as arbitrary boxes by a few writers, asked
    for in one or both FP8 schemes, and maybe also in the model dtype."""
    canonical = {}
    for i in range(draw(st.integers(1, 3))):
        stack = draw(st.booleans())
        name = f"layers.{i}.{'experts.*.' if stack else ''}proj.weight"
        rows, cols = draw(st.integers(1, 420)), draw(st.integers(1, 420))
        shape = (draw(st.integers(1, 3)), rows, cols) if stack else (rows, cols)
        canonical[name] = CanonicalTensor(name, shape, "bfloat16")
    n_writers = draw(st.integers(1, 4))
    held: dict[int, list[Shard]] = {r: [] for r in range(n_writers)}
    for name, tensor in canonical.items():
        for k in range(draw(st.integers(1, 6))):
            lo = [draw(st.integers(0, s)) for s in tensor.shape]
            size = [draw(st.integers(0, s - o)) for s, o in zip(tensor.shape, lo, strict=True)]
            if draw(st.booleans()):  # mostly non-empty
                size = [max(x, 1) if o < s else 0 for x, o, s in zip(size, lo, tensor.shape, strict=True)]
            box = Box(tuple(lo), tuple(size))
            region = Region(name, box, 0, contiguous_strides(box.sizes))
            rank = draw(st.integers(0, n_writers - 1))
            shards = held[rank]
            if shards and draw(st.booleans()):  # another region in the same shard (flat, as large as both)
                last = shards[-1]
                numel = max(int(np.prod(last.shape)), int(np.prod([max(x, 1) for x in size])))
                shards[-1] = Shard(last.name, (numel,), last.dtype, (*last.regions, region))
            else:
                shards.append(Shard(f"{name}.s{k}", tuple(max(s, 1) for s in size), "bfloat16", (region,)))
    writers = [RankLayout(r, tuple(s), canonical) for r, s in held.items()]
    readers = []
    for r, schemes in enumerate(draw(st.lists(st.sets(st.sampled_from([*SCHEMES, "plain"]), min_size=1),
                                              min_size=1, max_size=3))):
        names = dict(canonical)
        shards = []
        for name, tensor in canonical.items():
            for scheme_name in sorted(schemes):
                wanted = name if scheme_name == "plain" else SCHEMES[scheme_name].weight_name(name)
                if scheme_name != "plain":
                    scheme = SCHEMES[scheme_name]
                    names[wanted] = CanonicalTensor(wanted, tensor.shape, "float8_e4m3fn")
                    scale = scheme.scale_name(name)
                    names[scale] = CanonicalTensor(scale, scheme.grid(tensor.shape), "float32")
                box = Box.full(tensor.shape)
                shards.append(Shard(f"{wanted}.d", tensor.shape, names[wanted].dtype,
                                    (Region(wanted, box, 0, contiguous_strides(box.sizes)),)))
        readers.append(RankLayout(r, tuple(shards), names))
    return writers, readers


@slow(25)
@given(data=st.data())
def test_writer_quantizers_need_what_the_oracle_finds_in_the_ops(data):
    # FSDP and ZeRO-3 cut tiles (maxima exchanged); the quantizer reads the plan's columns.
    spec = data.draw(model_specs(scale=48))
    kind = parse_layout(data.draw(st.sampled_from(["fsdp:dp=3", "deepspeed:dp=2", "megatron:tp=2,dp=2",
                                                   "hf:replicas=2"])))
    try:
        kind.validate(spec)
    except ValueError:
        assume(False)
    scheme = data.draw(st.sampled_from(sorted(SCHEMES)))
    readers = [parse_layout(f"hf:quant={scheme}").rank_layout(spec, 0)]
    if data.draw(st.booleans()):
        readers.append(parse_layout("hf").rank_layout(spec, 0).with_rank(1))
    planned, quant = quantized_sources(kind.all_rank_layouts(spec), readers)
    plan = build_plan(planned, readers, PlanOptions(min_split_bytes=data.draw(st.sampled_from([0, 1 << 20]))))
    for layout in planned.layouts():
        quantizer = WriterQuantizer(quant, layout, plan)
        want = oracle.quantizer_needs(quant, layout, plan)
        got = {"needed": quantizer.needed, "exchanged": quantizer.exchanged, "listen": quantizer.listen,
               "publishes": quantizer.publishes, "value_ops": quantizer.value_ops, "active": quantizer.active}
        assert got == want, layout.rank


@slow(150)
@given(raw_fp8_layouts())
def test_arbitrary_boxes_derive_what_the_oracle_derives(layouts):
    assert_same(*layouts)


def test_replicas_get_one_derivation():
    # Writers holding the same shards (hf replicas) get equal derived shards.
    from weightsync.layout import ModelSpec

    spec = ModelSpec(family="qwen3", hidden_size=256, intermediate_size=384, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=64, vocab_size=100, tie_word_embeddings=False, dtype="bfloat16")
    writers = parse_layout("hf:replicas=3").all_rank_layouts(spec)
    readers = [RankLayout(0, parse_layout("hf:quant=fp8_block").rank_layout(spec, 0).shards,
                          quantized_canonical(spec, SCHEMES["fp8_block"]))]
    planned = quantized_sources(writers, readers)[0].layouts()
    assert [w.rank for w in planned] == [0, 1, 2]
    assert planned[0].shards == planned[2].shards
    assert_same(writers, readers)


def join_reference(boxes: list[Box]) -> list[Box]:
    """The oracle's per-expert cut with boxes that differ only in the expert joined, where
    consecutive, one pair at a time."""
    boxes = list(boxes)
    if not boxes or boxes[0].ndim < 3:
        return boxes
    d = boxes[0].ndim - 3
    merged = True
    while merged:
        merged = False
        for a, b in itertools.permutations(boxes, 2):
            same = all(a.offsets[i] == b.offsets[i] and a.sizes[i] == b.sizes[i]
                       for i in range(a.ndim) if i != d)
            if same and a.offsets[d] + a.sizes[d] == b.offsets[d]:
                sizes = list(a.sizes)
                sizes[d] += b.sizes[d]
                boxes = [x for x in boxes if x not in (a, b)] + [Box(a.offsets, tuple(sizes))]
                merged = True
                break
    return sorted(boxes, key=lambda box: box.offsets)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
    lambda shape: st.lists(st.booleans(), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))).map(
        lambda cells: np.array(cells, dtype=bool).reshape(shape))))
def test_grid_boxes_are_the_row_by_row_cut_with_experts_joined(mask):
    assert grid_boxes(mask) == join_reference(oracle.grid_boxes(mask))


def test_grid_boxes_of_nothing_and_of_whole_experts():
    assert grid_boxes(np.zeros((3, 4), dtype=bool)) == []
    assert grid_boxes(np.array(True)) == []
    assert grid_boxes(np.ones((2, 1, 3), dtype=bool)) == [Box((0, 0, 0), (2, 1, 3))]
    mask = np.zeros((6, 2, 3), dtype=bool)
    mask[1:4, :, :] = True  # a writer's three consecutive experts: one box
    mask[5, 1, :] = True
    assert grid_boxes(mask) == [Box((1, 0, 0), (3, 2, 3)), Box((5, 1, 0), (1, 1, 3))]


def test_every_box_of_a_small_grid():
    # Exhaustive over one tensor: each writer box of a 3x2 tile grid (ragged last tiles), with
    # and without a second writer cutting the first tile row.
    shape = (300, 200)
    name = "w.weight"
    canonical = {name: CanonicalTensor(name, shape, "bfloat16")}
    readers = [RankLayout(0, (Shard("d", shape, "float8_e4m3fn", (Region(
        f"{name}#fp8_block", Box.full(shape), 0, contiguous_strides(shape)),)),),
        {**canonical, f"{name}#fp8_block": CanonicalTensor(f"{name}#fp8_block", shape, "float8_e4m3fn"),
         "w.weight_scale_inv": CanonicalTensor("w.weight_scale_inv", (3, 2), "float32")})]
    points = [(0, 64, 128, 200, 256, 300), (0, 100, 128, 200)]
    for r0, r1 in itertools.combinations(points[0], 2):
        for c0, c1 in itertools.combinations(points[1], 2):
            box = Box((r0, c0), (r1 - r0, c1 - c0))
            first = Shard("a", box.sizes, "bfloat16", (Region(name, box, 0, contiguous_strides(box.sizes)),))
            cut = Box((0, 0), (64, 200))
            second = Shard("b", cut.sizes, "bfloat16", (Region(name, cut, 0, contiguous_strides(cut.sizes)),))
            assert_same([RankLayout(0, (first,), canonical)], readers)
            assert_same([RankLayout(0, (first,), canonical), RankLayout(1, (second,), canonical)], readers)
