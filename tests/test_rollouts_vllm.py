"""Rollouts and their KV survive the vLLM engine that ran them (issue 43), on vLLM's CPU build.

Two engines, each a process of its own (``weightsync.integrations.vllm_rollout_host``), share one
KV store in ``/dev/shm``: A serves checkpoint 2 as version 2 (a fresh engine on the target of
the update below), B starts on checkpoint 1 as version 1. A 3-turn greedy rollout calls a tool
after each of its first two turns. Four scenarios run once per module, in this order (fixtures),
and the tests check what they recorded:

1. *stale*: a ``keep-stale`` rollout, turns 1-2 on B under version 1; for turn 3 both engines are
   offered and it stays on B, the engine still serving its version, though A serves a newer one
   (compared with B's uninterrupted run);
2. *update*: on B, turns 1-2 under version 1, then an update of B to checkpoint 2 with ``abort``
   cuts turn 3, which goes on under version 2 (compared with A's answer to the same context);
3. *kill*: on A, turns 1-2, then A is SIGKILLed and B (now at version 2) resumes turn 3 with the
   KV A saved (compared with A's uninterrupted run); the connector's Prometheus metrics on both
   engines count the blocks A saved and B loaded;
4. *kept*: a ``keep-stale`` rollout, turns 1-2 on B under version 2, then B is updated to
   checkpoint 1 as version 3 with ``keep-stale`` while turn 3 waits: no engine serves version 2
   any more, so the turn runs under version 3 on the KV the old weights computed (B's prefix
   cache was kept, where ``abort`` resets it).

Block size 32; the lengths are chosen so that the first two turns end one token past a block
boundary: an engine that ran them saved every block of them (all but the last token, whose KV
is never computed), and the engine that resumes can restore 96 of the 105 tokens of turn 3's
prompt. Prefill figures are vLLM's own counters (``vllm:prompt_tokens_by_source``).
"""

from __future__ import annotations

import dataclasses
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
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from weightsync.integrations.vllm_rollout_host import HostedTurnEngine
    from weightsync.tools.tiny import tiny_config, write_checkpoint

    tmp = tmp_path_factory.mktemp("rollouts")
    checkpoints = (str(tmp / "ckpt1"), str(tmp / "ckpt2"))
    for seed, path in enumerate(checkpoints, start=1):
        write_checkpoint(Path(path), tiny_config(), seed=seed)
    directory = f"/dev/shm/weightsync-rl-test-{secrets.token_hex(4)}"
    env = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}
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
def version_1(fleet: Fleet) -> RolloutRecord:
    """B's uninterrupted run under version 1 (B serves checkpoint 1 until the update scenario)."""
    assert fleet.b.weight_version == 1
    return uninterrupted(fleet.rollouts, "version-1", fleet.b)


@pytest.fixture(scope="module")
def stale_scenario(fleet: Fleet, version_1: RolloutRecord) -> Scenario:
    rollouts, a, b = fleet.rollouts, fleet.a, fleet.b
    b.reset_prefix_cache()
    rollouts.start("stale", PROMPT, sampling=SAMPLING, on_update="keep-stale")
    run_turns(rollouts, "stale", [b], range(2))
    prefill_before = prefill(b)
    run_turns(rollouts, "stale", [a, b], range(2, 3))
    return Scenario(rollouts.record("stale"), version_1, delta(prefill(b), prefill_before), 0,
                    {"versions": (a.weight_version, b.weight_version)})


@pytest.fixture(scope="module")
def update_scenario(fleet: Fleet, version_1: RolloutRecord, stale_scenario: Scenario) -> Scenario:
    rollouts, a, b = fleet.rollouts, fleet.a, fleet.b
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
    a_before = a.info()["kv"]
    rollouts.start("killed", PROMPT, sampling=SAMPLING)
    run_turns(rollouts, "killed", [a], range(2))
    a_saved = kv_delta(a.info()["kv"], a_before)
    a.kill()
    kv_before, prefill_before, b_before = rollouts.kv.metrics(), prefill(b), b.info()["kv"]
    run_turns(rollouts, "killed", [a, b], range(2, 3))
    b_after = b.info()["kv"]
    return Scenario(rollouts.record("killed"), reference, delta(prefill(b), prefill_before),
                    rollouts.kv.metrics().loaded_blocks - kv_before.loaded_blocks,
                    {"a_saved": a_saved, "b_loaded": kv_delta(b_after, b_before), "b_gauges": b_after,
                     "ledger": rollouts.kv.metrics()})


@pytest.fixture(scope="module")
def kept_scenario(fleet: Fleet, kill_scenario: Scenario) -> Scenario:
    rollouts, b = fleet.rollouts, fleet.b
    assert b.weight_version == 2
    b.reset_prefix_cache()
    rollouts.start("kept", PROMPT, sampling=SAMPLING, on_update="keep-stale")
    run_turns(rollouts, "kept", [b], range(2))
    prefill_before = prefill(b)
    updating = _UpdatesDuringItsTurn(b, b.update_command(3, weights_path=fleet.checkpoints[0], mode="keep-stale"))
    rollouts.generate("kept", [updating], timeout=TIMEOUT)
    return Scenario(rollouts.record("kept"), kill_scenario.reference, delta(prefill(b), prefill_before), 0,
                    {"aborted": updating.futures[1].result(timeout=TIMEOUT)["aborted"]})


def kv_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in ("saved_blocks", "saved_bytes", "loaded_blocks",
                                                                 "loaded_bytes", "missed_blocks")}


