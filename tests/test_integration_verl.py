"""The verl checkpoint-engine backend, driven through verl's own registry and call sequence.

verl (0.9.1) imports and runs on CPU for this part: ``import_external_libs`` loads the
backend module as ``custom_backend_module`` does, ``CheckpointEngineRegistry`` builds the
engines, and the driver below makes the calls ``CheckpointEngineManager.update_weights``
makes each step (prepare on every worker, ``build_topology``, ``init_process_group`` with
the topology's per-rank arguments, ``send_weights`` on the actor workers concurrently with
``receive_weights`` on the rollout workers, ``finalize``), on Ray actors. What it does not
run: verl's RayWorkerGroup/rollout replicas (they need vLLM or SGLang servers on GPUs).
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("verl", reason="needs verl: `make test-verl` runs it in a venv of its own (verl pins transformers<5.11)")
ray = pytest.importorskip("ray", reason="needs ray (pip install 'weightsync[ray]')")

import torch  # noqa: E402
from ray import cloudpickle  # noqa: E402

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
