"""vLLM's ``weightsync`` worker backend on GPU, on CPU: its device decisions under the device model
(``tests/device_model.py``) with vLLM's model stubbed by tiny-qwen3's staging, and vLLM's own
config objects where the decision reads them (issue 39: defects 3 and 5)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from device_model import DeviceModel
from weightsync.configs import load_spec
from weightsync.engines.staging import StagedWeights
from weightsync.plan.phases import layer_phases
from weightsync.ports import device as device_port
from weightsync.ports.device import DeviceMemoryError

ParallelConfig = pytest.importorskip("vllm.config").ParallelConfig
pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def staging(rank: int = 0, replicas: int = 1) -> StagedWeights:
    return StagedWeights(load_spec("tiny-qwen3"), dtype=torch.float32, device="cpu", rank=rank, replicas=replicas)


def arena(phases: tuple[tuple[str, ...], ...] | None) -> int:
    """The staging arena of tiny-qwen3 in fp32 for ``phases`` (the whole model: about 1.2 MiB)."""
    laid_out = staging()
    laid_out.use_phases(phases)
    return laid_out.staging_bytes


WHOLE = arena(None)


def backend(monkeypatch: pytest.MonkeyPatch, staged: list[StagedWeights], *, parallel_config: Any = None,
            additional: dict[str, Any] | None = None) -> Any:
    """vLLM's worker backend, built as ``Worker.load_model`` builds it, with the model stubbed."""
    from weightsync.integrations import vllm_backend

    def worker(model: Any, vllm_config: Any, device: Any, rank: int, replicas: int, **kwargs: Any) -> StagedWeights:
        staged.append(staging(rank, replicas))
        return staged[-1]

    monkeypatch.setattr(vllm_backend, "_WorkerEngine", worker)
    monkeypatch.setattr(vllm_backend, "_staging_template", lambda vllm_config, device: staging(), raising=False)
    vllm_config = SimpleNamespace(parallel_config=parallel_config or ParallelConfig(), model_config=None,
                                  additional_config=additional or {})
    return vllm_backend.WeightSyncTransferEngine(SimpleNamespace(backend="weightsync"), vllm_config,
                                                 torch.device("cpu"), None)


def init_info(**extra: Any) -> dict[str, Any]:
    return {"num_writers": 1, "num_readers": 1, "meta_address": "http://127.0.0.1:9", "meta_token": "token-12345678",
            **extra}


def vllm_sizes_its_kv_cache(model: DeviceModel, utilization: float) -> None:
    """``Worker.determine_available_memory``: the KV cache is what ``utilization`` of the GPU leaves
    once everything the worker holds (weights, and what its backend took) is counted."""
    assert isinstance(model.budget, int)
    held = model.used + model.reserved["the engine's weights"]
    model.reserve(int(utilization * model.budget) - held, "vLLM's KV cache")


def test_every_data_parallel_replica_is_a_reader_of_its_own():
    """Defect 3: vLLM's DP client sends one init info to every replica, and each replica's worker
    took ``init_info.rank`` as its reader rank: the second replica was refused at rendezvous, or
    the job waited for it forever. The replica's index comes from vLLM's own ParallelConfig, as
    vLLM sets it up in each replica's engine core (a dense model resets data_parallel_rank to 0
    and keeps data_parallel_index)."""
    monkeypatch = pytest.MonkeyPatch()
    readers = []
    try:
        for replica in (0, 1):
            config = ParallelConfig(data_parallel_size=2, data_parallel_rank=replica)
            config.data_parallel_index = replica  # vllm/v1/engine/core.py, run_engine_core
            config.reconfigure_for_independent_dp_rank()
            assert config.data_parallel_rank == 0
            staged: list[StagedWeights] = []
            engine = backend(monkeypatch, staged, parallel_config=config)
            try:
                engine.init_transfer_engine(engine.parse_init_info(init_info(num_readers=2)))
                readers.append((engine.reader.rank, staged[0].layout().rank))
            finally:
                engine.shutdown()
    finally:
        monkeypatch.undo()
    assert readers == [(0, 0), (1, 1)]


def test_a_replica_past_num_readers_is_refused_naming_both():
    """A replica of a dense DP engine sees DP = 1 (vLLM reset it), so only its own rank can tell it
    that num_readers did not count every replica."""
    from weightsync.integrations.vllm_backend import reader_rank

    def replica(d: int) -> SimpleNamespace:
        config = ParallelConfig(data_parallel_size=2, data_parallel_rank=d)
        config.data_parallel_index = d
        config.reconfigure_for_independent_dp_rank()
        return SimpleNamespace(parallel_config=config)

    assert reader_rank(2, 4, replica(1)) == 3 and reader_rank(2, 4, replica(0)) == 2
    with pytest.raises(ValueError, match=r"data-parallel replica 1 of this engine would be reader 4 "
                                         r"\(WeightSyncInitInfo.rank=3 \+ replica x TP \+ TP rank\), and the job has "
                                         r"num_readers=4: count every worker of every replica"):
        reader_rank(3, 4, replica(1))