def test_a_keep_stale_rollout_stays_on_an_engine_that_still_serves_its_version(stale_scenario):
    record, extra = stale_scenario.record, stale_scenario.extra
    assert extra["versions"] == (2, 1)  # A serves a newer version than the rollout's
    assert [t.engine for t in generated(record)] == ["B", "B", "B"]
    assert [t.weight_version for t in generated(record)] == [1, 1, 1]
    assert record.version_changes == () and record.resumes == ()
    assert record.token_ids() == stale_scenario.reference.token_ids()  # what version 1 generates, uninterrupted
    # B's prefix cache held the first two turns (KV of version 1, the rollout's own)
    assert stale_scenario.prefill == {"local_compute": 9, "local_cache_hit": 96, "external_kv_transfer": 0}


def test_a_keep_stale_update_goes_on_under_the_new_version_with_the_old_weights_kv(kept_scenario):
    record = kept_scenario.record
    assert kept_scenario.extra["aborted"] == 0  # keep-stale aborts nothing
    assert [t.engine for t in generated(record)] == ["B", "B", "B"]
    assert [t.weight_version for t in generated(record)] == [2, 2, 3]
    assert record.version_changes == (VersionChange(turn=5, token=0, old=2, new=3),)
    assert record.resumes == ()
    # the context before turn 3 is what version 2 generated (A's uninterrupted run); turn 3 is not
    assert record.token_ids()[:-16] == kept_scenario.reference.token_ids()[:-16]
    # the update kept B's prefix cache: turn 3 read the KV version 2 computed (abort would have reset it)
    assert kept_scenario.prefill == {"local_compute": 9, "local_cache_hit": 96, "external_kv_transfer": 0}


def test_the_connectors_prometheus_metrics_count_what_each_engine_moved(kill_scenario):
    extra = kill_scenario.extra
    # A saved the three full blocks of the first two turns; B loaded those very bytes, none missed
    assert extra["a_saved"]["saved_blocks"] == 3 and extra["a_saved"]["loaded_blocks"] == 0
    assert extra["b_loaded"]["loaded_blocks"] == 3 and extra["b_loaded"]["missed_blocks"] == 0
    assert extra["b_loaded"]["loaded_bytes"] == extra["a_saved"]["saved_bytes"] > 0
    assert extra["b_loaded"]["saved_blocks"] == 0  # turn 3 completed no new block
    # the store's gauges on B's registry are the host ledger as B last reported (nothing moved since)
    ledger, gauges = extra["ledger"], extra["b_gauges"]
    assert {name: int(gauges[f"store_{name}"]) for name in dataclasses.asdict(ledger)} == dataclasses.asdict(ledger)
    assert gauges["store_budget_bytes"] == KVStoreConfig(directory="-").budget_bytes


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


def test_the_connectors_stats_sum_over_workers_and_its_gauges_read_the_ledger(tmp_path):
    """vLLM's metric hooks without an engine: workers' stats summed, counters per engine, and the
    store's gauges from the ledger (left alone while no store is there)."""
    from functools import partial
    from types import SimpleNamespace

    import prometheus_client
    import torch

    from weightsync.integrations.vllm_kv import WeightsyncKVConnector, WeightsyncKVStats

    registry = prometheus_client.CollectorRegistry()
    types = {cls: partial(cls, registry=registry)
             for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"directory": str(tmp_path), "budget_bytes": 1 << 20}))
    metrics = WeightsyncKVConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"], 1: ["1"]})
    assert metrics is not None

    def sample(name: str, engine: str = "1") -> float | None:
        return registry.get_sample_value(f"vllm:weightsync_kv_{name}", {"engine": engine})

    assert WeightsyncKVStats().is_empty()
    worker_0 = WeightsyncKVStats()
    worker_0.add(saved_blocks=2, saved_bytes=256)
    worker_1 = WeightsyncKVConnector.build_kv_connector_stats({"saved_blocks": 2, "saved_bytes": 256,
                                                              "missed_blocks": 1})
    assert worker_1 is not None
    total = worker_0.aggregate(worker_1)
    assert total.reduce() == {"saved_blocks": 4, "saved_bytes": 512, "loaded_blocks": 0, "loaded_bytes": 0,
                              "missed_blocks": 1}
    metrics.observe(total.to_dict(), engine_idx=1)
    assert (sample("saved_blocks_total"), sample("missed_blocks_total"), sample("saved_blocks_total", "0")) == (4, 1, 0)
    assert sample("store_bytes") == 0 and not os.path.exists(tmp_path / "kv")  # no store: nothing read or made
    assert sample("store_budget_bytes") == sample("store_budget_bytes", "0") == 1 << 20

    store = KVStore(KVStoreConfig(directory=str(tmp_path), budget_bytes=1 << 20))
    key = KVStore.keys("layout", "r", version=1, token_ids=range(4), block_size=4)[0]
    assert store.save(key, {"layer.0": torch.ones(2, 4)})
    store.load(key)
    metrics.observe({"loaded_blocks": 1, "loaded_bytes": 32}, engine_idx=1)
    ledger = store.metrics()
    assert (ledger.blocks, ledger.saved_blocks, ledger.loaded_blocks) == (1, 1, 1)
    assert {name: sample(f"store_{name}") for name in dataclasses.asdict(ledger)} == dataclasses.asdict(ledger)
    assert sample("loaded_bytes_total") == 32 and sample("store_bytes", "0") == 0  # engine 0 reported nothing


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
