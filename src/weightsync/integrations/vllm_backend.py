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
recovers it. An update that fails after a byte of it reached the model (a tensor received in
place, a phase loaded, vLLM's loader started) leaves the engine invalid, and vLLM's weight
version, stamped on every output, becomes ``invalid:<version>``; a failure before that leaves the
engine at its version. The worker answers whether it is invalid to its driver
(:data:`~weightsync.engines.vllm.WORKER_INVALID`, a method it adds to vLLM's worker). A worker in
the engine core's process (vLLM's ``uni`` executor) stamps the core itself before ``update_weights``
raises (:func:`_calling_engine_core`); otherwise the driver does (``update_llm``, the trainer side).
Every worker also answers which version it serves, since when, valid or not
(:data:`~weightsync.engines.vllm_version.WORKER_VERSION`: :meth:`WeightSyncTransferEngine.serving`).

An engine that drafts with the model's MTP layers (``speculative_config`` method ``mtp``) stages
them too, and every version reloads target and drafter in one session: the drafter holds the
version the target does after each ``update_weights``, whoever drives it (``update_llm``, the
trainer-side ``WeightSyncTrainerEngine.send_weights``, vLLM's HTTP routes or Ray client). vLLM
hands a backend its drafter only in a draft session (``start_draft_weight_update``), which
vLLM's trainer-side client protocol cannot open, so the backend takes it from the worker that
creates it (:func:`_creator`), and refuses at init an MTP engine whose drafter it cannot
find. A draft session is still accepted, for the version the target holds (nothing is left to load).
A drafter of its own (an EAGLE head) is synced the same way with ``drafter=True`` in the init info.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.engines.staging import StagedWeights, invalid_stamp
from weightsync.engines.vllm import (
    DRAFT_PREFIX,
    WORKER_INVALID,
    ReloadSession,
    check_supported,
    drafter_layout,
    drafts_separately,
    in_place_targets,
    runs_mtp,
    spec_of,
    staging_quant,
)
from weightsync.engines.vllm_lora import WorkerLoraEngine
from weightsync.engines.vllm_parallel import replica_index, worker_index, worker_reads, workers_per_engine
from weightsync.engines.vllm_version import WORKER_VERSION
from weightsync.integrations import vllm_step_trace
from weightsync.integrations.vllm_callers import _calling_engine_core, _creator, _hosting_worker
from weightsync.layout.lora import LoraSpec
from weightsync.ports import device as device_port
from weightsync.ports.engine import ServingVersion
from weightsync.roles.prefetch import Prefetch
from weightsync.roles.reader import UpdateResult, WeightReader
from weightsync.session.config import SyncConfig, check_value, from_fields, job_config, with_job_settings

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
@with_job_settings()
class WeightSyncInitInfo(WeightTransferInitInfo):
    """Where the job's meta server is, who this worker is in the job, and the job's settings.

    Besides the fields below it has one field per job setting (``SyncConfig``'s wire form,
    :mod:`weightsync.session.config`): ``num_writers`` and ``num_readers`` are required, the rest
    take ``SyncConfig``'s defaults. Every field is checked when vLLM parses the dict
    (:meth:`from_wire`), and an error names it.
    """

    #: This engine's first reader rank; TP rank t of data-parallel replica d is reader
    #: ``rank + d * TP + t`` (:func:`reader_rank`), so ``num_readers`` counts every worker.
    rank: int = 0
    #: The meta server's token (``meta_address``, a job setting, says where it is). Empty: read
    #: WEIGHTSYNC_META_TOKEN (and, with ``meta_address`` empty, WEIGHTSYNC_META_ADDR) from the
    #: worker's environment.
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
    #: sync the engine's drafter of its own (an EAGLE head) too, the job's second model under ``draft.``
    drafter: bool = False

    def __post_init__(self) -> None:
        where = type(self).__name__
        for name, kind in (("rank", int), ("meta_token", str), ("lora_id", int), ("prefetch", bool),
                           ("drafter", bool)):
            check_value(getattr(self, name), kind, f"{where}.{name}")
        if self.lora is not None and not isinstance(self.lora, dict):
            raise ValueError(f"{where}.lora must be an adapter config (a mapping) or null, got "
                             f"{type(self.lora).__name__}")
        config = self.sync_config()
        if not 0 <= self.rank < config.reader_seats:
            raise ValueError(f"{where}.rank must be in [0, {config.reader_seats}) (the reader seats), got {self.rank}")
        if self.lora_id < 1:
            raise ValueError(f"{where}.lora_id must be >= 1 (vLLM reserves 0 for 'no adapter'), got {self.lora_id}")
        if self.prefetch and config.layer_phases:
            raise ValueError(f"{where}: prefetch=True with layer_phases=True: each phase is loaded into the model "
                             "as it arrives, so the transfer cannot overlap generation; choose one")
        if self.drafter and self.lora is not None:
            raise ValueError(f"{where}: drafter=True with lora: adapter versions are the target's adapter alone, "
                             "with no drafter in them; choose one")
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
    """The model inside this worker, and its MTP drafter if it drafts with one, loaded through one
    reload session per version (fed a phase of whole layers at a time with ``layer_phases``)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device, rank: int,
                 replicas: int, *, in_place: bool = True, draft: torch.nn.Module | None = None,
                 drafter: bool = False) -> None:
        check_supported(vllm_config, drafter=drafter)
        self.mtp = runs_mtp(vllm_config)
        #: the drafter of its own (``drafter``) is the job's second model, staged under DRAFT_PREFIX
        self.separate = drafter
        if draft is None and (self.mtp or drafter):
            raise RuntimeError("the weightsync backend did not find this engine's drafter (vLLM 0.32's Worker."
                               "load_model, get_draft_model()), and its weights would go stale")
        # with MTP drafting the MTP layers are staged too, for the drafter; a TP worker receives
        # only the slices its loaders read
        super().__init__(spec_of(vllm_config, mtp=self.mtp), dtype=vllm_config.model_config.dtype, device=device,
                         rank=rank, replicas=replicas, quant=staging_quant(vllm_config),
                         reads=worker_reads(vllm_config, mtp=self.mtp),
                         extra=drafter_layout(vllm_config, rank) if drafter else None)
        self.model = model
        self.vllm_config = vllm_config
        self._session: ReloadSession | None = None
        #: the drafter (MTP, or of its own with ``drafter``), reloaded with the target in every session
        self.draft = draft if self.mtp or drafter else None
        if in_place:  # parameters that need no processing are received straight into the model
            self.receive_in_place(in_place_targets(model, self, quantized=staging_quant(vllm_config) is not None))

    def _begin(self, version: int) -> None:
        self._session = ReloadSession(self.model, self.vllm_config, draft=self.draft,
                                      draft_prefix=DRAFT_PREFIX if self.separate else None)
        self._session.begin()

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        assert self._session is not None, "a load outside a reload session"
        self._session.load(items)

    def _end(self, version: int, *, failed: bool = False) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.end()

    def load_draft(self, version: int | None) -> None:
        """A draft session (vLLM's ``start_draft_weight_update``): the drafter was loaded with the
        target's version (its MTP layers, or its own tensors), so only that version is accepted, and
        nothing is loaded."""
        if version is not None and version != self._version:
            raise ValueError(f"a draft update to version {version}: the target model holds version "
                             f"{self._version}, and the drafter is updated with the target, not alone")


def staging_settings(vllm_config: Any) -> tuple[bool, int]:
    """``(layer_phases, max_bucket_bytes)`` of the job, as the engine declares them before it starts:
    vLLM's ``additional_config={"weightsync": {"layer_phases": ..., "max_bucket_bytes": ...}}``
    (``--additional-config`` for ``vllm serve``); undeclared: the whole model at once.

    Raises:
        ValueError: a malformed declaration, naming it.
    """
    extra = getattr(vllm_config, "additional_config", None)
    declared = extra.get("weightsync", {}) if isinstance(extra, dict) else {}
    if not isinstance(declared, dict) or set(declared) - {"layer_phases", "max_bucket_bytes"}:
        raise ValueError("vLLM's additional_config['weightsync'] takes layer_phases and max_bucket_bytes (the job's "
                         f"settings, to reserve staging for before the KV cache is sized), got {declared!r}")
    default = SyncConfig(num_writers=1, num_readers=1).transport_options.max_bucket_bytes
    phases, budget = declared.get("layer_phases", False), declared.get("max_bucket_bytes", default)
    check_value(phases, bool, "additional_config['weightsync']['layer_phases']")
    check_value(budget, int, "additional_config['weightsync']['max_bucket_bytes']")
    return phases, budget


def _staging_template(vllm_config: Any, device: torch.device) -> StagedWeights | None:
    """The staging this engine's worker will lay out, unallocated (None: it takes LoRA adapters)."""
    if vllm_config.lora_config is not None:
        return None
    mtp = runs_mtp(vllm_config)
    return StagedWeights(spec_of(vllm_config, mtp=mtp), dtype=vllm_config.model_config.dtype, device=device, rank=0,
                         quant=staging_quant(vllm_config))


def reserve_staging(vllm_config: Any, device: torch.device) -> torch.Tensor | None:
    """Device memory for the staging arena, taken while vLLM's worker builds this backend
    (``Worker.load_model``), before ``determine_available_memory`` sizes the KV cache: vLLM
    counts everything the worker holds by then against ``gpu_memory_utilization``, so staging
    comes out of the KV cache instead of the memory vLLM leaves outside it (a tenth of the GPU
    at the default 0.9, less than many models' staging). Its size follows the job's phases as
    the engine declares them (:func:`staging_settings`); the whole model when undeclared. None
    for host memory (vLLM's CPU build sizes its KV cache by setting, not by measuring)."""
    dev = device_port.current()
    template = _staging_template(vllm_config, device) if dev.is_gpu(device) else None
    if template is None:
        return None
    from weightsync.plan.phases import layer_phases

    phased, budget = staging_settings(vllm_config)
    phases = layer_phases(template.layout().canonical, budget_bytes=budget) if phased else None
    nbytes = template.arena_bytes(phases)
    return device_port.allocate(dev, nbytes, device, what="weightsync's staging reserve",
                                fix="lower gpu_memory_utilization so that the model and its staging fit, or "
                                    "declare layer_phases in additional_config={'weightsync': {...}}")


def reader_rank(first: int, num_readers: int, vllm_config: Any) -> int:
    """This worker's weightsync reader rank: the engine's first (``WeightSyncInitInfo.rank``) plus
    the worker's place in the engine, ``d * TP + t`` (:func:`~weightsync.engines.vllm_parallel.worker_index`).

    vLLM sends every worker of every DP replica ``init_weight_transfer_engine`` with one init
    info, so the rank cannot come from it alone; ``d`` is the replica's ``data_parallel_index``
    (:func:`~weightsync.engines.vllm_parallel.replica_index`), which a dense replica keeps when
    vLLM resets its ``data_parallel_rank`` to 0.

    Raises:
        ValueError: the engine's workers, or this worker, do not fit below ``num_readers``.
    """
    workers = workers_per_engine(vllm_config)
    if first + workers > num_readers:
        raise ValueError(f"this engine has {workers} workers (TP x DP), each a weightsync reader, from reader rank "
                         f"{first}: num_readers={num_readers} must be at least {first + workers} (the trainer side: "
                         "WeightSyncTrainerInitInfo.num_readers)")
    mine = first + worker_index(vllm_config)
    if mine >= num_readers:  # a dense DP replica sees DP=1: only its own rank tells
        replica = replica_index(vllm_config.parallel_config)
        raise ValueError(f"data-parallel replica {replica} of this engine would be reader {mine} "
                         f"(WeightSyncInitInfo.rank={first} + replica x TP + TP rank), and the job has num_readers="
                         f"{num_readers}: count every worker of every replica of every engine in num_readers, and "
                         "give each engine the rank of its first worker")
    return mine




class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """vLLM ``WeightTransferEngine`` hosting a weightsync ``WeightReader`` (see module docstring)."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    #: With MTP drafting the drafter's layers arrive, and are loaded, with every version of the target;
    #: a draft session of that version is accepted (see :meth:`_WorkerEngine.load_draft`).
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
        worker = _creator(model)
        #: the drafter (MTP, or of its own), taken now: only the worker creating this engine can say which
        drafts = runs_mtp(vllm_config) or drafts_separately(vllm_config)
        self._draft_model = worker.get_draft_model() if worker is not None and drafts else None
        self._drafter = self._draft_model if runs_mtp(vllm_config) else None  # the one synced
        #: its model runner (for the KV caches the engine-state oracle leaves out), None if not found
        self._runner = getattr(worker, "model_runner", None)
        #: the bench's timestamps of forwards and of these calls (None unless it asks: vllm_step_trace)
        self._trace = vllm_step_trace.install(model)
        #: staging memory taken now, before vLLM sizes its KV cache (laid out at init)
        self._reserve = reserve_staging(vllm_config, device)
        #: what the worker serves once its reader is shut down (the reader's last answer)
        self._served = ServingVersion(None, None, True)
        if worker is not None:  # drivers ask it by name: collective_rpc(WORKER_VERSION), GET /weightsync/version
            setattr(worker, WORKER_VERSION, self.serving_state)

    def __call__(self, query: str) -> dict[str, Any]:
        """Answer a weightsync query about this worker's engine, JSON-able: what the oracle reads
        through ``collective_rpc("weight_transfer_engine", args=("engine_state",))`` (an ``LLM`` of
        any process, or ``vllm serve``'s ``/collective_rpc``; :mod:`weightsync.engines.vllm_state`)."""
        from weightsync.engines.vllm_state import backend_query, kv_caches

        return backend_query(self._default_model, self._drafter, self.vllm_config, query,
                             runtime=kv_caches(self._runner) if self._runner is not None else ())

    def _span(self, call: str) -> Any:
        return self._trace.span(call) if self._trace is not None else contextlib.nullcontext()

    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightSyncInitInfo:
        """Every field checked, an error naming it (vLLM's default passes the dict on unchecked)."""
        return WeightSyncInitInfo.from_wire(init_dict)

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        from weightsync.meta.client import open_meta

        if self.reader is not None:
            raise RuntimeError("the weightsync transfer engine is already initialised; shut it down first")
        config = init_info.sync_config()
        lora = init_info.lora_spec()
        rank = reader_rank(init_info.rank, config.reader_seats, self.vllm_config)
        engine: Any
        if lora is not None:  # adapter-only versions, into vLLM's LoRA manager
            engine = WorkerLoraEngine(self._default_model, self.vllm_config, lora, lora_id=init_info.lora_id,
                                      rank=rank)
        else:  # prefetched bytes must not reach the model early: stage everything
            if runs_mtp(self.vllm_config) and self._drafter is None:
                raise RuntimeError(
                    "this engine drafts with the model's MTP layers (speculative_config method 'mtp'), and the "
                    "weightsync backend did not find its drafter: vLLM hands a weight-transfer engine the drafter "
                    "only in a draft session, which its trainer-side client cannot open, so the backend takes it "
                    "from the worker that creates it (vLLM 0.32's Worker.load_model, get_draft_model()), and this "
                    "vLLM created it elsewhere. Its MTP weights would go stale: run without speculative decoding, "
                    "or with vLLM 0.32")
            if init_info.drafter:  # synced from now on, and so part of the engine's state
                self._drafter = self._draft_model
            engine = self._worker = _WorkerEngine(self._default_model, self.vllm_config, self.device, rank,
                                                  config.reader_seats, in_place=not init_info.prefetch,
                                                  draft=self._drafter, drafter=init_info.drafter)
            # Staging is laid out now, not at the first update, in the memory reserved before vLLM
            # sized its KV cache (reserve_staging); what does not fit in it is allocated from what
            # vLLM left, or refused here with the figure, never inside a sync.
            engine.adopt_reserve(self._reserve)
            self._reserve = None
            engine.lay_out(layer_phases=config.layer_phases,
                           budget_bytes=config.transport_options.max_bucket_bytes)
        # unreachable for the job's timeout is an error, as any other wait of the job
        meta = open_meta(config.meta_address or None, job=config.job, token=init_info.meta_token or None,
                         timeout=config.timeout)
        self.reader = WeightReader(engine, rank=rank, config=config, meta=meta)
        self.prefetch = Prefetch(self.reader) if init_info.prefetch else None
        worker = _hosting_worker(sys._getframe(1), self)
        if worker is not None:  # drivers ask it after a failed update: collective_rpc(WORKER_INVALID)
            setattr(worker, WORKER_INVALID, self.invalid_state)
        else:
            logger.warning("weightsync: the vLLM worker hosting this backend was not found; drivers cannot ask it "
                           "whether a failed update left its weights invalid (%s)", WORKER_INVALID)
        what = (f"LoRA adapter id {init_info.lora_id} (r={lora.r})" if lora is not None else
                "phases of whole layers" if config.layer_phases else "the whole model at once")
        logger.info("weightsync reader %d ready (%s%s); staging is laid out", rank,
                    what, ", prefetching" if init_info.prefetch else "")

    def start_weight_update(self) -> None:
        # The data arrives, and is checked, before the reload session opens: nothing to prepare,
        # unless prefetching, which starts receiving now while the engine keeps generating.
        if self.reader is None:
            raise RuntimeError("call llm.init_weight_transfer_engine(...) before updating weights")
        # vLLM's start_draft_weight_update retargets this engine at the drafter before calling this
        self._draft_session = self.model is not self._default_model
        if self._draft_session:
            if self._worker is None or self._worker.draft is None or self.model is not self._worker.draft:
                raise RuntimeError("a draft weight update: weightsync syncs an MTP drafter (speculative_config "
                                   "method 'mtp'), or a drafter of its own when initialised with drafter=True, "
                                   "with the target's versions, and this engine does neither or takes LoRA adapters")
            return
        if self.prefetch is not None:
            with self._span("start_weight_update"):
                self.prefetch.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch.
        with self._span("update_weights"):
            try:
                self.receive_weights(self.parse_update_info(update_info))
            except BaseException:
                self._stamp_invalid(sys._getframe(1))
                raise
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

    def serving(self) -> ServingVersion:
        """Which version this worker serves, since when, valid or not: its reader's answer; before
        ``init_weight_transfer_engine`` its start-up weights, after shutdown the last answer."""
        return self.reader.serving() if self.reader is not None else self._served

    def serving_state(self) -> dict[str, Any]:
        """This worker's :data:`~weightsync.engines.vllm_version.WORKER_VERSION` answer (plain data)."""
        return self.serving().to_wire()

    def invalid_state(self) -> dict[str, Any] | None:
        """This worker's :data:`~weightsync.engines.vllm.WORKER_INVALID` answer: None while its
        weights are valid, else the failed version, its error and since when (plain data)."""
        invalid = self.reader.invalid if self.reader is not None else None
        return None if invalid is None else {"version": invalid.version, "error": invalid.error,
                                             "since": invalid.since}

    def _stamp_invalid(self, caller: FrameType | None) -> None:
        """The update failed: if it left this worker's engine invalid, stamp vLLM's weight version
        ``invalid:<version>`` before the error reaches the driver (module docstring)."""
        invalid = self.reader.invalid if self.reader is not None else None
        if invalid is None:
            return
        core = _calling_engine_core(caller)
        if core is None:  # a worker process of its own: the driver stamps (update_llm, the trainer side)
            logger.warning("weightsync: version %d left this worker's weights invalid; vLLM's engine core runs in "
                           "another process, so its driver must stamp its weight version %r (update_llm and the "
                           "trainer side do; over HTTP: POST /update_weight_version)", invalid.version,
                           invalid_stamp(invalid.version))
            return
        try:
            core.set_weight_version(invalid_stamp(invalid.version))
        except Exception as exc:  # the update's own error is what the driver must see
            logger.warning("weightsync: stamping vLLM's weight version invalid: %s", exc)

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
        self._reserve = None
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None
        if self.reader is not None:
            reader, self.reader = self.reader, None
            self._served = reader.serving()
            reader.close()
            reader.meta.close()
