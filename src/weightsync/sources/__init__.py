"""Training-side adapters (one module each): plain modules, FSDP2/DTensor, ZeRO-3, Megatron.

Importing this package imports no training framework: each adapter imports its own, lazily.
"""

from weightsync.ports.engine import TrainingSource
from weightsync.sources.deepspeed import ZeroSource
from weightsync.sources.dtensor import DTensorSource
from weightsync.sources.megatron import MegatronSource
from weightsync.sources.module import ModuleSource, ShardedSource

__all__ = ["DTensorSource", "MegatronSource", "ModuleSource", "ShardedSource", "TrainingSource", "ZeroSource"]
