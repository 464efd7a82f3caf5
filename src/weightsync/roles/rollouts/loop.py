"""The tool loop a framework runs over one rollout, and the flat token view it hands back.

TRL's ``rollout_func`` and verl's agent loop differ in where prompts come from, how a turn reaches
an engine and what they return; what they share is here: open a rollout by its id (starting it,
or continuing it from its record), alternate generated turns and the tool's answers until the
tool says done or a limit is reached, and read a finished record as prompt, response, mask and
log-probabilities.

    record = open_rollout(rollouts, "trl-s3-c0-r0-1", prompt_ids, sampling=s, on_update="abort",
                          hint="a restarted trainer must see the same batch at the same step")
    record = tool_loop(rollouts, record, generate=lambda: rollouts.generate(rid, fleet, timeout=60),
                       tool=my_tool, max_turns=8)
    tokens = flatten(record)            # tokens.response_ids, tokens.mask (1: generated, 0: tool)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from weightsync.roles.rollouts.driver import Rollouts
from weightsync.roles.rollouts.record import RolloutRecord, Sampling, Turn, UpdateMode

#: the tool loop's step: the record so far and the turn just generated -> the tool's turn, or None (done)
Tool = Callable[[RolloutRecord, Turn], Turn | None]


def open_rollout(rollouts: Rollouts, rollout_id: str, prompt_ids: Sequence[int], *, sampling: Sampling,
                 on_update: UpdateMode, hint: str) -> RolloutRecord:
    """The rollout's record: started with ``prompt_ids``, or as its last save left it.

    Raises:
        ValueError: a rollout of this id exists with another prompt (``hint`` says what to check):
            two samples share an id, and continuing would mix them.
    """
    try:
        record = rollouts.record(rollout_id)
    except KeyError:
        record = rollouts.start(rollout_id, prompt_ids, sampling=sampling, on_update=on_update)
    if list(record.turns[0].token_ids) != list(prompt_ids):
        raise ValueError(f"rollout {rollout_id} exists with another prompt: {hint}")
    return record


def tool_loop(rollouts: Rollouts, record: RolloutRecord, *, generate: Callable[[], object], tool: Tool,
              max_turns: int, stop: Callable[[RolloutRecord], bool] | None = None) -> RolloutRecord:
    """Run ``record``'s rollout to its end from wherever its record stands; the finished record.

    ``generate()`` generates the next turn (its driver saves it); ``tool`` answers each generated
    turn but the ``max_turns``-th, or ends the rollout by answering None; ``stop(record)`` ends it
    early (a response budget). A record saved after a tool's answer goes on with a generated
    turn, one saved after a generated turn with the tool, so a rerun after a crash repeats no turn.
    """
    rid = record.rollout_id
    while not record.finished:
        generated = sum(t.kind == "generated" for t in record.turns)
        last = record.turns[-1]
        if (stop is not None and stop(record)) or (last.kind != "generated" and generated >= max_turns):
            record = rollouts.finish(rid)
        elif last.kind == "generated":
            answer = tool(record, last) if generated < max_turns else None
            record = rollouts.append_turn(rid, answer) if answer is not None else rollouts.finish(rid)
        else:
            generate()
            record = rollouts.record(rid)
    return record


@dataclass(frozen=True)
class Tokens:
    """A record as trainers read it: the prompt, then every later turn as one response, with
    ``mask`` 1 on the tokens the model generated and 0 on the tools', and the model's
    log-probabilities (0.0 on tools' tokens, and where the engine reported none)."""

    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int]
    logprobs: list[float]


def flatten(record: RolloutRecord) -> Tokens:
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for turn in record.turns[1:]:
        model = turn.kind == "generated"
        response += turn.token_ids
        mask += [int(model)] * len(turn.token_ids)
        logprobs += list(turn.logprobs) if model and turn.logprobs else [0.0] * len(turn.token_ids)
    return Tokens(list(record.turns[0].token_ids), response, mask, logprobs)
