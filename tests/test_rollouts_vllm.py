"""Rollouts and their KV survive the vLLM engine that ran them (issue 43), on vLLM's CPU build.

Two engines, each a process of its own (``weightsync.integrations.vllm_rollout_host``), share one
KV store in ``/dev/shm``: A serves checkpoint 2 as version 2 (a fresh engine on the target of
the update below), B starts on checkpoint 1 as version 1. A 3-turn greedy rollout calls a tool
after each of its first two turns. Two scenarios run once per module, in this order (fixtures),
and the tests check what they recorded:

1. *update*: on B, turns 1-2 under version 1, then an update of B to checkpoint 2 with ``abort``
   cuts turn 3, which goes on under version 2 (compared with A's answer to the same context);
2. *kill*: on A, turns 1-2, then A is SIGKILLed and B (now at version 2) resumes turn 3 with the
   KV A saved (compared with A's uninterrupted run).

Block size 32; the lengths are chosen so that the first two turns end one token past a block
boundary: an engine that ran them saved every block of them (all but the last token, whose KV
is never computed), and the engine that resumes can restore 96 of the 105 tokens of turn 3's
prompt. Prefill figures are vLLM's own counters (``vllm:prompt_tokens_by_source``).
"""

from __future__ import annotations

import importlib.util
import os
import random
import secrets
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from weightsync.roles.rollouts import (
    KVStore,
    KVStoreConfig,
    Resume,
    RolloutRecord,
    Rollouts,
    RolloutStore,
    Sampling,
    ToolCall,
    Turn,
    TurnRequest,
    TurnResult,
    VersionChange,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install -e '.[vllm]')"),
              pytest.mark.xdist_group("rollouts-vllm"), pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
PROMPT = [random.Random(43).randrange(4, 512) for _ in range(57)]
SAMPLING = Sampling(temperature=0.0, max_tokens=16, ignore_eos=True, seed=0)
TOOL_TOKENS = 8
TIMEOUT = 120.0
LLM = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 2, "seed": 0,
       "kv_cache_memory_bytes": 32 << 20}


def tool(turn: Turn) -> Turn:
    """The tool the rollout calls: a lookup keyed by what the model generated."""
    key = sum(turn.token_ids)
    return Turn(kind="tool", token_ids=tuple((key * (i + 3)) % 509 + 2 for i in range(TOOL_TOKENS)),
                tool_call=ToolCall(name="lookup", arguments=f'{{"key": {key}}}', call_id=f"call-{key}"),
                tool_result=str(key % 97))


@dataclass
class Fleet:
    a: Any
    b: Any
    checkpoints: tuple[str, str]
    rollouts: Rollouts


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from weightsync.integrations.vllm_rollout_host import HostedTurnEngine
    from weightsync.tools.tiny import tiny_config, write_checkpoint

    tmp = tmp_path_factory.mktemp("rollouts")
    checkpoints = (str(tmp / "ckpt1"), str(tmp / "ckpt2"))
    for seed, path in enumerate(checkpoints, start=1):
        write_checkpoint(Path(path), tiny_config(), seed=seed)
    directory = f"/dev/shm/weightsync-rl-test-{secrets.token_hex(4)}"
    cache = getattr(request.config, "cache", None)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or str(
               cache.mkdir("vllm") if cache is not None else tmp / "vllm-cache")}
    engines = [HostedTurnEngine.spawn(path, name=name, version=version, kv_directory=directory, block_size=BLOCK,
                                      llm=LLM, env=env)
               for name, version, path in (("A", 2, checkpoints[1]), ("B", 1, checkpoints[0]))]
    try:
        for engine in engines:
            engine.wait_ready(timeout=900)
        rollouts = Rollouts(RolloutStore(directory), KVStore(KVStoreConfig(directory=directory)))
        yield Fleet(*engines, checkpoints=checkpoints, rollouts=rollouts)
    finally:
        for engine in engines:
            engine.request_shutdown()
        for engine in engines:
            engine.close()
        shutil.rmtree(directory, ignore_errors=True)


def run_turns(rollouts: Rollouts, rollout_id: str, fleet: list[Any], turns: range) -> None:
    """Generated turns ``turns`` of the tool loop (0-based), each but the last answered by the tool."""
    for i in turns:
        turn = rollouts.generate(rollout_id, fleet, timeout=TIMEOUT, retain=False)
        if i < 2:
            rollouts.append_turn(rollout_id, tool(turn))


