"""What ``weightsync doctor``'s checks need to know about this machine, read once
(:meth:`Environment.probe`): torch and its CUDA build, the GPUs and their topology, which
optional packages are installed, and their versions (for a bug report).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
from dataclasses import dataclass, field


@dataclass(slots=True)
class Environment:
    """What the checks need to know about this machine (read once)."""

    torch: str
    cuda_build: str | None
    gpus: int
    gpu_names: list[str] = field(default_factory=list)
    nixl: bool = False
    nccl4py: bool = False  # the NCCL transport's binding (transport/torch/nccl_comm.py)
    vllm: bool = False
    vllm_cpu: bool = False  # the vllm-cpu distribution provides it (no GPU kernels)
    sglang: bool = False
    versions: dict[str, str] = field(default_factory=dict)
    topology: str = ""  # ``nvidia-smi topo -m``, where present

    @classmethod
    def probe(cls) -> Environment:
        import torch

        from weightsync.transport.torch.nccl_comm import nccl4py_missing

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(torch=torch.__version__, cuda_build=torch.version.cuda, gpus=gpus,
                   gpu_names=[torch.cuda.get_device_name(i) for i in range(gpus)],
                   nixl=bool(importlib.util.find_spec("nixl_cu12") or importlib.util.find_spec("nixl")),
                   nccl4py=nccl4py_missing() is None,
                   vllm=importlib.util.find_spec("vllm") is not None, vllm_cpu=_vllm_cpu_build(),
                   sglang=importlib.util.find_spec("sglang") is not None,
                   versions=_versions(), topology=_topology())


def _versions() -> dict[str, str]:
    """Installed versions of what a GPU path depends on (for a bug report)."""
    out = {}
    for name in ("weightsync", "torch", "vllm", "vllm-cpu", "sglang", "nixl", "nixl-cu12", "nccl4py",
                 "nvidia-nccl-cu12", "nvidia-nccl-cu13", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build: the ``vllm-cpu`` distribution, not ``vllm``."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _topology() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], check=False, capture_output=True, text=True,
                              timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi topo -m failed: {exc}"
