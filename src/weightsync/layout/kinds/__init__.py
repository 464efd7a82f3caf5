"""Parallel layout kinds: ``hf``, ``fsdp``, ``deepspeed``, ``megatron``, ``vllm``.

Each module registers one kind with :func:`register_kind`; :func:`parse_layout` turns a
``kind:k=v,...`` string into it. Importing this package registers all built-in kinds.
"""

from weightsync.layout.kinds import deepspeed, fsdp, hf, megatron, vllm
from weightsync.layout.kinds.base import LayoutKind, known_kinds, parse_layout, register_kind
from weightsync.layout.kinds.deepspeed import DeepSpeedLayout
from weightsync.layout.kinds.fsdp import FSDPLayout
from weightsync.layout.kinds.hf import HFLayout
from weightsync.layout.kinds.megatron import MegatronLayout
from weightsync.layout.kinds.vllm import VLLMLayout

__all__ = [
    "DeepSpeedLayout",
    "FSDPLayout",
    "HFLayout",
    "LayoutKind",
    "MegatronLayout",
    "VLLMLayout",
    "deepspeed",
    "fsdp",
    "hf",
    "known_kinds",
    "megatron",
    "parse_layout",
    "register_kind",
    "vllm",
]