def uninterrupted(rollouts: Rollouts, rollout_id: str, engine: Any) -> RolloutRecord:
    rollouts.start(rollout_id, PROMPT, sampling=SAMPLING)
    run_turns(rollouts, rollout_id, [engine], range(3))
    record = rollouts.record(rollout_id)
    assert len(record.token_ids()) == 57 + 16 + 8 + 16 + 8 + 16  # the lengths the module docstring counts on
    return record


def prefill(engine: Any) -> dict[str, float]:
    return engine.info()["prefill"]


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in ("local_compute", "local_cache_hit",
                                                                 "external_kv_transfer")}


def generated(record: RolloutRecord) -> list[Turn]:
    return [t for t in record.turns if t.kind == "generated"]


class _UpdatesDuringItsTurn:
    """B, but the first turn it is given is sent together with an update (``abort``) to checkpoint 2:
    the engine reads both before its next step, so the update cuts the turn."""

    def __init__(self, engine: Any, update: dict[str, Any]) -> None:
        self.engine, self.update, self.name = engine, update, engine.name
        self.futures: tuple[Future[dict[str, Any]], ...] = ()

    @property
    def weight_version(self) -> int | None:
        return self.engine.weight_version

    def generate(self, request: TurnRequest, *, timeout: float) -> TurnResult:
        if not self.futures:
            self.futures = self.engine.submit(request, self.update)
            result = self.engine.result(self.futures[0], timeout)
            self.engine.info()  # the version the update brought
            return result
        return self.engine.generate(request, timeout=timeout)


@dataclass
class Scenario:
    record: RolloutRecord
    reference: RolloutRecord  # what it is compared with
    prefill: dict[str, int]  # the resuming engine's prefill counters over the resumed turn
    loaded_blocks: int  # KV blocks the store handed out over the resumed turn
    extra: dict[str, Any]


@pytest.fixture(scope="module")
def update_scenario(fleet: Fleet) -> Scenario:
    rollouts, a, b = fleet.rollouts, fleet.a, fleet.b
    version_1 = uninterrupted(rollouts, "version-1", b)
    b.reset_prefix_cache()
    rollouts.start("updated", PROMPT, sampling=SAMPLING)
    run_turns(rollouts, "updated", [b], range(2))
    kv_versions_before = rollouts.kv.versions()
    kv_before, prefill_before = rollouts.kv.metrics(), prefill(b)
    updating = _UpdatesDuringItsTurn(b, b.update_command(2, weights_path=fleet.checkpoints[1], mode="abort"))
    rollouts.generate("updated", [updating], timeout=TIMEOUT)
    kv_after, prefill_after = rollouts.kv.metrics(), prefill(b)
    record = rollouts.record("updated")
    fresh = a.generate(TurnRequest(rollout_id="fresh", turn=5, token_ids=record.token_ids()[: -SAMPLING.max_tokens],
                                   sampling=SAMPLING, seed=SAMPLING.turn_seed(5), kv_version=None), timeout=TIMEOUT)
    return Scenario(record, version_1, delta(prefill_after, prefill_before),
                    kv_after.loaded_blocks - kv_before.loaded_blocks,
                    {"aborted": updating.futures[1].result(timeout=TIMEOUT)["aborted"], "fresh": fresh.token_ids,
                     "kv_versions_before": kv_versions_before, "kv_versions_after": rollouts.kv.versions(),
                     "dropped": kv_after.dropped_version_blocks - kv_before.dropped_version_blocks})


@pytest.fixture(scope="module")
def kill_scenario(fleet: Fleet, update_scenario: Scenario) -> Scenario:
    rollouts, a, b = fleet.rollouts, fleet.a, fleet.b
    assert b.weight_version == 2  # the update scenario moved B to checkpoint 2
    reference = uninterrupted(rollouts, "reference", a)
    a.reset_prefix_cache()
    b.reset_prefix_cache()
    rollouts.start("killed", PROMPT, sampling=SAMPLING)
    run_turns(rollouts, "killed", [a], range(2))
    a.kill()
    kv_before, prefill_before = rollouts.kv.metrics(), prefill(b)
    run_turns(rollouts, "killed", [a, b], range(2, 3))
    return Scenario(rollouts.record("killed"), reference, delta(prefill(b), prefill_before),
                    rollouts.kv.metrics().loaded_blocks - kv_before.loaded_blocks, {})


