"""verl's actor -> rollout weight sync through weightsync's checkpoint-engine backend, on CPU.

verl's trainer needs GPU rollout servers (vLLM or SGLang replicas); its checkpoint-engine layer
does not. This script makes the calls verl's ``CheckpointEngineManager.update_weights`` makes each
step, through verl's own registry, on Ray actors: ``prepare`` on every worker, the backend's
``build_topology``, ``init_process_group``, ``send_weights`` on every actor worker while the
rollout workers ``receive_weights``, ``finalize``. Each actor worker sends its share of the model
(none sends it whole); each rollout worker checks what it received bitwise. The meta server is
weightsync's detached Ray actor (``weightsync-meta``), created by the first worker that asks and
stopped at the end. Run it in a venv with verl (``make .venv-verl/.installed``)::

    .venv-verl/bin/python examples/verl/checkpoint_engine_cpu.py --steps 3 [--actors 2 --rollouts 2]

The GPU command (verl's own trainer) is in examples/verl/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys

MODULE = "weightsync.integrations.verl"


def weights(step: int):  # type: ignore[no-untyped-def]
    """What an actor's model yields at ``step``: whole tensors, mixed dtypes (a stand-in model)."""
    import torch

    g = torch.Generator().manual_seed(step)
    yield "model.embed_tokens.weight", torch.randn(512, 64, generator=g).to(torch.bfloat16)
    for i in range(4):
        yield f"model.layers.{i}.mlp.down_proj.weight", torch.randn(64, 192, generator=g)
        yield f"model.layers.{i}.input_layernorm.weight", torch.randn(64, generator=g)


def make_engine(is_master: bool):  # type: ignore[no-untyped-def]
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)  # what checkpoint_engine.custom_backend_module does on every worker
    return CheckpointEngineRegistry.new("weightsync", bucket_size=1 << 20, is_master=is_master, job="verl-example",
                                        timeout=120.0, device="cpu")


class Worker:
    """An actor or rollout worker's checkpoint engine (verl's workers hold one the same way)."""

    def __init__(self, is_master: bool) -> None:
        import torch

        torch.set_num_threads(1)
        self.engine = make_engine(is_master)

    def call(self, method: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        return getattr(self.engine, method)(*args, **kwargs)

    async def send(self, step: int) -> dict:
        return await self.engine.send_weights(weights(step), global_steps=step)  # type: ignore[no-any-return]

    async def receive(self, step: int) -> bool:
        import torch

        got = {name: t.clone() async for name, t in self.engine.receive_weights(global_steps=step)}
        want = dict(weights(step))
        return list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=2)
    args = parser.parse_args()
    import ray
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from weightsync.integrations.ray import stop_meta_server

    # no dashboard: a one-machine example has no use for it, and it costs seconds of the start
    ray.init(num_cpus=2, namespace="weightsync-verl-example", log_to_driver=False, include_dashboard=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        import_external_libs(MODULE)
        backend = CheckpointEngineRegistry.get("weightsync")
        remote = ray.remote(Worker).options(num_cpus=0)
        actors = [remote.remote(r == 0) for r in range(args.actors)]
        rollouts = [remote.remote(False) for _ in range(args.rollouts)]
        for step in range(1, args.steps + 1):
            metadata = ray.get([w.call.remote("prepare") for w in actors + rollouts])
            actor_kw, rollout_kw = backend.build_topology(len(actors), len(rollouts), metadata)
            ray.get([w.call.remote("init_process_group", **{k: v[i] for k, v in kw.items()})
                     for group, kw in ((actors, actor_kw), (rollouts, rollout_kw)) for i, w in enumerate(group)])
            sent = [w.send.remote(step) for w in actors]
            exact = ray.get([w.receive.remote(step) for w in rollouts], timeout=300)
            metrics = ray.get(sent, timeout=300)
            ray.get([w.call.remote("finalize") for w in actors + rollouts])
            print("STEP " + json.dumps({"step": step, "bitwise": all(exact),
                                        "bytes_per_actor": [m["weightsync/bytes"] for m in metrics],
                                        "sync_seconds": max(m["weightsync/sync_seconds"] for m in metrics),
                                        "version_lag": max(m["weightsync/version_lag"] for m in metrics)}),
                  flush=True)
            if not all(exact):
                return 1
    finally:
        stop_meta_server()
        ray.shutdown()
        from weightsync.transport.shm.files import sweep_stale_segments

        sweep_stale_segments()  # verl has no close hook: the writers' segments go with their processes
    return 0


if __name__ == "__main__":
    sys.exit(main())
