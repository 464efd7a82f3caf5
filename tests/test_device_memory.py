"""How weightsync tells a GPU's free memory, on CPU: the real port (``TorchDevices``) over fakes of
the few ``torch.cuda`` calls it makes, and the device model's caching allocator (issue 39,
defects 5 and 7)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from device_model import DeviceModel
from weightsync.ports import device as device_port
from weightsync.ports.device import DeviceMemoryError, TorchDevices, allocatable_bytes, cached_blocks

MiB = 1 << 20


def segment(total: int, *, pool: tuple[int, int] = (0, 0), free: list[int] = (), used: int = 0) -> dict[str, Any]:
    """A segment as ``torch.cuda.memory_snapshot()`` reports it (the keys weightsync reads)."""
    blocks = [{"size": n, "state": "inactive"} for n in free]
    if used:
        blocks.append({"size": used, "state": "active_allocated"})
    return {"device": 0, "total_size": total, "allocated_size": used, "active_size": used,
            "segment_pool_id": pool, "blocks": blocks}


class FakeCuda:
    """The calls ``TorchDevices.free_bytes`` may make, answering for one GPU; ``context``: whether
    this process has a CUDA context there. Creating one by asking is what the real call does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, context: bool, driver_free: int,
                 segments: list[dict[str, Any]], nvml_used: int = 0, total: int = 80 << 30) -> None:
        self.contexts = {0: context}
        self.calls: list[str] = []
        reserved = sum(s["total_size"] for s in segments)
        allocated = sum(s["allocated_size"] for s in segments)
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: self.contexts[i], raising=False)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda include_traces=True: segments)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
        monkeypatch.setattr(torch.cuda, "device_memory_used", lambda device=None: nvml_used)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {
            "total_memory": total})())
        self.driver_free, self.total = driver_free, total

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        index = torch.device(device).index if isinstance(device, (str, torch.device)) else int(device or 0)
        self.calls.append(f"mem_get_info({index})")
        self.contexts[index] = True  # cudaMemGetInfo needs a context: it makes one
        return self.driver_free, self.total


def test_free_memory_counts_only_what_one_allocation_can_get(monkeypatch):
    """Defect 5: free memory was the driver's plus everything torch reserved and had not
    allocated, CUDA graph pools and the fragments of split segments included, so an arena passed
    its check and then ran out of memory. One allocation gets the driver's free memory plus the
    wholly free segments torch gives back, or its largest free block."""
    segments = [segment(2048 * MiB, pool=(1, 0), free=[2048 * MiB]),  # a CUDA graph's private pool
                segment(400 * MiB, free=[10 * MiB] * 20, used=200 * MiB),  # fragments between live blocks
                segment(50 * MiB, free=[50 * MiB])]  # a whole free segment: empty_cache gives it back
    FakeCuda(monkeypatch, context=True, driver_free=100 * MiB, segments=segments)
    assert TorchDevices().free_bytes("cuda:0") == 150 * MiB
    assert cached_blocks(segments, 0) == [(10 * MiB, False)] * 20 + [(50 * MiB, True)]
    assert allocatable_bytes(5 * MiB, [(64 * MiB, False), (8 * MiB, True)]) == 64 * MiB  # a large free block


def test_free_memory_of_a_gpu_without_a_context_is_read_without_making_one(monkeypatch):
    """Defect 5: the CUDA IPC reader's check for the context it is about to create on the writer's
    GPU asked ``mem_get_info`` there, which creates that very context first. Without a context,
    the free memory comes from NVML (what nvidia-smi shows), which needs none."""
    fake = FakeCuda(monkeypatch, context=False, driver_free=0, segments=[], nvml_used=30 << 30, total=80 << 30)
    assert TorchDevices().free_bytes("cuda:0") == 50 << 30
    assert fake.calls == [] and fake.contexts == {0: False}


def test_an_arena_that_fits_only_in_fragments_or_graph_pools_is_refused_before_it_is_allocated():
    """The device model's caching allocator: a process's free cached blocks serve an allocation
    they fit (fragments), wholly free segments go back to the driver for one, graph pools serve
    only their graphs; the check refuses what the allocator could not place."""
    model = DeviceModel(budget=100 * MiB)
    model.cache(40 * MiB, blocks=40)  # 40 fragments of 1 MiB
    model.graph_pool(30 * MiB)
    model.cache(10 * MiB, whole=True)
    assert model.driver_free("cpu") == 20 * MiB and model.free_bytes("cpu") == 30 * MiB
    with pytest.raises(DeviceMemoryError, match=r"arena needs 31\.0 MiB on cpu, and only 30\.0 MiB of it is free"):
        device_port.allocate(model, 31 * MiB, "cpu", what="arena", fix="less")
    with pytest.raises(torch.OutOfMemoryError):
        model.empty(31 * MiB, "cpu", what="unchecked")
    arena = device_port.allocate(model, 30 * MiB, "cpu", what="arena", fix="less")  # the whole segment went back
    small = model.empty(MiB, "cpu", what="a fragment's worth")  # served by a fragment: nothing from the driver
    assert model.driver_free("cpu") == 0 and arena.numel() == 30 * MiB and small.numel() == MiB


@pytest.mark.parametrize(("settings", "backend", "switch"), [
    ("", "native", None),
    ("max_split_size_mb:128", "native", None),
    ("expandable_segments:True", "native", "expandable_segments:False"),
    ("max_split_size_mb:64,expandable_segments:True", "native", "expandable_segments:False"),
    ("expandable_segments:False", "native", None),
])
def test_shareable_memory_is_allocated_outside_expandable_segments(settings, backend, switch):
    """Defect 7: with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (common in trainers) torch
    maps large blocks into expandable segments, which CUDA IPC shares only through file
    descriptors the reader must take with ``pidfd_getfd`` (ptrace rights), or not at all where
    their IPC handles are off. The IPC slots are allocated with expandable segments off."""
    from weightsync.ports.device import ipc_allocator_settings

    assert ipc_allocator_settings(settings, backend) == switch


def test_the_cuda_malloc_async_backend_is_refused_for_cuda_ipc():
    from weightsync.ports.device import ipc_allocator_settings

    with pytest.raises(ValueError, match=r"backend:cudaMallocAsync, which cannot share IPC handles: .*transport='torch'"):
        ipc_allocator_settings("backend:cudaMallocAsync", "cudaMallocAsync")


def test_the_real_port_switches_expandable_segments_off_around_a_shareable_allocation(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:True")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: calls.append(f"set {s}"))
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    real_empty = torch.empty

    def empty(*shape: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        calls.append(f"empty on {device}")
        return real_empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    TorchDevices().empty(64, "cuda:0", what="slots", shareable=True)
    assert calls == ["empty_cache", "set expandable_segments:False", "empty on cuda:0", "set expandable_segments:True"]
    calls.clear()
    TorchDevices().empty(64, "cuda:0", what="staging")
    assert calls == ["empty on cuda:0"]


def test_cuda_ipc_slots_are_shared_whatever_the_allocators_expandable_segments(tmp_path):
    """Defect 7 under the device model: memory of an expandable segment cannot be shared, so the
    writer's slots must be allocated shareable; every byte arrives."""
    from gpu_harness import run_pair

    model = DeviceModel(seed=10, expandable_segments=True)
    result = run_pair("shm", tmp_path, model=model)
    assert result.errors == [] and result.bad == [] and model.violations == []
