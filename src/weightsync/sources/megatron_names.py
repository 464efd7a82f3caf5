"""Megatron-core parameters as Hugging Face canonical parts, asked of mbridge and megatron-core.

Two libraries already know how a Megatron-core GPT model lays out a Hugging Face checkpoint,
so weightsync keeps no table of its own:

* **mbridge** (``pip install mbridge``; the bridge verl uses) maps each Megatron-core parameter
  of the families it supports to its checkpoint tensors, and fuses them as Megatron does
  (``linear_qkv`` = ``[q_g; k_g; v_g]`` per query group, ``linear_fc1`` = ``[gate; up]``).
  :meth:`MegatronNames.resolve` asks its name mapping; :meth:`MegatronNames.parts` runs its own
  HF -> Megatron conversion on *probes*, one-column tensors whose values are row numbers, and
  reads back where each row went. Its TP split is read the same way (:meth:`MegatronNames.split_rows`).
* **megatron-core**'s layer specs say which modules a layer builds, and which of them tensor
  parallelism cuts by rows (``ColumnParallelLinear``) or columns (``RowParallelLinear``):
  :func:`layer_params` walks them. A live model says the same with partition attributes,
  which :class:`~weightsync.sources.megatron.MegatronSource` reads.

mbridge names Transformer Engine modules, where a norm is fused into the linear after it
(``self_attention.linear_q_up_proj.layer_norm_weight``); megatron-core's local spec, which runs
without Transformer Engine, keeps it a module (``self_attention.q_layernorm.weight``). megatron-core
relates the two itself (the state-dict hook that loads TE checkpoints into its local-norm spec,
``post_training/modelopt/gpt/state_dict_hooks.py``), so a name mbridge does not know is asked
again under its TE name.

Names are global: ``decoder.layers.{L}.`` with the global layer, experts as mbridge (and
``TEGroupedMLP``) name them, ``mlp.experts.linear_fc1.weight{e}`` with the global expert, and
MTP layers as ``mtp.layers.{i}.``, layer ``num_hidden_layers + i`` of the checkpoint (mbridge's
convention: its GLM-4.5 bridge maps ``enorm``/``hnorm``/``eh_proj``/``final_layernorm`` and the
``transformer_layer`` is that decoder layer's).

    names = MegatronNames.of(spec)
    names.parts("decoder.layers.3.self_attention.linear_kv_up_proj.weight")  # ParamParts of kv_b_proj
    install()  # the ``megatron`` layout kind lays out the families its tables do not know from these

gpt-oss, which mbridge lacks, is its Qwen2-MoE bridge with four names of its own
(:func:`_gpt_oss_bridge`); its whole experts are laid out by
:func:`~weightsync.layout.kinds.megatron.whole_expert_shard` (see docs/models.md, "Megatron").

Version notes (mbridge 0.15.1, the release on the package index): its bridges build a
megatron-core ``TransformerConfig`` in their constructor, which fails with megatron-core 0.16
(DeepSeek-V3's passes ``max_position_embeddings``) and transformers 5 (``rope_theta`` moved into
``rope_parameters``); the mapping and conversion methods used here need only the attributes
:func:`_bridge` sets. Its DeepSeek-V3 MTP mapping is written for 61 layers; the GLM-4.5 one,
used here for every family, is not.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from weightsync.layout import Box, CanonicalTensor, ModelSpec
from weightsync.layout.kinds.megatron import MegatronParam
from weightsync.layout.params import ParamParts

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"(.+\.experts\.)(\d+)(\..+)")
#: Parameter names a megatron-core module may hold (the router's load-balancing bias is a buffer;
#: ``softmax_offset``: gpt-oss's attention sinks, ``DotProductAttention`` with ``softmax_type="learnable"``).
_ATTRS = ("weight", "bias", "expert_bias", "softmax_offset")
#: The roles of gpt-oss's whole experts, which ``layout.kinds.megatron.whole_expert_shard`` lays out.
_WHOLE_EXPERT_ROLES = ("experts_gate_up", "experts_gate_up_bias", "experts_down", "experts_down_bias")
#: megatron-core modules whose attribute differs from their spec field: the MTP layer builds its
#: ``layer_norm`` spec as ``final_layernorm`` (``MultiTokenPredictionLayer.__init__``).
_ATTR_OF_FIELD = {"layer_norm": "final_layernorm"}

#: A probe row, resolved: (index of the HF tensor among the parameter's, row of that tensor).
Rows = tuple[tuple[int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A Megatron parameter as mbridge names it: its TE name and its canonical tensors in order."""

    te_name: str
    tensors: tuple[CanonicalTensor, ...]
    #: the expert each tensor's box takes from its stack (None: a whole tensor)
    experts: tuple[int | None, ...]
    roles: tuple[str, ...]


