"""Inference-side adapters (one module each): in-place buffers, HF transformers, vLLM, SGLang.

Engine libraries are imported only inside their own adapter module; the engine adapters are
attributes of this package that import their module on first use, so
``from weightsync.engines import VLLMEngine`` works without importing vLLM for everyone else.
"""

from __future__ import annotations

import importlib
from typing import Any

from weightsync.engines.buffers import ModuleEngine, ShardedEngine
from weightsync.ports.engine import InferenceEngine

#: attribute -> the adapter module that defines it (imported on first access)
_LAZY = {"VLLMEngine": "weightsync.engines.vllm", "update_llm": "weightsync.engines.vllm",
         "SGLangEngine": "weightsync.engines.sglang"}

__all__ = ["InferenceEngine", "ModuleEngine", "SGLangEngine", "ShardedEngine", "VLLMEngine", "update_llm"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'weightsync.engines' has no attribute {name!r}")
