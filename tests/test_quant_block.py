"""MXFP8, MXFP4 and NVFP4 quantize-on-send (issue 40): bitwise against references written here.

The references are numpy, independent of ``weightsync.tools.codecs.mx_math``: the OCP Microscaling
v1.0 conversion (section 6.3) for MXFP8 and MXFP4, compressed-tensors' NVFP4 rules for NVFP4,
each on the whole weight, with FP4 and FP8 rounding done by exhaustive nearest-value search
(ties to the even code). Every case plans from real layout kinds, lets each writer's quantizer
fill its twins and scales (exchanging the maxima of blocks writers share through an in-memory
board, concurrently, as the job channel does), applies the plan op by op, and compares every
byte every reader holds with the reference. Edge values (NaN, +-inf, huge, tiny, -0.0, an
all-zero block) sit in blocks that writers cut.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from weightsync.clock.deadline import Deadline
from weightsync.layout import ModelSpec, parse_layout
from weightsync.layout.quant_block import BLOCK_SCHEMES, BlockTensor, block_tensors
from weightsync.layout.quant_block_offers import block_sources
from weightsync.plan import PlanOptions, build_plan
from weightsync.tools.codecs.mx import BlockQuantizer
from weightsync.tools.tiny import canonical_weights, tiny_config
from weightsync.tools.torch_layout import TORCH_DTYPES, allocate, fill_from_canonical, strided_view

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e4m3_table() -> np.ndarray:
    """The value of each float8_e4m3fn code 0..126 (0x7F is NaN), from its bits."""
    out = []
    for code in range(127):
        exp, man = code >> 3, code & 7
        out.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return np.array(out)


E4M3 = e4m3_table()


def nearest_even(mag: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The code of the nearest table value, ties to the even code, above the last: the last."""
    dist = np.abs(np.minimum(mag, table[-1])[..., None] - table)
    code = np.argmin(dist, axis=-1)
    nxt = np.minimum(code + 1, len(table) - 1)
    tie = (np.take_along_axis(dist, nxt[..., None], -1)[..., 0] == np.take_along_axis(dist, code[..., None], -1)[
        ..., 0]) & (code % 2 == 1) & (nxt != code)
    return np.where(tie, nxt, code)


def ref_e2m1(v: np.ndarray) -> np.ndarray:
    nan = np.isnan(v)
    code = nearest_even(np.where(nan, 0.0, np.abs(v)), E2M1)
    return (code | (np.signbit(v) & ~nan) << 3).astype(np.uint8)


