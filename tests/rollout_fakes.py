"""A fake fleet for the rollout tests: engines whose faults a test schedules, and a hash for a model."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from weightsync.roles.rollouts import EngineGoneError, RolloutRecord, Rollouts, ToolCall, Turn, TurnRequest, TurnResult


def model(context: tuple[int, ...], version: int, seed: int, n: int) -> tuple[int, ...]:
    digest = hashlib.sha256(repr((context, version, seed)).encode()).digest()
    return tuple(b % 500 for b in digest[:n])


@dataclass
class FakeEngine:
    """Generates ``model(...)``; dies at the turns in ``die_at``; an update aborts the turns in ``abort_at``."""

    name: str
    version: int
    die_at: set[int] = field(default_factory=set)
    abort_at: dict[int, int] = field(default_factory=dict)  # turn -> the version the update brings
    dead: bool = False
    requests: list[TurnRequest] = field(default_factory=list)

    @property
    def weight_version(self) -> int:
        return self.version

    def generate(self, request: TurnRequest, *, timeout: float) -> TurnResult:
        if self.dead or request.turn in self.die_at:
            self.dead = True
            raise EngineGoneError(f"{self.name} was killed")
        self.requests.append(request)
        if request.turn in self.abort_at:
            self.version = self.abort_at.pop(request.turn)
            return TurnResult(token_ids=(), finish_reason="abort", version_spans=(), engine=self.name)
        tokens = model(request.token_ids, self.version, request.seed, request.sampling.max_tokens)
        return TurnResult(token_ids=tokens, finish_reason="length", version_spans=((self.version, 0, len(tokens)),),
                          engine=self.name, prompt_tokens=len(request.token_ids))


def tool_turn(turn: Turn) -> Turn:
    """A deterministic tool: answers a generated turn with a function of its tokens."""
    call = ToolCall(name="lookup", arguments=f'{{"key": {sum(turn.token_ids)}}}', call_id=f"c{sum(turn.token_ids)}")
    return Turn(kind="tool", token_ids=tuple((t * 7 + 3) % 500 for t in turn.token_ids[:3]), tool_call=call,
                tool_result=str(sum(turn.token_ids)))


def run(rollouts: Rollouts, rollout_id: str, fleet: list[FakeEngine], turns: int = 3) -> RolloutRecord:
    """The 3-turn tool loop: generate, call the tool, feed its result back; the last turn answers."""
    for i in range(turns):
        turn = rollouts.generate(rollout_id, fleet, timeout=10)
        if i < turns - 1:
            rollouts.append_turn(rollout_id, tool_turn(turn))
    return rollouts.record(rollout_id)
