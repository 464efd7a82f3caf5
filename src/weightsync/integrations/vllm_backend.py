"""The ``"weightsync"`` weight-transfer backend for vLLM: a weightsync reader inside the worker.

vLLM imports this module (through :func:`weightsync.engines.vllm.register`, run by the
``vllm.general_plugins`` entry point) when an engine is created with
``weight_transfer_config={"backend": "weightsync"}``; weightsync itself never does. The
worker-side lifecycle, driven by vLLM's standard weight-transfer API::

    llm.init_weight_transfer_engine({"init_info": {"meta_address": addr, "meta_token": token,
                                                   "job": "rl", "rank": 0,
                                                   "num_writers": 8, "num_readers": 4}})
    # per version (weightsync.engines.vllm.update_llm does these four calls):
    llm.start_weight_update()                                   # nothing to do yet
    llm.update_weights({"update_info": {"version": 7}})         # receive from trainers, reload
    llm.finish_weight_update(weight_version="7")
    llm.reset_prefix_cache()

``update_weights`` runs the whole update in the worker: the reader receives version 7
straight from the trainers into the worker's staging buffers, then one layerwise-reload
session loads every tensor. With ``prefetch=True`` in the init info, ``start_weight_update``
starts that receive in a background thread of the worker and returns, so the engine keeps
generating with its current weights while the next version arrives; ``update_weights`` then
waits for the receive to end and only applies (the reload session, and after
``finish_weight_update`` the cache reset): the engine's pause. Call ``start_weight_update``
early (when the trainer publishes, or right after the previous update), generate, then pause
and call ``update_weights``. Prefetching stages the whole model (the norms too, which are
otherwise received straight into the model) and refuses ``layer_phases``.

Names, shapes and dtypes are checked before the session starts, and the session is always
closed, so a failed update never leaves the model half-materialised; the next version
recovers it.

An engine that drafts with the model's MTP layers (``speculative_config`` method ``mtp``) stages
them too. vLLM hands a backend the drafter only in a draft session (``start_draft_weight_update``,
``update_weights`` with the same version, ``finish_weight_update``; ``update_llm`` runs one after
the target's): the first loads the MTP layers the target's update brought, and once the drafter
is known every version reloads target and drafter in one session.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.engines.staging import StagedWeights
from weightsync.engines.vllm import (
    ReloadSession,
    check_supported,
    in_place_targets,
    layer_of,
    runs_mtp,
    spec_of,
    staging_quant,
)
from weightsync.engines.vllm_lora import WorkerLoraEngine
from weightsync.layout.lora import LoraSpec
from weightsync.reader import Prefetch, UpdateResult, WeightReader
from weightsync.sync_config import SyncConfig, check_value, from_fields, job_config, with_job_settings

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
@with_job_settings()
class WeightSyncInitInfo(WeightTransferInitInfo):
    """Where the job's meta server is, who this worker is in the job, and the job's settings.

    Besides the fields below it has one field per job setting (``SyncConfig``'s wire form,
    :mod:`weightsync.sync_config`): ``num_writers`` and ``num_readers`` are required, the rest
    take ``SyncConfig``'s defaults. Every field is checked when vLLM parses the dict
    (:meth:`from_wire`), and an error names it.
    """

    rank: int = 0
    #: Empty: read WEIGHTSYNC_META_ADDR / WEIGHTSYNC_META_TOKEN from the worker's environment.
    meta_address: str = ""
    meta_token: str = ""
    #: A LoRA adapter's PEFT config (``adapter_config.json``: r, lora_alpha, target_modules):
    #: versions are that adapter alone, installed in vLLM's LoRA manager as ``lora_id``.
    lora: dict[str, Any] | None = None
    #: the adapter's id in vLLM (vllm serve: its position in --lora-modules, from 1)
    lora_id: int = 1
    #: receive the next version in the background from ``start_weight_update`` on, while the
    #: engine keeps generating; ``update_weights`` then only applies (module docstring). This
    #: worker's own choice, not a job setting: the trainers never see it.
    prefetch: bool = False

    def __post_init__(self) -> None:
        where = type(self).__name__
        for name, kind in (("rank", int), ("meta_address", str), ("meta_token", str), ("lora_id", int),
                           ("prefetch", bool)):
            check_value(getattr(self, name), kind, f"{where}.{name}")
        if self.lora is not None and not isinstance(self.lora, dict):
            raise ValueError(f"{where}.lora must be an adapter config (a mapping) or null, got "
                             f"{type(self.lora).__name__}")
        config = self.sync_config()
        if not 0 <= self.rank < config.num_readers:
            raise ValueError(f"{where}.rank must be in [0, num_readers={config.num_readers}), got {self.rank}")
        if self.lora_id < 1:
            raise ValueError(f"{where}.lora_id must be >= 1 (vLLM reserves 0 for 'no adapter'), got {self.lora_id}")
        if self.prefetch and config.layer_phases:
            raise ValueError(f"{where}: prefetch=True with layer_phases=True: each phase is loaded into the model "
                             "as it arrives, so the transfer cannot overlap generation; choose one")
        if self.prefetch and self.lora is not None:
            raise ValueError(f"{where}: prefetch=True with lora: adapter versions are installed whole into vLLM's "
                             "LoRA manager as they arrive, there is no staging to prefetch into; choose one")
        self.lora_spec()  # a malformed adapter config is refused here, naming the key

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> WeightSyncInitInfo:
        """The init info vLLM's ``init_weight_transfer_engine`` passes (a dict), checked field by field.

        Raises:
            ValueError: naming ``WeightSyncInitInfo.<field>`` for an unknown, missing or malformed field.
        """
        return from_fields(cls, wire, cls.__name__, required=("num_writers", "num_readers"))

    def sync_config(self) -> SyncConfig:
        """The job's settings as this worker's reader takes them."""
        return job_config(self, type(self).__name__)

    def lora_spec(self) -> LoraSpec | None:
        if self.lora is None:
            return None
        try:
            return LoraSpec.from_peft_config(self.lora)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{type(self).__name__}.lora is not a plain LoRA adapter config: {exc!r}") from exc


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """Which version to apply (None: the newest published) and how long to wait for it."""

    version: int | None = None
    timeout: float | None = None


class _WorkerEngine(StagedWeights):
    """The model inside this worker, loaded through one reload session per version (fed a
    phase of whole layers at a time with ``layer_phases``)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device, rank: int,
                 replicas: int, *, in_place: bool = True) -> None:
        check_supported(vllm_config)
        self.mtp = runs_mtp(vllm_config)
        # with MTP drafting the MTP layers are staged too, for the drafter
        super().__init__(spec_of(vllm_config, mtp=self.mtp), dtype=vllm_config.model_config.dtype, device=device,
                         rank=rank, replicas=replicas, quant=staging_quant(vllm_config))
        self.model = model
        self.vllm_config = vllm_config
        self._session: ReloadSession | None = None
        #: the MTP drafter, known once vLLM has retargeted a session at it (start_draft_weight_update)
        self.draft: torch.nn.Module | None = None
        #: (version, its MTP layers) that the drafter, not yet known, still has to load
        self._held: list[tuple[str, torch.Tensor]] = []
        self.draft_pending: int | None = None
        self._first_mtp = int(vllm_config.model_config.hf_config.num_hidden_layers)
        if in_place:  # parameters that need no processing are received straight into the model
            self.receive_in_place(in_place_targets(model, self, quantized=staging_quant(vllm_config) is not None))

    def _begin(self, version: int) -> None:
        self._held = []
        self._session = ReloadSession(self.model, self.vllm_config, draft=self.draft)
        self._session.begin()

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        assert self._session is not None, "a load outside a reload session"
        if self.mtp and self.draft is None:
            # copied: staging may be reused (phases) before the draft session loads them
            self._held += [(n, t.clone()) for n, t in items if layer_of(n) >= self._first_mtp]
            items = [(n, t) for n, t in items if layer_of(n) < self._first_mtp]
        self._session.load(items)

    def _end(self, version: int, *, failed: bool = False) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.end()
        if self.mtp and not failed:
            self.draft_pending = version if self.draft is None else None
            if self.draft is None:
                logger.warning("weightsync: the MTP drafter has not loaded version %d yet: vLLM hands it to this "
                               "backend in a draft session (start_draft_weight_update, update_weights with the "
                               "same version, finish_weight_update; weightsync.engines.vllm.update_llm does it)",
                               version)

    def load_draft(self, version: int | None) -> None:
        """A draft session: the drafter loads the MTP layers of ``version``, the version the target
        holds (received with it); from now on every version loads both in one reload session."""
        if self.draft is None:
            raise RuntimeError("a draft weight update outside a draft session")
        if self.draft_pending is None:
            if version is not None and version != self._version:
                raise ValueError(f"a draft update to version {version}: the target model holds version "
                                 f"{self._version}, and the drafter is updated with the target, not alone")
            return  # the drafter loaded it with the target
        if version is not None and version != self.draft_pending:
            raise ValueError(f"a draft update to version {version}: update the target model to it first (it "
                             f"holds version {self.draft_pending}; the drafter's layers arrive with the target's)")
        session = ReloadSession(None, self.vllm_config, draft=self.draft)
        session.begin()
        try:
            session.load(self._held)
        finally:
            session.end()
        self._held, self.draft_pending = [], None


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """vLLM ``WeightTransferEngine`` hosting a weightsync ``WeightReader`` (see module docstring)."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    #: With MTP drafting the drafter's layers arrive with every version; vLLM hands this backend the
    #: drafter in its first draft session, which loads them (see :meth:`_WorkerEngine.load_draft`).
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.reader: WeightReader | None = None
        self.prefetch: Prefetch | None = None
        self.last_version: int | None = None
        self.last_result: UpdateResult | None = None  # its phases: what the update cost
        #: the full-model engine (None with LoRA): the one that holds the MTP drafter's layers
        self._worker: _WorkerEngine | None = None
        self._draft_session = False

    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightSyncInitInfo:
        """Every field checked, an error naming it (vLLM's default passes the dict on unchecked)."""
        return WeightSyncInitInfo.from_wire(init_dict)

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        from weightsync.meta.client import MetaClient

        if self.reader is not None:
            raise RuntimeError("the weightsync transfer engine is already initialised; shut it down first")
        config = init_info.sync_config()
        lora = init_info.lora_spec()
        engine: Any
        if lora is not None:  # adapter-only versions, into vLLM's LoRA manager
            engine = WorkerLoraEngine(self._default_model, self.vllm_config, lora, lora_id=init_info.lora_id,
                                      rank=init_info.rank)
        else:  # prefetched bytes must not reach the model early: stage everything
            engine = self._worker = _WorkerEngine(self._default_model, self.vllm_config, self.device, init_info.rank,
                                                  config.num_readers, in_place=not init_info.prefetch)
            # Staging is allocated now, not at the first update: vLLM sized its KV cache when it
            # started (before this call brings the job's phases), so what does not fit in what it
            # left is refused here, with the figure, never inside a sync.
            engine.lay_out(layer_phases=config.layer_phases,
                           budget_bytes=config.transport_options.max_bucket_bytes)
        meta = (MetaClient(init_info.meta_address, job=config.job, token=init_info.meta_token)
                if init_info.meta_address else MetaClient.from_env(job=config.job))
        self.reader = WeightReader(engine, rank=init_info.rank, config=config, meta=meta)
        self.prefetch = Prefetch(self.reader) if init_info.prefetch else None
        what = (f"LoRA adapter id {init_info.lora_id} (r={lora.r})" if lora is not None else
                "phases of whole layers" if config.layer_phases else "the whole model at once")
        logger.info("weightsync reader %d ready (%s%s); staging is laid out", init_info.rank,
                    what, ", prefetching" if init_info.prefetch else "")

    def start_weight_update(self) -> None:
        # The data arrives, and is checked, before the reload session opens: nothing to prepare,
        # unless prefetching, which starts receiving now while the engine keeps generating.
        if self.reader is None:
            raise RuntimeError("call llm.init_weight_transfer_engine(...) before updating weights")
        # vLLM's start_draft_weight_update retargets this engine at the drafter before calling this
        self._draft_session = self.model is not self._default_model
        if self._draft_session:
            if self._worker is None or not self._worker.mtp:
                raise RuntimeError("a draft weight update: weightsync syncs MTP drafters (speculative_config "
                                   "method 'mtp') of full-model versions, and this engine drafts with another "
                                   "model or takes LoRA adapters")
            self._worker.draft = self.model
            return
        if self.prefetch is not None:
            self.prefetch.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        if self.reader is None:
            raise RuntimeError("call llm.init_weight_transfer_engine(...) before updating weights")
        if self._draft_session:
            if self._worker is None:
                raise RuntimeError("a draft weight update on an engine that takes LoRA adapters")
            self._worker.load_draft(update_info.version)
            return
        if self.prefetch is not None:
            result = self.prefetch.apply(update_info.version, timeout=update_info.timeout)
        else:
            result = self.reader.update(update_info.version, timeout=update_info.timeout)
        self.last_version, self.last_result = result.version, result
        logger.info("weightsync: version %d applied (%.1f MB, %.3fs)", result.version, result.nbytes / 1e6,
                    result.seconds)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None
        if self.reader is not None:
            reader, self.reader = self.reader, None
            reader.close()
            reader.meta.close()
