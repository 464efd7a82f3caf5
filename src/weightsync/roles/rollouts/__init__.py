"""RL state beyond weights: multi-turn agent rollouts, and their KV cache, that outlive their engine.

    rollouts = Rollouts(RolloutStore(directory), KVStore(KVStoreConfig(directory=directory)))
    rollouts.start("r-17", prompt_ids, sampling=Sampling(max_tokens=64, seed=3))
    turn = rollouts.generate("r-17", engines, timeout=60)       # resumes elsewhere if its engine dies
    rollouts.append_turn("r-17", Turn(kind="tool", token_ids=ids, tool_call=call, tool_result=text))
    rollouts.finish("r-17")

Modules: ``record`` (the typed rollout record and its msgpack form), ``store`` (records in a
directory, replaced whole), ``kv`` (KV blocks per rollout and weight version, within a budget),
``engine`` (what an engine adapter implements), ``driver`` (the API above), ``loop`` (the tool
loop and token view TRL's and verl's integrations share), ``files`` (atomic files). The vLLM
side: ``weightsync.integrations.vllm_kv`` (the KV connector) and
``weightsync.integrations.vllm_rollouts`` (the engine adapter). docs/rl-state.md.

Names are imported on first use: the record and its store need no torch (a process that only
reads or writes records stays light).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync.roles.rollouts.driver import NoEngineError, ResumePoint, Rollouts, choose_engine
    from weightsync.roles.rollouts.engine import KV_PARAMS_KEY, EngineGoneError, TurnEngine, TurnRequest, TurnResult
    from weightsync.roles.rollouts.kv import BlockKey, KVMetrics, KVMissError, KVStore, KVStoreConfig
    from weightsync.roles.rollouts.loop import Tokens, Tool, flatten, open_rollout, tool_loop
    from weightsync.roles.rollouts.record import (
        RecordError,
        Resume,
        RolloutRecord,
        Sampling,
        ToolCall,
        Turn,
        VersionChange,
    )
    from weightsync.roles.rollouts.store import RolloutStore, StaleRecordError

_MODULES = {
    "driver": ("NoEngineError", "ResumePoint", "Rollouts", "choose_engine"),
    "engine": ("KV_PARAMS_KEY", "EngineGoneError", "TurnEngine", "TurnRequest", "TurnResult"),
    "kv": ("BlockKey", "KVMetrics", "KVMissError", "KVStore", "KVStoreConfig"),
    "record": ("RecordError", "Resume", "RolloutRecord", "Sampling", "ToolCall", "Turn", "VersionChange"),
    "store": ("RolloutStore", "StaleRecordError"),
    "loop": ("Tokens", "Tool", "flatten", "open_rollout", "tool_loop"),
}
_LAZY = {name: f"weightsync.roles.rollouts.{module}" for module, names in _MODULES.items() for name in names}
__all__ = [
    "KV_PARAMS_KEY", "BlockKey", "EngineGoneError", "KVMetrics", "KVMissError", "KVStore", "KVStoreConfig",
    "NoEngineError", "RecordError", "Resume", "ResumePoint", "RolloutRecord", "RolloutStore", "Rollouts",
    "Sampling", "StaleRecordError", "Tokens", "Tool", "ToolCall", "Turn", "TurnEngine", "TurnRequest", "TurnResult",
    "VersionChange", "choose_engine", "flatten", "open_rollout", "tool_loop",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync.roles.rollouts' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
