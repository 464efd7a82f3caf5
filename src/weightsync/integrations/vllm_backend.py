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
        if runs_mtp(vllm_config):
            # vLLM hands this backend the drafter only inside a draft session (start_draft_weight_update):
            # synced without it, the drafter would keep its start-up weights and go stale unnoticed
            raise ValueError("the 'weightsync' weight-transfer backend does not sync the MTP drafter of an engine "
                             "that drafts with MTP (speculative_config method 'mtp'): its weights would go stale. "
                             "Use weightsync.engines.vllm.VLLMEngine in process (it syncs the drafter with every "
                             "version), or serve without MTP speculative decoding")
        check_supported(vllm_config)
        super().__init__(spec_of(vllm_config), dtype=vllm_config.model_config.dtype, device=device, rank=rank,
                         replicas=replicas, quant=staging_quant(vllm_config))
        self.model = model
        self.vllm_config = vllm_config
        self._session: ReloadSession | None = None
        # parameters that need no processing are received straight into the model
        self.receive_in_place(in_place_targets(model, self, quantized=staging_quant(vllm_config) is not None))

    def _begin(self, version: int) -> None:
        self._session = ReloadSession(self.model, self.vllm_config)
        self._session.begin()

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        assert self._session is not None, "a load outside a reload session"
        self._session.load(items)

    def _end(self, version: int, *, failed: bool = False) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.end()


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """vLLM ``WeightTransferEngine`` hosting a weightsync ``WeightReader`` (see module docstring)."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.reader: WeightReader | None = None
        self.last_version: int | None = None

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        from weightsync.meta.client import MetaClient

        if self.reader is not None:
            raise RuntimeError("the weightsync transfer engine is already initialised; shut it down first")
        engine = _WorkerEngine(self.model, self.vllm_config, self.device, init_info.rank, init_info.num_readers)
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
        if self.reader is None:
            raise RuntimeError("call llm.init_weight_transfer_engine(...) before updating weights")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        if self.reader is None:
            raise RuntimeError("call llm.init_weight_transfer_engine(...) before updating weights")
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
