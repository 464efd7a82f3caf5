"""What weightsync reads of a vLLM engine's model: its canonical spec, its quantization, which
parameters a transport may write in place, and which models it refuses (:func:`check_supported`).

Everything here reads vLLM 0.32's config and parameter attributes; ``vllm`` is imported lazily.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.layout import ModelSpec, RankLayout
from weightsync.layout.models import named_layout, prefixed
from weightsync.tools.torch_layout import dtype_name

if TYPE_CHECKING:
    from weightsync.engines.staging import StagedWeights

logger = logging.getLogger(__name__)

#: speculative methods that draft without weights of their own (nothing to sync)
WEIGHTLESS_DRAFTING = frozenset({"ngram", "ngram_gpu", "suffix"})

def spec_of(vllm_config: Any, *, mtp: bool = False) -> ModelSpec:
    """The canonical model of a vLLM engine, read from the Hugging Face config vLLM loaded.

    The MTP layers are part of it only with ``mtp`` (the caller reloads the MTP drafter: see
    :func:`runs_mtp`); otherwise the engine never reads them, and staging them would be waste.
    """
    spec = ModelSpec.from_hf_config(vllm_config.model_config.hf_config.to_dict())
    return spec if mtp else spec.without_mtp()


def runs_mtp(vllm_config: Any) -> bool:
    """Whether the engine drafts with the model's own MTP layers (``speculative_config`` method ``mtp``)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    return speculative is not None and "mtp" in str(getattr(speculative, "method", "") or "")


#: The prefix of a separate drafter's tensors in a job that syncs it (``VLLMEngine(llm, drafter=True)``):
#: the draft model's own checkpoint names under it (``weightsync.layout.models``).
DRAFT_PREFIX = "draft."


def drafts_separately(vllm_config: Any) -> bool:
    """Whether the engine drafts with a model of its own (an EAGLE head, a draft model), whose
    weights are not the target's."""
    speculative = getattr(vllm_config, "speculative_config", None)
    method = str(getattr(speculative, "method", "") or "") if speculative is not None else ""
    return bool(method) and not runs_mtp(vllm_config) and method not in WEIGHTLESS_DRAFTING


def drafter_checkpoint(vllm_config: Any) -> dict[str, tuple[int, ...]]:
    """The separate drafter's checkpoint tensors (name -> shape), read from the safetensors headers
    of the directory vLLM loaded it from: the names its loader takes, so the names a trainer of the
    draft sends (under :data:`DRAFT_PREFIX`).

    Raises:
        ValueError: the engine has no separate drafter, or its checkpoint is not a local directory of
            safetensors files (a hub id: pass the downloaded directory to vLLM).
    """
    import glob
    import os

    from safetensors import safe_open

    if not drafts_separately(vllm_config):
        raise ValueError("the engine has no drafter of its own to sync (speculative_config with an EAGLE head or a "
                         "draft model)")
    speculative = vllm_config.speculative_config
    path = str(getattr(getattr(speculative, "draft_model_config", None), "model", "") or speculative.model)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"the drafter's checkpoint {path!r} is not a directory of safetensors files: weightsync reads "
                         "the drafter's tensor names from there (download it and give vLLM the directory)")
    tensors: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = tuple(int(d) for d in f.get_slice(name).get_shape())
    return tensors


def drafter_layout(vllm_config: Any, rank: int) -> RankLayout:
    """The separate drafter as staged beside the target: its checkpoint's tensors, whole, in the
    engine's dtype, under :data:`DRAFT_PREFIX` (the job's second model)."""
    dtype = dtype_name(vllm_config.model_config.dtype)
    tensors = {name: (shape, dtype) for name, shape in drafter_checkpoint(vllm_config).items()}
    return prefixed(named_layout(tensors, rank), DRAFT_PREFIX)


