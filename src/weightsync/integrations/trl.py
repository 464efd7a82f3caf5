"""TRL's ``GRPOTrainer`` syncing its vLLM engine through weightsync: a one-line switch.

The switch is the import; nothing else in a TRL script changes::

    from weightsync.integrations.trl import GRPOTrainer      # instead of: from trl import GRPOTrainer

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(use_vllm=True, vllm_mode="server"),
                          train_dataset=dataset)              # optional: weightsync=TRLSyncSettings(job="grpo")
    trainer.train()

* **Server mode** (``vllm_mode="server"``): start the server with weightsync's backend,
  ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "weightsync"}'``.
  Every training rank is a weightsync writer of the parameters it holds (FSDP2 shards,
  ZeRO-3 partitions, or its share of a DDP replica), sent straight into the server's worker
  through the ``"weightsync"`` trainer backend of vLLM's weight-transfer API
  (:mod:`weightsync.integrations.vllm_trainer`): no rank gathers the model. The main process drives
  the server's routes once per sync (start, update, finish with the weight version, prefix-cache
  reset), as TRL's own client does.
* **Colocate mode** (``vllm_mode="colocate"``): TRL builds one in-process ``LLM`` per rank; each
  rank is a writer and its ``LLM`` a weightsync reader (:class:`~weightsync.engines.vllm.VLLMEngine`),
  over shared memory, loading the weights in one vLLM reload session per sync instead of TRL's
  ``load_weights`` call per parameter.

Each sync is version ``trainer.state.global_step``, the step TRL itself marks as loaded, and the
engine's weight version (``/weight_info``, ``CompletionOutput.weight_versions``) is its string.
A PEFT model syncs its merged weights, as TRL does (merge, send, unmerge): TRL generates with the
base model's name, never with an adapter, so an adapter-only sync would not be used.

Why a subclass: TRL 1.16 has no hook for the weight sync. ``GRPOTrainer.__init__`` builds its
``VLLMGeneration``, which in server mode opens the NCCL weight-transfer group (that raises on
a CPU machine and is refused by a weightsync server). The subclass swaps in
:class:`WeightSyncVLLMGeneration` for the duration of its own ``__init__`` only, and the
versions it was written against are checked first (:func:`check_trl_version`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import trl
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from weightsync.integrations.trl_sync import TRLSyncSettings

logger = logging.getLogger(__name__)

#: The TRL releases whose GRPOTrainer / VLLMGeneration internals this module was written against.
SUPPORTED_TRL = ("1.16.",)
#: What each sync adds to TRL's logged metrics: the sync's wall time on this rank, the bytes this
#: rank sent (its own shard: no rank gathers the model), and how many steps the weights vLLM
#: generates with are behind the trainer's (0 when the sync completed: TRL syncs before generating).
SYNC_METRICS = ("weightsync/sync_seconds", "weightsync/bytes", "weightsync/version_lag")


def check_trl_version(version: str | None = None) -> None:
    """Refuse a TRL release this integration was not written against.

    Raises:
        RuntimeError: naming the installed version and the supported ones.
    """
    version = version or trl.__version__
    if not version.startswith(SUPPORTED_TRL):
        raise RuntimeError(
            f"weightsync.integrations.trl supports TRL {', '.join(v + '*' for v in SUPPORTED_TRL)}, found trl "
            f"{version}: it replaces the weight sync of TRL's VLLMGeneration, whose internals change between "
            "releases. Install a supported TRL (pip install 'weightsync[trl]'), or use trl's GRPOTrainer")
    from trl.trainer import grpo_trainer

    if getattr(grpo_trainer, "VLLMGeneration", None) is not VLLMGeneration or not callable(
            getattr(VLLMGeneration, "_init_vllm", None)):
        raise RuntimeError(f"trl {version} does not build its vLLM engine through VLLMGeneration._init_vllm as "
                           "weightsync.integrations.trl expects")


class GRPOTrainer(trl.GRPOTrainer):  # type: ignore[misc]
    """TRL's ``GRPOTrainer`` whose vLLM weight sync goes through weightsync (module docstring).

    Args:
        weightsync: weightsync's settings (defaults: an embedded meta server on loopback).
        *args, **kwargs: exactly TRL's.

    Raises:
        RuntimeError: on a TRL release this integration does not support.
        ValueError: on a vLLM setup weightsync cannot serve (named with the fix).
    """

    def __init__(self, *args: Any, weightsync: TRLSyncSettings | None = None, **kwargs: Any) -> None:
        check_trl_version()
        with _generation_class(weightsync or TRLSyncSettings()):
            super().__init__(*args, **kwargs)
        if self.use_vllm:
            generation = self.vllm_generation
            assert isinstance(generation, WeightSyncVLLMGeneration)
            generation.version_of = lambda: int(self.state.global_step)
            generation.record = self._record_sync

    def _record_sync(self, metrics: dict[str, float]) -> None:
        """A sync's figures among TRL's logged metrics (averaged over the logging steps, as TRL's own)."""
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)


