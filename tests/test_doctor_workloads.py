"""The doctor's checks of what users run on GPUs (issue 39), on a CPU machine: each is listed
with the reason it is skipped, asks for exactly the run it names on a fake GPU machine, and the
demo options they use run for real between CPU processes."""

from __future__ import annotations

import types
from typing import Any

import pytest

from weightsync.apps import demo, doctor_workloads
from weightsync.apps.demo import FAULT_SECONDS, WriterStep, run_demo
from weightsync.apps.doctor import CHECKS, DoctorOptions, Environment
from weightsync.apps.doctor_workloads import EPOCH_VERSIONS, WORKLOADS, epochs_verdict
from weightsync.integrations import vllm_workloads

CPU = Environment(torch="2.13.0", cuda_build=None, gpus=0)
GPUS = Environment(torch="2.13.0", cuda_build="12.8", gpus=2, nccl4py=True, vllm=True)
TINY = {"size": "tiny", "source": "megatron:tp=1", "steps": 2, "timeout": 60}


def test_every_workload_is_a_line_of_the_doctors_table_and_says_why_it_is_skipped_here():
    assert set(WORKLOADS) <= set(CHECKS)
    for name in WORKLOADS:
        check = CHECKS[name](CPU, DoctorOptions())
        assert check.status == "skipped" and "needs" in check.detail and "GPU" in check.detail, (name, check)
    engines = DoctorOptions(engines=True)
    assert "vLLM worker backend, dp2: needs 2 GPU(s); this machine has 1" in \
        CHECKS["engine/vllm-dp2"](Environment(torch="2.13.0", cuda_build="12.8", gpus=1, vllm=True), engines).detail
    assert "its CPU build" in CHECKS["engine/vllm-graphs"](
        Environment(torch="2.13.0", cuda_build="12.8", gpus=1, vllm=True, vllm_cpu=True), engines).detail
    assert "run with --engines" in CHECKS["engine/vllm-prefetch"](GPUS, DoctorOptions()).detail


@pytest.fixture
def demos(monkeypatch):
    """Every run_demo the checks ask for (its keyword arguments); each returns a clean result."""
    seen: list[dict[str, Any]] = []

    def fake(**kwargs: Any) -> Any:
        seen.append(kwargs)
        writers = [WriterStep(rank=0, version=v, nbytes=1, phases={}, train_seconds=0.0, device_bytes=4096)
                   for v in range(kwargs["steps"])]
        killed = [types.SimpleNamespace(at=1.0)] if kwargs.get("kill_reader", -1) >= 0 else []
        errors = [types.SimpleNamespace(at=4.0)] if killed else []
        return types.SimpleNamespace(ok=True, writers=writers, readers=[], failures=[], killed=killed,
                                     writer_errors=errors)

    monkeypatch.setattr(demo, "run_demo", fake)
    return seen


def test_the_epochs_check_runs_two_cuda_ipc_readers_across_an_epoch_change(demos):
    status, detail, figures = WORKLOADS["gpu/cuda-ipc-readers-epochs"](GPUS, DoctorOptions())
    assert status == "passed" and figures == {"trainer_bytes_after_first": 4096.0, "trainer_bytes_after_last": 4096.0}
    (call,) = demos
    assert call["transport"] == "shm" and call["steps"] == EPOCH_VERSIONS and call["new_epoch_at"] >= 1
    assert call["devices"] == {"writer": ["cuda:0"], "reader": ["cuda:0", "cuda:0"]}


def test_the_epochs_verdict_fails_when_the_trainers_memory_grew():
    steps = [WriterStep(rank=0, version=v, nbytes=1, phases={}, train_seconds=0.0, device_bytes=1000 + (v > 4) * 500)
             for v in range(EPOCH_VERSIONS)]
    result = types.SimpleNamespace(ok=True, writers=steps, readers=[], failures=[])
    status, detail, figures = epochs_verdict(result)
    assert status == "failed" and "grew from 1000 bytes after version 0 to 1500" in detail
    assert figures["trainer_bytes_after_last"] == 1500.0