def separate_drafter(vllm_config: Any) -> str | None:
    """What an engine that drafts with weights other than the model's own MTP layers is told
    (an EAGLE head, a draft model, Medusa heads), or None.

    Those weights are a model of their own, which an RL run does not always train: unless the
    engine syncs the drafter (``VLLMEngine(llm, drafter=True)``), weightsync syncs the target only
    and the drafter keeps the weights it started with. Speculative decoding stays lossless (the
    target verifies every drafted token); only the share of drafted tokens it accepts may fall as
    the policy moves away from the drafter, so this is said once, when the engine is set up,
    rather than left for the user to find out.
    """
    if not drafts_separately(vllm_config):
        return None
    speculative = vllm_config.speculative_config
    draft_config = getattr(speculative, "draft_model_config", None)
    draft = getattr(draft_config, "model", None) or getattr(speculative, "model", "")
    return (f"the engine drafts with {speculative.method}{f' ({draft})' if draft else ''}: weightsync syncs the target "
            "model only, and the drafter keeps the weights it was started with (decoding stays lossless; the share of "
            "drafted tokens accepted may fall as the policy moves). To sync the drafter too, as a second model of the "
            f"job under {DRAFT_PREFIX!r}: VLLMEngine(llm, drafter=True), or drafter=True in the weightsync backend's "
            "init info (docs/models.md, \"Draft models\")")


def draft_model(model_runner: Any) -> torch.nn.Module | None:
    """The drafter's model of a worker's model runner, MTP or separate (vLLM 0.32:
    ``model_runner.drafter.model``)."""
    return getattr(getattr(model_runner, "drafter", None), "model", None)


#: Weight loaders that copy a checkpoint tensor into the parameter as it is (vLLM's own list
#: for ``nccl_m2n``'s direct loads, ``distributed/weight_transfer/m2n_layout.py``).
PLAIN_LOADERS = frozenset({"", "default_weight_loader", "ReplicatedLinear.weight_loader",
                           "ColumnParallelLinear.weight_loader", "ColumnParallelLinear.weight_loader_v2",
                           "RowParallelLinear.weight_loader", "RowParallelLinear.weight_loader_v2"})
#: Parameter attributes that mean the stored tensor is not the checkpoint's layout.
REPACKED_ATTRS = ("packed_dim", "packed_factor", "marlin_tile_size", "needs_scalar_to_array", "is_sharded_weight",
                  "is_transposed")


@dataclass(frozen=True, slots=True)
class ParamFacts:
    """What decides whether a vLLM parameter can be received in place (see :func:`in_place_names`)."""

    name: str  # the parameter's name in the model
    shape: tuple[int, ...]
    dtype: str
    contiguous: bool
    loader: str  # the weight loader's qualified name ("" when the parameter has none)
    repacked: bool  # carries one of REPACKED_ATTRS


def in_place_names(params: Iterable[ParamFacts], checkpoint: Mapping[str, tuple[tuple[int, ...], str]], *,
                   quantized: bool) -> list[str]:
    """Checkpoint tensors a vLLM model can take straight into its parameters, with no staging.

    A parameter qualifies when its name, shape and dtype are the checkpoint tensor's, it is
    contiguous, its loader copies as is (:data:`PLAIN_LOADERS`) and nothing repacks it; and
    only when every parameter of its module qualifies: vLLM's layerwise reload rebuilds a
    module as a unit, so a module fed through the reload would overwrite an in-place write
    into a sibling. Quantized models process every linear weight: none qualifies. On CPU,
    vLLM empties linear weights into oneDNN handles (shape ``[0]``), so what remains is the
    norms; on GPU it is also ``o_proj``, ``down_proj`` and the like.
    """
    if quantized:
        return []
    by_module: dict[str, list[tuple[str, bool]]] = {}
    for p in params:
        want = checkpoint.get(p.name)
        ok = (want is not None and want == (p.shape, p.dtype) and p.contiguous and p.loader in PLAIN_LOADERS
              and not p.repacked)
        by_module.setdefault(p.name.rpartition(".")[0], []).append((p.name, ok))
    return sorted(name for members in by_module.values() if all(ok for _, ok in members) for name, _ in members)


def param_facts(model: torch.nn.Module) -> list[ParamFacts]:
    """:class:`ParamFacts` of every parameter of a live vLLM model."""
    out = []
    for name, param in model.named_parameters():
        loader = getattr(param, "weight_loader", None)
        qualname = "" if loader is None else getattr(loader, "__qualname__", "<opaque>")
        out.append(ParamFacts(name, tuple(param.shape), dtype_name(param.dtype), param.is_contiguous(), qualname,
                              any(hasattr(param, a) for a in REPACKED_ATTRS)))
    return out


