"""verl's checkpoint-engine backend and agent loop, driven through verl's own registries and calls.

verl (0.9.1) imports and runs on CPU for this part: ``import_external_libs`` loads the
backend module as ``custom_backend_module`` does, ``CheckpointEngineRegistry`` builds the
engines, and the driver below makes the calls ``CheckpointEngineManager.update_weights``
makes each step (prepare on every worker, ``build_topology``, ``init_process_group`` with
the topology's per-rank arguments, ``send_weights`` on the actor workers concurrently with
``receive_weights`` on the rollout workers, ``finalize``), on Ray actors. What it does not
run: verl's RayWorkerGroup/rollout replicas (they need vLLM or SGLang servers on GPUs).

The agent loop (``weightsync.integrations.verl_agent_loop``) runs in verl's ``AgentLoopWorker``
(no Ray, no server): verl builds it from an agent loop config file, runs a batch through it and
pads its outputs; only ``server_manager`` is fake (section below).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs verl: `make test-verl` runs it in a venv of its own (verl pins transformers<5.11)")
ray = pytest.importorskip("ray", reason="needs ray (pip install 'weightsync[ray]')")

import torch  # noqa: E402
from ray import cloudpickle  # noqa: E402

from rollout_fakes import model, tool_turn  # noqa: E402
from weightsync.integrations.ray import stop_meta_server  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray"), pytest.mark.timeout(240)]
MODULE = "weightsync.integrations.verl"
WAIT = 120.0


def weights(step):
    """What the actor's model yields at ``step``: full tensors, mixed dtypes."""
    g = torch.Generator().manual_seed(step)
    yield "model.embed_tokens.weight", torch.randn(64, 32, generator=g).to(torch.bfloat16)
    for i in range(2):
        yield f"model.layers.{i}.mlp.down_proj.weight", torch.randn(32, 48, generator=g)
        yield f"model.layers.{i}.input_layernorm.weight", torch.randn(32, generator=g)


def make_engine(is_master):
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)  # what custom_backend_module does on every worker
    return CheckpointEngineRegistry.new("weightsync", bucket_size=1 << 20, is_master=is_master, job="verl-test",
                                        timeout=WAIT)


class ActorWorker:
    def __init__(self, rank):
        torch.set_num_threads(1)
        self.engine = make_engine(rank == 0)

    def call(self, method, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    async def update_weights(self, step):
        return await self.engine.send_weights(weights(step), global_steps=step)


class RolloutWorker:
    def __init__(self):
        torch.set_num_threads(1)
        self.engine = make_engine(False)

    def call(self, method, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    async def update_weights(self, step):
        got = {name: t.clone() async for name, t in self.engine.receive_weights(global_steps=step)}
        want = dict(weights(step))
        return {"names": list(got), "exact": list(got) == list(want) and all(
            got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want)}


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, namespace="weightsync-verl-test", log_to_driver=False, include_dashboard=False)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        stop_meta_server()
        ray.shutdown()
        from weightsync.transport.shm.files import sweep_stale_segments

        sweep_stale_segments()  # verl has no close hook: the writer's segment goes with its process


def test_verl_registry_builds_the_backend_and_steps_sync_bitwise(local_ray):
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)
    backend_cls = CheckpointEngineRegistry.get("weightsync")
    actors = [ray.remote(ActorWorker).options(num_cpus=0).remote(r) for r in range(2)]
    rollouts = [ray.remote(RolloutWorker).options(num_cpus=0).remote() for _ in range(2)]
    for step in (1, 2, 3):
        # CheckpointEngineManager.build_process_group, then update_weights, then finalize
        metadata = ray.get([w.call.remote("prepare") for w in actors + rollouts], timeout=WAIT)
        actor_kw, rollout_kw = backend_cls.build_topology(len(actors), len(rollouts), metadata)
        ray.get([w.call.remote("init_process_group", **{k: v[i] for k, v in actor_kw.items()})
                 for i, w in enumerate(actors)]
                + [w.call.remote("init_process_group", **{k: v[i] for k, v in rollout_kw.items()})
                   for i, w in enumerate(rollouts)], timeout=WAIT)
        sent = [w.update_weights.remote(step) for w in actors]
        got = ray.get([w.update_weights.remote(step) for w in rollouts], timeout=WAIT)
        metrics = ray.get(sent, timeout=WAIT)
        assert all(g["exact"] for g in got), got
        nbytes = sum(t.numel() * t.element_size() for _, t in weights(step))
        sent = [m["weightsync/bytes"] for m in metrics]
        # every actor worker sends its share, none the whole model; one node: each byte packed once
        assert sum(sent) == nbytes and all(0 < n < nbytes for n in sent), sent
        assert all(m["weightsync/version_lag"] == 0 and m["weightsync/sync_seconds"] > 0 for m in metrics), metrics
        ray.get([w.call.remote("finalize") for w in actors + rollouts], timeout=WAIT)
    ray.get([w.call.remote("init_process_group", "writer", 0, 2, 2) for w in actors[:1]], timeout=WAIT)  # same: ok
    with pytest.raises(ray.exceptions.RayTaskError, match="a weightsync job keeps its ranks"):
        ray.get(rollouts[0].call.remote("init_process_group", "reader", 0, 3, 2), timeout=WAIT)


