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
session loads every tensor. Names, shapes and dtypes are checked before the session
starts, and the session is always closed, so a failed update never leaves the model
half-materialised; the next version recovers it.

An engine that drafts with the model's MTP layers (``speculative_config`` method ``mtp``) stages
them too. vLLM hands a backend the drafter only in a draft session (``start_draft_weight_update``,
``update_weights`` with the same version, ``finish_weight_update``; ``update_llm`` runs one after
the target's): the first loads the MTP layers the target's update brought, and once the drafter
is known every version reloads target and drafter in one session.
"""

from __future__ import annotations

import logging
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
from weightsync.reader import WeightReader
from weightsync.session import SyncConfig, TransportOptions

logger = logging.getLogger(__name__)


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    """Where the job's meta server is and who this worker is in the job."""

    num_writers: int
    num_readers: int
    rank: int = 0
    #: Empty: read WEIGHTSYNC_META_ADDR / WEIGHTSYNC_META_TOKEN from the worker's environment.
    meta_address: str = ""
    meta_token: str = ""
    job: str = "default"
    transport: str = "auto"
    timeout: float = 300.0
    max_bucket_bytes: int = 64 << 20
    layer_phases: bool = False
    #: K >= 1: receive only what changed since the version this worker holds (a full version at
    #: least every K; torch transport; with ``layer_phases`` every version comes in full)
    delta_anchor_every: int = 0


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """Which version to apply (None: the newest published) and how long to wait for it."""

    version: int | None = None
    timeout: float | None = None


class _WorkerEngine(StagedWeights):
    """The model inside this worker, loaded through one reload session per version (fed a
    phase of whole layers at a time with ``layer_phases``)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device, rank: int,
                 replicas: int) -> None:
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
        # parameters that need no processing are received straight into the model
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
        self.last_version: int | None = None
        self._worker: _WorkerEngine | None = None
        self._draft_session = False

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        from weightsync.meta.client import MetaClient

        if self.reader is not None:
            raise RuntimeError("the weightsync transfer engine is already initialised; shut it down first")
        engine = self._worker = _WorkerEngine(self._default_model, self.vllm_config, self.device, init_info.rank,
                                              init_info.num_readers)
        config = SyncConfig(num_writers=init_info.num_writers, num_readers=init_info.num_readers,
                            job=init_info.job, transport=init_info.transport, timeout=init_info.timeout,
                            layer_phases=init_info.layer_phases,
                            transport_options=TransportOptions(max_bucket_bytes=init_info.max_bucket_bytes,
                                                               delta_anchor_every=init_info.delta_anchor_every))
        meta = (MetaClient(init_info.meta_address, job=init_info.job, token=init_info.meta_token)
                if init_info.meta_address else MetaClient.from_env(job=init_info.job))
        self.reader = WeightReader(engine, rank=init_info.rank, config=config, meta=meta)
        logger.info("weightsync reader %d ready (%s); staging is laid out at the first update", init_info.rank,
                    "phases of whole layers" if init_info.layer_phases else "the whole model at once")

    def start_weight_update(self) -> None:
        # Nothing to prepare: the data arrives, and is checked, before the reload session opens.
        if self.reader is None or self._worker is None:
            raise RuntimeError("call llm.init_weight_transfer_engine(...) before updating weights")
        # vLLM's start_draft_weight_update retargets this engine at the drafter before calling this
        self._draft_session = self.model is not self._default_model
        if self._draft_session:
            if not self._worker.mtp:
                raise RuntimeError("a draft weight update: weightsync syncs MTP drafters (speculative_config "
                                   "method 'mtp'), and this engine drafts with another model")
            self._worker.draft = self.model

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        if self.reader is None or self._worker is None:
            raise RuntimeError("call llm.init_weight_transfer_engine(...) before updating weights")
        if self._draft_session:
            self._worker.load_draft(update_info.version)
            return
        result = self.reader.update(update_info.version, timeout=update_info.timeout)
        self.last_version = result.version
        logger.info("weightsync: version %d applied (%.1f MB, %.3fs)", result.version, result.nbytes / 1e6,
                    result.seconds)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.reader is not None:
            reader, self.reader = self.reader, None
            reader.close()
            reader.meta.close()
