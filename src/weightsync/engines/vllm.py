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
this module and the two it builds on: :mod:`weightsync.engines.vllm_model` (what the engine's
model and config say) and :mod:`weightsync.engines.vllm_reload` (the reload session);
``vllm`` is imported lazily, inside functions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from weightsync.engines.staging import StagedWeights, invalid_stamp
from weightsync.engines.vllm_model import (
    DRAFT_PREFIX,
    PLAIN_LOADERS,
    REPACKED_ATTRS,
    ParamFacts,
    check_supported,
    draft_model,
    drafter_checkpoint,
    drafter_layout,
    drafts_separately,
    in_place_names,
    in_place_targets,
    param_facts,
    quant_scheme,
    runs_mtp,
    spec_of,
    staging_quant,
)
from weightsync.engines.vllm_reload import ReloadSession, layer_of, reload_model

if TYPE_CHECKING:
    from vllm import LLM

logger = logging.getLogger(__name__)

#: The vLLM release the version-specific code below was written and tested against.
TESTED_VLLM = "0.32.0"
BACKEND_NAME = "weightsync"

__all__ = [
    "BACKEND_NAME",
    "DRAFT_PREFIX",
    "PLAIN_LOADERS",
    "REPACKED_ATTRS",
    "TESTED_VLLM",
    "WORKER_INVALID",
    "ParamFacts",
    "ReloadSession",
    "VLLMEngine",
    "check_supported",
    "draft_model",
    "drafter_checkpoint",
    "drafter_layout",
    "drafts_separately",
    "in_place_names",
    "in_place_targets",
    "invalid_stamp_of",
    "layer_of",
    "param_facts",
    "quant_scheme",
    "register",
    "reload_model",
    "runs_mtp",
    "spec_of",
    "staging_quant",
    "stamp_if_invalid",
    "update_llm",
]


# -- the in-process engine ---------------------------------------------------------------------

class VLLMEngine(StagedWeights):
    """An in-process ``vllm.LLM`` as a weightsync :class:`InferenceEngine`: one worker, or this
    process's TP worker of an engine TRL colocates over its ranks (``external_launcher``), whose
    reader receives only the slices that worker loads (:mod:`weightsync.engines.vllm_parallel`).

    ``apply`` loads the staged weights through vLLM's reload path, resets the prefix
    cache (cached KV blocks were computed with the old weights) and sets the engine's
    weight version to ``str(version)``, so every ``CompletionOutput.weight_versions`` span
    says which weights produced it. With ``drafter=True`` an engine that drafts with a model of
    its own (an EAGLE head) takes that model too, as the job's second model under
    :data:`DRAFT_PREFIX` (docs/models.md, "Draft models").
    """

    def __init__(self, llm: LLM, *, rank: int = 0, replicas: int | None = None, in_place: bool = True,
                 drafter: bool = False) -> None:
        engine = llm.llm_engine
        if type(engine.engine_core).__name__ != "InprocClient":
            raise ValueError(
                "VLLMEngine needs an in-process vLLM engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before "
                "creating the LLM, or use the 'weightsync' weight-transfer backend "
                "(LLM(weight_transfer_config={'backend': 'weightsync'})), which runs the reader inside the worker"
            )
        vllm_config: Any = engine.vllm_config
        check_supported(vllm_config, drafter=drafter)
        # with MTP drafting, the drafter's layers are synced too (reloaded after the target's)
        mtp = runs_mtp(vllm_config)
        #: ``drafter``: the engine's separate drafter (an EAGLE head, a draft model) is a second model
        #: of the job, its checkpoint's tensors under DRAFT_PREFIX, reloaded in the target's session
        self.drafter = drafter
        super().__init__(spec_of(vllm_config, mtp=mtp), dtype=vllm_config.model_config.dtype,
                         device=vllm_config.device_config.device, rank=rank, replicas=replicas,
                         quant=staging_quant(vllm_config), reads=llm.collective_rpc(_worker_reads, args=(mtp,))[0],
                         extra=drafter_layout(vllm_config, rank) if drafter else None)
        self.llm = llm
        if in_place:  # parameters that need no processing are received straight into the model
            checkpoint = {shard.name: (shard.shape, shard.dtype) for shard in self.layout().shards}
            quantized = staging_quant(vllm_config) is not None
            self.receive_in_place(llm.collective_rpc(_in_place_params, args=(checkpoint, quantized))[0])

    # In-process, collective_rpc calls the functions directly: the tensors are passed by reference.
    def _begin(self, version: int) -> None:
        self.llm.collective_rpc(_reload_begin, args=(self.drafter,))

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



# Worker-side halves of VLLMEngine's load (collective_rpc runs them in the worker; in process).
def _in_place_params(worker: Any, checkpoint: Mapping[str, tuple[tuple[int, ...], str]],
                     quantized: bool) -> dict[str, torch.Tensor]:
    model = worker.model_runner.get_model()
    names = set(in_place_names(param_facts(model), checkpoint, quantized=quantized))
    return {name: param.data for name, param in model.named_parameters() if name in names}


def _worker_reads(worker: Any, mtp: bool) -> Any:
    from weightsync.engines.vllm_parallel import worker_reads

    return worker_reads(worker.vllm_config, mtp=mtp)


def _reload_begin(worker: Any, drafter: bool = False) -> None:
    draft = draft_model(worker.model_runner) if drafter or runs_mtp(worker.vllm_config) else None
    worker._weightsync_reload = ReloadSession(worker.model_runner.get_model(), worker.vllm_config, draft=draft,
                                              draft_prefix=DRAFT_PREFIX if drafter else None)
    worker._weightsync_reload.begin()


def _reload_load(worker: Any, items: list[tuple[str, torch.Tensor]]) -> None:
    worker._weightsync_reload.load(items)


def _reload_end(worker: Any) -> None:
    session, worker._weightsync_reload = worker._weightsync_reload, None
    if session is not None:
        session.end()




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
