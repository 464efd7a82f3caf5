"""``weightsync doctor`` on this (CPU) machine: the CPU checks pass, every GPU check is listed
with the reason it was skipped."""

from __future__ import annotations

import json

import pytest

from weightsync.apps.doctor import CHECKS
from weightsync.cli import main


@pytest.mark.timeout(180)
def test_doctor_runs_the_cpu_checks_and_names_every_gpu_check_it_skipped(capsys):
    code = main(["doctor", "--json", "--only", "meta-server,cpu/shm,cpu/gloo,gpu,engine"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 0 and report["ok"], report
    assert checks["meta-server"]["status"] == "passed"
    for name in ("cpu/shm", "cpu/gloo"):
        assert checks[name]["status"] == "passed" and checks[name]["gbps"] > 0, checks[name]
        assert "bitwise" in checks[name]["detail"]
    gpu = [n for n in CHECKS if n.startswith("gpu/")]
    assert len(gpu) >= 5 and set(gpu) <= set(checks)
    if report["environment"]["gpus"] == 0:
        for name in gpu:
            assert checks[name]["status"] == "skipped" and "GPU" in checks[name]["detail"], checks[name]
    for name in ("engine/vllm", "engine/sglang"):
        assert checks[name]["status"] == "skipped" and checks[name]["detail"], checks[name]


def test_doctor_lists_every_gpu_path_of_a_real_job_and_writes_a_report(tmp_path, capsys):
    """Issue 23 section 3: every GPU path is listed, with a result or the reason it did not run,
    and ``--report FILE`` holds versions, topology and each check (fast: GPU checks only)."""
    path = tmp_path / "doctor.json"
    code = main(["doctor", "--json", "--only", "gpu,engine", "--report", str(path)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 0
    for name in ("gpu/nccl-2gpu", "gpu/nccl-4ranks", "gpu/same-gpu", "gpu/cuda-ipc-2gpu", "gpu/nixl-vram", "gpu/delta",
                 "gpu/nccl-abort", "gpu/cuda-ipc-visible-devices", "gpu/nixl-push", "gpu/nixl-pull", "gpu/phases-shm",
                 "gpu/phases-routed", "gpu/fp8", "engine/vllm-memory"):
        assert name in checks and checks[name]["detail"], name
        if report["environment"]["gpus"] == 0:
            assert checks[name]["status"] == "skipped" and "GPU" in checks[name]["detail"], checks[name]
    if report["environment"]["gpus"] == 0:
        assert "peak device memory during an update against the reserve: needs 1 GPU(s); this machine has 0" in \
            checks["engine/vllm-memory"]["detail"], checks["engine/vllm-memory"]
    saved = json.loads(path.read_text())
    assert saved["checks"] == report["checks"] and "torch" in saved["environment"]["versions"]
    assert "topology" in saved["environment"]


def test_the_nccl_checks_say_they_need_nccl4py():
    """weightsync drives NCCL through nccl4py (transport/torch/nccl_comm.py): on a GPU machine without
    it every NCCL check is refused with the package to install, and on one without GPUs the
    reason names both."""
    from weightsync.apps.doctor import DoctorOptions, Environment
    from weightsync.transport.torch.nccl_comm import MISSING

    assert MISSING == "the NCCL transport needs nccl4py (pip install weightsync[gpu])"
    gpus = Environment(torch="2.13.0", cuda_build="12.8", gpus=8, nccl4py=False)
    cpu = Environment(torch="2.13.0", cuda_build=None, gpus=0, nccl4py=False)
    for name in ("gpu/nccl-2gpu", "gpu/nccl-4ranks", "gpu/delta", "gpu/nccl-abort"):
        check = CHECKS[name](gpus, DoctorOptions())
        assert check.status == "skipped" and MISSING in check.detail and "needs" not in check.detail.replace(MISSING, ""), (name, check)
        check = CHECKS[name](cpu, DoctorOptions())
        assert check.status == "skipped" and "GPU" in check.detail and MISSING in check.detail, (name, check)
