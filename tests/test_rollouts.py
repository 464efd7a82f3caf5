"""Rollouts that outlive their engine, without an engine: the record, its store, the KV store, the driver.

The driver runs on fake engines whose faults the test schedules (an engine dies at a given
turn, an update aborts a given turn); the model is a hash of the context, the weight version
and the seed, so "the same tokens as an uninterrupted run" is a real check. The vLLM side:
tests/test_rollouts_vllm.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch

from rollout_fakes import FakeEngine, model, run, tool_turn
from weightsync.roles.rollouts import (
    EngineGoneError,
    KVMissError,
    KVStore,
    KVStoreConfig,
    NoEngineError,
    RecordError,
    Resume,
    RolloutRecord,
    Rollouts,
    RolloutStore,
    Sampling,
    StaleRecordError,
    ToolCall,
    Turn,
    TurnRequest,
    TurnResult,
    VersionChange,
)
from weightsync.roles.rollouts.files import locked
from weightsync.roles.rollouts.kv import block_digests

HERE = Path(__file__).resolve().parent
SAMPLING = Sampling(temperature=0.0, max_tokens=6, seed=11)


@pytest.fixture
def rollouts(tmp_path: Path) -> Rollouts:
    return Rollouts(RolloutStore(tmp_path / "state"), KVStore(KVStoreConfig(directory=str(tmp_path / "state"))))


def generated(record: RolloutRecord) -> list[Turn]:
    return [t for t in record.turns if t.kind == "generated"]


# -- the record ------------------------------------------------------------------------------------

def test_record_round_trips_through_msgpack_with_every_field():
    record = RolloutRecord.start("r-1", [5, 6, 7], sampling=Sampling(temperature=0.7, top_k=5, seed=9,
                                                                      stop_token_ids=(2,)), on_update="keep-stale")
    record = record.with_turn(Turn(kind="generated", token_ids=(1, 2), weight_version=3, engine="e0",
                                   finish_reason="stop", tool_call=ToolCall(name="f", arguments='{"a": 1}'),
                                   logprobs=(-0.5, -1.25)))
    record = record.with_turn(Turn(kind="tool", token_ids=(9,), tool_call=ToolCall(name="f"), tool_result="42"))
    record = record.with_turn(Turn(kind="generated", token_ids=(4, 4, 4), weight_version=3, engine="e1",
                                   version_spans=((3, 0, 1), (4, 1, 3)), finish_reason="length"))
    record = record.with_resume(Resume(turn=3, from_engine="e0", to_engine="e1", reason="engine-died")).finish()
    decoded = RolloutRecord.decode(record.encode())
    assert decoded == record
    assert decoded.version_changes == (VersionChange(turn=3, token=1, old=3, new=4),)
    assert decoded.token_ids() == (5, 6, 7, 1, 2, 9, 4, 4, 4) and decoded.version == 4


@pytest.mark.parametrize(("blob", "message"), [
    (b"\xc1", "not a rollout record (msgpack"),
    (msgpack.packb([1, 2]), "not a rollout record of format 1 (got list"),
    (msgpack.packb({"format": 2}), "with format 2"),
    (msgpack.packb({"format": 1, "id": "r"}), "rollout record 'r' is malformed: KeyError"),
])
def test_a_record_that_is_not_one_is_refused_naming_why(blob, message):
    with pytest.raises(RecordError, match=message.replace("(", r"\(")):
        RolloutRecord.decode(blob)


def test_a_record_with_token_ids_of_the_wrong_type_is_refused():
    obj = msgpack.unpackb(RolloutRecord.start("r", [1], sampling=SAMPLING).encode())
    obj["turns"][0]["token_ids"] = ["1"]
    with pytest.raises(RecordError, match="token_ids must be a list of integers"):
        RolloutRecord.decode(msgpack.packb(obj))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Turn(kind="generated", token_ids=(1,)), "needs the weight_version"),
    (lambda: Turn(kind="tool", token_ids=(1,)), "names the tool_call it answers"),
    (lambda: Turn(kind="tool", token_ids=(1,), weight_version=2, tool_call=ToolCall(name="f")), "has no weight version"),
    (lambda: Turn(kind="generated", token_ids=(1, 2), weight_version=1, logprobs=(0.0,)), "has 1 logprobs"),
    (lambda: Sampling(top_p=0), "top_p must be in"),
    (lambda: RolloutRecord.start("../x", [1], sampling=SAMPLING), "must be 1-128 characters"),
    (lambda: RolloutRecord.start("r", [1], sampling=SAMPLING, on_update="wait"), "not one of"),  # type: ignore[arg-type]
    (lambda: RolloutRecord.start("r", [], sampling=SAMPLING), "the prompt has no tokens"),
])
def test_bad_turns_and_settings_are_refused_naming_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# -- the record store --------------------------------------------------------------------------------

def test_store_saves_over_the_save_it_follows_only(tmp_path):
    store = RolloutStore(tmp_path)
    first = store.save(RolloutRecord.start("r", [1, 2], sampling=SAMPLING))
    assert first.seq == 1 and store.load("r") == first and store.ids() == ["r"]
    second = store.save(first.with_turn(Turn(kind="generated", token_ids=(3,), weight_version=1)))
    with pytest.raises(StaleRecordError, match="holds save 2 of it, this record follows save 1"):
        store.save(first.with_turn(Turn(kind="generated", token_ids=(4,), weight_version=1)))
    with pytest.raises(StaleRecordError, match="holds save 2"):
        store.save(RolloutRecord.start("r", [9], sampling=SAMPLING))
    assert store.load("r") == second
    with pytest.raises(KeyError, match="no rollout 'q'"):
        store.load("q")


def test_a_process_killed_while_saving_leaves_the_previous_record_whole(tmp_path):
    """The saver stops after the first 4 KiB of a ~1 MB record and is SIGKILLed there."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(HERE / "_rollout_saver.py"), str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "MID-SAVE"
    finally:
        child.kill()
        child.wait(timeout=30)
    records = tmp_path / "records"
    left = sorted(os.listdir(records))
    record = RolloutStore(tmp_path, sweep=False).load("r")
    assert record.seq == 1 and record.token_ids() == (1, 2, 3)
    assert [n for n in left if not n.startswith(".")] == ["r.rollout"]
    assert any(n.startswith(".tmp-") for n in left)  # the cut-off save, hidden from readers
    assert RolloutStore(tmp_path).ids() == ["r"]  # a writer's store sweeps the dead writer's temporary
    assert sorted(os.listdir(records)) == [".lock", "r.rollout"]


