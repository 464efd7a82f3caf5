"""The two ways :mod:`weightsync.integrations.trl` moves a TRL trainer's weights into vLLM.

:class:`ServerSync` (``vllm_mode="server"``) makes every trainer rank a writer through the
``"weightsync"`` trainer backend of vLLM's weight-transfer API; :class:`ColocateSync`
(``vllm_mode="colocate"``) makes every rank a writer and its in-process ``LLM`` a reader.
Both are built on every rank by ``WeightSyncVLLMGeneration._init_vllm`` and driven by its
``sync_weights``::

    sync = ServerSync(generation, settings)     # every rank, when TRL sets up vLLM
    sync.sync(version)                          # every rank, each time TRL syncs
    sync.close()

The writer is created at the first sync, not at set-up: the trainer shards (FSDP2) or
partitions (ZeRO-3) the model when training starts, after TRL built its vLLM side.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from weightsync.session.config import (
    UNKNOWN_READERS,
    SyncConfig,
    check_value,
    job_config,
    job_wire,
    with_job_settings,
)

if TYPE_CHECKING:
    from weightsync.roles.writer import WriteResult

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
@with_job_settings(exclude=("num_writers", "num_readers", "host", "transport_host"),
                   defaults={"job": "trl", "layer_phases": True})
class TRLSyncSettings:
    """weightsync's settings for a TRL trainer (the same on every rank).

    Besides the fields below, every job setting of ``SyncConfig``'s wire form
    (:mod:`weightsync.session.config`) but the job's size (TRL's world) and the rank's own node and
    address; defaults as ``SyncConfig``'s, except ``job="trl"`` and ``layer_phases=True``
    (a vLLM worker stages one phase of whole layers rather than a copy of the whole model).

    Attributes:
        meta_address / meta_token: the job's meta server, reachable by every trainer rank and by
            the vLLM server (``meta_address`` is the job setting ``SyncConfig.meta_address``: an
            etcd cluster's ``etcd://`` address works too, with no token); empty:
            ``WEIGHTSYNC_META_ADDR`` / ``WEIGHTSYNC_META_TOKEN`` if set, else the main process
            starts an embedded one on ``meta_host`` and tells the others.
        meta_host: the interface the embedded meta server listens on: loopback by default, an
            address the other nodes reach when the trainers or the vLLM server span machines.
    """

    meta_token: str = ""
    meta_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        for name in ("meta_token", "meta_host"):
            check_value(getattr(self, name), str, f"TRLSyncSettings.{name}")
        if self.meta_token and not self.coordinator:
            raise ValueError("TRLSyncSettings.meta_token is set without meta_address: give both, or neither")
        self.sync_config(num_writers=1, num_readers=UNKNOWN_READERS)  # every job setting checked now, named

    @property
    def coordinator(self) -> str:
        """``meta_address`` as given (a job setting: ``with_job_settings`` declares it, not this class)."""
        return str(job_wire(self)["meta_address"])

    def sync_config(self, *, num_writers: int, num_readers: int) -> SyncConfig:
        """The job's settings for ``num_writers`` trainer ranks and ``num_readers`` engines."""
        return job_config(self, "TRLSyncSettings", num_writers=num_writers, num_readers=num_readers)

    def trainer_init_info(self, *, rank: int, world: int, meta_address: str, meta_token: str,
                          model_config: Any, readers: int = 1) -> Any:
        """vLLM's ``WeightSyncTrainerInitInfo`` for trainer rank ``rank`` of ``world`` (server mode),
        into a server of ``readers`` workers (TP x PP x DP: one weightsync reader each)."""
        from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo

        job = {**job_wire(self), "num_writers": world, "num_readers": readers, "meta_address": meta_address}
        return WeightSyncTrainerInitInfo(rank=rank, meta_token=meta_token, model_config=model_config, **job)


class _Sync:
    """What both modes share: the job's meta server, the version guard, the writer's source."""

    def __init__(self, generation: Any, settings: TRLSyncSettings) -> None:
        self.generation = generation
        self.settings = settings
        self.accelerator = generation.accelerator
        self.rank = int(self.accelerator.process_index)
        self.world = int(self.accelerator.num_processes)
        self.version: int | None = None
        #: seconds any one wait may take (the job's ``timeout``)
        self.timeout = settings.sync_config(num_writers=1, num_readers=UNKNOWN_READERS).timeout
        #: this rank's WriteResult of the last version (bytes on the wire, seconds per phase)
        self.last_result: WriteResult | None = None
        self._closers: list[Any] = []
        self._lock = threading.Lock()
        atexit.register(self.close)

    def _meta(self, check: Any = None) -> dict[str, Any]:
        """The job's meta server (``address``, ``token``), the same on every rank; ``check()`` runs
        on the main process first and the fields it returns are shared too (an ``error`` it
        returns is raised on every rank)."""
        from weightsync.meta.config import MetaEnv

        payload: dict[str, Any] | None = None
        if self.accelerator.is_main_process:
            payload = {"address": self.settings.coordinator, "token": self.settings.meta_token, "error": ""}
            try:
                payload.update(check() if check is not None else {})
                if not payload["address"]:
                    env = MetaEnv.from_env()
                    payload["address"], payload["token"] = env.address or "", env.token or ""
                if not payload["address"]:
                    from weightsync.meta.embedded import EmbeddedMetaServer

                    server = EmbeddedMetaServer(host=self.settings.meta_host).start()
                    self._closers.append(server.stop)
                    payload["address"], payload["token"] = server.address, server.token
            except Exception as exc:  # every rank must learn it, or the others wait forever
                payload["error"] = f"{type(exc).__name__}: {exc}"
        shared = share_from_main(self.accelerator, payload)
        if shared["error"]:
            raise ValueError(f"weightsync (TRL {self.generation.mode} mode): {shared['error']}")
        return shared

    def _source(self) -> Any:
        """This rank's training source over the trainer's model (merged-weight names for PEFT)."""
        return training_source(self.generation.model, self.rank)

    def sync(self, version: int) -> WriteResult | None:
        """Send ``version`` (every rank); this rank's result, or None when vLLM holds it already."""
        with self._lock:
            if self.version is not None and version <= self.version:
                if version == self.version:
                    return None  # vLLM holds this step's weights already
                raise ValueError(f"weightsync: version {version} (the trainer's global step) is older than "
                                 f"{self.version}, which vLLM holds; a resumed run must not go back in steps")
            with merged_adapter(self.generation.model):
                self.last_result = self._send(version)
            self.version = version
            logger.info("weightsync: rank %d sent version %d (%d bytes, %.3f s)", self.rank, version,
                        self.last_result.nbytes, self.last_result.seconds)
            return self.last_result

    def _send(self, version: int) -> WriteResult:
        raise NotImplementedError

    def close(self) -> None:
        closers, self._closers = self._closers, []
        for close in closers:
            try:
                close()
            except Exception as exc:  # best effort: everything else still closes
                logger.warning("weightsync: closing the TRL sync: %s", exc)


class ServerSync(_Sync):
    """Every rank writes its shards into a ``vllm serve --weight-transfer-config
    '{"backend": "weightsync"}'`` server; the main process drives the server's routes."""

    def __init__(self, generation: Any, settings: TRLSyncSettings) -> None:
        super().__init__(generation, settings)
        self.engine: Any = None
        shared = self._meta(self._check_server)
        self.address, self.token = str(shared["address"]), str(shared["token"])
        #: the server's workers (TP x DP), each a weightsync reader of the slices it loads
        self.readers = int(shared["readers"])

    def _check_server(self) -> dict[str, Any]:
        client = self.generation.vllm_client
        transfer = client.get_server_info().get("weight_transfer_config") or {}
        if transfer.get("backend") != "weightsync":
            return {"error": f"the vLLM server at {client.base_url} runs weight-transfer backend "
                             f"{transfer.get('backend')!r}; start it with --weight-transfer-config "
                             "'{\"backend\": \"weightsync\"}' (and VLLM_SERVER_DEV_MODE=1)"}
        return {"readers": int(client.get_world_size())}

    def _send(self, version: int) -> WriteResult:
        if self.engine is None:
            self.engine = self._start()
        self.engine.send_weights(version)
        result: WriteResult | None = self.engine.last_result
        assert result is not None
        return result

    def _start(self) -> Any:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        source = self._source()
        info = self.settings.trainer_init_info(rank=self.rank, world=self.world, meta_address=self.address,
                                               meta_token=self.token, model_config=source.config,
                                               readers=self.readers)
        client = HTTPVLLMWeightSyncClient(self.generation.base_url, timeout=self.timeout)  # rank 0 drives it
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        self._closers.insert(0, engine.shutdown)
        return engine


class ColocateSync(_Sync):
    """Every rank writes its shards; every rank's in-process ``LLM`` reads a whole model.

    **The local copy.** When this rank holds the whole model (a DDP replica), nothing needs to
    cross a process: the engine worker in this process loads the rank's own tensors through
    vLLM's loader (:meth:`~weightsync.engines.staging.StagedWeights.load_local`), with no shared
    memory, no staging copy and no meta-server round trip. That holds for a TP worker too
    (``vllm_tensor_parallel_size > 1``): its loader takes whole checkpoint tensors and keeps its
    own slices, as when it starts. Every rank decides it from its own tensors, and the ranks of
    one job agree: DDP ranks all hold replicas."""

    def __init__(self, generation: Any, settings: TRLSyncSettings) -> None:
        from weightsync.engines.vllm import VLLMEngine
        from weightsync.meta.client import open_meta
        from weightsync.roles.reader import WeightReader

        super().__init__(generation, settings)
        self.writer: Any = None
        #: this rank's source when its engine loads it locally (False: the job moves the shards)
        self._local_source: Any = None
        shared = self._meta()
        self.address, self.token = str(shared["address"]), str(shared["token"])
        self.meta = open_meta(self.address, job=self._config().job, token=self.token or None, timeout=self.timeout)
        self._closers.insert(0, self.meta.close)
        engine = VLLMEngine(generation.llm, rank=self.rank, replicas=self.world)
        self.engine = engine
        self.reader = WeightReader(engine, rank=self.rank, config=self._config(), meta=self.meta)
        self._closers.insert(0, self.reader.close)

    def _config(self) -> SyncConfig:
        return self.settings.sync_config(num_writers=self.world, num_readers=self.world)

    def _send(self, version: int) -> WriteResult:
        from weightsync.roles.writer import WeightWriter, WriteResult

        local = self._local_weights()
        if local is not None:
            t0 = time.perf_counter()
            self.engine.load_local(local, version=version)
            return WriteResult(version, 0, {"local": time.perf_counter() - t0})  # no byte left the process
        if self.writer is None:
            self.writer = WeightWriter(self._source(), rank=self.rank, config=self._config(), meta=self.meta)
            self._closers.insert(0, self.writer.close)
        writer = self.writer
        result: WriteResult = run_concurrently(lambda: self.reader.update(version, timeout=self.timeout),
                                               lambda: writer.write(version), self.timeout)
        return result

    def _local_weights(self) -> dict[str, torch.Tensor] | None:
        """This rank's whole model under the engine's checkpoint names when the engine can load it
        here (module docstring), else None (the job moves the shards)."""
        shards = self.engine.layout().shards
        if self._local_source is None:  # decided once: the model's structure and the settings do not change
            self._local_source = False
            if self._local_allowed():
                source = self._source()
                held = source.tensors()  # FSDP2 or ZeRO shards, or a TP engine's slices, are not whole
                if all(s.name in held and tuple(held[s.name].shape) == s.shape for s in shards):
                    self._local_source = source
                    logger.info("weightsync: rank %d holds the whole model its engine loads: each version is a "
                                "local copy", self.rank)
        if self._local_source is False:
            return None
        held = self._local_source.tensors()
        return {s.name: held[s.name] for s in shards}

    def _local_allowed(self) -> bool:
        """Whether the settings leave the data path to weightsync: a transport asked for by name,
        integrity checks, deltas or the fleet-wide commit each need the job's path, which honours them."""
        config = self._config()
        asked = [name for name, on in (("transport", config.transport != "auto"), ("integrity", config.integrity),
                                       ("delta_anchor_every", config.transport_options.delta_anchor_every > 0),
                                       ("commit", config.commit != "each")) if on]
        if asked:
            logger.info("weightsync: rank %d sends through the job, not a local copy, as %s asks", self.rank,
                        " and ".join(asked))
        return not asked


def share_from_main(accelerator: Any, payload: dict[str, Any] | None) -> dict[str, Any]:
    """The main process's ``payload`` on every rank, as JSON bytes broadcast over the process group."""
    if accelerator.num_processes == 1:
        assert payload is not None
        return payload
    import torch.distributed as dist

    data = json.dumps(payload).encode() if accelerator.is_main_process else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=accelerator.device)
    dist.broadcast(size, src=0)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=accelerator.device)
    if accelerator.is_main_process:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    shared: dict[str, Any] = json.loads(bytes(buffer.cpu().tolist()))
    return shared