class MegatronNames:
    """mbridge's view of one model: Megatron parameter name -> canonical parts.

    Raises:
        ValueError: mbridge has no bridge for the family. gpt-oss, which mbridge 0.15.1 lacks, is
            mbridge's Qwen2-MoE bridge plus its few own names (:func:`_gpt_oss_bridge`).
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.bridge = _bridge(spec)
        self._aliases = _te_aliases(self.bridge)
        self._mtp = _mtp_table()
        self._rows: dict[tuple[str, tuple[tuple[int, ...], ...]], Rows] = {}
        self._canonical = spec.canonical_tensors()
        self._roles = spec.roles()

    @classmethod
    def of(cls, spec: ModelSpec) -> MegatronNames:
        cached = spec._cache.get("megatron_names")
        if cached is None:
            cached = spec._cache["megatron_names"] = cls(spec)
        return cached  # type: ignore[no-any-return]

    def resolve(self, name: str) -> Resolved | None:
        """The canonical tensors of global Megatron parameter ``name``; None when mbridge maps it to none."""
        mtp = _MTP.fullmatch(name)
        if mtp is not None:
            layer, rest = self.spec.num_layers + int(mtp[1]), mtp[2]
            if not rest.startswith("transformer_layer."):
                templates = self._mtp.get(rest)
                return None if templates is None else self._found(name, [t.format(layer_number=layer)
                                                                          for t in templates])
            name = f"decoder.layers.{layer}.{rest.removeprefix('transformer_layer.')}"
        for candidate in (name, *(name.replace(local, te) for local, te in self._aliases if name.endswith(local))):
            try:
                hf = self.bridge._weight_name_mapping_mcore_to_hf(candidate)
            except (NotImplementedError, AssertionError, KeyError, IndexError, ValueError):
                continue
            found = self._found(candidate, hf)
            if found is not None:
                return found
        return None

    def _found(self, te_name: str, hf_names: list[str]) -> Resolved | None:
        tensors, experts, roles = [], [], []
        for hf in hf_names:
            expert: int | None = None
            tensor = self._canonical.get(hf)
            if tensor is None and hf == "lm_head.weight" and self.spec.tie_word_embeddings:
                tensor = self.spec.tensor("embed")  # the output layer of a tied model is the embedding
            if tensor is None and (m := _HF_EXPERT.fullmatch(hf)) is not None:
                tensor, expert = self._canonical.get(f"{m[1]}*{m[3]}"), int(m[2])
            if tensor is None:
                return None
            tensors.append(tensor)
            experts.append(expert)
            roles.append(self._roles[tensor.name][0])
        return Resolved(te_name, tuple(tensors), tuple(experts), tuple(roles)) if tensors else None

    def parts(self, name: str) -> ParamParts | None:
        """Global Megatron parameter ``name`` unsharded, as canonical boxes; None when unknown."""
        found = self.resolve(name)
        if found is None:
            return None
        lead = 1 if found.experts[0] is not None else 0
        pieces = []
        for index, lo, hi in self.fused_rows(found):
            tensor, expert = found.tensors[index], found.experts[index]
            shape = tensor.shape[lead:]
            box = Box((lo,) + (0,) * (len(shape) - 1), (hi - lo, *shape[1:]))
            if expert is not None:
                box = Box((expert, *box.offsets), (1, *box.sizes))
            pieces.append((tensor, box))
        role = found.roles[0] if len(set(found.roles)) == 1 else "+".join(found.roles)
        return ParamParts.concat(pieces, drop_leading=lead, role=role)

    def fused_rows(self, found: Resolved) -> Rows:
        """Runs ``(tensor index, first row, end row)`` of the fused parameter, in its row order:
        mbridge's HF -> Megatron conversion run on probes of the tensors' row numbers."""
        lead = 1 if found.experts[0] is not None else 0
        shapes = tuple(t.shape[lead:] for t in found.tensors)
        key = (_template(found.te_name), shapes)
        rows = self._rows.get(key)
        if rows is None:
            probes, offsets = _probes(shapes)
            fused = self.bridge._weight_to_mcore_format(found.te_name, probes)
            rows = self._rows[key] = _decode(fused, offsets, shapes, found.te_name)
        return rows

    def split_rows(self, found: Resolved, tp: int) -> list[list[int]]:
        """The fused rows each of ``tp`` ranks holds under mbridge's own TP split (row-cut parameters)."""
        lead = 1 if found.experts[0] is not None else 0
        rows = sum(t.shape[lead] for t in found.tensors)
        whole = torch.arange(rows, dtype=torch.float64).reshape(rows, 1)
        local = torch.empty(rows // tp, 1, dtype=torch.float64)
        split = self.bridge._weight_split_across_tp(found.te_name, whole, local, tp)
        return [[int(x) for x in part.flatten()] for part in split]


def _template(name: str) -> str:
    """A name with its layer and expert numbers taken out (mbridge fuses by name, not by number)."""
    return re.sub(r"weight\d+$", "weight", re.sub(r"layers\.\d+\.", "layers.L.", name))


def _probes(shapes: tuple[tuple[int, ...], ...]) -> tuple[list[torch.Tensor], list[int]]:
    """One probe per tensor: its row numbers, offset so that every tensor's are distinct."""
    probes, offsets, start = [], [], 0
    for shape in shapes:
        column = torch.arange(start, start + shape[0], dtype=torch.float64)
        probes.append(column if len(shape) == 1 else column.reshape(shape[0], 1))
        offsets.append(start)
        start += shape[0]
    return probes, offsets


def _decode(fused: torch.Tensor, offsets: list[int], shapes: tuple[tuple[int, ...], ...], name: str) -> Rows:
    values = fused.flatten().to(torch.int64)
    total = sum(s[0] for s in shapes)
    if values.numel() != total or not torch.equal(values.sort().values, torch.arange(total)):
        raise ValueError(f"mbridge's conversion of {name} does not hold each row of its tensors once "
                         "(it does more than fuse whole rows): weightsync cannot lay it out")
    index = torch.searchsorted(torch.tensor(offsets), values, right=True) - 1
    row = values - torch.tensor(offsets)[index]
    breaks = torch.nonzero((index[1:] != index[:-1]) | (row[1:] != row[:-1] + 1)).flatten() + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), total]
    return tuple((int(index[a]), int(row[a]), int(row[a]) + b - a) for a, b in zip(starts, ends, strict=True))


