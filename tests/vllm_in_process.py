"""What a test process does before it starts a vLLM engine inside itself
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or ``LLM`` in a script the test runs).

A server starts one engine and pays two start-up costs once. A test worker starts dozens of
engines, and paid them for every one (docs/benchmarks.md, "Engine starts in the suite"):

* **Model inspection in a new process.** vLLM inspects a model class it has not cached
  (``$VLLM_CACHE_ROOT/modelinfos``) in a fresh Python process, so that importing the model does not
  initialize CUDA in the engine's process. The CPU build has no CUDA to initialize, and that
  process (a fresh import of vLLM) took 15-18 s per architecture here. It runs in this process
  instead: the engine imports the model module right after anyway. The result is cached as before.
* **Collecting the test's heap.** vLLM collects the whole heap about ten times while an engine
  starts and stops (0.6 s each in a process holding vLLM and transformers), and freezes the heap
  itself once the engine is up (``freeze_gc_heap``); its shutdown unfreezes it. Freezing just
  before the start lets those collections skip what the process held before the engine. The
  engine's shutdown still unfreezes everything, so nothing stays frozen past the engine.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


def _in_this_process(inspect: Callable[[], _T]) -> _T:
    return inspect()


def inspect_models_here() -> None:
    """vLLM inspects model classes in this process from now on (the first cost above)."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = _in_this_process  # read at call time, as a module global


def before_engine_start() -> None:
    """Call right before ``LLM(...)`` in this process, once vLLM's environment is set: both costs
    above. The heap is frozen only when the engine runs in this process: an engine core in a
    process of its own would not unfreeze this one's at shutdown."""
    inspect_models_here()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        gc.collect()
        gc.freeze()


def cpu_attention(config: dict, dtype: str) -> str | None:
    """The attention backend to ask for where vLLM's CPU choice depends on the machine: on a CPU
    with AMX tiles vLLM prefers its AMX MLA backend, which packs ``W_UK`` and takes bf16 weights
    only (a float32 DeepSeek fails to start there: "expect weight to be bfloat16, ..."); the
    reference CPU MLA takes any dtype. A float32 MLA model asks for the reference one, for the
    target (``attention_config``) and an MTP drafter (``speculative_config``, which vLLM does
    not take from the target), so the tests run the same engine on every machine."""
    if dtype == "float32" and int(config.get("kv_lora_rank") or 0) > 0:
        return "CPU_MLA"
    return None