def run_concurrently(first: Callable[[], Any], second: Callable[[], Any], timeout: float) -> Any:
    """``first()`` on a helper thread while ``second()`` runs here; ``second``'s result; raises either's error."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-trl") as pool:
        future = pool.submit(first)
        try:
            return second()
        finally:
            future.result(timeout=timeout)


# -- the trainer's model as a training source ------------------------------------------------

def hf_config(model: Any) -> dict[str, Any]:
    """The Hugging Face config of a transformers model, PEFT-wrapped or not."""
    base = model.get_base_model() if _is_peft(model) else model
    config = getattr(base, "config", None)
    if config is None:
        raise ValueError(f"{type(base).__name__} has no Hugging Face config: weightsync's TRL integration needs a "
                         "transformers model")
    return dict(config.to_dict())


def training_source(model: torch.nn.Module, rank: int) -> Any:
    """This rank's source: ZeRO-3 partitions, FSDP2 shards, or a whole (DDP) replica, under the
    checkpoint names vLLM loads (a PEFT model: its merged base weights)."""
    from weightsync.sources import DTensorSource, ZeroSource

    config = hf_config(model)
    view: Any = PeftMergedView(model) if _is_peft(model) else model
    if any(hasattr(p, "ds_tensor") for p in model.parameters()):
        return ZeroSource(view, config, rank=rank)
    if any(type(p).__name__ == "FlatParameter" for p in model.parameters()):
        raise ValueError("FSDP1 flattens parameters, which weightsync cannot send without a gather: use FSDP2 "
                         "(fsdp_config={'version': 2}), the default of transformers >= 5")
    return DTensorSource(view, config, rank=rank)  # FSDP2 shards; plain tensors are whole replicas


def _is_peft(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "merge_adapter", None)) and callable(getattr(model, "get_base_model", None))


class PeftMergedView:
    """A PEFT model's parameters under the names of the merged checkpoint, as TRL names them
    for vLLM: ``base_model.model.`` and ``.base_layer`` dropped, the adapter's own tensors and
    ``modules_to_save``'s original copies left out, its trained copies renamed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.peft_model = model
        self.prefix = str(getattr(model, "prefix", "lora_"))

    def name(self, name: str) -> str | None:
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if self.prefix in name or "original_module" in name:
            return None
        return name.replace("modules_to_save.default.", "")

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, param in self.peft_model.named_parameters():
            renamed = self.name(name)
            if renamed is not None:
                yield renamed, param

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buffer in self.peft_model.named_buffers():
            renamed = self.name(name)
            if renamed is not None:
                yield renamed, buffer

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def modules(self) -> Iterator[torch.nn.Module]:
        return self.peft_model.modules()


@contextlib.contextmanager
def merged_adapter(model: Any) -> Iterator[None]:
    """A PEFT model's adapters merged into its base weights while the block runs (TRL does the same)."""
    if not _is_peft(model):
        yield
        return
    with torch.no_grad():
        model.merge_adapter()
    try:
        yield
    finally:
        with torch.no_grad():
            model.unmerge_adapter()