#: What gpt-oss adds to mbridge's Qwen2-MoE bridge (q/k/v biases, a router, experts), by the names of
#: megatron-core's own modules (``DotProductAttention.softmax_offset``, ``TopKRouter.bias``,
#: ``RowParallelLinear.bias``): the only gpt-oss names written here. Its experts are not in the table:
#: the checkpoint holds them whole, interleaved (``weightsync.layout.kinds.megatron.whole_expert_shard``).
_GPT_OSS_ATTENTION = {
    "self_attention.linear_proj.bias": ["model.layers.{layer_number}.self_attn.o_proj.bias"],
    "self_attention.core_attention.softmax_offset": ["model.layers.{layer_number}.self_attn.sinks"],
}
_GPT_OSS_MLP = {
    "mlp.router.weight": ["model.layers.{layer_number}.mlp.router.weight"],
    "mlp.router.bias": ["model.layers.{layer_number}.mlp.router.bias"],
}


def _gpt_oss_bridge() -> Any:
    """mbridge's Qwen2-MoE bridge (its q/k/v fusion with biases, norms, embedding and head) with the
    gpt-oss names of :data:`_GPT_OSS_ATTENTION` and :data:`_GPT_OSS_MLP` in place of its MLP table.

    mbridge 0.15.1 has no gpt-oss bridge, and megatron-bridge's is not installable beside
    transformers 5 without Transformer Engine; the attention, norms and router of gpt-oss are
    Qwen2-MoE's, so only what differs is named."""
    from mbridge.models.qwen2moe import Qwen2MoEBridge

    mlp = {k: v for k, v in Qwen2MoEBridge._MLP_MAPPING.items() if k == "pre_mlp_layernorm"}
    return type("GptOssBridge", (Qwen2MoEBridge,), {
        "_ATTENTION_MAPPING": {**Qwen2MoEBridge._ATTENTION_MAPPING, **_GPT_OSS_ATTENTION},
        "_MLP_MAPPING": {**mlp, **_GPT_OSS_MLP},
    })


