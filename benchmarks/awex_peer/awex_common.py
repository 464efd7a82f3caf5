"""Shared helpers for driving awex 0.9.0's planner + p2p path on CPU/gloo.

Nothing here is awex code: it builds the *inputs* awex's own code consumes
(per-rank raw parameter metadata in the canonical HF names awex's converters
emit for Qwen3ForCausalLM) and deterministic tensors so results can be
checked bitwise.  The metadata is pushed through awex's real
ParamMetaResolver._build_params_meta + awex's real ShardingStrategy
(mcore flavour for train ranks, sglang flavour for inference ranks).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from awex.meta.meta_resolver import ParamMetaResolver
from awex.models.registry import get_sharding_strategy
from awex.sharding.rank_info import RankInfo

ARCH = "Qwen3ForCausalLM"


@dataclass
class QwenShape:
    vocab: int
    hidden: int
    layers: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def q_rows(self):
        return self.heads * self.head_dim

    @property
    def kv_rows(self):
        return self.kv_heads * self.head_dim


SHAPES = {
    # tiny: a few hundred KB, for correctness
    "tiny": QwenShape(vocab=512, hidden=64, layers=2, inter=128, heads=4, kv_heads=2, head_dim=16),
    # Qwen3-0.6B-like dims (untied lm_head) = ~0.75B params
    "qwen3-0.6b": QwenShape(vocab=151936, hidden=1024, layers=28, inter=3072, heads=16, kv_heads=8, head_dim=128),
    # ~0.2B params: same widths, fewer layers, smaller vocab
    "qwen3-mid": QwenShape(vocab=32768, hidden=1024, layers=12, inter=3072, heads=16, kv_heads=8, head_dim=128),
}


def hf_param_shapes(s: QwenShape) -> dict[str, tuple[int, ...]]:
    """Global (unsharded) canonical HF names/shapes, i.e. the names awex's
    Qwen3 mcore converter emits on train ranks and its Qwen3 sglang converter
    emits on infer ranks (both unfuse qkv -> q/k/v and fc1 -> gate/up)."""
    out = {"model.embed_tokens.weight": (s.vocab, s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (s.hidden,)
        out[p + "self_attn.q_proj.weight"] = (s.q_rows, s.hidden)
        out[p + "self_attn.k_proj.weight"] = (s.kv_rows, s.hidden)
        out[p + "self_attn.v_proj.weight"] = (s.kv_rows, s.hidden)
        out[p + "self_attn.o_proj.weight"] = (s.hidden, s.q_rows)
        out[p + "self_attn.q_norm.weight"] = (s.head_dim,)
        out[p + "self_attn.k_norm.weight"] = (s.head_dim,)
        out[p + "post_attention_layernorm.weight"] = (s.hidden,)
        out[p + "mlp.gate_proj.weight"] = (s.inter, s.hidden)
        out[p + "mlp.up_proj.weight"] = (s.inter, s.hidden)
        out[p + "mlp.down_proj.weight"] = (s.hidden, s.inter)
    out["model.norm.weight"] = (s.hidden,)
    out["lm_head.weight"] = (s.vocab, s.hidden)
    return out


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def full_tensor(name: str, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(name))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def make_rank_info(*, tp_rank, tp_size, world_size, global_rank, engine_rank, is_infer) -> RankInfo:
    return RankInfo(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, dp_size=1, dp_rank=0,
        ep_rank=0, ep_size=1, ep_tp_rank=0, ep_tp_size=1,
        attn_tp_rank=tp_rank, attn_tp_size=tp_size, attn_dp_rank=0,
        world_size=world_size, global_rank=global_rank, local_rank=global_rank,
        engine_rank=engine_rank, is_infer=is_infer,
    )


def make_strategy(engine_name: str, rank_info: RankInfo):
    """awex's registered sharding strategy for the arch, built the way
    get_mcore_sharding_strategy / get_sglang_sharding_strategy build it."""
    cls = get_sharding_strategy(ARCH)
    return cls(
        engine_name=engine_name, enable_dp_attention=False, enable_dp_lm_head=False,
        moe_dense_tp_size=rank_info.tp_size, tp_size=rank_info.tp_size,
        ep_size=1, ep_tp_size=1, rank_info=rank_info, device_backend="cpu",
    )


class _ListResolver(ParamMetaResolver):
    """Minimal concrete resolver: feeds pre-gathered raw metas into awex's
    real ParamMetaResolver._build_params_meta (which computes replicas and
    global offsets)."""

    def __init__(self, raw, engine_name):
        self._raw = raw
        self._engine_name = engine_name
        self.num_hidden_layers = 0

    def get_model_arch_name(self):
        return ARCH

    def get_parameters_meta(self):
        return self._build_params_meta()

    def _get_params_raw_meta(self):
        return self._raw

    def _get_sharding_info(self, name, rank_info, param_meta):
        return make_strategy(self._engine_name, rank_info).get_sharding_strategy(
            name, rank_info=rank_info, param_meta=param_meta)


def local_shard_spec(name: str, gshape, tp_rank: int, tp_size: int, engine_name: str):
    """(sharding_dim or None, local shape) for one rank, as decided by awex's
    own ShardingStrategy for that engine."""
    ri = make_rank_info(tp_rank=tp_rank, tp_size=tp_size, world_size=tp_size,
                        global_rank=tp_rank, engine_rank=0, is_infer=engine_name != "mcore")
    stype, dim, nshards = make_strategy(engine_name, ri).get_sharding_strategy(name)
    if nshards == 1:
        return None, tuple(gshape)
    assert gshape[dim] % nshards == 0, (name, gshape, dim, nshards)
    shp = list(gshape)
    shp[dim] //= nshards
    return dim, tuple(shp)


def local_tensor(name, gshape, dtype, tp_rank, tp_size, engine_name):
    dim, _ = local_shard_spec(name, gshape, tp_rank, tp_size, engine_name)
    t = full_tensor(name, gshape, dtype)
    if dim is None:
        return t
    return t.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def build_train_meta(shapes: dict[str, tuple], dtype, tp_size: int):
    """What McoreParamMetaResolver would all_gather: one raw meta per train
    rank, then awex's _build_params_meta."""
    raw = []
    for r in range(tp_size):
        ri = make_rank_info(tp_rank=r, tp_size=tp_size, world_size=tp_size,
                            global_rank=r, engine_rank=0, is_infer=False)
        pm = []
        for n, g in shapes.items():
            _, ls = local_shard_spec(n, g, r, tp_size, "mcore")
            numel = 1
            for d in ls:
                numel *= d
            pm.append({"name": n, "shape": ls, "numel": numel, "dtype": dtype, "vp_stage": 0})
        raw.append({"rank_info": ri, "params_meta": pm, "model_arch_name": ARCH})
    return _ListResolver(raw, "mcore").get_parameters_meta()


def build_infer_meta(shapes: dict[str, tuple], dtype, tp_size: int):
    """Meta of ONE inference engine (awex publishes engine 0's meta and the
    planner replicates it num_infer_engines times)."""
    raw = []
    for r in range(tp_size):
        ri = make_rank_info(tp_rank=r, tp_size=tp_size, world_size=tp_size,
                            global_rank=r, engine_rank=0, is_infer=True)
        pm = []
        for n, g in shapes.items():
            _, ls = local_shard_spec(n, g, r, tp_size, "sglang")
            numel = 1
            for d in ls:
                numel *= d
            pm.append({"name": n, "shape": ls, "numel": numel, "dtype": dtype})
        raw.append({"rank_info": ri, "params_meta": pm})
    return _ListResolver(raw, "sglang").get_parameters_meta()


def nbytes_of(shapes, dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    tot = 0
    for g in shapes.values():
        n = 1
        for d in g:
            n *= d
        tot += n * es
    return tot
