"""Inference-side adapters (one module each): in-place buffers, HF transformers, vLLM, SGLang.

Engine libraries are imported only inside their own adapter module.
"""

from weightsync.engines.base import InferenceEngine
from weightsync.engines.buffers import ModuleEngine, ShardedEngine

__all__ = ["InferenceEngine", "ModuleEngine", "ShardedEngine"]
