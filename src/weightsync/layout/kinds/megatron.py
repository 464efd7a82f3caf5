"""``megatron``: Megatron-core GPT models under TP, PP, DP, EP (and expert TP).

Rank order is Megatron's default (``tp`` fastest, then ``dp``, then ``pp``):
``rank = t + tp * (d + dp * p)``. Within a pipeline stage, the ``tp * dp`` ranks are
regrouped for experts as ``(etp, ep, edp)`` with ``etp`` fastest, so ``ep * etp`` must divide
``tp * dp``. ``etp`` defaults to ``tp``, as in Megatron-core (``initialize_model_parallel``:
``expert_tensor_parallel_size=None`` means ``tensor_model_parallel_size``); the usual MoE
setting, experts whole on each rank, is ``etp=1``, written out.

Fused tensors, as Megatron lays them out:

* ``linear_qkv``: per query group ``g`` the rows ``[q heads of g; k_g; v_g]``; TP splits
  whole groups, so ``num_key_value_heads`` must be divisible by ``tp``;
* ``linear_fc1`` (SwiGLU, ``partition_stride`` 2): TP rank ``r`` holds ``[gate_r; up_r]``;
* the vocabulary is padded to a multiple of ``vocab_multiple * tp`` (Megatron's
  ``make_vocab_size_divisible_by``), padding rows mapping to nothing;
* layers are spread over stages as evenly as possible (earlier stages take the remainder)
  and numbered locally from 0 on each stage; the embedding lives on the first stage, the
  final norm and ``output_layer`` on the last (with tied embeddings and ``pp > 1`` the last
  stage's ``output_layer`` is a second copy of the embedding).

``grouped=1`` names experts like ``TEGroupedMLP`` (``experts.linear_fc1.weight{i}``) instead
of ``SequentialMLP`` (``experts.local_experts.{i}.linear_fc1.weight``).

The rules above name Llama-style attention and MLPs (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral).
The other families (DeepSeek-V3/Kimi-K2's latent attention, shared experts, router expert bias
and MTP layers; GLM-4.5; gpt-oss, whose whole experts :func:`whole_expert_shard` lays out) are
laid out from :class:`MegatronParam` rules that ``weightsync.sources.megatron_names.install()``
derives from mbridge's mappings and megatron-core's layer specs (:func:`use_params`); without
them this kind refuses those families by name. MTP layers (``mtp.layers.{i}.``) live on the last stage, which then holds
an embedding of its own when ``pp > 1`` (megatron-core's ``GPTModel``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from weightsync.layout.box import Box, even_bounds
from weightsync.layout.builders import (
    Part,
    concat_shard,
    padded_size,
    replicated,
    rows,
    split,
    vocab_parallel,
)
from weightsync.layout.families import FLOAT32_ROLES
from weightsync.layout.kinds.base import LayoutKind, memo, register_kind
from weightsync.layout.kinds.pieces import Piece
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import CanonicalTensor, Region, Shard

#: Megatron local name of each role that is a plain (unfused) parameter.
_PLAIN_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_attn_norm": "pre_mlp_layernorm.weight",
    "q_norm": "self_attention.q_layernorm.weight",
    "k_norm": "self_attention.k_layernorm.weight",
    "router": "mlp.router.weight",
}


#: The families whose Megatron-core parameters the tables below name (Llama-style attention and MLPs).
_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"})


@dataclasses.dataclass(frozen=True, slots=True)
class MegatronParam:
    """One parameter of a Megatron layer, the same in every layer of its kind.

    ``suffix`` is its name within the layer (``self_attention.linear_kv_up_proj.weight``; an
    expert's as ``TEGroupedMLP`` names it before the expert number, ``mlp.experts.linear_fc1.weight``).
    ``runs`` lay the whole parameter's rows out along dim 0: ``(role, first row, end row)`` of
    that role's tensor in the layer, in order. Tensor parallelism cuts it along ``dim`` (None:
    whole on every rank) into ``tp * stride`` chunks, rank ``r`` holding chunks ``r, r + tp, ...``
    (megatron-core's ``partition_dim`` and ``partition_stride``); an ``expert`` parameter is one
    per expert, placed by EP and cut over expert TP.
    """

    suffix: str
    runs: tuple[tuple[str, int, int], ...]
    dim: int | None
    stride: int = 1
    expert: bool = False


#: (spec, global layer) -> the layer's parameters, set by ``weightsync.sources.megatron_names.install``.
_PARAMS: dict[str, Callable[[ModelSpec, int], tuple[MegatronParam, ...]]] = {}


def use_params(provider: Callable[[ModelSpec, int], tuple[MegatronParam, ...]] | None) -> None:
    """Lay out the families the rules below do not name from ``provider`` (None: refuse them)."""
    from weightsync.layout.kinds.base import _memo_tables

    _PARAMS.pop("megatron", None)
    if provider is not None:
        _PARAMS["megatron"] = provider
    _memo_tables.cache_clear()


def derives(spec: ModelSpec) -> bool:
    """Whether the kind lays ``spec`` out from the rules :func:`use_params` installs (not its own)."""
    return spec.family not in _FAMILIES


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global layer numbers on ``stage``: as even as possible, remainder to early stages."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


@register_kind
@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronLayout(LayoutKind):
    """``megatron:tp=,pp=,dp=[,ep=,etp=,vocab_multiple=,grouped=]``."""

    kind = "megatron"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 0
    vocab_multiple: int = 128
    grouped: int = 0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp  # Megatron-core's default (see module docstring)

    def validate(self, spec: ModelSpec) -> None:
        if spec.family not in _FAMILIES and "megatron" not in _PARAMS:
            raise ValueError(f"megatron: the {spec.family} family's Megatron-core names come from mbridge and "
                             "megatron-core's layer specs: pip install 'weightsync[megatron]' and call "
                             "weightsync.sources.megatron_names.install() first (weightsync plan does); "
                             f"named without them: {sorted(_FAMILIES)}")
        if self._derived(spec):
            self._params(spec, 0)  # a family mbridge has no bridge for (gpt-oss) is refused here, by name
        if not spec.is_mla and spec.num_kv_heads % self.tp:
            raise ValueError(
                f"megatron: num_key_value_heads={spec.num_kv_heads} (query groups) is not "
                f"divisible by tp={self.tp}"
            )
        if spec.num_heads % self.tp:
            raise ValueError(f"megatron: num_attention_heads={spec.num_heads} is not divisible by tp={self.tp}")
        if spec.intermediate_size % self.tp:
            raise ValueError(f"megatron: intermediate_size={spec.intermediate_size} is not divisible by tp={self.tp}")
        if self.pp > spec.num_layers:
            raise ValueError(f"megatron: pp={self.pp} exceeds num_hidden_layers={spec.num_layers}")
        if spec.is_moe:
            if spec.num_experts % self.ep:
                raise ValueError(f"megatron: num_experts={spec.num_experts} is not divisible by ep={self.ep}")
            if (self.tp * self.dp) % (self.ep * self.expert_tp):
                raise ValueError(
                    f"megatron: ep={self.ep} x etp={self.expert_tp} must divide tp x dp = "
                    f"{self.tp * self.dp} (experts are placed on the tp x dp ranks of each stage)"
                )
            if spec.moe_intermediate_size % self.expert_tp:
                raise ValueError(
                    f"megatron: moe_intermediate_size={spec.moe_intermediate_size} is not "
                    f"divisible by etp={self.expert_tp}"
                )
        elif self.ep > 1:
            raise ValueError(f"megatron: ep={self.ep} needs an MoE model, {spec.family} has no experts")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp rank, dp rank, pp stage) of a global rank."""
        t = rank % self.tp
        d = (rank // self.tp) % self.dp
        p = rank // (self.tp * self.dp)
        return t, d, p

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        self.validate(spec)
        return self.piece_shards(spec, rank)

    def pieces(self, spec: ModelSpec, rank: int) -> list[Piece]:
        """The embedding (first stage; the last too with MTP layers), each layer's dense part and experts (MTP
        layers after the decoder's on the last stage), the head (last stage)."""
        t, d, p = self.coords(rank)
        last = p == self.pp - 1
        # megatron-core's MTP block (on the last stage) embeds on its own stage
        out = [Piece("embed", (t,))] if p == 0 or (last and spec.mtp_layers) else []
        i = t + self.tp * d  # index among the tp x dp ranks of this stage
        e_rank, ep_rank = i % self.expert_tp, (i // self.expert_tp) % self.ep
        layers = [(layer, f"decoder.layers.{local}.")
                  for local, layer in enumerate(stage_layers(spec.num_layers, self.pp, p))]
        if last:
            layers += [(spec.num_layers + j, f"mtp.layers.{j}.") for j in range(spec.mtp_layers)]
        for layer, prefix in layers:
            out.append(Piece("dense", (t,), layer, prefix))
            if spec.is_moe_layer(layer):
                out.append(Piece("experts", (ep_rank, e_rank), layer, prefix))
        if last:
            out.append(Piece("head", (t,)))
        return out

    def build_piece(self, spec: ModelSpec, piece: Piece) -> list[Shard]:
        what, args, layer = piece.what, piece.args, piece.layer
        padded = padded_size(spec.vocab_size, self.vocab_multiple * self.tp)
        if what == "embed":
            embed = spec.tensor("embed")
            return [vocab_parallel(embed, "embedding.word_embeddings.weight", tp=self.tp, rank=args[0],
                                   padded_rows=padded, dtype=self.local_dtype(embed))]
        if what == "dense":
            assert layer is not None
            return self._layer(spec, layer, piece.prefix, args[0])
        if what == "experts":
            assert layer is not None
            return self._experts(spec, layer, piece.prefix, args[0], args[1])
        norm = spec.tensor("final_norm")
        out = [replicated(norm, "decoder.final_layernorm.weight", self.local_dtype(norm))]
        if not spec.tie_word_embeddings or self.pp > 1:
            head = spec.tensor("lm_head")  # resolves to the embedding when tied
            out.append(vocab_parallel(head, "output_layer.weight", tp=self.tp, rank=args[0],
                                      padded_rows=padded, dtype=self.local_dtype(head)))
        return out

    def _derived(self, spec: ModelSpec) -> bool:
        return derives(spec)

    def _params(self, spec: ModelSpec, layer: int) -> tuple[MegatronParam, ...]:
        """The derived rules of ``layer``, asked once per kind of layer (its roles)."""
        cache = memo(self, spec, "params")
        key = spec.layer_roles(layer)
        if key not in cache:
            cache[key] = _PARAMS["megatron"](spec, layer)
        return cache[key]  # type: ignore[no-any-return]

    def _param_shard(self, spec: ModelSpec, layer: int, param: MegatronParam, name: str, *, parts: int,
                     index: int, expert: int | None = None) -> Shard:
        """Rank ``index`` of ``parts`` of ``param`` (of expert ``expert``), named ``name``."""
        tensors = [(spec.tensor(role, layer), lo, hi) for role, lo, hi in param.runs]
        first = tensors[0][0]
        dtype = "float32" if param.runs[0][0] in FLOAT32_ROLES else self.local_dtype(first)
        lead = 0 if expert is None else 1

        def box(tensor: CanonicalTensor, lo: int, hi: int) -> Box:
            """Rows ``[lo, hi)`` of the tensor (of the expert's slice of a stack)."""
            shape = tensor.shape[lead:]
            inner = Box((lo,) + (0,) * (len(shape) - 1), (hi - lo, *shape[1:]))
            return inner if expert is None else Box((expert, *inner.offsets), (1, *inner.sizes))

        if param.dim == 1:
            if len(tensors) != 1:
                raise ValueError(f"megatron: {name} fuses {len(tensors)} tensors and is cut along dim 1")
            tensor, lo, hi = tensors[0]
            a, b = even_bounds(tensor.shape[lead + 1], parts, what=f"dim 1 of {name}")[index]
            return concat_shard(name, dtype, [(tensor, _cols(box(tensor, lo, hi), lead, a, b))], dim=1,
                                drop_leading=lead)
        total = sum(hi - lo for _, lo, hi in tensors)
        held = [(0, total)]
        if param.dim == 0 and parts > 1:
            if total % (parts * param.stride):
                raise ValueError(f"megatron: {name} has {total} rows, not divisible by {parts} ranks x stride "
                                 f"{param.stride}")
            chunk = total // (parts * param.stride)
            held = [((j * parts + index) * chunk, (j * parts + index + 1) * chunk) for j in range(param.stride)]
        pieces = []
        for start, stop in held:
            cursor = 0
            for tensor, lo, hi in tensors:
                a, b = max(start, cursor), min(stop, cursor + hi - lo)
                if b > a:
                    pieces.append((tensor, box(tensor, lo + a - cursor, lo + b - cursor)))
                cursor += hi - lo
        return concat_shard(name, dtype, pieces, drop_leading=lead)

    def _layer(self, spec: ModelSpec, layer: int, prefix: str, t: int) -> list[Shard]:
        """The non-expert parameters of one layer on TP rank ``t``."""
        if self._derived(spec):
            return [self._param_shard(spec, layer, param, prefix + param.suffix, parts=self.tp, index=t)
                    for param in self._params(spec, layer) if not param.expert]
        roles = spec.layer_roles(layer)
        tensor = lambda role: spec.tensor(role, layer)  # noqa: E731
        dtype = self.local_dtype(tensor("q"))
        out: list[Shard] = []
        for role in roles:
            if role in _PLAIN_NAMES:
                out.append(replicated(tensor(role), prefix + _PLAIN_NAMES[role], dtype))
        out.append(concat_shard(prefix + "self_attention.linear_qkv.weight", dtype,
                                self._qkv_parts(spec, layer, t, "")))
        if spec.attention_bias:
            out.append(concat_shard(prefix + "self_attention.linear_qkv.bias", dtype,
                                    self._qkv_parts(spec, layer, t, "_bias")))
        out.append(split(tensor("o"), prefix + "self_attention.linear_proj.weight",
                         dim=1, parts=self.tp, index=t, dtype=dtype))
        if "o_bias" in roles:  # a RowParallelLinear's bias is whole on every rank
            out.append(replicated(tensor("o_bias"), prefix + "self_attention.linear_proj.bias", dtype))
        if not spec.is_moe_layer(layer):
            gate, up = tensor("gate"), tensor("up")
            lo, hi = even_bounds(gate.shape[0], self.tp, what="intermediate_size")[t]
            out.append(concat_shard(prefix + "mlp.linear_fc1.weight", dtype,
                                    [(gate, rows(gate, lo, hi)), (up, rows(up, lo, hi))]))
            out.append(split(tensor("down"), prefix + "mlp.linear_fc2.weight",
                             dim=1, parts=self.tp, index=t, dtype=dtype))
        return out

    def _qkv_parts(self, spec: ModelSpec, layer: int, t: int, suffix: str) -> list[Part]:
        q = spec.tensor("q" + suffix, layer)
        k = spec.tensor("k" + suffix, layer)
        v = spec.tensor("v" + suffix, layer)
        hd = spec.head_dim
        per_group = spec.num_heads // spec.num_kv_heads
        groups = spec.num_kv_heads // self.tp
        parts: list[Part] = []
        for g in range(t * groups, (t + 1) * groups):
            parts.append((q, rows(q, g * per_group * hd, (g + 1) * per_group * hd)))
            parts.append((k, rows(k, g * hd, (g + 1) * hd)))
            parts.append((v, rows(v, g * hd, (g + 1) * hd)))
        return parts

    def _experts(self, spec: ModelSpec, layer: int, prefix: str, ep_rank: int, e_rank: int) -> list[Shard]:
        """The local experts of EP rank ``ep_rank``, expert-TP rank ``e_rank``."""
        if self._derived(spec):
            return self._derived_experts(spec, layer, prefix, ep_rank, e_rank)
        gate = spec.tensor("expert_gate", layer)
        up = spec.tensor("expert_up", layer)
        down = spec.tensor("expert_down", layer)
        etp = self.expert_tp
        dtype = self.local_dtype(gate)
        local_experts = spec.num_experts // self.ep
        inter = spec.moe_intermediate_size
        lo, hi = even_bounds(inter, etp, what="moe_intermediate_size")[e_rank]
        h = spec.hidden_size
        out: list[Shard] = []
        for local in range(local_experts):
            e = ep_rank * local_experts + local
            fc1_parts: list[Part] = [
                (gate, Box((e, lo, 0), (1, hi - lo, h))),
                (up, Box((e, lo, 0), (1, hi - lo, h))),
            ]
            fc2_part: list[Part] = [(down, Box((e, 0, lo), (1, h, hi - lo)))]
            if self.grouped:
                fc1_name = f"{prefix}mlp.experts.linear_fc1.weight{local}"
                fc2_name = f"{prefix}mlp.experts.linear_fc2.weight{local}"
            else:
                fc1_name = f"{prefix}mlp.experts.local_experts.{local}.linear_fc1.weight"
                fc2_name = f"{prefix}mlp.experts.local_experts.{local}.linear_fc2.weight"
            out.append(concat_shard(fc1_name, dtype, fc1_parts, dim=0, drop_leading=1))
            out.append(concat_shard(fc2_name, dtype, fc2_part, dim=1, drop_leading=1))
        return out

    def _derived_experts(self, spec: ModelSpec, layer: int, prefix: str, ep_rank: int, e_rank: int) -> list[Shard]:
        local_experts = spec.num_experts // self.ep
        out = []
        for local in range(local_experts):
            expert = ep_rank * local_experts + local
            if spec.family_info.experts == "whole":
                lo, hi = even_bounds(spec.moe_intermediate_size, self.expert_tp, what="moe_intermediate_size")[e_rank]
                for suffix in WHOLE_EXPERT_PARAMS:
                    name = (f"{prefix}mlp.experts.{suffix}{local}" if self.grouped
                            else f"{prefix}mlp.experts.local_experts.{local}.{suffix}")
                    out.append(whole_expert_shard(spec, layer, suffix, expert, (lo, hi), name=name,
                                                  dtype=self.local_dtype(spec.tensor("experts_gate_up", layer))))
                continue
            for param in self._params(spec, layer):
                if param.expert:
                    head, _, tail = param.suffix.rpartition("experts.")
                    name = (f"{prefix}{head}experts.{tail}{local}" if self.grouped
                            else f"{prefix}{head}experts.local_experts.{local}.{tail}")
                    out.append(self._param_shard(spec, layer, param, name, parts=self.expert_tp, index=e_rank,
                                                 expert=expert))
        return out


#: A gpt-oss expert's parameters in megatron-core (``SequentialMLP`` with ``add_bias_linear``).
WHOLE_EXPERT_PARAMS = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")


def whole_expert_shard(spec: ModelSpec, layer: int, suffix: str, expert: int, rows: tuple[int, int], *, name: str,
                       dtype: str) -> Shard:
    """What a megatron-core rank holding intermediate rows ``rows = [lo, hi)`` of gpt-oss expert ``expert`` sends for
    its parameter ``suffix`` (one of :data:`WHOLE_EXPERT_PARAMS`).

    ``linear_fc2`` (``[H, w]`` and its ``[H]`` bias) is the checkpoint's ``down_proj[e]`` (``[I, H]``)
    transposed, a plain strided region. ``linear_fc1`` is ``[gate_r; up_r]`` rows (``[2w, H]``), while the
    checkpoint's ``gate_up_proj[e]`` (``[H, 2I]``) interleaves gate and up columns: a step-2 selection no
    region expresses. So the source sends a *staged* copy of it, ``[H, 2w]`` (its bias ``[2w]``) with the
    columns interleaved as in the checkpoint (:func:`weightsync.sources.megatron.stage_fc1`), which is
    columns ``[2 lo, 2 hi)`` of the expert's slice, one contiguous region.
    """
    lo, hi = rows
    w, h = hi - lo, spec.hidden_size
    box: Box
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    if suffix == "linear_fc1.weight":
        tensor, box, shape, strides = "experts_gate_up", Box((expert, 0, 2 * lo), (1, h, 2 * w)), (h, 2 * w), (2 * w, 1)
    elif suffix == "linear_fc1.bias":
        tensor, box, shape, strides = "experts_gate_up_bias", Box((expert, 2 * lo), (1, 2 * w)), (2 * w,), (1,)
    elif suffix == "linear_fc2.weight":
        tensor, box, shape, strides = "experts_down", Box((expert, lo, 0), (1, w, h)), (h, w), (1, w)
    elif suffix == "linear_fc2.bias":
        tensor, box, shape, strides = "experts_down_bias", Box((expert, 0), (1, h)), (h,), (1,)
    else:
        raise ValueError(f"megatron: {name} is no parameter of a gpt-oss expert (expected {WHOLE_EXPERT_PARAMS})")
    return Shard(name, shape, dtype, (Region(spec.tensor(tensor, layer).name, box, 0, (0, *strides)),))


def _cols(box: Box, lead: int, lo: int, hi: int) -> Box:
    """Columns ``[lo, hi)`` (dim 1 after ``lead`` leading dims) of ``box``."""
    d = lead + 1
    offsets, sizes = list(box.offsets), list(box.sizes)
    offsets[d] += lo
    sizes[d] = hi - lo
    return Box(tuple(offsets), tuple(sizes))
