"""Versions and asynchrony: one-sided put/get, staleness bound, in-flight updates.

- ``TensorStore``: writer processes put slices of non-weight tensors and never wait; the
  test process gets them resharded, bitwise, and a superseded version gives a clear error.
- ``WeightWriter`` with ``staleness=K``: under a deliberately slow reader, ``write(V)``
  returns only once the slowest reader applied ``V - K``, and does return earlier than a
  synchronous write would (training really runs ahead).
- ``InflightReader``: the engine keeps stepping while the next version arrives in staging,
  and no step ever sees two versions at once.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
import torch

from launcher import launch as launch_process
from weightsync import SyncConfig, WeightReader, WeightWriter
from weightsync.engines import ModuleEngine
from weightsync.layout import ModelSpec
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.plan import PlanError
from weightsync.roles.inflight import InflightReader
from weightsync.roles.tensorstore import StoreConfig, SupersededError, TensorSlice, TensorStore, slice_of
from weightsync.sources import ModuleSource

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from _store_worker import SHARDED, store_values  # noqa: E402

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "vocab_size": 128, "torch_dtype": "float32"}


# -- one-sided put / get ---------------------------------------------------------------------------

def test_store_put_get_non_weight_tensors_across_processes_bitwise():
    versions = [0, 1, 2]
    with EmbeddedMetaServer() as server:
        env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
               "OMP_NUM_THREADS": "1"}
        procs = [launch_process([sys.executable, os.path.join(HERE, "_store_worker.py"),
                                 json.dumps({"rank": r, "num_writers": 2, "job": "rl", "slots": 3,
                                             "versions": versions, "timeout": 60})], env=env)
                 for r in range(2)]
        try:
            with TensorStore(StoreConfig(job="rl", timeout=60),
                             meta=MetaClient(server.address, token=server.token, job="rl")) as store:
                for version in versions:
                    want = store_values(version)
                    # whole tensors, from two writers' halves (or writer 0's whole copy)
                    got = store.multi_get(dict.fromkeys(want), version=version)
                    assert store.version == version
                    for name, tensor in want.items():
                        assert got[name].dtype == tensor.dtype, name
                        assert torch.equal(got[name], tensor), (version, name)
                    # resharded: a 3-way split along the other dimension, into caller-owned memory
                    for name in SHARDED:
                        full = want[name]
                        for i in range(3):
                            where = TensorSlice.part(full.shape, index=i, count=3, dim=1)
                            out = torch.full(where.box.sizes, 7, dtype=full.dtype)
                            assert store.get(name, out, where=where, version=version) is out
                            assert torch.equal(out, slice_of(full, where))
                names = store.names()
                assert names["rollout/tokens"].shape == (6, 33) and names["rollout/mask"].dtype == "bool"
                assert store.get("stats/reward_mean").item() == 2.25 and store.version == 2  # newest
                with pytest.raises(KeyError, match=r"no tensor 'nope'.*rollout/mask"):
                    store.get("nope")
                store.meta.put_document("done", b"1")
        finally:
            outs = [p.communicate(timeout=60) for p in procs]
        for p, (stdout, stderr) in zip(procs, outs, strict=True):
            assert p.returncode == 0, stderr[-3000:]
            assert stdout.count("completed") == len(versions)
    assert not [n for n in os.listdir("/dev/shm") if f"-{procs[0].pid}-" in n or f"-{procs[1].pid}-" in n]


def test_store_superseded_version_names_the_newest_and_newest_get_moves_on():
    with EmbeddedMetaServer() as server:
        def client() -> MetaClient:
            return MetaClient(server.address, token=server.token, job="s")

        config = StoreConfig(job="s", slots=1, timeout=5)
        with TensorStore(config, rank=0, meta=client()) as writer, TensorStore(config, meta=client()) as reader:
            with pytest.raises(TimeoutError, match="no version"):
                reader.get("x", timeout=0.2)
            writer.put("x", torch.zeros(3))
            writer.complete(0)
            assert torch.equal(reader.get("x"), torch.zeros(3)) and reader.version == 0
            pinned = reader._view  # a reader in the middle of reading version 0
            writer.put("x", torch.ones(3))
            writer.complete(1)  # slots=1: version 0 is retired (files unlinked)
            with pytest.raises(SupersededError, match=r"version 0 was superseded.*newest complete version is 1"):
                reader.get("x", version=0)
            assert torch.equal(reader.get("x"), torch.ones(3)) and reader.version == 1
            assert pinned is not None and torch.equal(reader._read(pinned, {"x": None})["x"], torch.zeros(3))
            with pytest.raises(ValueError, match="does not increase"):
                writer.complete(1)
            with pytest.raises(ValueError, match="read-only"):
                reader.put("x", torch.ones(3))
            with pytest.raises(ValueError, match="shape"):
                writer.put("y", torch.ones(3), where=TensorSlice.part((4,), index=0, count=3))
            half = TensorSlice.part((4, 3), index=0, count=2)
            writer.put("half", torch.ones(2, 3), where=half)  # the other half was never put
            writer.complete(2)
            assert torch.equal(reader.get("half", where=half), torch.ones(2, 3))
            with pytest.raises(PlanError, match=r"(?s)not fully covered.*6 of 12 elements"):
                reader.get("half")


# -- staleness bound ---------------------------------------------------------------------------------

class _Named(torch.nn.Module):
    """Parameters under Hugging Face names (``a.b`` is not a valid attribute name)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.ParameterDict({name.replace(".", "__"): torch.nn.Parameter(torch.zeros(t.shape))
                                             for name, t in ModelSpec.from_hf_config(CONFIG)
                                             .canonical_tensors().items()})

    def named_parameters(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        for name, p in self.inner.items():
            yield name.replace("__", "."), p


def _fill(module: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for _, p in module.named_parameters():
            p.fill_(value)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_staleness_bound_holds_under_a_slow_reader(staleness):
    versions = range(6)
    config = SyncConfig(num_writers=1, num_readers=1, transport="shm", staleness=staleness, timeout=30)
    trainer, served = _Named(), _Named()
    with EmbeddedMetaServer() as server:
        def client() -> MetaClient:
            return MetaClient(server.address, token=server.token)

        reader = WeightReader(ModuleEngine(served, CONFIG), rank=0, config=config, meta=client())
        writer = WeightWriter(ModuleSource(trainer, CONFIG), rank=0, config=config, meta=client())
        applied: list[tuple[int, bool]] = []

        def slow_reader() -> None:
            while reader.version != versions[-1]:
                time.sleep(0.2)  # a slow engine: busy between two updates
                result = reader.update(timeout=30)
                applied.append((result.version, all(bool((p == result.version).all())
                                                    for _, p in served.named_parameters())))

        thread = threading.Thread(target=slow_reader)
        thread.start()
        lag = []
        try:
            for v in versions:
                _fill(trainer, float(v))
                writer.write(v)
                assert writer.version == v
                seen = client().reader_versions()[0]
                lag.append(v - (seen if seen is not None else -1))
        finally:
            thread.join(60)
            writer.close()
            reader.close()
    assert not thread.is_alive()
    assert max(lag) <= staleness, lag  # the bound: never more than K versions behind at write's return
    if staleness:
        assert max(lag) == staleness, lag  # and training did run ahead of the slow reader
    assert all(exact for _, exact in applied), applied  # each applied version bitwise, never a mix
    assert [v for v, _ in applied] == sorted({v for v, _ in applied}) and applied[-1][0] == versions[-1]


# -- in-flight updates --------------------------------------------------------------------------------

def test_inflight_update_engine_steps_never_see_a_half_applied_version():
    versions = range(1, 9)
    config = SyncConfig(num_writers=1, num_readers=1, transport="shm", staleness=1, timeout=30)
    trainer, served = _Named(), _Named()
    _fill(served, 0.0)
    params = [p for _, p in served.named_parameters()]
    engine = ModuleEngine(served, CONFIG)
    engine.apply(0)
    with EmbeddedMetaServer() as server:
        def client() -> MetaClient:
            return MetaClient(server.address, token=server.token)

        writer = WeightWriter(ModuleSource(trainer, CONFIG), rank=0, config=config, meta=client())
        inflight = InflightReader(engine, rank=0, config=config, meta=client(), poll=0.2)

        def train() -> None:
            for v in versions:
                _fill(trainer, float(v))
                writer.write(v)
                time.sleep(0.02)

        trainer_thread = threading.Thread(target=train)
        steps: list[int] = []
        with inflight:
            trainer_thread.start()
            deadline = time.monotonic() + 60
            while inflight.version != versions[-1] and time.monotonic() < deadline:
                inflight.step_boundary()
                # one engine "step": reads every weight twice, a while apart; with the transport
                # writing into live weights (no staging) the two reads would disagree.
                first = torch.stack([p.detach().flatten()[[0, -1]] for p in params])
                time.sleep(0.003)
                last = torch.stack([p.detach().flatten()[[0, -1]] for p in params])
                assert torch.equal(first, last) and bool((first == first[0, 0]).all()), "a step saw two versions"
                assert first[0, 0].item() == inflight.version
                steps.append(int(first[0, 0].item()))
            trainer_thread.join(60)
            assert inflight.extra_bytes == sum(p.numel() * 4 for p in params)  # one staging copy, no more
            pauses = [r.phases["apply"] for r in inflight.results]
        writer.close()
    assert inflight.version == versions[-1] and not trainer_thread.is_alive()
    assert steps == sorted(steps) and len(steps) > len(set(steps))  # stepped on while versions arrived
    assert all(torch.equal(p, torch.full_like(p, versions[-1])) for p in params)
    assert pauses and max(pauses) < 5.0
