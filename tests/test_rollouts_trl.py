"""TRL's ``rollout_func`` on resumable rollouts (``weightsync.integrations.trl_rollouts``), on fake engines.

The trainer is what ``rollout_func`` reads of TRL's GRPOTrainer (``state.global_step``,
``accelerator.process_index``); the batch is a slice as TRL's sampler makes it (each prompt
repeated). A training process that dies in the middle of its rollouts and restarts at the same
step gets the rollouts it had started, continued from their last complete turn.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout_fakes import FakeEngine, model
from weightsync.integrations.trl_rollouts import rollout_func
from weightsync.roles.rollouts import NoEngineError, RolloutRecord, Rollouts, RolloutStore, Sampling, ToolCall, Turn

SAMPLING = Sampling(temperature=1.0, max_tokens=4, seed=5)
PROMPTS = ["add 2 3", "add 2 3", "mul 4 5", "mul 4 5"]  # two prompts, num_generations=2


def tokenize(prompt: str) -> list[int]:
    return [ord(c) for c in prompt]


def tool(record: RolloutRecord, turn: Turn) -> Turn | None:
    """Two tool calls per rollout, then the answer."""
    if sum(t.kind == "tool" for t in record.turns) == 2:
        return None
    return Turn(kind="tool", token_ids=(7, sum(turn.token_ids) % 100), tool_call=ToolCall(name="calc"),
                tool_result=str(sum(turn.token_ids)))


def trainer(step: int = 3) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(global_step=step), accelerator=SimpleNamespace(process_index=1))


def test_rollout_func_returns_what_grpo_trainer_takes_with_tool_results_masked(tmp_path):
    func = rollout_func(Rollouts(RolloutStore(tmp_path)), [FakeEngine("A", 1)], tool=tool, sampling=SAMPLING,
                        tokenize=tokenize, max_turns=5)
    out = func(PROMPTS, trainer())
    assert out["prompt_ids"] == [tokenize(p) for p in PROMPTS]
    assert out["rollout_id"] == [f"trl-s3-c0-r1-{i}" for i in range(4)]
    for completion, mask, logprobs in zip(out["completion_ids"], out["env_mask"], out["logprobs"], strict=True):
        assert len(completion) == len(mask) == len(logprobs) == 3 * 4 + 2 * 2  # 3 turns, 2 tool results
        assert mask == [1] * 4 + [0] * 2 + [1] * 4 + [0] * 2 + [1] * 4
    assert out["completion_ids"][0] != out["completion_ids"][1]  # copies of a prompt sample with their own seeds
    assert func(PROMPTS, trainer())["rollout_id"][0] == "trl-s3-c1-r1-0"  # a second call of the step: new ids


def test_a_trainer_restarted_at_the_same_step_continues_its_rollouts(tmp_path):
    store = RolloutStore(tmp_path)
    dies = FakeEngine("A", 1, die_at={3})  # every rollout's second generated turn
    with pytest.raises(NoEngineError):
        rollout_func(Rollouts(store), [dies], tool=tool, sampling=SAMPLING, tokenize=tokenize)(PROMPTS, trainer())
    started = store.load("trl-s3-c0-r1-0")
    assert [t.kind for t in started.turns] == ["prompt", "generated", "tool"]

    restarted = rollout_func(Rollouts(store), [FakeEngine("B", 1)], tool=tool, sampling=SAMPLING, tokenize=tokenize)
    out = restarted(PROMPTS, trainer())
    record = store.load("trl-s3-c0-r1-0")
    assert record.finished and record.turns[:3] == started.turns
    assert [t.engine for t in record.turns if t.kind == "generated"] == ["A", "B", "B"]
    # the rollout is what one engine would have generated: turn 3's tokens follow from its whole context
    seed = record.sampling.turn_seed(3)
    assert record.turns[3].token_ids == model(record.token_ids()[:7 + 4 + 2], 1, seed, 4)
    assert out["prompt_ids"][0] == tokenize(PROMPTS[0]) and len(out["completion_ids"][0]) == 16
    others = [store.load(f"trl-s3-c0-r1-{i}") for i in range(1, 4)]
    assert all(r.finished for r in others)


def test_a_restart_that_sees_another_batch_is_refused(tmp_path):
    store = RolloutStore(tmp_path)
    func = rollout_func(Rollouts(store), [FakeEngine("A", 1)], tool=tool, sampling=SAMPLING, tokenize=tokenize)
    func(PROMPTS[:1], trainer())
    again = rollout_func(Rollouts(store), [FakeEngine("A", 1)], tool=tool, sampling=SAMPLING, tokenize=tokenize)
    with pytest.raises(ValueError, match="exists with another prompt"):
        again(["other"], trainer())