def test_staging_is_reserved_before_vllm_sizes_its_kv_cache(monkeypatch):
    """Defect 5: the staging arena was allocated at ``init_weight_transfer_engine``, after vLLM had
    sized its KV cache out of ``gpu_memory_utilization``: at the default 0.9 only a tenth of the
    GPU was left, less than the model's staging, and a whole-model arena was refused. The backend
    now takes it while vLLM's worker builds it (before the KV cache is sized), and lays the arena
    out there at init."""
    model = DeviceModel(budget=8 * MiB)
    model.reserve(4 * MiB, "the engine's weights")
    staged: list[StagedWeights] = []
    with device_port.use(model):
        engine = backend(monkeypatch, staged)
        try:
            vllm_sizes_its_kv_cache(model, 0.9)
            assert model.free_bytes("cpu") < WHOLE  # what vLLM leaves does not hold the model's staging
            engine.init_transfer_engine(engine.parse_init_info(init_info()))
            assert staged[0].staging_bytes == WHOLE and model.peak == WHOLE  # laid out in the reserve
        finally:
            engine.shutdown()


def test_a_job_with_layer_phases_lays_one_phase_out_in_the_reserve(monkeypatch):
    """With layer phases the arena laid out at init is the largest phase the job will use (the
    phases every rank computes), in the reserve, and the first update finds it laid out."""
    budget = 1 << 18
    phases = layer_phases(staging().layout().canonical, budget_bytes=budget)
    phase = arena(phases)
    model = DeviceModel(budget=8 * MiB)
    model.reserve(4 * MiB, "the engine's weights")
    staged: list[StagedWeights] = []
    with device_port.use(model):
        engine = backend(monkeypatch, staged)
        try:
            vllm_sizes_its_kv_cache(model, 0.9)
            engine.init_transfer_engine(engine.parse_init_info(init_info(layer_phases=True, max_bucket_bytes=budget)))
            (laid_out,) = staged
            assert laid_out.staging_bytes == phase < WHOLE and model.peak == WHOLE
            laid_out.use_phases(phases)  # what the reader does at the first update
            assert laid_out.staging_bytes == phase and model.peak == WHOLE
        finally:
            engine.shutdown()


def test_a_reserve_that_does_not_fit_is_refused_when_the_worker_builds_the_backend(monkeypatch):
    """The reserve is taken within the GPU's free memory, and refused with its figure and the
    settings to change, before vLLM starts serving."""
    model = DeviceModel(budget=8 * MiB)
    model.reserve(7 * MiB, "the engine's weights")
    with device_port.use(model), pytest.raises(
            DeviceMemoryError, match=r"weightsync's staging reserve needs 1\.2 MiB on cpu, and only 1\.0 MiB of it is "
                                     r"free: lower gpu_memory_utilization .*layer_phases in additional_config"):
        backend(monkeypatch, [])
    assert model.peak == 0


def test_declared_layer_phases_reserve_one_phase_and_an_undeclared_whole_model_is_refused(monkeypatch):
    """Defect 5: a job with layer phases declares them to the engine (additional_config), which then
    reserves one phase, not a model's worth of KV cache; a job that then stages more than it
    declared is refused at init, naming the declaration, with nothing else allocated."""
    budget = 1 << 18
    phase = arena(layer_phases(staging().layout().canonical, budget_bytes=budget))
    declared = {"weightsync": {"layer_phases": True, "max_bucket_bytes": budget}}
    for job, fits in ((init_info(layer_phases=True, max_bucket_bytes=budget), True), (init_info(), False)):
        model = DeviceModel(budget=8 * MiB)
        model.reserve(4 * MiB, "the engine's weights")
        staged: list[StagedWeights] = []
        with device_port.use(model):
            engine = backend(monkeypatch, staged, additional=declared)
            try:
                assert model.used == phase
                vllm_sizes_its_kv_cache(model, 0.9)
                if fits:
                    engine.init_transfer_engine(engine.parse_init_info(job))
                    assert staged[0].staging_bytes == phase and model.peak == phase
                    continue
                with pytest.raises(DeviceMemoryError, match=r"the engine's staging arena needs 1\.2 MiB on cpu, and "
                                                            r"only 1\.0 MiB of it is free: .*additional_config"):
                    engine.init_transfer_engine(engine.parse_init_info(job))
                assert model.used == 0  # the reserve was given back, nothing else taken
            finally:
                engine.shutdown()


def test_a_malformed_staging_declaration_is_refused_naming_it():
    from weightsync.integrations.vllm_backend import staging_settings

    assert staging_settings(SimpleNamespace(additional_config={}))[0] is False
    assert staging_settings(SimpleNamespace(additional_config={"weightsync": {"layer_phases": True}}))[0] is True
    with pytest.raises(ValueError, match=r"additional_config\['weightsync'\] takes layer_phases and max_bucket_bytes"):
        staging_settings(SimpleNamespace(additional_config={"weightsync": {"phases": True}}))
