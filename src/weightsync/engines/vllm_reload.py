"""Reloading a live vLLM model from checkpoint-format tensors: one layerwise-reload session
(:class:`ReloadSession`), and the vLLM 0.32 CPU fixes a reload needs.

vLLM rebuilds each module once all its checkpoint tensors arrived and processes it as at
start-up, so fused and repacked layers come out exactly as a fresh engine builds them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from weightsync.engines.vllm_model import on_cpu, spec_of


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

    def __init__(self, model: Any, vllm_config: Any, *, draft: Any = None, draft_prefix: str | None = None) -> None:
        self.model = model
        self.vllm_config = vllm_config
        #: the drafter: an MTP drafter is fed the checkpoint's MTP layers (from ``num_hidden_layers``
        #: on); a separate one (``draft_prefix``) the tensors under its prefix, by its own names
        self.draft = draft
        self.draft_prefix = draft_prefix
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
            _give_back_released_weights(model)
        with set_current_vllm_config(self.vllm_config):
            # the drafter's modules shared with the target (embedding, output head) are the target's
            # to reload: initialised here first, the drafter's initialisation skips them
            for model in self._models():
                initialize_layerwise_reload(model)
                _release_unprocessed(model)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        items = list(weights)
        if self.draft_prefix is not None:
            cut = len(self.draft_prefix)
            draft = [(n[cut:], t) for n, t in items if n.startswith(self.draft_prefix)]
            target = [(n, t) for n, t in items if not n.startswith(self.draft_prefix)]
        else:
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
        from vllm.utils.torch_utils import set_default_torch_dtype

        dtype = self.vllm_config.model_config.dtype
        try:  # in the model's dtype, as at start-up: what processing creates (AMX MLA's emptied
            # kv_b_proj.weight) must have the dtype a fresh engine's has
            with set_current_vllm_config(self.vllm_config), set_default_torch_dtype(dtype):
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


def _give_back_released_weights(model: torch.nn.Module) -> None:
    """Give a weight another layer emptied after start-up a tensor of its checkpoint shape again.

    On CPU, vLLM 0.32 packs each linear layer's weight for its GEMM and empties the parameter in
    the layer's own processing, which a reload session repeats (empty into empty). MLA's
    ``kv_b_proj`` is the exception: marked ``_cpu_skip_gemm_dispatch``, its processing keeps the
    weight, and on a CPU with AMX tiles the *attention* layer packs ``W_UK`` and ``W_UV`` from it
    into its backend, then replaces ``kv_b_proj.weight`` by an empty parameter. A session then
    processes ``kv_b_proj`` (which keeps the new weight) and copies it into the live tensor,
    which holds no element: the copy fails, and the attention layer, processed last, would pack
    the old weights anyway. Such a parameter gets a tensor of the shape vLLM recorded for
    reloading at start-up (its own record, ``restore_metadata``, materialised by its own
    function), so ``kv_b_proj`` takes the new weight, the attention layer packs it, and empties
    it again.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

    for layer in model.modules():
        if not getattr(layer, "_cpu_skip_gemm_dispatch", False):  # its own processing empties it again
            continue
        recorded = get_layerwise_info(layer).restore_metadata[0]
        for name, param in list(layer.named_parameters(recurse=False)):
            meta = recorded.get(name)
            if param.numel() == 0 and meta is not None and meta.numel() > 0:
                with torch.device(param.device):
                    setattr(layer, name, materialize_meta_tensor(meta))  # of the recorded class (a Parameter)


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


# -- vLLM 0.32 CPU reload fixes (each has its own test in tests/test_engine_vllm.py) --------------


def _stash_cpu_moe_kernels(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """Make a reload re-prepack unquantized MoE experts on CPU (undone by :func:`_restore_cpu_moe_kernels`).

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` runs the CPU prepack
    (``CPUUnquantizedExperts.process_weights_after_loading``) only when ``moe_kernel`` is
    None, i.e. at start-up. A reload copies checkpoint-layout experts into the prepacked
    storage, and the kernel reads garbage. Dropping ``moe_kernel`` for the session makes
    the reload take the start-up path (new kernel, prepack); layers the session did not
    rebuild get their old kernel back.
    """
    if not on_cpu():
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
    if head is None or embed is None or head is embed or not on_cpu():
        return
    if getattr(head, "weight", None) is getattr(embed, "weight", None):
        head.quant_method.process_weights_after_loading(head)