def _bridge(spec: ModelSpec) -> Any:
    """The mbridge bridge of ``spec``'s family, holding what its mapping and conversion methods read
    (see the module docstring for why its constructor is not run)."""
    try:
        import mbridge.models  # noqa: F401  (registers the bridges)
        from mbridge.core.bridge import _MODEL_REGISTRY
    except ImportError as exc:
        raise ValueError(f"Megatron parameter names come from mbridge, which is not installed ({exc}): "
                         "pip install 'weightsync[megatron]'") from exc
    cls = _gpt_oss_bridge() if spec.family == "gpt_oss" else _MODEL_REGISTRY.get(spec.family)
    if cls is None:
        raise ValueError(f"mbridge has no bridge for the {spec.family} family (it has: {sorted(_MODEL_REGISTRY)}), "
                         "so weightsync cannot name its Megatron-core parameters")
    bridge = cls.__new__(cls)
    # hidden_size 1: the qkv fusion reshapes to [-1, hidden_size], and the probes are one column wide
    bridge.hf_config = SimpleNamespace(num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                                       head_dim=spec.head_dim, hidden_size=1,
                                       tie_word_embeddings=spec.tie_word_embeddings)
    bridge.config = SimpleNamespace(num_layers=spec.num_layers, mtp_num_layers=spec.mtp_layers or None,
                                    num_moe_experts=spec.num_experts or None, gated_linear_unit=True)
    bridge.mpu = SimpleNamespace(tp_size=1, etp_size=1, ep_size=1, pp_size=1)
    bridge.dtype = None
    bridge.extra_args = {}
    bridge.make_vocab_size_divisible_by = None
    bridge.vocab_size = bridge.padded_vocab_size = None
    return bridge


def _mtp_table() -> Mapping[str, list[str]]:
    """mbridge's names of an MTP layer's own tensors (its GLM-4.5 bridge's, which any layer count fits)."""
    from mbridge.models.glm4moe import GLM4MoEBridge

    return dict(GLM4MoEBridge._MTP_MAPPING)


def _te_aliases(bridge: Any) -> tuple[tuple[str, str], ...]:
    """(local-spec name suffix, TE name suffix) pairs for the TE names in ``bridge``'s tables,
    as megatron-core's own TE -> local state-dict hook renames them."""
    from megatron.core.post_training.modelopt.gpt.state_dict_hooks import mcore_gpt_load_te_state_dict_pre_hook

    keys = [k for table in ("_ATTENTION_MAPPING", "_MLP_MAPPING", "_OTHER_MAPPING")
            for k in getattr(bridge, table, {})]
    state = {f"x.{k}": k for k in keys}
    mcore_gpt_load_te_state_dict_pre_hook(state, "", {}, True, [], [], [])
    return tuple((local[2:], te) for local, te in state.items() if local[2:] != te)


# -- the layout kind's view: which parameters a layer has, from megatron-core's layer specs ------------

def _leaves(node: Any, path: str = "") -> Iterator[tuple[str, type]]:
    """(module path, class) of every leaf module a megatron-core spec builds."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(node, ModuleSpec):
        if node.submodules is None:
            yield path.rstrip("."), node.module
            return
        for field in dataclasses.fields(node.submodules):
            child = getattr(node.submodules, field.name)
            if child is not None and not isinstance(child, dict):
                yield from _leaves(child, f"{path}{_ATTR_OF_FIELD.get(field.name, field.name)}.")
    elif isinstance(node, type):
        yield path.rstrip("."), node


def _layer_spec(spec: ModelSpec, layer: int) -> Any:
    """megatron-core's local spec of decoder layer ``layer`` (an MTP layer's: its MTP spec)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.multi_token_prediction import get_mtp_layer_spec_for_backend

    decoder = get_gpt_layer_local_spec(num_experts=spec.num_experts if spec.is_moe_layer(layer) else None,
                                       qk_layernorm=bool(spec.is_mla or spec.qk_norm),
                                       multi_latent_attention=spec.is_mla, normalization="RMSNorm")
    if spec.is_mtp_layer(layer):
        return get_mtp_layer_spec_for_backend(transformer_layer_spec=decoder, backend=LocalSpecProvider())
    return decoder


