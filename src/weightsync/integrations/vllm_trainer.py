"""The ``"weightsync"`` backend on the trainer side of vLLM's weight-transfer API.

A user of vLLM's own API switches ``backend`` to ``"weightsync"`` on both sides and nothing
else changes::

    # vLLM (any process): LLM(..., weight_transfer_config={"backend": "weightsync"})
    #   or: VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "weightsync"}'
    # every trainer rank:
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=rank, num_writers=world, num_readers=1,
                                  meta_address=addr, meta_token=token, model_config=hf_config),
        client=HTTPVLLMWeightSyncClient("http://rollout:8000"), source=ModuleSource(fsdp_model))
    for step in range(steps):
        train_step()
        engine.send_weights()           # every rank; rank 0 drives the vLLM side

Unlike vLLM's built-in backends there is no sender rank that gathers the model: *every*
trainer rank is a weightsync writer of its own shards (a DTensor/FSDP2 module is sent
shard by shard, never ``full_tensor()``-ed), and the planner sends each byte once, straight
into each worker. Rank 0 alone talks to the vLLM control plane, exactly once per version:
``start_weight_update``; ``update_weights({"version": V})`` (the workers receive, running
concurrently with every rank's ``write(V)``); ``finish_weight_update(str(V))``; then the
prefix cache is reset (KV blocks cached with the old weights would be reused).

Sources: a weightsync training source (``DTensorSource``, ``ZeroSource``, ``MegatronSource``,
``ModuleSource``, ``ShardedSource``), vLLM's ``ModuleSource`` (unwrapped to the module: FSDP2
DTensors are read shard by shard), or any vLLM ``WeightSource``, whose ``held_names()`` says
what this rank holds (each held tensor is materialized by the source, copied once into
buffers weightsync sends from).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from weightsync.integrations.vllm_trainer_source import as_training_source
from weightsync.layout.lora import LoraSpec
from weightsync.ports.engine import ServingVersion
from weightsync.session.config import SCOPES, SyncConfig, check_value, job_config, job_wire, with_job_settings

if TYPE_CHECKING:
    from weightsync.roles.writer import WriteResult

logger = logging.getLogger(__name__)


@dataclasses.dataclass
@with_job_settings(defaults={"num_writers": 1, "num_readers": 1, "layer_phases": True})
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """What every trainer rank passes to ``trainer_init`` (``rank`` is this rank's).

    Besides the fields below it has one field per job setting (``SyncConfig``'s wire form,
    :mod:`weightsync.session.config`, docs/engines.md lists them), with ``SyncConfig``'s
    defaults except ``num_writers=1``, ``num_readers=1`` and ``layer_phases=True``. The
    workers receive every setting but the rank's own (``host``, ``transport_host``).

    Attributes:
        num_writers: trainer ranks (every one sends its own shards).
        num_readers: vLLM workers (one weightsync reader each).
        meta_address / meta_token: the job's meta server, reachable by trainers and workers
            (``meta_address`` is the job setting ``SyncConfig.meta_address``; an etcd cluster's
            ``etcd://`` address works too, with no token); empty: ``WEIGHTSYNC_META_ADDR`` /
            ``WEIGHTSYNC_META_TOKEN``, or, for a single trainer rank with neither set, an embedded
            server on this host (``meta_host``).
        model_config: the model's Hugging Face config, a dict or a transformers config object
            (needed for vLLM sources; weightsync sources carry their own).
        reader_rank: the weightsync rank of the engine's first worker (several engines: 0, 1, ...).
        lora_id: with a LoRA source (``LoraSource``), the adapter's id in the workers' LoRA manager
            (vllm serve: its position in ``--lora-modules``, from 1).
        layer_phases: move each version in phases of whole layers (``SyncConfig.layer_phases``), so
            a worker stages one phase (at most ``max_bucket_bytes``, or one layer) instead of the
            whole model.
        delta_anchor_every: 0 sends every version in full; K >= 1 sends each worker only what
            changed since the version it holds, with a full version at least every K
            (``TransportOptions.delta_anchor_every``: torch (gloo), shm, NIXL pull, file and routed between CPU ranks,
            refused elsewhere; with ``layer_phases`` a worker keeps a host copy of its share).
    """

    backend: ClassVar[str] = "weightsync"

    meta_token: str = ""
    meta_host: str = "127.0.0.1"
    model_config: Any = None
    reader_rank: int = 0
    lora_id: int = 1

    def __post_init__(self) -> None:
        where = type(self).__name__
        for name, kind in (("rank", int), ("meta_token", str), ("meta_host", str),
                           ("reader_rank", int), ("lora_id", int)):
            check_value(getattr(self, name), kind, f"{where}.{name}")
        self.model_config = hf_config_dict(self.model_config, f"{where}.model_config")
        config = self.sync_config()
        if not 0 <= self.rank < config.num_writers:
            raise ValueError(f"{where}.rank must be in [0, num_writers={config.num_writers}), got {self.rank}")
        if not 0 <= self.reader_rank < config.reader_seats:
            raise ValueError(f"{where}.reader_rank must be in [0, {config.reader_seats}) (the reader seats), got "
                             f"{self.reader_rank}")
        if self.lora_id < 1:
            raise ValueError(f"{where}.lora_id must be >= 1 (vLLM reserves 0 for 'no adapter'), got {self.lora_id}")

    def sync_config(self) -> SyncConfig:
        """The job's settings as this trainer rank's writer takes them."""
        return job_config(self, type(self).__name__)

    def worker_init_info(self, meta_address: str, meta_token: str,
                         lora: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What the workers' ``init_weight_transfer_engine`` needs (JSON-safe): every job setting
        but this rank's own, and ``lora`` (an adapter's PEFT config) for adapter-only versions."""
        wire = {name: value for name, value in job_wire(self).items() if SCOPES[name] != "rank"}
        out = {**wire, "meta_address": meta_address, "meta_token": meta_token, "rank": self.reader_rank}
        if lora is not None:
            out.update(lora=dict(lora), lora_id=self.lora_id)
        return out


def hf_config_dict(config: Any, what: str) -> dict[str, Any] | None:
    """A Hugging Face config as a plain dict: a mapping as is, a transformers config object by
    ``to_dict()`` (what weightsync publishes must be JSON).

    Raises:
        ValueError: naming ``what``, for anything else.
    """
    if config is None or isinstance(config, dict):
        return config
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        out = to_dict()
        if isinstance(out, Mapping):
            return dict(out)
    raise ValueError(f"{what} must be the model's Hugging Face config, a dict or a transformers config object "
                     f"(PretrainedConfig), got {type(config).__name__}")




class LLMClient:
    """vLLM's control plane for an ``LLM`` in this process (its engine core may be a child
    process): the four calls of ``VLLMWeightSyncClient``, plus the prefix-cache reset."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests are running)")

    def stamp_if_invalid(self) -> str | None:
        """After a failed version: stamp the engine ``invalid:<version>`` if a worker's weights are."""
        from weightsync.engines.vllm import stamp_if_invalid

        return stamp_if_invalid(self.llm)

    def serving(self) -> ServingVersion:
        """Which version the engine serves, since when, valid or not (its workers' answers)."""
        from weightsync.engines.vllm_version import serving_llm

        return serving_llm(self.llm)


def check_reset_answer(url: str, body: bytes) -> None:
    """Refuse a prefix-cache reset that vLLM answered 200 but did not do: since 0.32 the route says
    ``{"success": false}`` while running requests hold KV blocks, and the update would otherwise
    end with blocks of the old weights cached for reuse. An empty body (older vLLM answered with
    the status alone) is taken as done.

    Raises:
        RuntimeError: naming the route and what to do.
    """
    if not body.strip():
        return
    try:
        answer = json.loads(body)
    except ValueError:
        raise RuntimeError(f"POST {url} answered 200 with a body that is not JSON: {body[:200]!r}") from None
    if isinstance(answer, dict) and answer.get("success") is False:
        raise RuntimeError(f"POST {url} answered {{\"success\": false}}: vLLM did not reset its prefix cache "
                           "because requests are running and hold KV blocks computed with the old weights; "
                           "pause generation (POST /pause) before send_weights and resume (POST /resume) after it; "
                           "with /pause?mode=keep&clear_cache=false the frozen requests hold their blocks too: pause "
                           "with clear_cache (vLLM's default), which preempts them")


def prefix_cache_resetter(client: Any, timeout: float) -> Callable[[], None]:
    """How to drop KV blocks cached with the old weights, through whichever control plane
    ``client`` is; decided once, at ``trainer_init``, so that a client that cannot do it is an
    error then, not stale completions later.

    ``VLLMWeightSyncClient`` has no such call: a client with ``reset_prefix_cache()`` (ours,
    ``LLMClient``) uses it; vLLM's HTTP client (or anything with its ``base_url``) posts to the
    server's ``/reset_prefix_cache`` (a dev-mode route, like the weight-transfer routes); its
    Ray client (or anything with its actor ``handles``) calls each actor.

    Raises:
        ValueError: naming the client's type, when none of these applies.
    """
    if callable(getattr(client, "reset_prefix_cache", None)):
        return client.reset_prefix_cache  # type: ignore[no-any-return]
    base_url = getattr(client, "base_url", None)
    if isinstance(base_url, str):
        def over_http() -> None:
            import httpx

            url = f"{base_url.rstrip('/')}/reset_prefix_cache"
            response = httpx.post(url, timeout=timeout)
            response.raise_for_status()
            check_reset_answer(url, response.content)
        return over_http
    handles = getattr(client, "handles", None)
    if handles is not None:
        def over_ray() -> None:
            import ray

            ray.get([h.reset_prefix_cache.remote() for h in handles], timeout=timeout)
        return over_ray
    raise ValueError(f"{type(client).__name__} cannot reset vLLM's prefix cache (KV blocks computed with old "
                     "weights would be reused): give it a reset_prefix_cache() method, or use vLLM's "
                     "HTTPVLLMWeightSyncClient / RayVLLMWeightSyncClient or weightsync's LLMClient")


def embedded_meta_server(init_info: WeightSyncTrainerInitInfo, config: SyncConfig) -> tuple[str, str, Any]:
    """(address, token, server or None) of the meta server trainer ranks start when none is given:
    one trainer rank starts its own on ``meta_host``; several, launched by torchrun or accelerate,
    share the one rank 0 starts (:mod:`weightsync.meta.launch`).

    Raises:
        ValueError: several trainer ranks without a launcher's store (naming WEIGHTSYNC_META_ADDR).
    """
    from weightsync.meta.embedded import EmbeddedMetaServer
    from weightsync.meta.launch import LaunchEnv, no_store_error, shared_meta_server

    if config.num_writers == 1:
        server = EmbeddedMetaServer(host=init_info.meta_host).start()
        return server.address, server.token, server
    launch = LaunchEnv.from_env()
    if not launch.launched:
        raise no_store_error(dataclasses.replace(launch, rank=init_info.rank, world_size=config.num_writers))
    host = None if init_info.meta_host == "127.0.0.1" else init_info.meta_host  # default: from MASTER_ADDR
    return shared_meta_server(config.job, launch, timeout=config.timeout, host=host)


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """vLLM ``TrainerWeightTransferEngine`` hosting a weightsync writer per trainer rank."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, writer: Any, info: WeightSyncTrainerInitInfo,
                 closers: list[Any]) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.writer = writer
        self.info = info
        self.version = 0
        #: this rank's WriteResult of the last version sent (bytes on the wire, seconds per phase)
        self.last_result: WriteResult | None = None
        self._closers = closers
        self._lock = threading.Lock()
        self._reset_prefix_cache: Callable[[], None] = lambda: None  # the sender's is set at trainer_init
        #: the sender's way to stamp vLLM invalid after a failed version (vllm_trainer_stamp.py); None: none
        self._stamp_invalid: Callable[[], str | None] | None = None
        #: a write still running when the workers' error was raised (waited for by the next version)
        self._unfinished_write: Future[Any] | None = None
        #: seconds any one wait may take (the job's ``timeout``)
        self.timeout: float = info.sync_config().timeout

    @classmethod
    def trainer_init(cls, init_info: WeightSyncTrainerInitInfo, *, client: Any,
                     source: Any = None) -> WeightSyncTrainerEngine:
        from weightsync.integrations.vllm_trainer_stamp import invalid_stamper
        from weightsync.meta.client import open_meta
        from weightsync.meta.config import MetaEnv
        from weightsync.roles.writer import WeightWriter

        if source is None:
            raise ValueError("the weightsync trainer backend needs a source (a weightsync TrainingSource or a vLLM "
                             "WeightSource) on every trainer rank")
        config = init_info.sync_config()
        resetter = prefix_cache_resetter(client, config.timeout) if init_info.is_sender else None
        address, token = config.meta_address, init_info.meta_token
        closers: list[Any] = []
        if not address:
            env = MetaEnv.from_env()
            address, token = env.address or "", token or env.token or ""
        if not address:
            address, token, server = embedded_meta_server(init_info, config)
            if server is not None:
                closers.append(server.stop)
        meta = open_meta(address, job=config.job, token=token or None, timeout=config.timeout)
        closers.insert(0, meta.close)
        training_source = as_training_source(source, init_info.model_config, init_info.rank)
        lora = getattr(training_source, "lora", None)
        writer = WeightWriter(training_source, rank=init_info.rank, config=config, meta=meta)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, writer=writer, info=init_info,
                     closers=closers)
        if engine.is_sender:
            assert resetter is not None
            engine._reset_prefix_cache = resetter
            engine._stamp_invalid = invalid_stamper(client, config.timeout)
            adapter = lora.peft_config() if isinstance(lora, LoraSpec) else None  # adapter-only versions
            client.init_weight_transfer_engine(init_info.worker_init_info(address, token, adapter))
        return engine

    def send_weights(self, version: int | None = None) -> None:
        """Send the next version (or ``version``) on every rank; rank 0 drives vLLM (module docstring).

        Raises:
            SyncError: a rank or a worker failed. Workers whose weights the failed version touched
                are invalid, and rank 0 has stamped vLLM's weight version ``invalid:<version>``;
                the others keep their version. The next version recovers them.
        """
        with self._lock:
            self.version = version if version is not None else self.version + 1
            v = self.version
            unfinished, self._unfinished_write = self._unfinished_write, None
            if unfinished is not None:
                with contextlib.suppress(Exception):  # its error was the workers'; raised then
                    unfinished.result(timeout=self.timeout)
            if not self.is_sender:
                self.last_result = self.writer.write(v)
                return
            self.client.start_weight_update()
            try:
                self._send_and_update(v)
            except BaseException:
                self._stamp_if_invalid(v)
                raise
            self.client.finish_weight_update(weight_version=str(v))
            self._reset_prefix_cache()

    def _send_and_update(self, version: int) -> None:
        """This rank's ``write(version)`` while vLLM's workers receive it in ``update_weights``.

        Whichever side fails first is the error, raised as itself as soon as it happens: a worker
        that cannot join the job (a wrong token, an unreachable meta server) fails at once, while
        this rank's writer would only give up waiting for it at the job's timeout. Neither call is
        waited for past the timeout (threads that never answer are left behind, not joined).
        """
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="weightsync-vllm-send")
        deadline = time.monotonic() + self.timeout
        try:
            rpc = pool.submit(self.client.update_weights, {"version": version, "timeout": self.timeout})
            write = pool.submit(self.writer.write, version)
            done, _ = wait([rpc, write], timeout=self.timeout, return_when=FIRST_EXCEPTION)
            if rpc in done and rpc.exception() is not None and not (write in done and write.exception() is not None):
                self._unfinished_write = write  # the next version waits for it: one write at a time
                raise self._worker_error(rpc.exception(), version)  # the workers' refusal, as itself
            try:
                self.last_result = write.result(timeout=max(0.0, self.timeout))
            except BaseException:  # the writer's error is the one to see (the workers fail because of it) ...
                with contextlib.suppress(Exception):  # ... once they did: what they hold is then settled
                    rpc.result(timeout=max(0.0, deadline - time.monotonic()))
                raise
            self._worker_result(rpc, version)
        finally:
            pool.shutdown(wait=False)  # an RPC that never answers must not hold this call past its timeout

    def _worker_error(self, error: BaseException | None, version: int) -> BaseException:
        assert error is not None
        logger.error("trainer rank %d: vLLM's workers failed update_weights of version %d: %s: %s (this rank's "
                     "writer stops waiting for them at its timeout)", self.info.rank, version,
                     type(error).__name__, error)
        return error

    def serving(self) -> list[ServingVersion]:
        """Which version each engine behind the client serves, since when, valid or not (rank 0,
        the sender, asks; :func:`~weightsync.integrations.vllm_trainer_stamp.serving_reader`).

        Raises:
            ValueError: on a rank that does not drive vLLM, or a client that cannot be asked.
        """
        from weightsync.integrations.vllm_trainer_stamp import serving_reader

        ask = serving_reader(self.client, self.timeout) if self.is_sender else None
        if ask is None:
            raise ValueError(f"trainer rank {self.info.rank}: " + (
                "only the sender (is_sender=True) drives vLLM; ask the engine on that rank" if not self.is_sender
                else f"{type(self.client).__name__} cannot be asked which version vLLM serves: give it a serving() "
                     "method, or use vLLM's HTTP or Ray client"))
        return ask()

    def _stamp_if_invalid(self, version: int) -> None:
        """Version ``version`` failed: if it left a worker's weights mixed, stamp vLLM invalid."""
        if self._stamp_invalid is None:
            logger.warning("version %d failed, and %s cannot stamp vLLM's weight version invalid if a worker's "
                           "weights are (the meta server's status page shows its reader)", version,
                           type(self.client).__name__)
            return
        try:
            self._stamp_invalid()
        except Exception as exc:  # the update's own error is what the caller must see
            logger.warning("version %d failed; stamping vLLM's weight version invalid failed too: %s", version, exc)

    def _worker_result(self, rpc: Future[Any], version: int) -> None:
        """The workers' ``update_weights`` of ``version``: their error, or one naming where they
        receive from when they do not answer (``concurrent.futures`` times out with no message)."""
        from weightsync.session.sync_session import SyncError

        try:
            rpc.result(timeout=self.timeout)
        except FutureTimeout:
            raise SyncError(f"trainer rank {self.info.rank}: vLLM's workers did not finish update_weights of version "
                            f"{version} within {self.timeout:g} s after this rank sent it; they receive through "
                            f"the meta server at {self.writer.meta.address}: check that they reach it "
                            "(WeightSyncTrainerInitInfo.meta_address, meta_host) and the workers' log") from None

    def shutdown(self) -> None:
        """Release vLLM's workers (rank 0: ``shutdown_weight_transfer_engine``), then this rank's
        writer, then the meta server it started, if any.

        In that order: the workers' readers leave the job while its meta server still runs
        (stopped first, every worker's later shutdown stalled 30 s retrying it), and the
        ``LLM`` is free for another trainer without a call of the user's.
        """
        release = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if self.is_sender and release is not None:
            try:
                release()
            except Exception as exc:  # best effort: the trainer's side still closes
                logger.warning("releasing vLLM's workers from the weightsync trainer engine: %s", exc)
        self.writer.close()
        for close in self._closers:
            try:
                close()
            except Exception as exc:  # best effort, everything else still closes
                logger.warning("closing the weightsync trainer engine: %s", exc)
        self._closers = []


def register() -> None:
    """Register the trainer side with vLLM's ``WeightTransferTrainerFactory`` (idempotent).

    Runs when this module is imported, which any trainer does to build its
    :class:`WeightSyncTrainerInitInfo`, and from the ``vllm.general_plugins`` entry point.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if WeightSyncTrainerInitInfo.backend not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(WeightSyncTrainerInitInfo.backend, WeightSyncTrainerEngine)


register()