def test_topology_needs_exactly_one_master():
    from weightsync.integrations.verl import topology

    actor_kw, rollout_kw = topology(2, 3, [{"master": False}, {"master": True}, {}, {}, {}])
    # every actor worker writes its share; the master is writer 0 (it publishes the tensor list)
    assert actor_kw == {"role": ["writer", "writer"], "rank": [1, 0], "num_readers": [3, 3], "num_writers": [2, 2]}
    assert rollout_kw == {"role": ["reader"] * 3, "rank": [0, 1, 2], "num_readers": [3, 3, 3],
                          "num_writers": [2, 2, 2]}
    with pytest.raises(ValueError, match="exactly one master actor worker, got 0"):
        topology(1, 1, [{"master": False}, {}])


# CI's budget (66 s): `make test-heavy`; test_verl_registry_builds_the_backend_and_steps_sync_bitwise
# makes the same calls through verl's registry on Ray actors, by default
@pytest.mark.heavy
@pytest.mark.timeout(480)
def test_the_verl_example_runs_as_its_readme_says():
    """examples/verl/checkpoint_engine_cpu.py, its smallest run (one step), in this venv."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "examples" / "verl" / "checkpoint_engine_cpu.py"), "--steps", "1"],
                          capture_output=True, text=True, timeout=420, cwd=root,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"),
                                                                            os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (step,) = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("STEP ")]
    assert step["bitwise"] and len(step["bytes_per_actor"]) == 2 and all(b > 0 for b in step["bytes_per_actor"])
    assert step["version_lag"] == 0


# -- the agent loop (weightsync.integrations.verl_agent_loop) ------------------------------------------
# verl's AgentLoopWorker runs on CPU without Ray or a server: it is built here as AgentLoopManager
# builds it (with the trainer config composed from verl's own ppo_trainer.yaml and a tiny model
# directory), and its generate_sequences takes the batch as the manager hands it over (``uid`` per
# prompt, repeated n times, ``priority`` = position). Only the server manager is fake.

RESPONSE_LENGTH = 32
TURN_TOKENS = 4  # the fake server stops each turn after 4 tokens, as a model ending a tool call
USER = {"role": "user", "content": "w9 w10 w11"}  # the word-level tokenizer: ``wN`` is id N


def agent_tool(record, turn):
    """Two tool calls per rollout, then done (rollout_fakes' deterministic tool)."""
    return None if sum(t.kind == "tool" for t in record.turns) == 2 else tool_turn(turn)


class FakeServerManager:
    """verl's ``LLMServerClient.generate`` (llm_server.py): token ids of a hash of the context, the
    weights' version and the seed (``rollout_fakes.model``), as verl's ``TokenOutput``. Raises Ray's
    ``ActorDiedError`` at call ``die_at`` (its server died); ``versions`` is the version per call."""

    def __init__(self, versions=(3,), die_at=None, aborted=()):
        self.versions, self.die_at, self.aborted = list(versions), die_at, set(aborted)
        self.calls = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids), "params": dict(sampling_params)})
        n = len(self.calls)
        version = self.versions[min(n, len(self.versions)) - 1]
        if n == self.die_at:
            raise ray.exceptions.ActorDiedError()
        if n in self.aborted:
            return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": version})
        tokens = model(tuple(prompt_ids), version, sampling_params["seed"], min(TURN_TOKENS, sampling_params["max_tokens"]))
        return TokenOutput(token_ids=list(tokens), log_probs=[-t / 1000 for t in tokens], stop_reason="completed",
                           extra_fields={"global_steps": version})


