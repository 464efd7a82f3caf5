"""vLLM as a weightsync reader: staging buffers in checkpoint layout, loaded by vLLM itself.

vLLM does not keep its weights in a form a transport can write into: on CPU every linear
layer is repacked into a oneDNN handle (the parameter itself is emptied), MoE experts are
prepacked, and fused layers (``qkv_proj``, ``gate_up_proj``) are cut per TP rank. So the
reader receives into *staging buffers* holding the model under its Hugging Face checkpoint
names (the ``hf`` layout kind), and ``apply`` pushes every tensor through vLLM's own
loader in one layerwise-reload session, so each fused layer is rebuilt whole and
re-processed exactly as at start-up.

Two ways in:

* :class:`VLLMEngine` wraps an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  one worker)::

      llm = LLM(model=path, enforce_eager=True)
      engine = VLLMEngine(llm, rank=0)
      reader = WeightReader(engine, rank=0, config=SyncConfig(num_writers=2, num_readers=1))
      reader.update()                   # receive, reload, reset the prefix cache, stamp the version
      engine.update(state_dict, version=7)   # or: load tensors you already hold

* the ``"weightsync"`` weight-transfer backend (:mod:`weightsync.integrations.vllm_backend`) puts
  the reader inside vLLM's worker, so bytes go from the trainers straight into the worker's
  staging buffers, whatever process the worker lives in::

      llm = LLM(model=path, weight_transfer_config={"backend": "weightsync"})
      llm.init_weight_transfer_engine({"init_info": {"meta_address": ..., "rank": 0, ...}})
      update_llm(llm, version=7)

Memory: the staging buffers are one copy of the model in the engine's dtype (e.g. 1.2 GB
for a 0.6B-parameter model in bf16), allocated once, on the engine's device; a reload
adds at most one layer's processed weights on top (vLLM rebuilds one layer at a time).

Everything version-specific (vLLM 0.32 private attributes, two CPU reload fixes) lives in
this module; ``vllm`` is imported lazily, inside functions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.engines.staging import StagedWeights, invalid_stamp
from weightsync.layout import ModelSpec
from weightsync.tools.torch_layout import dtype_name

if TYPE_CHECKING:
    from vllm import LLM

logger = logging.getLogger(__name__)

#: The vLLM release the version-specific code below was written and tested against.
TESTED_VLLM = "0.32.0"
BACKEND_NAME = "weightsync"


# -- the in-process engine ---------------------------------------------------------------------

class VLLMEngine(StagedWeights):
    """An in-process ``vllm.LLM`` as a weightsync :class:`InferenceEngine`: one worker, or this
    process's TP worker of an engine TRL colocates over its ranks (``external_launcher``), whose
    reader receives only the slices that worker loads (:mod:`weightsync.engines.vllm_parallel`).

    ``apply`` loads the staged weights through vLLM's reload path, resets the prefix
    cache (cached KV blocks were computed with the old weights) and sets the engine's
    weight version to ``str(version)``, so every ``CompletionOutput.weight_versions`` span
    says which weights produced it.
    """

    def __init__(self, llm: LLM, *, rank: int = 0, replicas: int | None = None, in_place: bool = True) -> None:
        engine = llm.llm_engine
        if type(engine.engine_core).__name__ != "InprocClient":
            raise ValueError(
                "VLLMEngine needs an in-process vLLM engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before "
                "creating the LLM, or use the 'weightsync' weight-transfer backend "
                "(LLM(weight_transfer_config={'backend': 'weightsync'})), which runs the reader inside the worker"
            )
        vllm_config: Any = engine.vllm_config
        check_supported(vllm_config)
        # with MTP drafting, the drafter's layers are synced too (reloaded after the target's)
        mtp = runs_mtp(vllm_config)
        super().__init__(spec_of(vllm_config, mtp=mtp), dtype=vllm_config.model_config.dtype,
                         device=vllm_config.device_config.device, rank=rank, replicas=replicas,
                         quant=staging_quant(vllm_config), reads=llm.collective_rpc(_worker_reads, args=(mtp,))[0])
        self.llm = llm
        if in_place:  # parameters that need no processing are received straight into the model
            checkpoint = {shard.name: (shard.shape, shard.dtype) for shard in self.layout().shards}
            quantized = staging_quant(vllm_config) is not None
            self.receive_in_place(llm.collective_rpc(_in_place_params, args=(checkpoint, quantized))[0])

    # In-process, collective_rpc calls the functions directly: the tensors are passed by reference.
    def _begin(self, version: int) -> None:
        self.llm.collective_rpc(_reload_begin)

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc(_reload_load, args=(items,))

    def _end(self, version: int, *, failed: bool = False) -> None:
        self.llm.collective_rpc(_reload_end)
        if failed:
            return
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests are running); cached KV "
                               "blocks computed with the old weights would be reused")
        self.llm.llm_engine.set_weight_version(str(version))

    def _invalidate(self, version: int) -> None:
        # Outputs generated from now on are stamped, so rollouts from broken weights can be dropped.
        self.llm.llm_engine.set_weight_version(invalid_stamp(version))


#: The method the ``"weightsync"`` backend gives each vLLM worker it runs in: None while the
#: worker's weights are valid, else ``{"version", "error", "since"}`` of the failed update that left
#: them mixed. Drivers ask it by name: ``llm.collective_rpc(WORKER_INVALID)``, and through ``vllm
#: serve``'s dev-mode ``POST /collective_rpc {"method": "weightsync_invalid"}``.
WORKER_INVALID = "weightsync_invalid"


def invalid_stamp_of(states: Iterable[Mapping[str, Any] | None]) -> str | None:
    """vLLM's weight version for an engine whose workers answered ``states`` (:data:`WORKER_INVALID`):
    ``invalid:<version>`` if any worker is invalid, else None (every worker valid)."""
    versions = [int(state["version"]) for state in states if state]
    return invalid_stamp(max(versions)) if versions else None


def stamp_if_invalid(llm: LLM) -> str | None:
    """After a failed update of ``llm`` (``"weightsync"`` backend): if the failure left a worker's
    weights mixed, set vLLM's weight version to ``invalid:<version>`` (every later output carries
    it) and return it; None if every worker kept valid weights.

    A worker that runs in the engine core's process stamps it itself; vLLM's CPU build runs
    workers in processes of their own, where only the driver can.
    """
    stamp = invalid_stamp_of(llm.collective_rpc(WORKER_INVALID))
    if stamp is not None:
        llm.update_weight_version(stamp)
    return stamp


def update_llm(llm: LLM, version: int, *, timeout: float | None = None) -> None:
    """Driver side of the ``"weightsync"`` backend: bring every worker of ``llm`` to ``version``.

    Each worker's reader receives ``version`` from the trainers and reloads (an engine drafting
    with MTP reloads its drafter's MTP layers in the same session); then the prefix cache is
    reset and the engine's weight version set to ``str(version)``.

    Raises:
        Whatever a worker raised (``SyncError``, ``TimeoutError``). If the failed version had
        touched a worker's weights, the engine is stamped ``invalid:<version>``
        (:func:`stamp_if_invalid`) before this raises; otherwise it keeps its version. The next
        successful update recovers the engine.
    """
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"version": version, "timeout": timeout}})
    except Exception:
        try:
            stamp_if_invalid(llm)
        except Exception as exc:  # the update's own error is what the caller must see
            logger.warning("after version %d failed, asking vLLM's workers whether their weights are valid: %s",
                           version, exc)
        raise
    llm.finish_weight_update(weight_version=str(version))
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not reset its prefix cache (requests are running)")


# -- worker side: runs in the process that holds the model ---------------------------------------

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


def draft_model(model_runner: Any) -> torch.nn.Module | None:
    """The MTP drafter's model of a worker's model runner (vLLM 0.32: ``model_runner.drafter.model``)."""
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


def check_supported(vllm_config: Any) -> None:
    """Reject engine configurations whose reload path this adapter has not been built for."""
    from weightsync.engines.vllm_parallel import check_parallel

    check_parallel(vllm_config)
    staging_quant(vllm_config)
    if vllm_config.lora_config is not None:
        raise ValueError("engines with LoRA enabled are not supported")
    if getattr(vllm_config.model_config, "dtype", None) == torch.float16 and spec_of(vllm_config).family_info.sinks \
            and _on_cpu():
        raise ValueError(f"{spec_of(vllm_config).family} in float16 on vLLM's CPU build: its attention backend keeps "
                         "a float32 copy "
                         "of the attention sinks, cast once at the first forward, which no reload refreshes; run the "
                         "engine in bfloat16 or float32")


class ReloadSession:
    """One layerwise-reload session on a live vLLM model, opened, fed, and always closed.

    Each module is rebuilt once all its checkpoint tensors arrived (so every part of a fused
    layer must come in one :meth:`load`, or across loads of one session), processed like at
    start-up (repacking) and copied into the old kernel tensors, whose addresses therefore
    never change. Feeding a session several times, one phase of whole layers each, is what
    bounds staging to a phase. The session must always be closed (:meth:`end`), even on
    error: an open one leaves layers on the meta device, and the next forward pass hangs
    the engine.
    """

    def __init__(self, model: Any, vllm_config: Any, *, draft: Any = None) -> None:
        self.model = model
        self.vllm_config = vllm_config
        #: the MTP drafter, fed the checkpoint's MTP layers (from ``num_hidden_layers`` on)
        self.draft = draft
        self._first_mtp = int(vllm_config.model_config.hf_config.num_hidden_layers)
        self._stashed: list[tuple[Any, Any]] = []
        spec = spec_of(vllm_config)
        #: checkpoint tensors holding every expert of a layer (gpt-oss): fed one expert at a time
        self._whole_experts = frozenset(n for n, (role, _) in spec.roles().items() if role.startswith("experts_"))

    def _models(self) -> list[Any]:
        return [m for m in (self.model, self.draft) if m is not None]  # model None: the drafter alone

    def begin(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        for model in self._models():
            self._stashed += _stash_cpu_moe_kernels(model)
        with set_current_vllm_config(self.vllm_config):
            # the drafter's modules shared with the target (embedding, output head) are the target's
            # to reload: initialised here first, the drafter's initialisation skips them
            for model in self._models():
                initialize_layerwise_reload(model)
                _release_unprocessed(model)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        items = list(weights)
        draft = [(n, t) for n, t in items if layer_of(n) >= self._first_mtp]
        target = [(n, t) for n, t in items if layer_of(n) < self._first_mtp]
        with set_current_vllm_config(self.vllm_config):
            if target:
                if self.model is None:
                    raise ValueError(f"{target[0][0]} is the target model's, and this session reloads the drafter")
                if self._whole_experts:
                    target = _one_expert_at_a_time(self.model, target, self._whole_experts)
                self.model.load_weights(iter(target))
            if draft:
                if self.draft is None:
                    raise ValueError(f"{draft[0][0]} is an MTP layer's, and this engine has no MTP drafter")
                self.draft.load_weights(iter(draft))

    def end(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            with set_current_vllm_config(self.vllm_config):
                for model in self._models():
                    finalize_layerwise_reload(model, self.vllm_config.model_config)
        finally:
            _restore_cpu_moe_kernels(self._stashed)
            self._stashed = []
        if self.model is not None:
            _cpu_retie_lm_head(self.model)


def _release_unprocessed(model: torch.nn.Module) -> None:
    """Take the modules vLLM never post-processes out of the reload session just opened on ``model``.

    A layerwise reload puts every module on the meta device and rebuilds it once its loader
    calls are all in. A module without a quant method (a norm, gpt-oss's attention holding the
    ``sinks``) is never processed: what the loader writes is what it computes with. Some
    loaders write such modules by a direct copy, not through the parameter's weight loader
    (vLLM 0.32's gpt-oss: ``param.data.copy_`` into the sinks), which a session never sees:
    the copy lands in a meta tensor, the session puts the old tensors back, and the engine
    keeps the old values (and so does every holder of the same tensor: the attention
    backend's ``impl.sinks``). Outside the session the loader writes the live tensors, as at
    start-up, by either route. Attention layers stay: the session processes them last.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

    for layer in model.modules():
        info = get_layerwise_info(layer)
        if (not info.can_load() or info.kernel_tensors is None or is_deferred_attention_layer(layer)
                or isinstance(getattr(layer, "quant_method", None), QuantizeMethodBase)):
            continue
        _place_kernel_tensors(layer, info)  # the live tensors, with their own weight loaders
        info.reset()


def _one_expert_at_a_time(model: Any, items: list[tuple[str, torch.Tensor]],
                          whole: frozenset[str]) -> list[tuple[str, torch.Tensor]]:
    """``items`` with each whole-experts checkpoint tensor cut into vLLM's one-expert-at-a-time form.

    vLLM 0.32's gpt-oss loader copies a checkpoint's whole-expert tensors (``experts.gate_up_proj``
    ``[E, H, 2I]``, its bias, ``down_proj``, its bias) straight into the fused expert parameters,
    which a reload session (parameters on the meta device, loads counted through their weight
    loaders) never sees: the experts kept their old values. The same loader also takes one expert
    at a time (``layers.L.mlp.experts.<e>.w13_weight``, its streamed-expert format) through the
    experts' weight loader, which the session counts, then processes the layer as at start-up
    (the CPU prepack, the quant config holding the biases). The parameter names are the model's
    own mapping of the checkpoint's (``hf_to_vllm_mapper``); each expert is a view, not a copy.
    """
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    inner = getattr(model, "model", None)
    if mapper is None or not hasattr(inner, "_get_streamed_expert_info"):
        raise NotImplementedError(f"{type(model).__name__} holds whole-expert checkpoint tensors, and this vLLM has no "
                                  "one-expert-at-a-time loader for them: a reload would leave its experts stale")
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in items:
        if name not in whole:
            out.append((name, tensor))
            continue
        (mapped, _), = mapper.apply([(name, tensor)])
        out += [(mapped.replace(".experts.", f".experts.{e}.", 1), tensor[e]) for e in range(tensor.shape[0])]
    return out


def layer_of(name: str) -> int:
    """The layer number of a checkpoint name (-1 outside the layers)."""
    parts = name.split(".", 3)
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else -1


def reload_model(model: Any, vllm_config: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format ``weights`` into a live vLLM model in one reload session."""
    session = ReloadSession(model, vllm_config)
    session.begin()
    try:
        session.load(weights)
    finally:
        session.end()


# Worker-side halves of VLLMEngine's load (collective_rpc runs them in the worker; in process).
def _in_place_params(worker: Any, checkpoint: Mapping[str, tuple[tuple[int, ...], str]],
                     quantized: bool) -> dict[str, torch.Tensor]:
    model = worker.model_runner.get_model()
    names = set(in_place_names(param_facts(model), checkpoint, quantized=quantized))
    return {name: param.data for name, param in model.named_parameters() if name in names}


def _worker_reads(worker: Any, mtp: bool) -> Any:
    from weightsync.engines.vllm_parallel import worker_reads

    return worker_reads(worker.vllm_config, mtp=mtp)


def _reload_begin(worker: Any) -> None:
    draft = draft_model(worker.model_runner) if runs_mtp(worker.vllm_config) else None
    worker._weightsync_reload = ReloadSession(worker.model_runner.get_model(), worker.vllm_config, draft=draft)
    worker._weightsync_reload.begin()


def _reload_load(worker: Any, items: list[tuple[str, torch.Tensor]]) -> None:
    worker._weightsync_reload.load(items)


def _reload_end(worker: Any) -> None:
    session, worker._weightsync_reload = worker._weightsync_reload, None
    if session is not None:
        session.end()


# -- vLLM 0.32 CPU reload fixes (each has its own test in tests/test_engine_vllm.py) --------------

def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _stash_cpu_moe_kernels(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """Make a reload re-prepack unquantized MoE experts on CPU (undone by :func:`_restore_cpu_moe_kernels`).

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` runs the CPU prepack
    (``CPUUnquantizedExperts.process_weights_after_loading``) only when ``moe_kernel`` is
    None, i.e. at start-up. A reload copies checkpoint-layout experts into the prepacked
    storage, and the kernel reads garbage. Dropping ``moe_kernel`` for the session makes
    the reload take the start-up path (new kernel, prepack); layers the session did not
    rebuild get their old kernel back.
    """
    if not _on_cpu():
        return []
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    stashed: list[tuple[Any, Any]] = []
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None and isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            stashed.append((method, kernel))
            method.moe_kernel = None
    return stashed


def _restore_cpu_moe_kernels(stashed: list[tuple[Any, Any]]) -> None:
    """Give layers the session did not rebuild their old kernel back."""
    for method, kernel in stashed:
        if method.moe_kernel is None:
            method.moe_kernel = kernel


def _cpu_retie_lm_head(model: torch.nn.Module) -> None:
    """Refresh a tied ``lm_head`` after a reload on CPU.

    With ``tie_word_embeddings`` the checkpoint has no ``lm_head.weight``; vLLM's
    ``lm_head`` shares the embedding's tensor, but on CPU it computes with a oneDNN copy
    packed at start-up, which a reload never rebuilds (nothing was loaded into it). The
    model then keeps projecting with the old embedding. Re-processing ``lm_head`` costs
    one vocab x hidden repack.
    """
    head: Any = getattr(model, "lm_head", None)
    embed: Any = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head is embed or not _on_cpu():
        return
    if getattr(head, "weight", None) is getattr(embed, "weight", None):
        head.quant_method.process_weights_after_loading(head)


# -- registration with vLLM ----------------------------------------------------------------------

def register() -> None:
    """Register the ``"weightsync"`` weight-transfer backend with vLLM (idempotent).

    Also the ``vllm.general_plugins`` entry point, so every vLLM process (engine core,
    workers) registers it without user code. The backend's two sides are integrations above
    the roles (:mod:`weightsync.integrations`), named here by module path: vLLM's factories
    import them when an engine asks for the backend, and this adapter never does.
    """
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, "weightsync.integrations.vllm_backend",
                                                    "WeightSyncTransferEngine")
    if BACKEND_NAME not in WeightTransferTrainerFactory._registry:  # the trainer side
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, "weightsync.integrations.vllm_trainer",
                                                     "WeightSyncTrainerEngine")
