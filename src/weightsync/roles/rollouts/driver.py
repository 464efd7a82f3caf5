"""``Rollouts``: the API a framework calls to keep multi-turn rollouts alive across engines.

Four calls carry a rollout's state; one more drives a turn on a fleet of engines:

    rollouts = Rollouts(RolloutStore(directory), KVStore(KVStoreConfig(directory=directory)))
    rollouts.start("r-17", prompt_ids, sampling=Sampling(max_tokens=64, seed=3))
    turn = rollouts.generate("r-17", engines, timeout=60)        # a generated turn, on some engine
    rollouts.append_turn("r-17", Turn(kind="tool", token_ids=result_ids, tool_call=call, tool_result=text))
    turn = rollouts.generate("r-17", engines, timeout=60)        # engine died? resumed on another
    rollouts.finish("r-17")

A framework with its own generation loop calls :meth:`Rollouts.resume` for the engine to use
and the request to send it (with the ``kv_transfer_params`` the KV connector reads), then
:meth:`Rollouts.append_turn` with what came back.

**Resuming.** A turn is recorded once complete, so a rollout always resumes from its last
complete turn: a turn cut short (the engine died, or aborted its requests for a weight update)
is generated again from its start, with the same seed. The engine that resumes it loads the KV
blocks that the rollout's earlier engines saved for the version it serves, and computes the
rest (``kv.py``).

**Versions** (the rollout's ``on_update``). ``abort``: the rollout goes to an engine serving the
newest version the fleet serves (its own engine if that one does); a turn an update cut is
generated again under the new version, and the record's ``version_changes`` says at which turn
the version changed. ``keep-stale``: the rollout stays on engines that serve the version of its
last turn while any does (an engine that updates with vLLM's ``keep`` pause lets its turn in
flight finish on its old KV: the turn's ``version_spans`` say where the weights changed); when
no engine serves that version any more it goes on under the newest, recorded the same way.
After each turn the KV of versions no engine of the fleet serves is deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsync.clock.deadline import Deadline
from weightsync.roles.rollouts.engine import EngineGoneError, TurnEngine, TurnRequest, TurnResult
from weightsync.roles.rollouts.record import Resume, ResumeReason, RolloutRecord, Sampling, Turn, UpdateMode
from weightsync.roles.rollouts.store import RolloutStore

if TYPE_CHECKING:
    from weightsync.roles.rollouts.kv import KVStore

logger = logging.getLogger(__name__)


class NoEngineError(RuntimeError):
    """No engine of the fleet can run the rollout's next turn."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a rollout's next turn runs: the engine, and the request to send it."""

    record: RolloutRecord
    engine: TurnEngine
    request: TurnRequest


class Rollouts:
    """Rollout records and their KV (see module docstring). One driver per rollout at a time;
    the store refuses a save that lost a race with another driver."""

    def __init__(self, store: RolloutStore, kv: KVStore | None = None, *, max_attempts: int = 8) -> None:
        """Args:
            kv: where engines keep the rollouts' KV blocks (None: engines compute every context).
            max_attempts: tries of one turn (engines dying, updates aborting it) before giving up.
        """
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.store = store
        self.kv = kv
        self.max_attempts = max_attempts

    # -- the record ----------------------------------------------------------------------------------
    def start(self, rollout_id: str, prompt_ids: Sequence[int], *, sampling: Sampling,
              on_update: UpdateMode = "abort") -> RolloutRecord:
        """A new rollout with its prompt.

        Raises:
            StaleRecordError: a rollout of this id exists.
        """
        return self.store.save(RolloutRecord.start(rollout_id, prompt_ids, sampling=sampling, on_update=on_update))

    def append_turn(self, rollout_id: str, turn: Turn) -> RolloutRecord:
        """Record a complete turn (generated, or a tool's result)."""
        return self.store.save(self.store.load(rollout_id).with_turn(turn))

    def record(self, rollout_id: str) -> RolloutRecord:
        return self.store.load(rollout_id)

    def finish(self, rollout_id: str) -> RolloutRecord:
        """Mark the rollout finished and delete its KV (its record stays)."""
        record = self.store.save(self.store.load(rollout_id).finish())
        if self.kv is not None:
            self.kv.drop_rollout(rollout_id)
        return record

    # -- where the next turn runs ------------------------------------------------------------------
    def resume(self, rollout_id: str, engines: Sequence[TurnEngine], *, reason: ResumeReason | None = None,
               from_engine: str | None = None) -> ResumePoint:
        """The engine for the rollout's next turn and the request to send it.

        Records a :class:`~weightsync.roles.rollouts.record.Resume` when the rollout leaves its engine:
        with ``reason`` if given, else ``engine-removed`` when its engine is not in ``engines``.

        Args:
            engines: the live engines to choose from.
            reason: why the rollout left ``from_engine`` (its last turn's engine by default).

        Raises:
            NoEngineError: ``engines`` is empty.
        """
        record = self.store.load(rollout_id)
        if record.finished:
            raise ValueError(f"rollout {rollout_id} is finished; nothing to resume")
        engine = choose_engine(record, engines)
        origin = from_engine if from_engine is not None else record.engine
        names = {e.name for e in engines}
        if reason is None and origin and origin not in names:
            reason = "engine-removed"
        if reason is not None:
            record = self.store.save(record.with_resume(
                Resume(turn=len(record.turns), from_engine=origin, to_engine=engine.name, reason=reason)))
            logger.info("rollout %s resumes at turn %d on %s (%s from %s)", rollout_id, len(record.turns),
                        engine.name, reason, origin or "-")
        return ResumePoint(record, engine, self.request(record, engine))

    def request(self, record: RolloutRecord, engine: TurnEngine) -> TurnRequest:
        """The request for ``record``'s next turn on ``engine`` (its KV under the engine's version)."""
        turn = len(record.turns)
        return TurnRequest(rollout_id=record.rollout_id, turn=turn, token_ids=record.token_ids(),
                           sampling=record.sampling, seed=record.sampling.turn_seed(turn),
                           kv_version=engine.weight_version if self.kv is not None else None)

    # -- driving a turn ----------------------------------------------------------------------------
    def generate(self, rollout_id: str, engines: Sequence[TurnEngine], *, timeout: float,
                 retain: bool = True) -> Turn:
        """Generate the rollout's next turn on one of ``engines``, resuming elsewhere as needed.

        An engine that dies (:class:`EngineGoneError`) is left out of this call's fleet and the turn is
        generated again on another; a turn the engine aborted (an update) is generated again
        where :func:`choose_engine` says. Both are recorded as resumes.

        Args:
            engines: the whole fleet (with ``retain``, the KV of versions none of them serves is deleted).
            timeout: seconds for the turn, every attempt included.

        Raises:
            NoEngineError: every engine died.
            RuntimeError: ``max_attempts`` attempts were cut short.
            TimeoutError: the turn did not end in time.
        """
        deadline = Deadline.after(timeout)
        fleet = list(engines)
        reason: ResumeReason | None = None
        origin: str | None = None
        for _ in range(self.max_attempts):
            point = self.resume(rollout_id, fleet, reason=reason, from_engine=origin)
            try:
                result = point.engine.generate(point.request, timeout=deadline.remaining())
            except EngineGoneError as exc:
                logger.warning("rollout %s: %s", rollout_id, exc)
                fleet = [e for e in fleet if e is not point.engine]
                reason, origin = "engine-died", point.engine.name
                continue
            if result.aborted:
                reason, origin = "aborted-for-update", point.engine.name
                continue
            turn = generated_turn(result)
            self.store.save(point.record.with_turn(turn))
            if retain and self.kv is not None:
                self.retain_served(fleet)
            return turn
        raise RuntimeError(f"rollout {rollout_id}: {self.max_attempts} attempts at turn "
                           f"{len(self.store.load(rollout_id).turns)} were all cut short (last: {reason} on {origin}); "
                           "raise max_attempts if updates come this often")

    def retain_served(self, engines: Sequence[TurnEngine]) -> int:
        """Delete the KV of versions that none of ``engines`` serves; returns blocks deleted."""
        if self.kv is None:
            return 0
        served = {e.weight_version for e in engines if e.weight_version is not None}
        return self.kv.retain_versions(served)


def choose_engine(record: RolloutRecord, engines: Sequence[TurnEngine]) -> TurnEngine:
    """The engine for ``record``'s next turn (see module docstring, *Versions*).

    Among the engines at the wanted version, the rollout's own engine first (its prefix cache
    holds the context), else the first listed.
    """
    if not engines:
        raise NoEngineError(f"rollout {record.rollout_id}: no engine left to run turn {len(record.turns)}")
    versions = [e.weight_version for e in engines]
    known = [v for v in versions if v is not None]
    newest = max(known) if known else None
    wanted = newest
    if record.on_update == "keep-stale" and record.version is not None and record.version in known:
        wanted = record.version
    candidates = [e for e, v in zip(engines, versions, strict=True) if v == wanted]
    return next((e for e in candidates if e.name == record.engine), candidates[0])


def generated_turn(result: TurnResult) -> Turn:
    """The record's turn for a complete result."""
    spans = result.version_spans
    if not spans:
        raise ValueError(f"engine {result.engine} returned a turn without its weight version")
    return Turn(kind="generated", token_ids=result.token_ids, weight_version=spans[0][0],
                version_spans=spans if len({v for v, _, _ in spans}) > 1 else (), engine=result.engine,
                finish_reason=result.finish_reason, logprobs=result.logprobs)
