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
from weightsync.roles.rollouts.record import RolloutRecord, Sampling, Turn, UpdateMode

#: the tool loop's step: the record so far and the turn just generated -> the tool's turn, or None (done)
Tool = Callable[[RolloutRecord, Turn], Turn | None]


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
    try:
        record = rollouts.record(rid)
    except KeyError:
        record = rollouts.start(rid, prompt_ids, sampling=sampling, on_update=on_update)
    if list(record.turns[0].token_ids) != prompt_ids:
        raise ValueError(f"rollout {rid} exists with another prompt; a restarted trainer must see the same batch "
                         "at the same step (or use another prefix)")
    while not record.finished:
        generated = sum(t.kind == "generated" for t in record.turns)
        last = record.turns[-1]
        if last.kind == "generated":
            answer = tool(record, last) if generated < max_turns else None
            record = rollouts.append_turn(rid, answer) if answer is not None else rollouts.finish(rid)
            continue
        rollouts.generate(rid, fleet, timeout=timeout)
        record = rollouts.record(rid)
    return record


def outputs(records: Sequence[RolloutRecord]) -> dict[str, Any]:
    """TRL's fields for finished rollouts: everything after the prompt is the completion."""
    out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
                                 "rollout_id": []}
    for record in records:
        completion: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        for turn in record.turns[1:]:
            completion += turn.token_ids
            model = turn.kind == "generated"
            logprobs += list(turn.logprobs) if model and turn.logprobs else [0.0] * len(turn.token_ids)
            mask += [int(model)] * len(turn.token_ids)
        out["prompt_ids"].append(list(record.turns[0].token_ids))
        out["completion_ids"].append(completion)
        out["logprobs"].append(logprobs)
        out["env_mask"].append(mask)
        out["rollout_id"].append(record.rollout_id)
    return out