@pytest.mark.parametrize(("gpus", "transport", "reader"), [(2, "torch", "cuda:1"), (1, "shm", "cuda:0")])
def test_the_stopped_peer_check_stops_a_reader_over_nccl_or_cuda_ipc(demos, gpus, transport, reader):
    env = Environment(torch="2.13.0", cuda_build="12.8", gpus=gpus, nccl4py=True)
    status, detail, figures = WORKLOADS["gpu/stopped-peer"](env, DoctorOptions())
    assert status == "passed" and figures == {"seconds_to_fail": 3.0} and "SIGSTOPped" in detail
    assert demos[0]["fault"] == "stop" and demos[0]["kill_reader"] == 0 and demos[0]["transport"] == transport
    assert demos[0]["devices"] == {"writer": ["cuda:0"], "reader": [reader]}


def test_the_vllm_workloads_start_vllm_as_users_run_it():
    for case in vllm_workloads.CASES:
        options = vllm_workloads.engine_options(case)
        assert options["weight_transfer_config"] == {"backend": "weightsync"} and options["dtype"] == "bfloat16"
        assert options["enforce_eager"] is False  # CUDA graphs on
    assert vllm_workloads.engine_options("utilization")["gpu_memory_utilization"] == 0.9
    assert vllm_workloads.engine_options("dp2")["data_parallel_size"] == 2
    server = types.SimpleNamespace(address="http://127.0.0.1:1", token="t")
    assert vllm_workloads.init_info("dp2", server, readers=2)["num_readers"] == 2
    assert vllm_workloads.init_info("prefetch", server, readers=1)["prefetch"] is True
    assert vllm_workloads.init_info("failure", server, readers=1)["layer_phases"] is True
    assert vllm_workloads.decode_ratio(90.0, 100.0) == 0.9 and vllm_workloads.decode_ratio(1.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="unknown vLLM workload 'tp2'"):
        vllm_workloads.engine_options("tp2")


def test_a_vllm_workload_reports_the_childs_verdict_and_figures(monkeypatch):
    """The child's JSON line becomes the check's line and its figures."""
    line = vllm_workloads.PREFIX + '{"ok": true, "detail": "prefetch: fine", "figures": {"decode_ratio": 0.93}}'

    def run(*args: Any, **kwargs: Any) -> Any:
        return types.SimpleNamespace(returncode=0, stdout=f"noise\n{line}\n", stderr="")

    monkeypatch.setattr(doctor_workloads.subprocess, "run", run)
    assert doctor_workloads.run_workload("prefetch", timeout=5) == ("passed", "prefetch: fine", {"decode_ratio": 0.93})


@pytest.mark.timeout(180)
def test_run_demo_moves_the_job_to_a_new_epoch_and_every_version_still_arrives():
    """Two readers of one writer take a version before the epoch change, the one that changes it
    and one after. Every rank is a thread of one process (``same_process``): on host memory the
    readers map the writer's segments by file either way, and one process costs a third of the
    three processes' start (67 s against 19 s here, side by side)."""
    result = run_demo(**{**TINY, "steps": 3}, target="vllm:tp=1,replicas=2", transport="shm", new_epoch_at=1,
                      same_process=True)
    assert result.ok, result.failures
    assert sorted((r.rank, r.version) for r in result.readers) == [(r, v) for r in (0, 1) for v in range(3)]
    assert all(w.device_bytes == 0 for w in result.writers)  # host memory


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_run_demo_stops_a_reader_mid_transfer_and_the_writer_fails_in_time_naming_it(transport):
    result = run_demo(**TINY, target="vllm:tp=1", transport=transport, kill_reader=0, fault="stop")
    assert result.ok, result.failures
    assert [(k.rank, k.version) for k in result.killed] == [(0, 1)]
    [error] = result.writer_errors
    assert "reader 0" in error.error and error.at - result.killed[0].at < FAULT_SECONDS, error