@pytest.fixture(scope="module")
def trainer_config(tmp_path_factory):
    """verl's trainer config (hydra-composed ppo_trainer.yaml) over a tiny model directory: a llama
    config.json (no model-specific Continuous Token builder: verl's default one) and a word-level
    tokenizer whose chat template writes each message's words."""
    import json

    import verl
    import verl.experimental.agent_loop  # its import (seconds without bytecode) is the setup's
    from hydra import compose, initialize_config_dir

    from weightsync.tools.tiny import FRONTIER, VOCAB, write_tokenizer

    model = tmp_path_factory.mktemp("verl-model")
    (model / "config.json").write_text(json.dumps({**FRONTIER["llama"], "vocab_size": VOCAB, "num_hidden_layers": 1}))
    write_tokenizer(model)
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.prompt_length=8", f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "+actor_rollout_ref.model.custom_chat_template='{% for m in messages %}{{ m.content }} {% endfor %}'"])


def agent_worker(trainer_config, tmp_path, server, rollout=None, **entry):
    """An AgentLoopWorker whose agent loop config file has one entry: the weightsync loop with
    ``entry`` (``rollout``: overrides of actor_rollout_ref.rollout)."""
    import json

    from omegaconf import OmegaConf
    from verl.experimental.agent_loop import AgentLoopWorker

    entry = {"name": "weightsync_tool_agent", "_target_": "weightsync.integrations.verl_agent_loop.WeightsyncToolAgentLoop",
             **entry}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"agent-{len(list(tmp_path.glob('agent-*')))}.yaml"
    path.write_text(json.dumps([{k: v for k, v in entry.items() if v is not None}]))  # JSON is YAML
    config = OmegaConf.merge(trainer_config, {"actor_rollout_ref": {"rollout": {**(rollout or {}), "agent": {
        "agent_loop_config_path": str(path), "default_agent_loop": "weightsync_tool_agent"}}}})
    return AgentLoopWorker(config, llm_client=server)


def batch(n=2, uid="5f1c0d2e-uid-of-step-7"):
    """One prompt repeated n times (``uid`` shared, as ray_trainer.fit makes it), ``priority`` its
    position (as AgentLoopManager.generate_sequences sets it)."""
    import numpy as np
    from verl.protocol import DataProto

    prompts = np.empty(n, dtype=object)
    prompts[:] = [[USER] for _ in range(n)]
    return DataProto.from_dict(non_tensors={"raw_prompt": prompts, "uid": np.array([uid] * n, dtype=object),
                                            "index": np.zeros(n, dtype=np.int64),
                                            "priority": np.arange(n, dtype=np.int64)})


def generate(worker, data):
    return asyncio.run(asyncio.wait_for(worker.generate_sequences(data), timeout=60))


def store(tmp_path):
    from weightsync.roles.rollouts import RolloutStore

    return RolloutStore(tmp_path / "rollouts")


