"""The rollout record: every turn of a multi-turn agent rollout, typed, and its msgpack form.

A record is what a rollout needs to go on elsewhere: the token ids of every turn (the prompt,
what the model generated, what the tools returned), the tool calls and their results, the
sampling settings and seed, and the weight version each generated turn was sampled under.
Records are immutable: every change makes a new one, which the store saves in place of the
old (``store.py``) if no other process saved one since.

    record = RolloutRecord.start("r-17", prompt_ids, sampling=Sampling(max_tokens=64, seed=3))
    record = record.with_turn(Turn(kind="generated", token_ids=ids, weight_version=7, engine="e0"))
    blob = record.encode()                     # msgpack, never pickle
    assert RolloutRecord.decode(blob) == record
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import msgpack

UpdateMode = Literal["abort", "keep-stale"]
TurnKind = Literal["prompt", "generated", "tool"]
ResumeReason = Literal["engine-died", "engine-removed", "aborted-for-update"]
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)
RESUME_REASONS: tuple[str, ...] = get_args(ResumeReason)
FORMAT = 1
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class RecordError(ValueError):
    """A record blob that is not a rollout record of this format (the message names the field)."""


def check_rollout_id(rollout_id: str) -> str:
    """``rollout_id`` if it can name files on every host (it names the record and its KV)."""
    if not isinstance(rollout_id, str) or not _ID.fullmatch(rollout_id):
        raise ValueError(f"rollout id {rollout_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return rollout_id


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """How every generated turn of a rollout samples.

    Attributes:
        temperature: 0 is greedy.
        top_p, top_k: nucleus and top-k filtering (``top_k=0``: off).
        max_tokens: at most this many tokens per generated turn.
        seed: the rollout's seed; turn ``i`` samples with ``seed + i`` (:meth:`turn_seed`), so a
            turn generated again after a resume draws the same random numbers.
        stop_token_ids: a generated turn ends at any of these (kept as its last token).
        ignore_eos: go on past the model's end-of-sequence token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def turn_seed(self, turn: int) -> int:
        """The seed of turn ``turn`` (its index in the record)."""
        return self.seed + turn


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A call the model made: the tool's name and its arguments as the model wrote them (JSON)."""

    name: str
    arguments: str = "{}"
    call_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One turn of a rollout.

    Attributes:
        kind: ``prompt`` (the task; only the first turn), ``generated`` (sampled by an engine) or
            ``tool`` (a tool's result, fed back to the model).
        token_ids: the turn's tokens as the model sees them.
        weight_version: generated turns: the version of the weights that sampled its first token.
        version_spans: generated turns whose weights changed while they ran (an update that kept
            the request, ``keep-stale``): ``(version, start, end)`` per run of tokens; else empty.
        engine: generated turns: the engine that sampled it.
        finish_reason: generated turns: ``stop`` (a stop token) or ``length``.
        tool_call: generated turns: the call they make, if any; tool turns: the call they answer.
        tool_result: tool turns: the result as the tool returned it.
        logprobs: generated turns: each token's log-probability under the weights that sampled
            it (empty if the engine did not report them).
    """

    kind: TurnKind
    token_ids: tuple[int, ...]
    weight_version: int | None = None
    version_spans: tuple[tuple[int, int, int], ...] = ()
    engine: str = ""
    finish_reason: str = ""
    tool_call: ToolCall | None = None
    tool_result: str = ""
    logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in get_args(TurnKind):
            raise ValueError(f"turn kind {self.kind!r} is not one of {get_args(TurnKind)}")
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "version_spans", tuple(tuple(int(x) for x in s) for s in self.version_spans))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"a turn of {len(self.token_ids)} tokens has {len(self.logprobs)} logprobs")
        if self.kind == "generated" and self.weight_version is None:
            raise ValueError("a generated turn needs the weight_version that sampled it")
        if self.kind != "generated" and (self.weight_version is not None or self.version_spans):
            raise ValueError(f"a {self.kind} turn has no weight version (only generated turns do)")
        if self.kind == "tool" and self.tool_call is None:
            raise ValueError("a tool turn names the tool_call it answers")

    @property
    def versions(self) -> tuple[int, ...]:
        """Every weight version that sampled tokens of this turn, in order."""
        if self.version_spans:
            return tuple(v for v, _, _ in self.version_spans)
        return () if self.weight_version is None else (self.weight_version,)


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionChange:
    """Where the rollout's weight version changed: turn ``turn`` (token ``token`` of it) was
    the first sampled under ``new``."""

    turn: int
    token: int
    old: int
    new: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """The rollout went on elsewhere: at turn ``turn`` (the first one not complete), from
    engine ``from_engine`` to ``to_engine``, because of ``reason``."""

    turn: int
    from_engine: str
    to_engine: str
    reason: ResumeReason


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutRecord:
    """A rollout: its turns so far and everything needed to go on (see module docstring).

    Attributes:
        rollout_id: names the record and its KV blocks (letters, digits, ``._-``).
        sampling: how its generated turns sample.
        on_update: ``abort`` (a turn an update cuts is generated again on the new version) or
            ``keep-stale`` (it stays on engines serving its version while any does).
        turns: complete turns, the prompt first.
        version_changes: where the version changed between (or inside) generated turns.
        resumes: each time it went on on another engine.
        finished: no turn follows.
        seq: the saves this record follows (0: never saved); the store saves it only over the
            record of that ``seq`` and returns it with ``seq + 1``.
    """

    rollout_id: str
    sampling: Sampling
    on_update: UpdateMode = "abort"
    turns: tuple[Turn, ...] = ()
    version_changes: tuple[VersionChange, ...] = ()
    resumes: tuple[Resume, ...] = ()
    finished: bool = False
    seq: int = 0

    def __post_init__(self) -> None:
        check_rollout_id(self.rollout_id)
        if self.on_update not in UPDATE_MODES:
            raise ValueError(f"on_update {self.on_update!r} is not one of {UPDATE_MODES}")
        if self.turns and (self.turns[0].kind != "prompt" or any(t.kind == "prompt" for t in self.turns[1:])):
            raise ValueError(f"rollout {self.rollout_id}: the first turn, and only it, is the prompt")

    @classmethod
    def start(cls, rollout_id: str, prompt_ids: Sequence[int], *, sampling: Sampling,
              on_update: UpdateMode = "abort") -> RolloutRecord:
        if not prompt_ids:
            raise ValueError(f"rollout {rollout_id}: the prompt has no tokens")
        return cls(rollout_id=rollout_id, sampling=sampling, on_update=on_update,
                   turns=(Turn(kind="prompt", token_ids=tuple(prompt_ids)),))

    # -- reading ---------------------------------------------------------------------------------
    def token_ids(self) -> tuple[int, ...]:
        """Every token of every complete turn, in order: the context of the next turn."""
        return tuple(t for turn in self.turns for t in turn.token_ids)

    @property
    def version(self) -> int | None:
        """The version that sampled the rollout's latest generated token (None before any)."""
        for turn in reversed(self.turns):
            if turn.versions:
                return turn.versions[-1]
        return None

    @property
    def engine(self) -> str:
        """The engine that generated the latest turn ("" before any)."""
        return next((t.engine for t in reversed(self.turns) if t.kind == "generated"), "")

    # -- changing ----------------------------------------------------------------------------------
    def with_turn(self, turn: Turn) -> RolloutRecord:
        """This record with ``turn`` appended (and the version change it makes, if any)."""
        if self.finished:
            raise ValueError(f"rollout {self.rollout_id} is finished; start another to generate more")
        if turn.kind == "prompt":
            raise ValueError(f"rollout {self.rollout_id} already has its prompt; append generated or tool turns")
        changes = list(self.version_changes)
        previous = self.version
        spans = turn.version_spans
        if not spans and turn.weight_version is not None:
            spans = ((turn.weight_version, 0, len(turn.token_ids)),)
        for version, start, _ in spans:
            if previous is not None and version != previous:
                changes.append(VersionChange(turn=len(self.turns), token=start, old=previous, new=version))
            previous = version
        return dataclasses.replace(self, turns=(*self.turns, turn), version_changes=tuple(changes))

    def with_resume(self, resume: Resume) -> RolloutRecord:
        return dataclasses.replace(self, resumes=(*self.resumes, resume))

    def finish(self) -> RolloutRecord:
        return dataclasses.replace(self, finished=True)

    # -- wire ------------------------------------------------------------------------------------
    def encode(self) -> bytes:
        """The record as msgpack (plain maps, lists, ints and strings)."""
        return msgpack.packb({
            "format": FORMAT, "id": self.rollout_id, "seq": self.seq, "on_update": self.on_update,
            "finished": self.finished, "sampling": _fields(self.sampling),
            "turns": [_turn_wire(t) for t in self.turns],
            "version_changes": [_fields(c) for c in self.version_changes],
            "resumes": [_fields(r) for r in self.resumes],
        }, use_bin_type=True)

    @classmethod
    def decode(cls, blob: bytes) -> RolloutRecord:
        """The record ``blob`` holds.

        Raises:
            RecordError: not msgpack, another format, or a field missing or of the wrong type.
        """
        try:
            obj = msgpack.unpackb(blob, raw=False, strict_map_key=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise RecordError(f"not a rollout record (msgpack: {exc})") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise RecordError(f"not a rollout record of format {FORMAT} (got {type(obj).__name__} "
                              f"with format {obj.get('format') if isinstance(obj, dict) else None!r})")
        try:
            sampling = obj["sampling"]
            return cls(
                rollout_id=obj["id"], seq=_int(obj["seq"]), on_update=obj["on_update"],
                finished=bool(obj["finished"]),
                sampling=Sampling(**{**sampling, "stop_token_ids": tuple(sampling["stop_token_ids"])}),
                turns=tuple(_turn_from(t) for t in obj["turns"]),
                version_changes=tuple(VersionChange(**{k: _int(v) for k, v in c.items()})
                                      for c in obj["version_changes"]),
                resumes=tuple(Resume(**r) for r in obj["resumes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"rollout record {obj.get('id')!r} is malformed: {type(exc).__name__}: {exc}") from None


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _turn_wire(turn: Turn) -> dict[str, Any]:
    out = _fields(turn)
    out["token_ids"] = list(turn.token_ids)
    out["version_spans"] = [list(s) for s in turn.version_spans]
    out["logprobs"] = list(turn.logprobs)
    out["tool_call"] = None if turn.tool_call is None else _fields(turn.tool_call)
    return out


def _turn_from(obj: dict[str, Any]) -> Turn:
    tokens = obj["token_ids"]
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise TypeError("token_ids must be a list of integers")
    call = obj["tool_call"]
    return Turn(**{**obj, "token_ids": tuple(tokens), "version_spans": tuple(tuple(s) for s in obj["version_spans"]),
                   "tool_call": None if call is None else ToolCall(**call), "logprobs": tuple(obj["logprobs"])})
