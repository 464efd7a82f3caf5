"""Training-side adapters (one module each): plain modules, FSDP2/DTensor, ZeRO-3, Megatron."""

from weightsync.sources.base import TrainingSource
from weightsync.sources.module import ModuleSource, ShardedSource, allocate

__all__ = ["ModuleSource", "ShardedSource", "TrainingSource", "allocate"]