# -- the KV store ----------------------------------------------------------------------------------

def blocks(key_seed: int, nbytes: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(key_seed)
    return {"layer0": torch.randn(nbytes // 8, generator=g), "layer1": torch.randn(nbytes // 8, generator=g)}


def test_kv_is_found_only_for_the_same_tokens_rollout_and_version(tmp_path):
    kv = KVStore(KVStoreConfig(directory=str(tmp_path)))
    tokens = list(range(40))
    keys = kv.keys("L", "r", version=3, token_ids=tokens, block_size=8)
    assert len(keys) == 5
    for i, key in enumerate(keys[:3]):
        assert kv.save(key, blocks(i))
    assert kv.lookup(keys) == 3
    assert kv.lookup(kv.keys("L", "r", version=4, token_ids=tokens, block_size=8)) == 0
    assert kv.lookup(kv.keys("L", "q", version=3, token_ids=tokens, block_size=8)) == 0
    assert kv.lookup(kv.keys("L", "r", version=3, token_ids=[99] + tokens[1:], block_size=8)) == 0
    assert kv.lookup(kv.keys("L", "r", version=3, token_ids=tokens[:8] + [99] * 32, block_size=8)) == 1
    loaded = kv.load(keys[1])
    assert all(torch.equal(loaded[n], t) for n, t in blocks(1).items())
    with pytest.raises(KVMissError, match="evicted, dropped or never saved"):
        kv.load(keys[4])
    m = kv.metrics()
    assert (m.blocks, m.saved_blocks, m.loaded_blocks, m.missed_blocks) == (3, 3, 1, 1)


def test_block_digests_chain_every_token_before_and_extend_without_rehashing():
    tokens = list(range(50))
    full = block_digests(tokens, 8)
    assert len(full) == 6 and block_digests(tokens, 8, 3) == full[:3]
    assert block_digests(tokens, 8, after=full[:2]) == full
    assert block_digests(tokens, 8, after=["00" * 12] * 2)[2] != full[2]  # the chain, not the block alone
    assert block_digests([99] + tokens[1:], 8)[5] != full[5]


def test_a_block_of_a_sharded_engine_counts_once_every_shard_saved_it(tmp_path):
    kv = KVStore(KVStoreConfig(directory=str(tmp_path)))
    (key,) = kv.keys("L", "r", version=1, token_ids=list(range(8)), block_size=8)
    kv.save(key.of_shard(1), blocks(1))
    assert kv.lookup([key], shards=2) == 0
    kv.save(key.of_shard(0), blocks(0))
    assert kv.lookup([key], shards=2) == 1
    assert torch.equal(kv.load(key.of_shard(1))["layer0"], blocks(1)["layer0"])
    with pytest.raises(KVMissError, match="holds"):  # one shard's file is never read as another's
        os.replace(kv.path(key.of_shard(0)), kv.path(key.of_shard(1)))
        kv.load(key.of_shard(1))


def test_a_torn_or_foreign_block_file_is_a_miss_never_data(tmp_path):
    kv = KVStore(KVStoreConfig(directory=str(tmp_path)))
    a, b = kv.keys("L", "r", version=1, token_ids=list(range(16)), block_size=8)
    kv.save(a, blocks(0))
    kv.save(b, blocks(1))
    Path(kv.path(b)).write_bytes(Path(kv.path(b)).read_bytes()[:100])
    with pytest.raises(KVMissError, match="unreadable"):
        kv.load(b)
    os.replace(kv.path(a), kv.path(b))  # a's bytes under b's name
    with pytest.raises(KVMissError, match="holds"):
        kv.load(b)


def test_retain_versions_drops_the_kv_of_versions_no_engine_serves(tmp_path):
    kv = KVStore(KVStoreConfig(directory=str(tmp_path)))
    for version in (1, 2, 3):
        for key in kv.keys("L", f"r{version}", version=version, token_ids=list(range(24)), block_size=8):
            kv.save(key, blocks(key.index))
    assert kv.versions() == {1, 2, 3}
    assert kv.retain_versions({3, 7}) == 6
    assert kv.versions() == {3}
    assert kv.drop_rollout("r3") == 3 and kv.versions() == set()
    m = kv.metrics()
    assert (m.blocks, m.bytes, m.dropped_version_blocks, m.dropped_finished_blocks) == (0, 0, 6, 3)


def test_eviction_takes_the_oldest_rollout_first_from_its_last_block(tmp_path):
    size = len(__import__("safetensors.torch").torch.save(blocks(0), metadata={"x": "y" * 60}))  # about one block
    kv = KVStore(KVStoreConfig(directory=str(tmp_path), budget_bytes=int(size * 6.5), low_watermark=1.0))
    old = kv.keys("L", "old", version=1, token_ids=list(range(32)), block_size=8)
    new = kv.keys("L", "new", version=1, token_ids=list(range(100, 132)), block_size=8)
    for key in old:
        kv.save(key, blocks(key.index))
    time.sleep(0.02)  # a later mtime (the age eviction orders by)
    for key in new[:2]:
        kv.save(key, blocks(key.index))
    kv.save(new[2], blocks(2))  # the seventh block: the old rollout's last block makes room
    assert kv.lookup(old) == 3 and kv.lookup(new) == 3
    m = kv.metrics()
    assert m.evicted_blocks == 1 and m.bytes <= kv.config.budget_bytes and m.blocks == 6


def test_the_budget_holds_under_100_concurrent_rollouts(tmp_path):
    """8 threads save the blocks of 100 rollouts interleaved (each thread its own locks, as processes
    have); a watcher measures the bytes on disk under the store's lock the whole time."""
    budget = 400_000
    kv = KVStore(KVStoreConfig(directory=str(tmp_path), budget_bytes=budget))
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with locked(kv.root):
                seen.append(sum(f.stat().st_size for f in Path(kv.root).rglob("*.kv")))
            time.sleep(0.002)

    def drive(ids: range) -> None:
        for i in range(4):
            for r in ids:
                key = kv.keys("L", f"r{r}", version=1, token_ids=list(range(r, r + 32)), block_size=8)[i]
                kv.save(key, blocks(r * 10 + i, nbytes=2048))

    watcher = threading.Thread(target=watch)
    watcher.start()
    drivers = [threading.Thread(target=drive, args=(range(t, 100, 8),)) for t in range(8)]
    for t in drivers:
        t.start()
    for t in drivers:
        t.join(timeout=120)
    stop.set()
    watcher.join(timeout=10)
    m = kv.metrics()
    on_disk = sum(f.stat().st_size for f in Path(kv.root).rglob("*.kv"))
    assert len(seen) > 10 and max(seen) <= budget and on_disk == m.bytes <= budget
    assert m.saved_blocks == 400 and m.evicted_blocks == 400 - m.blocks and m.evicted_blocks > 150
    assert m.evicted_bytes + m.bytes == m.saved_bytes


def test_a_block_larger_than_the_budget_is_refused_and_counted(tmp_path):
    kv = KVStore(KVStoreConfig(directory=str(tmp_path), budget_bytes=1000))
    (key,) = kv.keys("L", "r", version=1, token_ids=list(range(8)), block_size=8)
    assert not kv.save(key, blocks(0))
    assert kv.lookup([key]) == 0 and kv.metrics().rejected_blocks == 1


# -- the driver ------------------------------------------------------------------------------------

def test_a_rollout_whose_engine_dies_resumes_on_another_from_its_last_complete_turn(rollouts):
    rollouts.start("ref", [1, 2, 3], sampling=SAMPLING)
    reference = run(rollouts, "ref", [FakeEngine("B", 1)])
    a, b = FakeEngine("A", 1, die_at={5}), FakeEngine("B", 1)
    rollouts.start("r", [1, 2, 3], sampling=SAMPLING)
    record = run(rollouts, "r", [a, b])
    assert record.token_ids() == reference.token_ids()
    assert [t.engine for t in generated(record)] == ["A", "A", "B"]
    assert record.resumes == (Resume(turn=5, from_engine="A", to_engine="B", reason="engine-died"),)
    assert b.requests[-1].token_ids == record.token_ids()[: -SAMPLING.max_tokens]  # the whole context
    assert b.requests[-1].seed == SAMPLING.turn_seed(5) and b.requests[-1].kv_version == 1


def test_a_rollout_whose_engine_left_the_fleet_resumes_and_says_so(rollouts):
    a, b = FakeEngine("A", 1), FakeEngine("B", 1)
    rollouts.start("r", [4], sampling=SAMPLING)
    turn = rollouts.generate("r", [a, b], timeout=10)
    rollouts.append_turn("r", tool_turn(turn))
    rollouts.generate("r", [b], timeout=10)
    assert rollouts.record("r").resumes == (Resume(turn=3, from_engine="A", to_engine="B", reason="engine-removed"),)


def test_an_update_that_aborts_a_turn_continues_it_on_the_new_version_and_records_where(rollouts):
    engine = FakeEngine("A", 1, abort_at={5: 2})
    rollouts.start("r", [1, 2, 3], sampling=SAMPLING)
    record = run(rollouts, "r", [engine])
    assert [t.weight_version for t in generated(record)] == [1, 1, 2]
    assert record.version_changes == (VersionChange(turn=5, token=0, old=1, new=2),)
    assert record.resumes == (Resume(turn=5, from_engine="A", to_engine="A", reason="aborted-for-update"),)
    context = record.token_ids()[: -SAMPLING.max_tokens]
    assert generated(record)[-1].token_ids == model(context, 2, SAMPLING.turn_seed(5), SAMPLING.max_tokens)
    assert [r.kv_version for r in engine.requests] == [1, 1, 1, 2]  # the aborted try asked for version 1's KV


def test_abort_goes_to_the_newest_version_keep_stale_stays_on_its_own_while_served(rollouts):
    old, new = FakeEngine("old", 1), FakeEngine("new", 2)
    for mode in ("abort", "keep-stale"):
        rollouts.start(mode, [7], sampling=SAMPLING, on_update=mode)
        point = rollouts.resume(mode, [old])
        rollouts.append_turn(mode, Turn(kind="generated", token_ids=(1,), weight_version=1, engine="old"))
        del point
    assert rollouts.generate("abort", [old, new], timeout=10).engine == "new"
    assert rollouts.generate("keep-stale", [old, new], timeout=10).engine == "old"
    assert rollouts.generate("keep-stale", [new], timeout=10).weight_version == 2  # version 1 is no longer served
    record = rollouts.record("keep-stale")
    assert record.version_changes == (VersionChange(turn=3, token=0, old=1, new=2),)
    assert record.resumes[-1].reason == "engine-removed"


def test_the_kv_of_versions_no_engine_serves_is_dropped_after_a_turn(rollouts):
    assert rollouts.kv is not None
    for version in (1, 2):
        (key,) = rollouts.kv.keys("L", "x", version=version, token_ids=list(range(8)), block_size=8)
        rollouts.kv.save(key, blocks(version))
    rollouts.start("r", [1], sampling=SAMPLING)
    rollouts.generate("r", [FakeEngine("A", 2)], timeout=10)
    assert rollouts.kv.versions() == {2} and rollouts.kv.metrics().dropped_version_blocks == 1


def test_finish_drops_the_rollouts_kv_and_refuses_more_turns(rollouts):
    assert rollouts.kv is not None
    (key,) = rollouts.kv.keys("L", "r", version=1, token_ids=list(range(8)), block_size=8)
    rollouts.kv.save(key, blocks(0))
    rollouts.start("r", [1], sampling=SAMPLING)
    assert rollouts.finish("r").finished and rollouts.kv.lookup([key]) == 0
    with pytest.raises(ValueError, match="is finished"):
        rollouts.generate("r", [FakeEngine("A", 1)], timeout=10)


def test_when_every_engine_dies_the_driver_says_so(rollouts):
    rollouts.start("r", [1], sampling=SAMPLING)
    with pytest.raises(NoEngineError, match="no engine left to run turn 1"):
        rollouts.generate("r", [FakeEngine("A", 1, die_at={1}), FakeEngine("B", 1, die_at={1})], timeout=10)
    assert [r.reason for r in rollouts.record("r").resumes] == ["engine-died"]


def test_turns_cut_short_too_often_give_up_naming_the_setting(tmp_path):
    rollouts = Rollouts(RolloutStore(tmp_path), max_attempts=2)
    rollouts.start("r", [1], sampling=SAMPLING)
    engine = FakeEngine("A", 1)

    def always_abort(request: TurnRequest, *, timeout: float) -> TurnResult:
        engine.version += 1
        return TurnResult(token_ids=(), finish_reason="abort", version_spans=(), engine="A")

    engine.generate = always_abort  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"2 attempts at turn 1 were all cut short .* raise max_attempts"):
        rollouts.generate("r", [engine], timeout=10)
    assert rollouts.record("r").turns == RolloutRecord.start("r", [1], sampling=SAMPLING).turns


# -- an engine in another process: the driver's handle --------------------------------------------

def test_a_hosted_engine_handle_answers_in_order_and_reports_its_engine_gone(tmp_path):
    """The engine's side is played here over the socket pair; the engine says it is ready before
    anyone waits for it (the handle must not lose that answer)."""
    import socket

    from weightsync.integrations.vllm_rollout_host import HostedTurnEngine, _recv, _send

    ours, theirs = socket.socketpair()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    engine = HostedTurnEngine(process, ours, name="e")
    try:
        _send(theirs, {"id": 0, "version": 4})
        time.sleep(0.05)  # the handle's reader takes the answer before wait_ready asks for it
        engine.wait_ready(timeout=10)
        assert engine.weight_version == 4
        request = TurnRequest(rollout_id="r", turn=1, token_ids=(1, 2), sampling=SAMPLING, seed=12, kv_version=4)
        turn, update = engine.submit(request, engine.update_command(5, weights_path="/ckpt"))
        sent = [_recv(theirs), _recv(theirs)]
        assert [m["op"] for m in sent] == ["generate", "update"]  # together, in order
        assert TurnRequest.from_wire(sent[0]["request"]) == request
        _send(theirs, {"id": sent[1]["id"], "aborted": 1},
              {"id": sent[0]["id"], "result": TurnResult(token_ids=(), finish_reason="abort", version_spans=(),
                                                         engine="e").to_wire()})
        assert engine.result(turn, timeout=10).aborted and update.result(timeout=10)["aborted"] == 1
        pending = engine.submit(request)[0]
        assert _recv(theirs) is not None
        theirs.close()  # the engine's process is gone
        with pytest.raises(EngineGoneError, match="engine e is gone: its process exited"):
            engine.result(pending, timeout=10)
        with pytest.raises(EngineGoneError, match="engine e is gone"):
            engine.generate(request, timeout=10)
    finally:
        process.kill()
        engine.close()