_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def _generation_class(settings: TRLSyncSettings) -> Iterator[None]:
    """TRL's trainer module builds :class:`WeightSyncVLLMGeneration` while the block runs."""
    from trl.trainer import grpo_trainer

    def build(*args: Any, **kwargs: Any) -> WeightSyncVLLMGeneration:
        return WeightSyncVLLMGeneration(*args, weightsync=settings, **kwargs)

    with _SWAP_LOCK:
        setattr(grpo_trainer, "VLLMGeneration", build)  # noqa: B010 (a module global, restored below)
        try:
            yield
        finally:
            setattr(grpo_trainer, "VLLMGeneration", VLLMGeneration)  # noqa: B010


class WeightSyncVLLMGeneration(VLLMGeneration):  # type: ignore[misc]
    """TRL's vLLM generation, unchanged, with weightsync's ``sync_weights`` (module docstring)."""

    def __init__(self, *args: Any, weightsync: TRLSyncSettings, **kwargs: Any) -> None:
        self.weightsync = weightsync
        self.sync: Any = None  # _ServerSync or _ColocateSync, set by _init_vllm
        #: the version of the next sync: the trainer's global step (GRPOTrainer sets it)
        self.version_of: Callable[[], int] = lambda: 0
        #: where each sync's metrics go (GRPOTrainer: its logged metrics, :data:`SYNC_METRICS`)
        self.record: Callable[[dict[str, float]], None] = lambda metrics: None
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        from weightsync.integrations.trl_sync import ColocateSync, ServerSync

        accelerator = self.accelerator
        if self.mode == "server":
            # TRL's server set-up minus init_communicator, the NCCL group weightsync replaces.
            if accelerator.is_main_process:
                self.vllm_client = VLLMClient(base_url=self.base_url, group_port=self.group_port,
                                              connection_timeout=self.server_timeout)
            self.sync = ServerSync(self, self.weightsync)
            accelerator.wait_for_everyone()
        elif self.mode == "colocate":
            if self.enable_sleep_mode:
                raise ValueError(
                    "vllm_enable_sleep_mode=True with weightsync: TRL sleeps the engine at level 2 after every "
                    "generation, which discards its weights, so weightsync would re-send the whole model before every "
                    "generation instead of once per optimizer step (as TRL's own path does: 0.51 s and 0.38 s per "
                    "sync of a 58M-parameter model on 2 ranks, docs/benchmarks.md); level 1 would keep the weights in "
                    "host memory, but TRL 1.16 calls sleep(level=2) itself, and vLLM's CPU build ignores sleep. Set "
                    "vllm_enable_sleep_mode=False (docs/distributed.md), or use trl's GRPOTrainer")
            super()._init_vllm()
            self.sync = ColocateSync(self, self.weightsync)
        else:
            super()._init_vllm()  # TRL's own error for an unknown mode

    @property
    def base_url(self) -> str:
        """The vLLM server's URL, as TRL builds it from ``GRPOConfig`` (on every rank)."""
        return str(self.server_base_url or f"http://{self.server_host}:{self.server_port}")

    def sync_weights(self) -> None:
        """Send the trainer's current weights to vLLM as version ``global_step`` (every rank).

        A sync of the version vLLM already holds does nothing: the weights change only with the
        global step. Each sync's :data:`SYNC_METRICS` go to TRL's logged metrics.
        """
        version = self.version_of()
        start = time.perf_counter()
        sent = self.sync.sync(version)
        if sent is not None:
            self.record({"weightsync/sync_seconds": time.perf_counter() - start, "weightsync/bytes": float(sent.nbytes),
                         "weightsync/version_lag": float(version - self.sync.version)})

    def close(self) -> None:
        """Leave the weightsync job (writers, readers, an embedded meta server)."""
        if self.sync is not None:
            self.sync.close()