def _split_dim(cls: type, attr: str) -> int | None:
    """The dimension tensor parallelism cuts a megatron-core module's parameter ``attr`` along (None: whole).

    A ``RowParallelLinear``'s bias is added after the all-reduce, whole on every rank; the attention
    sinks (``softmax_offset``) are ``num_attention_heads_per_partition`` long (``DotProductAttention``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if issubclass(cls, ColumnParallelLinear) or attr == "softmax_offset":
        return 0
    if issubclass(cls, RowParallelLinear) and attr != "bias":
        return 1
    return None


def layer_params(spec: ModelSpec, layer: int) -> tuple[MegatronParam, ...]:
    """Every parameter megatron-core's local spec gives layer ``layer`` (MTP layers too), named as
    in the layer (``self_attention.linear_q_down_proj.weight``, ``enorm.weight``,
    ``mlp.experts.linear_fc1.weight`` for every expert), with its canonical parts from mbridge.

    Raises:
        ValueError: a canonical tensor of the layer that no parameter holds (the derivation missed it).
    """
    names = MegatronNames.of(spec)
    prefix = (f"mtp.layers.{layer - spec.num_layers}." if spec.is_mtp_layer(layer) else f"decoder.layers.{layer}.")
    out: list[MegatronParam] = []
    covered: set[str] = set()
    whole = spec.family_info.experts == "whole"
    for path, cls in _leaves(_layer_spec(spec, layer)):
        expert = ".experts." in f".{path}." and ".shared_experts." not in f".{path}."
        if expert and whole:
            continue  # the kind lays gpt-oss's experts out itself (whole_expert_shard)
        held: set[str] = set()
        for attr in _ATTRS:
            found = names.resolve(f"{prefix}{path}.{attr}" + ("0" if expert else ""))
            # mbridge matches names by substring, so a norm's ``bias`` finds the norm's weight: a name
            # whose tensors another parameter of the module holds is no parameter of its own
            if found is None or set(found.roles) <= held:
                continue
            if covered & set(found.roles):
                raise ValueError(f"megatron: {prefix}{path}.{attr} and another parameter both hold "
                                 f"{sorted(covered & set(found.roles))} (mbridge maps both)")
            dim = _split_dim(cls, attr)
            stride = _stride(names, found) if dim == 0 else 1
            runs = tuple((found.roles[i], lo, hi) for i, lo, hi in names.fused_rows(found))
            out.append(MegatronParam(f"{path}.{attr}", runs, dim, stride, expert))
            held.update(found.roles)
            covered.update(found.roles)
    missing = [role for role in spec.layer_roles(layer) if role not in covered
               and not (whole and role in _WHOLE_EXPERT_ROLES)]
    if missing:
        raise ValueError(f"megatron: no parameter of megatron-core's layer spec maps to {missing} of layer {layer} "
                         f"of the {spec.family} model (mbridge and megatron-core disagree with the config)")
    return tuple(out)


def _stride(names: MegatronNames, found: Resolved) -> int:
    """How many separate row runs each TP rank holds under mbridge's split (2: ``[gate_r; up_r]``)."""
    rows = sum(t.shape[1 if found.experts[0] is not None else 0] for t in found.tensors)
    if rows % 2:
        return 1  # an odd number of rows cannot be cut in two (the kind refuses such a split by name)
    first = names.split_rows(found, 2)[0]
    return 1 + sum(1 for a, b in zip(first, first[1:], strict=False) if b != a + 1)


def install() -> None:
    """Make the ``megatron`` layout kind lay out the families its own rules do not name
    (DeepSeek-V3/Kimi-K2, GLM-4.5, gpt-oss) from :func:`layer_params`."""
    from weightsync.layout.kinds import megatron as kind

    kind.use_params(layer_params)
