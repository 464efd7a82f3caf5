"""What the rollout driver needs of an inference engine: generate one turn, say its weight version.

An engine adapter (``weightsync.integrations.vllm_rollouts`` for vLLM, in process or in a process
of its own) implements :class:`TurnEngine`. The driver hands it a :class:`TurnRequest`: the
rollout's whole context, the turn's sampling and seed, and the weight version whose KV the
engine may load from the store and save to it (:meth:`TurnRequest.kv_transfer_params`, which an
engine passes to its KV connector untouched). The engine answers with a :class:`TurnResult`, or
raises :class:`EngineGoneError` when it died: its requests are lost and the driver resumes them on
another engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from weightsync.roles.rollouts.record import Sampling, check_rollout_id

#: the key of ``kv_transfer_params`` that the weightsync KV connector reads
KV_PARAMS_KEY = "weightsync_kv"


class EngineGoneError(RuntimeError):
    """The engine died, or was shut down, before the turn ended: the turn is lost."""


@dataclass(frozen=True, kw_only=True)
class TurnRequest:
    """One generated turn to run.

    Attributes:
        rollout_id: whose turn.
        turn: the index the turn will have in the rollout's record.
        token_ids: the context: every token of the rollout's complete turns.
        sampling: the rollout's sampling; ``seed`` is this turn's.
        seed: ``sampling.turn_seed(turn)``.
        kv_version: the weight version whose KV blocks the engine may load and save (its own, as
            the driver read it); None: no KV store.
    """

    rollout_id: str
    turn: int
    token_ids: tuple[int, ...]
    sampling: Sampling
    seed: int
    kv_version: int | None

    def __post_init__(self) -> None:
        check_rollout_id(self.rollout_id)
        if not self.token_ids:
            raise ValueError(f"rollout {self.rollout_id} turn {self.turn}: the context has no tokens")

    def to_wire(self) -> dict[str, Any]:
        """Plain values for msgpack (an engine in another process)."""
        return {"rollout_id": self.rollout_id, "turn": self.turn, "token_ids": list(self.token_ids),
                "sampling": {f.name: getattr(self.sampling, f.name) for f in dataclasses.fields(self.sampling)},
                "seed": self.seed, "kv_version": self.kv_version}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> TurnRequest:
        sampling = dict(obj["sampling"])
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
        return cls(rollout_id=obj["rollout_id"], turn=int(obj["turn"]), token_ids=tuple(obj["token_ids"]),
                   sampling=Sampling(**sampling), seed=int(obj["seed"]), kv_version=obj["kv_version"])

    def kv_transfer_params(self) -> dict[str, Any] | None:
        """What the engine passes to its KV connector for this request (None: no KV)."""
        if self.kv_version is None:
            return None
        return {KV_PARAMS_KEY: {"rollout": self.rollout_id, "version": self.kv_version}}


@dataclass(frozen=True, kw_only=True)
class TurnResult:
    """How a turn ended.

    Attributes:
        token_ids: the generated tokens (none of them kept if ``finish_reason`` is ``abort``).
        finish_reason: ``stop``, ``length`` or ``abort`` (the engine cut it, e.g. for an update).
        version_spans: ``(version, start, end)`` per run of tokens sampled under one version.
        engine: who ran it.
        prompt_tokens: the context's length.
        cached_tokens: context tokens the engine did not compute (its prefix cache, plus restored).
        restored_tokens: of those, tokens whose KV came from the store.
        logprobs: each generated token's log-probability (empty if not asked for).
    """

    token_ids: tuple[int, ...]
    finish_reason: str
    version_spans: tuple[tuple[int, int, int], ...]
    engine: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    restored_tokens: int = 0
    logprobs: tuple[float, ...] = ()

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    def to_wire(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["token_ids"] = list(self.token_ids)
        out["version_spans"] = [list(s) for s in self.version_spans]
        out["logprobs"] = list(self.logprobs)
        return out

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> TurnResult:
        return cls(**{**obj, "token_ids": tuple(obj["token_ids"]), "logprobs": tuple(obj["logprobs"]),
                      "version_spans": tuple(tuple(s) for s in obj["version_spans"])})


class TurnEngine(Protocol):
    """An engine that generates turns. ``generate`` may block; it is called from one thread per request."""

    @property
    def name(self) -> str: ...

    @property
    def weight_version(self) -> int | None:
        """The version of the weights it serves now (None: unknown)."""
        ...

    def generate(self, request: TurnRequest, *, timeout: float) -> TurnResult:
        """Run one turn.

        Raises:
            EngineGoneError: the engine died or was shut down.
            TimeoutError: the turn did not end within ``timeout`` seconds.
        """
        ...