def test_agent_loop_returns_verl_the_rollouts_tokens_with_tool_results_masked(trainer_config, tmp_path):
    server = FakeServerManager(versions=(3,))
    worker = agent_worker(trainer_config, tmp_path, server, directory=str(tmp_path / "rollouts"),
                          tool=f"{__name__}:agent_tool")
    out = generate(worker, batch(n=2))

    records = [store(tmp_path).load(f"verl-5f1c0d2e-uid-of-step-7-p{i}") for i in range(2)]
    for i, record in enumerate(records):
        assert record.finished
        assert [t.kind for t in record.turns] == ["prompt", "generated", "tool", "generated", "tool", "generated"]
        assert record.turns[0].token_ids == (9, 10, 11)  # verl's chat template over the word tokenizer
        assert [t.weight_version for t in record.turns if t.kind == "generated"] == [3, 3, 3]
        assert [t.tool_call.name for t in record.turns if t.kind == "tool"] == ["lookup", "lookup"]
        assert record.turns[2].tool_result == str(sum(record.turns[1].token_ids))
        assert not record.resumes and not record.version_changes
        # exactly what verl got: left-padded prompt, right-padded response, 1 on generated, 0 on tool tokens
        response = [t for turn in record.turns[1:] for t in turn.token_ids]
        mask = [int(turn.kind == "generated") for turn in record.turns[1:] for _ in turn.token_ids]
        assert len(response) == 3 * TURN_TOKENS + 2 * 3
        assert out.batch["prompts"][i].tolist() == [0] * 5 + [9, 10, 11]
        assert out.batch["responses"][i].tolist() == response + [0] * (RESPONSE_LENGTH - len(response))
        assert out.batch["response_mask"][i].tolist() == mask + [0] * (RESPONSE_LENGTH - len(mask))
        assert out.batch["rollout_log_probs"][i, : len(response)].tolist() == pytest.approx(
            [-t / 1000 if m else 0.0 for t, m in zip(response, mask)])
        assert out.non_tensor_batch["weightsync_rollout_id"][i] == record.rollout_id
        assert out.non_tensor_batch["__num_turns__"][i] == 6
        assert (out.non_tensor_batch["min_global_steps"][i], out.non_tensor_batch["max_global_steps"][i]) == (3, 3)
    # each sample its own seed: the two copies of the prompt differ
    assert records[0].turns[1].token_ids != records[1].turns[1].token_ids
    # one server_manager.generate per generated turn: the record's context, the turn's seed, what is left
    calls = [c for c in server.calls if c["request_id"].startswith(records[0].rollout_id)]
    assert [c["prompt_ids"] for c in calls] == [
        [t for turn in records[0].turns[:k] for t in turn.token_ids] for k in (1, 3, 5)]
    assert [c["params"]["seed"] for c in calls] == [records[0].sampling.turn_seed(k) for k in (1, 3, 5)]
    assert [c["params"]["max_tokens"] for c in calls] == [32, 32 - 7, 32 - 14]
    assert len({c["request_id"] for c in calls}) == 1 and calls[0]["params"]["logprobs"] is True
    # importing the module (hydra did, for the first sample) kept the config file's entry, settings and all
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    assert _agent_loop_registry["weightsync_tool_agent"]["directory"] == str(tmp_path / "rollouts")


def test_agent_loop_resumes_a_rollout_whose_server_died_from_its_last_complete_turn(trainer_config, tmp_path):
    from weightsync.roles.rollouts import EngineGoneError, Resume

    directory = str(tmp_path / "rollouts")
    whole = FakeServerManager()
    want = generate(agent_worker(trainer_config, tmp_path / "whole", whole, directory=str(tmp_path / "whole"),
                                 tool=f"{__name__}:agent_tool"), batch(n=1))

    dying = FakeServerManager(die_at=3)  # turns 1 and 3 are generated, the server dies under turn 5
    with pytest.raises(EngineGoneError, match="died at turn 5") as died:
        generate(agent_worker(trainer_config, tmp_path, dying, directory=directory, tool=f"{__name__}:agent_tool"),
                 batch(n=1))
    assert type(died.value.__cause__).__name__ == "ActorDiedError"  # Ray's error, kept as the cause
    rid = "verl-5f1c0d2e-uid-of-step-7-p0"
    cut = store(tmp_path).load(rid)
    assert [t.kind for t in cut.turns] == ["prompt", "generated", "tool", "generated", "tool"] and not cut.finished

    # verl runs the same batch again (a new worker, a new server manager): turn 5 is the first it generates
    again = FakeServerManager()
    got = generate(agent_worker(trainer_config, tmp_path, again, directory=directory, tool=f"{__name__}:agent_tool"),
                   batch(n=1))
    assert [c["prompt_ids"] for c in again.calls] == [list(cut.token_ids())]
    assert again.calls[0]["params"]["seed"] == cut.sampling.turn_seed(5)
    for key in ("prompts", "responses", "response_mask", "rollout_log_probs", "input_ids", "attention_mask"):
        assert got.batch[key].tolist() == want.batch[key].tolist(), key
    record = store(tmp_path).load(rid)
    assert record.finished and record.turns[:5] == cut.turns
    old, new = cut.turns[-2].engine, record.turns[-1].engine
    assert old != new and old.startswith("verl-") and new.startswith("verl-")
    assert record.resumes == (Resume(turn=5, from_engine=old, to_engine=new, reason="engine-removed"),)
    assert dying.calls[0]["request_id"] != again.calls[0]["request_id"]  # a fresh route through verl's balancer