def in_place_targets(model: torch.nn.Module, engine: StagedWeights, *, quantized: bool) -> dict[str, torch.Tensor]:
    """The parameters ``engine`` receives in place (:func:`in_place_names`), by checkpoint name."""
    checkpoint = {s.name: (s.shape, s.dtype) for s in engine.layout().shards}
    names = set(in_place_names(param_facts(model), checkpoint, quantized=quantized))
    return {name: param.data for name, param in model.named_parameters() if name in names}


def staging_quant(vllm_config: Any) -> str | None:
    """The FP8 scheme the engine's checkpoint uses (staged and sent as FP8), None if unquantized."""
    config = getattr(vllm_config.model_config.hf_config, "quantization_config", None)
    if config is None and vllm_config.model_config.quantization is None:
        return None
    return quant_scheme(config or {"quant_method": vllm_config.model_config.quantization})


def quant_scheme(config: Mapping[str, Any]) -> str:
    """weightsync's FP8 scheme for a checkpoint's ``quantization_config``; anything else is refused.

    Two formats are served: DeepSeek-V3 style blocks (``quant_method: fp8``,
    ``weight_block_size: [128, 128]``) and compressed-tensors per-channel FP8 weights
    (``strategy: channel``, 8-bit float, static). Both must quantize exactly the tensors
    weightsync quantizes (every linear weight but ``lm_head``; routers and norms stay).
    """
    method = config.get("quant_method")
    if method == "fp8":
        if list(config.get("weight_block_size") or []) != [128, 128]:
            raise ValueError(f"FP8 checkpoints with weight_block_size={config.get('weight_block_size')} are not "
                             "supported: weightsync sends 128x128 blocks (fp8_block) or per-channel scales")
        skipped = config.get("modules_to_not_convert") or config.get("ignored_layers") or []
        scheme = "fp8_block"
    elif method == "compressed-tensors":
        groups = list((config.get("config_groups") or {}).values())
        weights = groups[0].get("weights") or {} if len(groups) == 1 else {}
        if not (weights.get("num_bits") == 8 and weights.get("type") == "float" and weights.get("strategy") == "channel"
                and weights.get("symmetric", True) and not weights.get("dynamic", False)):
            raise ValueError("of compressed-tensors checkpoints weightsync serves FP8 weights with per-channel static "
                             f"scales (FP8_DYNAMIC); this one has config_groups {config.get('config_groups')}")
        skipped = config.get("ignore") or []
        scheme = "fp8_channel"
    else:
        raise ValueError(f"quantized models ({method}) are not supported: weightsync stages unquantized "
                         "checkpoints, fp8 block (weight_block_size [128, 128]) or compressed-tensors per-channel FP8")
    unexpected = [m for m in skipped if m.split(".")[-1] not in ("lm_head", "gate")]
    if unexpected:
        raise ValueError(f"the checkpoint leaves {unexpected[:4]} unquantized; weightsync quantizes every linear "
                         "weight but lm_head and the MoE routers")
    return scheme


def check_supported(vllm_config: Any, *, drafter: bool = False) -> None:
    """Reject engine configurations whose reload path this adapter has not been built for
    (``drafter``: the engine syncs its separate drafter too)."""
    from weightsync.engines.vllm_parallel import check_parallel

    check_parallel(vllm_config)
    staging_quant(vllm_config)
    if drafter:
        drafter_checkpoint(vllm_config)  # refuses an engine without one, naming why
        if int(vllm_config.parallel_config.tensor_parallel_size) > 1:
            raise ValueError("syncing a separate drafter needs an engine of one TP worker: the drafter's tensors are "
                             "staged whole, and a TP worker loads only its slices")
    elif (notice := separate_drafter(vllm_config)) is not None:
        logger.info(notice)
    if vllm_config.lora_config is not None:
        raise ValueError("engines with LoRA enabled are not supported")
    if getattr(vllm_config.model_config, "dtype", None) == torch.float16 and spec_of(vllm_config).family_info.sinks \
            and on_cpu():
        raise ValueError(f"{spec_of(vllm_config).family} in float16 on vLLM's CPU build: its attention backend keeps "
                         "a float32 copy "
                         "of the attention sinks, cast once at the first forward, which no reload refreshes; run the "
                         "engine in bfloat16 or float32")


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