def ref_e4m3(v: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bits of float values: round to nearest even, saturating at 448; NaN: 0x7F."""
    nan = np.isnan(v)
    code = nearest_even(np.where(nan, 0.0, np.abs(v)), E4M3)
    bits = (code | (np.signbit(v) & ~nan) << 7).astype(np.uint8)
    return np.where(nan, np.uint8(0x7F), bits)


def ref_block_form(weight: torch.Tensor, t: BlockTensor) -> np.ndarray:
    """The weight as float64, its input dimension last, cut into blocks: [..., blocks, block]."""
    w = weight.float().numpy().astype(np.float64).transpose(t.perm)
    return w.reshape(*w.shape[:-1], w.shape[-1] // t.scheme.block, t.scheme.block)


def ref_mx(weight: torch.Tensor, t: BlockTensor) -> dict[str, np.ndarray]:
    """OCP MX v1.0: shared = floor(log2 amax) - emax, E8M0; elements RNE, saturating."""
    blocks = ref_block_form(weight, t)
    amax = np.abs(blocks).max(axis=-1)
    emax = 2 if t.scheme.elements == "e2m1" else 8
    finite = np.isfinite(amax)
    exponent = np.frexp(np.where(finite, amax, 1.0))[1]  # amax = m * 2**e, m in [0.5, 1): floor(log2) = e - 1
    shared = np.where(amax > 0, np.clip(exponent - 1 - emax, -127, 127), -127)
    codes = np.where(finite, shared + 127, 0xFF).astype(np.uint8)
    scaled = blocks / np.exp2(shared)[..., None]
    nan_block = (codes == 0xFF)[..., None]
    if t.scheme.elements == "e2m1":
        elements = np.where(nan_block, 0, ref_e2m1(scaled)).astype(np.uint8)
        flat = elements.reshape(*elements.shape[:-2], -1)
        values = flat[..., 0::2] | (flat[..., 1::2] << 4)
    else:
        values = np.where(nan_block, 0, ref_e4m3(scaled)).astype(np.uint8).reshape(*blocks.shape[:-2], -1)
    return {t.values_name: values.reshape(t.values_shape), t.scale_name: codes}


def ref_nvfp4(weight: torch.Tensor, t: BlockTensor) -> dict[str, np.ndarray]:
    """compressed-tensors' NVFP4, in float32 arithmetic: gs = 448*6/amax (1 if 0 or not finite),
    s = e4m3(min(amax_b / 6 * gs, 448)) (0 -> 0.125), P = e2m1(x / (s / gs)); NaN block: s NaN, P 0."""
    f32 = np.float32
    blocks = ref_block_form(weight, t).astype(f32)
    lead = t.lead
    amax_t = np.abs(blocks).max(axis=tuple(range(lead, blocks.ndim))) if lead else np.abs(blocks).max()
    amax_t = np.asarray(amax_t, dtype=f32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        gs = np.where(np.isfinite(amax_t) & (amax_t > 0), f32(2688.0) / amax_t, f32(1.0)).astype(f32)
        g = gs.reshape(*gs.shape, *(1,) * (blocks.ndim - 1 - lead)) if lead else gs
        amax_b = np.abs(blocks).max(axis=-1)
        raw = np.minimum((amax_b / f32(6.0)).astype(f32) * g, f32(448.0)).astype(f32)
        bits = ref_e4m3(raw.astype(np.float64))
        value = np.where(bits == 0x7F, np.nan, E4M3[np.minimum(bits & 0x7F, 126)] * np.where(bits & 0x80, -1, 1))
        zero = value == 0
        bits = np.where(zero, ref_e4m3(np.array(0.125)), bits).astype(np.uint8)
        value = np.where(zero, 0.125, value).astype(f32)
        effective = (value / g).astype(f32)
        elements = ref_e2m1((blocks / effective[..., None]).astype(f32).astype(np.float64))
    elements = np.where((bits == 0x7F)[..., None], 0, elements).astype(np.uint8)
    flat = elements.reshape(*elements.shape[:-2], -1)
    values = flat[..., 0::2] | (flat[..., 1::2] << 4)
    return {t.values_name: values.reshape(t.values_shape), t.scale_name: bits,
            t.global_name: gs.reshape(t.global_shape)}


def reference(weight: torch.Tensor, t: BlockTensor) -> dict[str, np.ndarray]:
    return ref_nvfp4(weight, t) if t.scheme.global_scale else ref_mx(weight, t)


def config(family: str | None = None) -> dict:
    if family == "gpt_oss":
        return tiny_config(family="gpt_oss")  # whole experts [E, H, 2I], blocks along H
    if family == "narrow":  # 8 heads: Megatron TP 8 cuts every input dimension inside a block
        return {**config(), "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8}
    return {**tiny_config(moe=True), "hidden_size": 64, "moe_intermediate_size": 64, "intermediate_size": 64}


def with_edges(weights: dict[str, torch.Tensor], spec: ModelSpec, scheme: str) -> dict[str, torch.Tensor]:
    """Edge values in the first quantized weights' blocks (rows 0-2 of the block-last form)."""
    out = dict(weights)
    tensors = block_tensors(spec, BLOCK_SCHEMES[scheme])
    for t, edges in zip(tensors[:3], ([float("nan"), 1.0], [float("inf"), -float("inf"), 2.0],
                                      [3e38, 1e-40, -0.0, -1e-45]), strict=False):
        w = out[t.base].clone().permute(t.perm)  # a view: writes land in the clone
        w[(0,) * (w.ndim - 2)][0, : len(edges)] = torch.tensor(edges)
        w[(0,) * (w.ndim - 2)][1, : t.scheme.block] = 0.0  # an all-zero block
        w[(0,) * (w.ndim - 2)][2, : t.scheme.block] = -0.0
        out[t.base] = w.permute(tuple(np.argsort(t.perm).tolist())).contiguous()
    return out


def run_sync(cfg: dict, writer_kind: str, reader_kind: str, scheme: str, *, edges: bool = False, seed: int = 0):
    """Plan, quantize on every writer (concurrently), apply every op; (spec, weights, readers, buffers, plan)."""
    spec = ModelSpec.from_hf_config(cfg)
    writers = parse_layout(writer_kind).all_rank_layouts(spec)
    sep = "," if ":" in reader_kind else ":"
    readers = parse_layout(f"{reader_kind}{sep}quant={scheme}").all_rank_layouts(spec)
    planned, blocks = block_sources(writers, readers)
    plan = build_plan(planned, readers, options=PlanOptions(min_split_bytes=0))
    weights = {n: t.to(torch.bfloat16) for n, t in canonical_weights(cfg, seed).items()}
    if edges:
        weights = with_edges(weights, spec, scheme)
    src = {}
    for layout in writers:
        src[layout.rank] = allocate(layout, device="cpu")
        src[layout.rank] = {n: t.to(torch.bfloat16) for n, t in src[layout.rank].items()}
        fill_from_canonical(layout, src[layout.rank], weights)
    board: dict[int, bytes] = {}
    cond = threading.Condition()

    def exchange(rank: int, payload: bytes | None, publishers: list[int]) -> list[bytes]:
        with cond:
            if payload is not None:
                board[rank] = payload
                cond.notify_all()
            assert cond.wait_for(lambda: all(w in board for w in publishers), timeout=30)
            return [board[w] for w in publishers]

    def derive(rank: int):
        quantizer = BlockQuantizer(blocks, rank=rank)
        return rank, quantizer.derive(src[rank], lambda p, pubs: exchange(rank, p, pubs))

    with ThreadPoolExecutor(len(writers)) as pool:
        derived = dict(pool.map(derive, [w.rank for w in writers]))
    dst = {layout.rank: allocate(layout) for layout in readers}
    for op in plan.ops:
        flat_src = derived[op.src_rank][op.src_shard].reshape(-1)
        flat_dst = dst[op.dst_rank][op.dst_shard].view(-1)
        strided_view(flat_dst, op.box.sizes, op.dst_strides, op.dst_offset).copy_(
            strided_view(flat_src, op.box.sizes, op.src_strides, op.src_offset).to(TORCH_DTYPES[op.dst_dtype]))
    return spec, weights, readers, dst, plan


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy() if t.element_size() == 1 else \
        t.contiguous().view(torch.int32).numpy()


def check_readers(spec, weights, readers, dst, scheme: str) -> int:
    """Every region every reader holds equals the reference (bytes; float32 by bits); returns how
    many quantized regions were checked."""
    want: dict[str, np.ndarray] = {}
    for t in block_tensors(spec, BLOCK_SCHEMES[scheme]):
        want.update(reference(weights[t.base], t))
    checked = 0
    for layout in readers:
        for shard in layout.shards:
            flat = dst[layout.rank][shard.name].view(-1)
            for r in shard.regions:
                got = strided_view(flat, r.box.sizes, r.strides, r.offset)
                if r.canonical in want:
                    expect = want[r.canonical][r.box.slices()]
                    expect = expect.view(np.int32) if expect.dtype == np.float32 else expect
                    assert np.array_equal(bits(got), expect), f"reader {layout.rank} {shard.name}: {r.canonical}"
                    checked += 1
                else:
                    assert torch.equal(got, weights[r.canonical][r.box.slices()].to(got.dtype)), r.canonical
    return checked


LAYOUTS = [
    (None, "fsdp:dp=3", "vllm:tp=2", False),  # FSDP row cuts (NVFP4: tensors no writer holds whole)
    (None, "megatron:tp=2", "hf", False),  # TP splits input dimensions at block boundaries
    ("narrow", "megatron:tp=8", "vllm:tp=2", True),  # ... and inside blocks: their maxima are exchanged
    ("narrow", "megatron:tp=4,dp=2", "hf", True),  # replicated holders of cut blocks
]


# Every format through the uncut layouts; the cut ones once per block size and scale kind (MXFP8
# exchanges MXFP4's 32-element E8M0 block maxima: only its element encoding differs)
@pytest.mark.parametrize("scheme, family, writer_kind, reader_kind, shared", [
    (scheme, *case) for case in LAYOUTS for scheme in sorted(BLOCK_SCHEMES)
    if not (case[3] and scheme == "mxfp8")])
def test_block_formats_equal_the_reference_with_edge_values(scheme, family, writer_kind, reader_kind, shared):
    spec, weights, readers, dst, plan = run_sync(config(family), writer_kind, reader_kind, scheme, edges=True)
    assert check_readers(spec, weights, readers, dst, scheme) > 0
    assert plan.stats.sent_bytes == plan.stats.needed_bytes  # no value or scale byte travels twice
    _, blocks = block_sources(parse_layout(writer_kind).roster(spec), readers)
    cut = any(o.exchanged.any() for o in blocks.offers.values())
    # NVFP4's 16-element blocks are whole at TP 4 (16 columns a rank)
    assert cut == (shared and not (scheme == "nvfp4" and writer_kind == "megatron:tp=4,dp=2"))


def test_gpt_oss_mxfp4_lands_in_its_checkpoint_layout_and_names():
    """vLLM's gpt-oss MXFP4 parameters (w13_weight [E, 2I, H/2] uint8 ...), filled from FSDP writers
    that cut experts, equal the reference; the blocks and scales are the checkpoint's own tensors,
    which transformers' own dequantizer reads back to the rounded weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = config("gpt_oss")
    spec, weights, readers, dst, _ = run_sync(cfg, "fsdp:dp=3", "vllm:tp=2", "mxfp4", edges=True)
    assert check_readers(spec, weights, readers, dst, "mxfp4") > 0
    _, weights, hf_readers, hf_dst, _ = run_sync(cfg, "fsdp:dp=3", "hf", "mxfp4")
    tensors = hf_dst[0]
    blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    scales = tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]
    e, i2, h = 4, 2 * cfg["intermediate_size"], cfg["hidden_size"]
    assert blocks.shape == (e, i2, h // 32, 16) and blocks.dtype == torch.uint8
    assert scales.shape == (e, i2, h // 32) and scales.dtype == torch.uint8
    weight = weights["model.layers.0.mlp.experts.gate_up_proj"].float()  # [E, H, 2I]
    back = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, H, 2I]
    assert back.shape == weight.shape
    assert torch.allclose(back, weight, rtol=0.5, atol=0.1 * float(weight.abs().max()))
    assert not any(n.startswith("model.layers.0.self_attn") and n.endswith("_blocks") for n in tensors)


def test_a_byte_cut_between_writers_is_refused_naming_it():
    cfg = config()
    spec = ModelSpec.from_hf_config(cfg)
    writers = parse_layout("deepspeed:dp=7").all_rank_layouts(spec)  # flat cuts at odd positions
    readers = parse_layout("hf:quant=mxfp4").all_rank_layouts(spec)
    with pytest.raises(ValueError, match="cuts the input dimension at an odd position"):
        block_sources(writers, readers)


@pytest.mark.parametrize("scheme", sorted(BLOCK_SCHEMES))
def test_a_weights_values_and_scales_are_in_one_phase(scheme):
    """Layer phases keep every weight's values, block scales and global scales together (the
    engine loads a phase whole, so it never holds values of one version with scales of another)."""
    from weightsync.layout.quant_block import reader_canonical
    from weightsync.plan import layer_phases

    for cfg in (config(), config("gpt_oss")):
        spec = ModelSpec.from_hf_config(cfg)
        canonical = reader_canonical(spec, scheme)
        phases = layer_phases(canonical, budget_bytes=1)  # as small as it goes: a module a phase
        phase = {name: i for i, names in enumerate(phases) for name in names}
        for t in block_tensors(spec, BLOCK_SCHEMES[scheme]):
            assert len({phase[n] for n in t.derived()}) == 1, t.base


def test_a_version_whose_scale_piece_does_not_arrive_fails_and_is_never_loaded():
    """Version 2's block scales are held back (the transport delivers the values, then its deadline
    passes before the scale piece): the reader fails version 2, its engine never loads the phase,
    nothing is reported applied; version 3 then loads whole, bitwise the reference."""
    from weightsync.engines.staging import StagedWeights
    from weightsync.meta import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import ReadersFailedError, WeightWriter
    from weightsync.session.sync_session import SyncConfig, SyncError
    from weightsync.tools.tiny import CanonicalSource
    from weightsync.transport import TransportError, TransportOptions

    cfg = config()
    spec = ModelSpec.from_hf_config(cfg)

    class Loading(StagedWeights):
        def __init__(self) -> None:
            super().__init__(spec, dtype=torch.float32, device="cpu", rank=0, quant="mxfp4")
            self.loaded: dict[int, dict[str, torch.Tensor]] = {}

        def _load_items(self, items):
            self.loaded.setdefault(self._loading, {}).update({n: t.clone() for n, t in items})

    engine = Loading()
    sync = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=60, layer_phases=True,
                      transport_options=TransportOptions(max_bucket_bytes=64 << 10))
    held_back = "model.layers.1.mlp.experts.*.down_proj.weight_scale"
    errors: list[BaseException] = []

    def write(server) -> None:
        try:
            source = CanonicalSource(cfg)
            with WeightWriter(source, rank=0, config=sync, meta=MetaClient(server.address, token=server.token)) as w:
                for version in (1, 2, 3):
                    fill_from_canonical(source.layout(), source.tensors(), canonical_weights(cfg, version))
                    try:
                        w.write(version)
                    except ReadersFailedError:
                        assert version == 2
        except BaseException as exc:
            errors.append(exc)

    with EmbeddedMetaServer() as server:
        writer = threading.Thread(target=write, args=(server,))
        writer.start()
        try:
            with WeightReader(engine, rank=0, config=sync, meta=MetaClient(server.address, token=server.token)) as r:
                assert r.update(1).version == 1
                planned = r.session.planned
                phase = next(i for i, names in enumerate(planned.phase_names) if held_back in names)
                original = planned.transport.receive

                def receive(v: int, *, deadline: Deadline, phase_: int = 0, **kw):
                    p = kw.get("phase", phase_)
                    if v == 2 and p == phase:  # the values land; the scale piece is not there by the deadline
                        original(v, deadline=deadline, phase=p)
                        raise TransportError(f"version 2 phase {p}: {held_back} did not arrive before the deadline")
                    return original(v, deadline=deadline, phase=p)

                planned.transport.receive = receive
                with pytest.raises(SyncError, match="did not arrive"):
                    r.update(2)
                assert engine.weight_version is None and r.last_failed == 2
                in_phase = {shard.name for shard in engine._phase_shards[phase]}
                assert any(held_back.split("*", maxsplit=1)[0] in n and "weight_scale" in n for n in in_phase)
                assert engine.loaded.get(2) and not set(engine.loaded[2]) & in_phase  # earlier phases loaded, not it
                assert r.update(3).version == 3 and engine.weight_version == 3
        finally:
            writer.join(60)
    assert not errors, errors
    want: dict[str, np.ndarray] = {}
    weights = canonical_weights(cfg, 3)
    for t in block_tensors(spec, BLOCK_SCHEMES["mxfp4"]):
        want.update(reference(weights[t.base], t))
    for shard in engine.layout().shards:
        got = engine.loaded[3][shard.name].view(-1)
        for reg in shard.regions:
            if reg.canonical in want:
                assert np.array_equal(bits(strided_view(got, reg.box.sizes, reg.strides, reg.offset)),
                                      want[reg.canonical][reg.box.slices()]), reg.canonical


@pytest.mark.parametrize("scheme, variant", [("nvfp4", "shm"), ("mxfp4", "torch-delta")])
def test_block_and_bf16_readers_from_three_training_processes(scheme, variant):
    """Three FSDP processes (NVFP4: no writer holds a weight whole, so global maxima go through the
    meta server) write two versions; a reader of the block format and a bf16 reader of the same
    job each get their own, bitwise; with deltas too."""
    import sys
    import uuid
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig
    from weightsync.transport import TransportOptions
    from writer_process import writer_processes

    transport, flags, settings = {"shm": ("shm", (), {}), "torch-delta": (
        "torch", ("--delta", "4"), {"transport_options": TransportOptions(delta_anchor_every=4)})}[variant]
    cfg = config()
    job = f"{scheme}-{uuid.uuid4().hex[:8]}"
    engines = [ShardedEngine(f"hf:quant={scheme}", cfg, 0), ShardedEngine("hf:replicas=2", cfg, 1)]
    errors: list[BaseException] = []
    snapshot: dict[int, dict] = {}
    with EmbeddedMetaServer() as server, writer_processes(server, cfg, "fsdp:dp=3", job=job, seeds=[2, 1],
                                                          extra=("--transport", transport, "--readers", "2", *flags)):
        sync = SyncConfig(num_writers=3, num_readers=2, job=job, transport=transport, timeout=120, **settings)

        def read(rank: int) -> None:
            try:
                with MetaClient(server.address, job=job, token=server.token) as meta, \
                        WeightReader(engines[rank], rank=rank, config=sync, meta=meta) as reader:
                    for version in (1, 2):
                        assert reader.update(version).version == version
                        if version == 1:
                            snapshot[rank] = {n: t.clone() for n, t in engines[rank].tensors.items()}
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=read, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
    assert not errors, errors
    spec = ModelSpec.from_hf_config(cfg)
    for seed, tensors, plain in ((2, snapshot[0], snapshot[1]), (1, engines[0].tensors, engines[1].tensors)):
        weights = canonical_weights(cfg, seed)  # the writers' float32 weights
        layouts = [engines[0].layout()]
        assert check_readers(spec, weights, layouts, {0: tensors}, scheme) > 0
        check_readers(spec, weights, [engines[1].layout()], {1: plain}, scheme)  # the bf16 reader's, bitwise


def test_vllm_splits_gpt_oss_mx_experts_by_whole_blocks():
    """vLLM's gpt-oss MXFP4 loader gives each expert-TP rank ``cdiv(I / 32, tp)`` whole blocks (the
    last rank fewer, its tensors padded), not ``I / tp`` columns; the layout follows, bitwise."""
    cfg = {**config("gpt_oss"), "intermediate_size": 96}  # 3 blocks over 2 ranks: 2 and 1
    spec = ModelSpec.from_hf_config(cfg)
    kind = parse_layout("vllm:dp=2,quant=mxfp4")
    down = [kind.rank_layout(spec, r).shard("model.layers.0.mlp.experts.routed_experts.w2_weight") for r in (0, 1)]
    assert [d.shape for d in down] == [(4, 64, 32), (4, 64, 32)]  # 64 columns each, packed two a byte
    assert [(r.box.offsets[2], r.box.sizes[2]) for d in down for r in d.regions] == [(0, 2), (2, 1)]
    spec_, weights, readers, dst, _ = run_sync(cfg, "fsdp:dp=3", "vllm:dp=2", "mxfp4", edges=True)
    assert check_readers(spec_, weights, readers, dst, "mxfp4") > 0