def test_a_rollout_whose_engine_is_killed_after_turn_2_resumes_on_another_with_its_kv(kill_scenario):
    record, reference = kill_scenario.record, kill_scenario.reference
    assert record.token_ids() == reference.token_ids()
    assert [t.engine for t in generated(record)] == ["A", "A", "B"]
    assert record.resumes == (Resume(turn=5, from_engine="A", to_engine="B", reason="engine-died"),)
    assert [t.weight_version for t in generated(record)] == [2, 2, 2] and record.version_changes == ()
    # B computed only the last 9 of turn 3's 105 prompt tokens: the first two turns came from the store
    assert kill_scenario.prefill == {"local_compute": 9, "local_cache_hit": 0, "external_kv_transfer": 96}
    assert kill_scenario.loaded_blocks == 3


def test_an_update_with_abort_resumes_the_rollout_on_the_new_version_without_old_kv(update_scenario):
    record, extra = update_scenario.record, update_scenario.extra
    assert extra["aborted"] == 1
    assert [t.weight_version for t in generated(record)] == [1, 1, 2]
    assert record.version_changes == (VersionChange(turn=5, token=0, old=1, new=2),)
    assert record.resumes == (Resume(turn=5, from_engine="B", to_engine="B", reason="aborted-for-update"),)
    # no KV of version 1 was used after the update: nothing loaded, the prefix cache was reset, all computed
    assert update_scenario.prefill == {"local_compute": 105, "local_cache_hit": 0, "external_kv_transfer": 0}
    assert update_scenario.loaded_blocks == 0
    # turn 3 is what a fresh engine on checkpoint 2 generates from the same context, not version 1's answer
    assert generated(record)[-1].token_ids == extra["fresh"] != generated(update_scenario.reference)[-1].token_ids
    assert record.token_ids()[:-16] == update_scenario.reference.token_ids()[:-16]
    # after the turn the store dropped the KV of version 1, which no engine of the turn's fleet serves
    assert 1 in extra["kv_versions_before"] and 1 not in extra["kv_versions_after"] and extra["dropped"] > 0


class _FakeLLM:
    """What VLLMTurnEngine calls on ``vllm.LLM``, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.llm_engine = self

    def set_weight_version(self, version: str) -> None:
        self.calls.append(("set_weight_version", version))

    def add_request(self, rid: str, prompt: Any, params: Any) -> str:
        self.calls.append(("add_request", rid))
        return rid

    def abort_request(self, rids: list[str]) -> None:
        self.calls.append(("abort_request", rids))

    def step(self) -> list[Any]:
        return []

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache", None))
        return True

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        self.calls.append((method, kwargs))
        return []


def test_an_update_aborts_its_turns_then_loads_then_stamps_the_version_then_resets_the_cache():
    from weightsync.integrations import vllm_kv
    from weightsync.integrations.vllm_rollouts import VLLMTurnEngine

    llm = _FakeLLM()
    engine = VLLMTurnEngine(llm, name="e", version=1)
    request = TurnRequest(rollout_id="r", turn=1, token_ids=(1, 2), sampling=SAMPLING, seed=1, kv_version=1)
    rid = engine.submit(request)
    try:
        assert engine.update(2, apply=lambda: llm.calls.append(("apply", None))) == [rid]
        assert llm.calls[-4:] == [("abort_request", [rid]), ("apply", None), ("set_weight_version", "2"),
                                  ("reset_prefix_cache", None)]
        assert vllm_kv.engine_version() == 2 and engine.weight_version == 2
        assert engine.step()[rid].aborted
        engine.update(3, weights_path="/ckpt", mode="keep-stale")
        assert llm.calls[-2:] == [("reload_weights", {"weights_path": "/ckpt"}), ("set_weight_version", "3")]
        with pytest.raises(ValueError, match="exactly one of weights_path"):
            engine.update(4, mode="abort")
        with pytest.raises(ValueError, match="update mode 'wait' is not one of"):
            engine.update(4, weights_path="/ckpt", mode="wait")
    finally:
        vllm_kv.set_engine_version(None)
