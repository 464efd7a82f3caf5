"""TRL's ``GRPOTrainer(rollout_func=...)`` on resumable multi-turn rollouts (``weightsync.roles.rollouts``).

TRL 1.16 hands a ``rollout_func(prompts, trainer)`` each process's slice of the batch (each
prompt already repeated ``num_generations`` times by its sampler) and takes back ``prompt_ids``,
``completion_ids`` and ``logprobs``, plus ``env_mask`` (1 on tokens the model generated, 0 on
tool results: TRL leaves those out of the loss) and any other field, which it forwards to the
reward functions. :func:`rollout_func` builds one whose rollouts run through
:class:`~weightsync.roles.rollouts.Rollouts` on a fleet of engines: a rollout whose engine dies goes on
on another from its last complete turn, with its saved KV::

    trainer = GRPOTrainer(model=..., reward_funcs=reward, args=GRPOConfig(...), train_dataset=dataset,
                          rollout_func=rollout_func(rollouts, engines, tool=my_tool, sampling=Sampling(...),
                                                    tokenize=lambda p: tokenizer.apply_chat_template(
                                                        p, add_generation_prompt=True, tokenize=True)))

Rollout ids are deterministic: ``<prefix>-s<global step>-c<call of that step>-r<process>-<index>``.
A training process that restarts at the same step asks for the same ids, so its rollouts go on
from their records instead of starting over (and finished ones are taken as they are). Each
rollout samples with its own seed (the sampling's seed plus a hash of its id), so the
``num_generations`` copies of a prompt differ. ``rollout_id`` is forwarded to the reward
functions, which may read the whole record (tool calls and results included) from the store.

Why not TRL's own tool loop (``GRPOTrainer(tools=...)``): it runs inside the trainer's generate
call on the trainer's own engine and keeps nothing between turns; there is no place in it to
resume a rollout elsewhere.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from weightsync.roles.rollouts.driver import Rollouts
from weightsync.roles.rollouts.engine import TurnEngine
from weightsync.roles.rollouts.loop import Tool, flatten, open_rollout, tool_loop
from weightsync.roles.rollouts.record import RolloutRecord, Sampling, UpdateMode

__all__ = ["Tool", "outputs", "rollout_func"]


def rollout_func(rollouts: Rollouts, engines: Sequence[TurnEngine] | Callable[[], Sequence[TurnEngine]], *,
                 tool: Tool, sampling: Sampling, tokenize: Callable[[Any], Sequence[int]],
                 max_turns: int = 8, on_update: UpdateMode = "abort", prefix: str = "trl",
                 timeout: float = 600.0, concurrency: int = 1) -> Callable[[list[Any], Any], dict[str, Any]]:
    """A ``rollout_func`` for TRL's GRPOTrainer (see module docstring).

    Args:
        engines: the fleet, or a callable returning it at each call (engines come and go).
        tool: runs the tool a generated turn calls; None ends the rollout.
        tokenize: a prompt (text or messages) -> its token ids, as the model reads them.
        max_turns: generated turns per rollout at most.
        concurrency: rollouts driven at once (threads; engines must then be thread-safe, as
            :class:`~weightsync.integrations.vllm_rollout_host.HostedTurnEngine` is).
    """
    if max_turns < 1 or concurrency < 1:
        raise ValueError(f"max_turns and concurrency must be >= 1, got {max_turns} and {concurrency}")
    calls: dict[int, int] = {}

    def run(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        step = int(trainer.state.global_step)
        call = calls.get(step, 0)
        calls[step] = call + 1
        rank = int(getattr(getattr(trainer, "accelerator", None), "process_index", 0))
        fleet = list(engines() if callable(engines) else engines)
        ids = [f"{prefix}-s{step}-c{call}-r{rank}-{i}" for i in range(len(prompts))]

        def one(rid: str, prompt: Any) -> RolloutRecord:
            return _run_one(rollouts, rid, list(tokenize(prompt)), fleet, tool=tool, max_turns=max_turns,
                            sampling=dataclasses.replace(sampling, seed=sampling.seed + zlib.crc32(rid.encode())),
                            on_update=on_update, timeout=timeout)

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            records = list(pool.map(one, ids, prompts))
        return outputs(records)

    return run


def _run_one(rollouts: Rollouts, rid: str, prompt_ids: list[int], fleet: list[TurnEngine], *, tool: Tool,
             max_turns: int, sampling: Sampling, on_update: UpdateMode, timeout: float) -> RolloutRecord:
    record = open_rollout(rollouts, rid, prompt_ids, sampling=sampling, on_update=on_update,
                          hint="a restarted trainer must see the same batch at the same step (or use another prefix)")
    return tool_loop(rollouts, record, generate=lambda: rollouts.generate(rid, fleet, timeout=timeout), tool=tool,
                     max_turns=max_turns)


def outputs(records: Sequence[RolloutRecord]) -> dict[str, Any]:
    """TRL's fields for finished rollouts: everything after the prompt is the completion."""
    out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
                                 "rollout_id": []}
    for record in records:
        tokens = flatten(record)
        out["prompt_ids"].append(tokens.prompt_ids)
        out["completion_ids"].append(tokens.response_ids)
        out["logprobs"].append(tokens.logprobs)
        out["env_mask"].append(tokens.mask)
        out["rollout_id"].append(record.rollout_id)
    return out
