"""Background receives run on a stream of their own (issue 39, defect 4), under the device model
(``tests/device_model.py``): an engine's forward pass issued while a prefetch or in-flight receive
is under way never queues behind it, and what the engine then loads from staging is ordered after
the receive. One writer (simulated process "trainer") over CUDA IPC, a real meta server."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from device_model import DeviceModel
from weightsync.engines.staging import StagedWeights
from weightsync.layout import ModelSpec
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.ports import device as device_port
from weightsync.roles.inflight import InflightReader
from weightsync.roles.prefetch import Prefetch
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import WeightWriter
from weightsync.session.sync_session import SyncConfig
from weightsync.tools.tiny import CanonicalSource, canonical_weights, checkpoint_tensors, tiny_config
from weightsync.tools.torch_layout import fill_from_canonical

pytestmark = pytest.mark.timeout(120)
CONFIG = {**tiny_config(), "torch_dtype": "float32"}
JOB = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=30)


class LoadingEngine(StagedWeights):
    """Serves ``model``, which its loader fills from staging with copies on the current stream."""

    def __init__(self) -> None:
        super().__init__(ModelSpec.from_hf_config(CONFIG), dtype=torch.float32, device="cpu", rank=0)
        self.model: dict[str, torch.Tensor] = {}

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for name, staged in items:
            self.dev.copy(self.model.setdefault(name, torch.empty_like(staged)), staged)

    def serves(self, seed: int) -> bool:
        want = checkpoint_tensors(canonical_weights(CONFIG, seed))
        return set(self.model) == set(want) and all(torch.equal(self.model[n], t) for n, t in want.items())


@contextmanager
def one_trainer(model: DeviceModel, versions: tuple[int, ...]) -> Iterator[MetaClient]:
    """A meta server and a writer thread (process "trainer") writing ``versions`` (seed = version)."""
    errors: list[BaseException] = []
    with EmbeddedMetaServer() as server:
        def write() -> None:
            try:
                with model.as_process("trainer"):
                    source = CanonicalSource(CONFIG)
                    with WeightWriter(source, rank=0, config=JOB,
                                      meta=MetaClient(server.address, token=server.token)) as writer:
                        for version in versions:
                            fill_from_canonical(source.layout(), source.tensors(), canonical_weights(CONFIG, version))
                            writer.write(version)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=write)
        thread.start()
        try:
            yield MetaClient(server.address, token=server.token)
        finally:
            thread.join(60)
    assert errors == []


def decode_during_the_transfer(model: DeviceModel, engine: LoadingEngine, thread_prefix: str) -> Callable[[], None]:
    """Hook: when the background thread synchronises its transfer (its copies still pending), the
    engine runs a forward pass over its weights first, on the serving thread; returns a wait for it."""
    pending, decoded = threading.Event(), threading.Event()

    def hook() -> None:
        if threading.current_thread().name.startswith(thread_prefix) and not pending.is_set():
            pending.set()
            decoded.wait(30)

    model.before_synchronize = hook

    def decode() -> None:
        assert pending.wait(30), "the background receive never synchronised"
        try:
            model.forward(list(engine.model.values()), "a decode step")
        finally:
            decoded.set()
    return decode


def test_a_prefetch_receives_on_its_own_stream_and_the_apply_waits_for_it():
    """Defect 4: the prefetch thread queued its receive on torch's current stream, for a background
    thread the device's default stream, which the engine's forward uses: decode steps queued behind
    the whole transfer. It receives on a stream of its own, and the apply is ordered after it."""
    model = DeviceModel(chance=0.0)
    with device_port.use(model):
        engine = LoadingEngine()
        engine.update(checkpoint_tensors(canonical_weights(CONFIG, 0)), version=0)
        model.synchronize_all()
        decode = decode_during_the_transfer(model, engine, "weightsync-prefetch")
        with one_trainer(model, (1,)) as meta, WeightReader(engine, rank=0, config=JOB, meta=meta) as reader:
            prefetch = Prefetch(reader)
            prefetch.start()
            decode()
            result = prefetch.apply(1)
            model.synchronize("cpu")
        assert result.version == 1 and engine.serves(1)
    assert model.violations == []


def test_an_inflight_reader_receives_on_its_own_stream_and_copies_after_it():
    """Defect 4, in-flight updates: the background receive into staging, and the copy into the live
    buffers at a step boundary ordered after it (and the next receive after that copy)."""
    model = DeviceModel(chance=0.0)
    with device_port.use(model):
        engine = LoadingEngine()
        engine.update(checkpoint_tensors(canonical_weights(CONFIG, 0)), version=0)
        model.synchronize_all()
        decode = decode_during_the_transfer(model, engine, "weightsync-inflight")
        with one_trainer(model, (1, 2)) as meta:
            with InflightReader(engine, rank=0, config=JOB, meta=meta) as updater:
                decode()
                assert updater.wait_version(2, timeout=30) == 2
                model.synchronize("cpu")
                assert engine.serves(2)
    assert model.violations == []
