"""Prefetch: the next version is received into staging while the engine serves, applied on demand.

A stand-in engine that stages like vLLM (``StagedWeights``) and "loads" by copying staging into
its own model tensors: what it serves changes only in ``apply``. One writer thread (a whole
model, float32, integrity checks on) and one reader, with a real meta server.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from weightsync.engines.buffers import ShardedEngine
from weightsync.engines.staging import StagedWeights
from weightsync.layout import ModelSpec
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.roles.prefetch import Prefetch
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import WeightWriter
from weightsync.session.sync_session import SyncConfig
from weightsync.tools.tiny import CanonicalSource, canonical_weights, checkpoint_tensors, tiny_config
from weightsync.tools.torch_layout import fill_from_canonical

CONFIG = {**tiny_config(), "torch_dtype": "float32"}


class LoadingEngine(StagedWeights):
    """Serves ``model``, which only its loader (``apply``) writes."""

    def __init__(self) -> None:
        super().__init__(ModelSpec.from_hf_config(CONFIG), dtype=torch.float32, device="cpu", rank=0)
        self.model: dict[str, torch.Tensor] = {}

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.model.update({name: t.clone() for name, t in items})

    def serves(self, seed: int) -> bool:
        want = checkpoint_tensors(canonical_weights(CONFIG, seed))
        return set(self.model) == set(want) and all(torch.equal(self.model[n], t) for n, t in want.items())


def test_the_engine_serves_its_version_until_the_prefetched_one_is_applied():
    config = SyncConfig(num_writers=1, num_readers=1, transport="torch", timeout=60, integrity=True)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            source = CanonicalSource(CONFIG)
            with WeightWriter(source, rank=0, config=config, meta=MetaClient(server.address, token=server.token)) as w:
                for version in (1, 2):  # version v holds seed v
                    fill_from_canonical(source.layout(), source.tensors(), canonical_weights(CONFIG, version))
                    w.write(version)
        except BaseException as exc:
            errors.append(exc)

    engine = LoadingEngine()
    engine.update(checkpoint_tensors(canonical_weights(CONFIG, 0)), version=0)
    with EmbeddedMetaServer() as server:
        writer = threading.Thread(target=write)
        writer.start()
        try:
            with WeightReader(engine, rank=0, config=config,
                              meta=MetaClient(server.address, token=server.token)) as reader:
                prefetch = Prefetch(reader)
                prefetch.start()
                deadline = time.monotonic() + 60
                while prefetch.received is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert prefetch.received == 1
                assert engine.weight_version == 0 and engine.serves(0)  # version 1 sits in staging, unused
                result = prefetch.apply(1)
                assert (result.version, engine.weight_version) == (1, 1) and engine.serves(1)
                assert "apply" in result.phases and "check" in result.phases  # checked before it was applied
                assert not prefetch.pending
                result = prefetch.apply(2)  # nothing prefetched: receives and applies at once
                assert result.version == 2 and engine.serves(2)
        finally:
            writer.join(60)
    assert not writer.is_alive() and not errors, errors


def test_prefetch_refuses_engines_whose_model_would_see_the_next_version_early():
    config = SyncConfig(num_writers=1, num_readers=1, transport="torch")
    with EmbeddedMetaServer() as server, MetaClient(server.address, token=server.token) as meta:
        live = ShardedEngine("vllm:tp=1", CONFIG, 0)  # receives into the weights it serves
        with pytest.raises(ValueError, match=r"ShardedEngine receives into its live weights: .* InflightReader"):
            Prefetch(WeightReader(live, rank=0, config=config, meta=meta))
        staged = LoadingEngine()
        staged.receive_in_place({"model.norm.weight": torch.ones(CONFIG["hidden_size"])})
        with pytest.raises(ValueError, match=r"receives 1 tensors \(model.norm.weight, ...\) straight into the model"):
            Prefetch(WeightReader(staged, rank=0, config=config, meta=meta))
        phased = SyncConfig(num_writers=1, num_readers=1, transport="torch", layer_phases=True)
        with pytest.raises(ValueError, match=r"layer_phases=True\): each phase is loaded into the model"):
            Prefetch(WeightReader(LoadingEngine(), rank=0, config=phased, meta=meta))