def test_agent_loop_records_verls_versions_and_generates_an_aborted_turn_again(trainer_config, tmp_path):
    from weightsync.roles.rollouts import Resume, VersionChange

    # the server's weights change under the rollout (3, then 4 from call 2); call 3 is aborted for the update
    server = FakeServerManager(versions=(3, 4, 4, 4), aborted={3})
    out = generate(agent_worker(trainer_config, tmp_path, server, directory=str(tmp_path / "rollouts"),
                                tool=f"{__name__}:agent_tool"), batch(n=1))
    record = store(tmp_path).load("verl-5f1c0d2e-uid-of-step-7-p0")
    assert [t.weight_version for t in record.turns if t.kind == "generated"] == [3, 4, 4]
    assert record.version_changes == (VersionChange(turn=3, token=0, old=3, new=4),)
    engine = record.turns[1].engine
    assert record.resumes == (Resume(turn=5, from_engine=engine, to_engine=engine, reason="aborted-for-update"),)
    assert server.calls[2]["prompt_ids"] == server.calls[3]["prompt_ids"]  # turn 5 again, from its start,
    assert server.calls[2]["params"]["seed"] == server.calls[3]["params"]["seed"]  # with the same seed
    assert (out.non_tensor_batch["min_global_steps"][0], out.non_tensor_batch["max_global_steps"][0]) == (3, 4)

    # a server that reports no version (never synced by verl): the configured initial_version
    unsynced = FakeServerManager(versions=(None,))
    generate(agent_worker(trainer_config, tmp_path, unsynced, directory=str(tmp_path / "rollouts"),
                          tool=f"{__name__}:agent_tool", initial_version=7), batch(n=1, uid="other-step"))
    record = store(tmp_path).load("verl-other-step-p0")
    assert {t.weight_version for t in record.turns if t.kind == "generated"} == {7}


def test_agent_loop_stops_at_verls_response_length(trainer_config, tmp_path):
    server = FakeServerManager()
    out = generate(agent_worker(trainer_config, tmp_path, server, rollout={"response_length": 12},
                                directory=str(tmp_path / "rollouts"), tool=f"{__name__}:agent_tool"), batch(n=1))
    record = store(tmp_path).load("verl-5f1c0d2e-uid-of-step-7-p0")
    # a turn asks for what is left of the response (12, then 12 - 7); the tool's answer fills it: done,
    # and verl gets the response cut at response_length, as its own loops cut it
    assert [len(t.token_ids) for t in record.turns[1:]] == [4, 3, 4, 3] and record.finished
    assert [c["params"]["max_tokens"] for c in server.calls] == [12, 5]
    assert out.batch["response_mask"][0].tolist() == [1] * 4 + [0] * 3 + [1] * 4 + [0]


def test_agent_loop_refuses_a_configuration_it_cannot_run_and_says_which_setting(trainer_config, tmp_path):
    def fails(match, data=None, **entry):
        worker = agent_worker(trainer_config, tmp_path, FakeServerManager(), **entry)
        with pytest.raises(Exception, match=match):
            generate(worker, data or batch(n=1))

    tool, directory = f"{__name__}:agent_tool", str(tmp_path / "rollouts")
    fails(r"`directory` \(where rollout records are kept\) is not set: add `directory: ", tool=tool)
    fails(r"`tool` is not set", directory=directory)
    fails(r"`tool` 'no_such_module:f': cannot import no_such_module", directory=directory, tool="no_such_module:f")
    fails(r"`max_turns` must be >= 1", directory=directory, tool=tool, max_turns=0)
    fails(r"`on_update: keep-stale` cannot be honoured: verl's server manager picks each turn's server",
          directory=directory, tool=tool, on_update="keep-stale")
    fails(r"rollout.name=sglang is not supported", directory=directory, tool=tool, rollout={"name": "sglang"})
    no_uid = batch(n=1)
    del no_uid.non_tensor_batch["uid"]
    fails(r"the sample has no \['uid'\].*set `id_fields`", no_uid, directory=directory, tool=tool)
    # a record under the sample's id with another prompt: the id fields do not name one sample
    generate(agent_worker(trainer_config, tmp_path, FakeServerManager(), directory=directory, tool=tool), batch(n=1))
    # the process's driver pool exists now (256 threads, the default): another number is refused, not ignored
    fails(r"`threads: 3`, but this agent loop worker drives its rollouts with 256 threads", directory=directory,
          tool=tool, threads=3)
    other = batch(n=1)
    other.non_tensor_batch["raw_prompt"][0] = [{"role": "user", "content": "w12"}]
    fails(r"exists with another prompt", other, directory=directory, tool=tool)


class HangingServerManager(FakeServerManager):
    """A server that never answers turn 3 (call 2): the call waits until it is cancelled."""

    hanging = cancelled = None  # when the call began to wait, and when it was cancelled

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        if len(self.calls) == 1:
            self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids), "params": dict(sampling_params)})
            self.hanging = time.monotonic()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled = time.monotonic()
                raise
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)


def test_agent_loop_bounds_a_turn_by_its_timeout_and_lets_verl_cancel_a_sample(trainer_config, tmp_path):
    from weightsync.roles.rollouts import RolloutStore

    tool = f"{__name__}:agent_tool"
    server = HangingServerManager()
    worker = agent_worker(trainer_config, tmp_path, server, directory=str(tmp_path / "a"), tool=tool, timeout=1.0)
    with pytest.raises(TimeoutError, match=r"turn 3 did not end within [\d.]+ s"):  # what is left of 1 s
        generate(worker, batch(n=1))
    assert server.cancelled is not None  # the call in flight was cancelled, not left running on verl's loop
    assert len(RolloutStore(tmp_path / "a").load("verl-5f1c0d2e-uid-of-step-7-p0").turns) == 3

    # verl cancels the sample (its task) while the turn waits: the call is cancelled at once, not after `timeout`
    server = HangingServerManager()
    worker = agent_worker(trainer_config, tmp_path, server, directory=str(tmp_path / "b"), tool=tool, timeout=60)

    async def cancel_while_hanging():
        task = asyncio.create_task(worker.generate_sequences(batch(n=1)))
        while server.hanging is None and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled_at = time.monotonic()
        while server.cancelled is None and time.monotonic() - cancelled_at < 5:  # verl's loop goes on
            await asyncio.sleep(0.01)
        return server.cancelled

    assert asyncio.run(asyncio.wait_for(cancel_while_hanging(), timeout=60)) is not None


def test_meta_address_points_the_backend_at_that_coordinator_not_the_ray_actor(monkeypatch):
    """``engine_kwargs.weightsync.meta_address`` (issue 38): the job's coordinator is the one it
    names (here a meta server, its token from the environment), and no Ray actor is looked up."""
    from weightsync.integrations.verl import WeightSyncCheckpointEngine
    from weightsync.meta import EmbeddedMetaServer

    with EmbeddedMetaServer() as server:
        monkeypatch.setenv("WEIGHTSYNC_META_TOKEN", server.token)
        engine = WeightSyncCheckpointEngine(bucket_size=1 << 20, job="verl-address", meta_address=server.address)
        meta = engine._meta()
        try:
            assert meta.address == server.address and meta.job == "verl-address"
            meta.put_document("k", b"v")
            assert meta.get_document("k") == b"v"
        finally:
            meta.close()
    assert not ray.is_initialized()  # the Ray actor's path was not taken
