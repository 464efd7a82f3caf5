"""The GPU paths of the transports, run on CPU under the device model (``tests/device_model.py``):
asynchronous copies, CUDA IPC handles, NIXL registrations. Each test names the issue-23 defect it
pins where it pins one."""

from __future__ import annotations

import math

import pytest

from device_model import DeviceModel
from gpu_harness import run_pair
from nixl_model import NixlModel
from weak_memory import WeakMemory
from weightsync.layout.types import itemsize
from weightsync.ports import device as device_port
from weightsync.transport.nixl import agent as nixl_agent

pytestmark = pytest.mark.timeout(120)


def test_cuda_ipc_between_two_processes_moves_every_byte(tmp_path):
    model = DeviceModel(seed=1)
    result = run_pair("shm", tmp_path, model=model, target="vllm:tp=1,replicas=2")
    assert result.errors == [] and result.bad == [] and len(result.received) == 4
    assert model.violations == []


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_nixl_on_device_memory_moves_every_byte(tmp_path, monkeypatch, mode):
    from weightsync.transport import TransportOptions

    model = DeviceModel(seed=2)
    monkeypatch.setattr(nixl_agent, "load_nixl", NixlModel(model).module)
    result = run_pair("nixl", tmp_path, model=model, options=TransportOptions(
        nixl_mode=mode, max_bucket_bytes=1 << 16, direct_min_bytes=1024))
    assert result.errors == [] and result.bad == [] and model.violations == []


def back_to_back(layout):
    """The reader's tensors as separate allocations placed back to back, as the CUDA caching
    allocator places them: each its own storage (its own NIXL registration), one after another."""
    import torch

    from weightsync.tools.torch_layout import TORCH_DTYPES

    sizes = [(s, math.prod(s.shape) * itemsize(s.dtype)) for s in layout.shards]
    memory = bytearray(sum(n for _, n in sizes))
    out, at = {}, 0
    for shard, n in sizes:
        storage = torch.frombuffer(memoryview(memory)[at: at + n], dtype=torch.uint8)
        out[shard.name] = storage.view(TORCH_DTYPES[shard.dtype])  # flat, as empty_shards makes them
        at += n
    return out


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_nixl_descriptors_never_span_two_registrations(tmp_path, monkeypatch, mode):
    """Defect 8: ranges adjacent in memory but in two registrations stay two descriptors."""
    from weightsync.transport import TransportOptions

    model = DeviceModel(seed=4)
    monkeypatch.setattr(nixl_agent, "load_nixl", NixlModel(model).module)
    result = run_pair("nixl", tmp_path, model=model, target="hf", reader_tensors=back_to_back, options=TransportOptions(
        nixl_mode=mode, max_bucket_bytes=1 << 16, direct_min_bytes=64))
    assert result.errors == [] and result.bad == [] and model.violations == []


def engine_reads(model):
    """before_receive: the engine's kernels (a forward pass) still read its weights, queued on its
    stream, when the next version's receive starts."""
    import torch

    def queue(version, phase, tensors):
        for t in tensors.values():
            model.copy(torch.empty_like(t), t)
    return queue


@pytest.mark.parametrize("phase_bytes", [None, 1 << 17])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_nixl_readers_synchronise_before_a_nic_writes_into_their_tensors(tmp_path, monkeypatch, mode, phase_bytes):
    """Defect 3: a pull reader's READs, and a push reader's ready word, come after its device
    synchronise: the NIC writes outside stream order, into memory queued kernels may still read
    (the engine's last forward; with layer phases, the previous phase's load kernels reading the
    staging arena the next phase lands in)."""
    from weightsync.transport import TransportOptions

    model = DeviceModel(seed=5, chance=0.0)
    monkeypatch.setattr(nixl_agent, "load_nixl", NixlModel(model).module)
    result = run_pair("nixl", tmp_path, model=model, before_receive=engine_reads(model), phase_bytes=phase_bytes,
                      options=TransportOptions(nixl_mode=mode, max_bucket_bytes=1 << 16, direct_min_bytes=1024))
    assert result.errors == [] and result.bad == [] and model.violations == []


def test_cuda_ipc_within_one_process_hands_the_slots_over_without_opening_the_handle(tmp_path):
    """Defect 2: an in-process trainer and engine (what ``auto`` picks shm for): CUDA refuses to
    open a handle in the process that exported it, so the reader takes the writer's slots as they are."""
    model = DeviceModel(seed=6)
    result = run_pair("shm", tmp_path, model=model, processes=None, target="vllm:tp=1,replicas=2")
    assert result.errors == [] and result.bad == [] and len(result.received) == 4
    assert model.violations == []


def test_the_self_checks_trainer_holds_its_weights_where_the_engine_stages():
    """Defect 1: ``doctor --engines`` ran a CPU stand-in trainer against a GPU engine, a mix
    ``choose_transport`` refuses. The stand-in now lives on the engine's device ("meta" here:
    a device that is not the CPU, on any machine)."""
    import types

    from weightsync.tools.tiny import CanonicalSource, tiny_config

    source = CanonicalSource.beside(types.SimpleNamespace(device="meta"), tiny_config())
    assert {str(t.device) for t in source.tensors().values()} == {"meta"}


def test_the_file_transport_on_gpu_goes_through_one_bounded_pinned_buffer_per_rank(tmp_path):
    """Defect 11: GPU tensors are written and read through page-locked host memory, one buffer
    of ``message_bytes`` per rank, never a pageable copy of a whole tensor."""
    from weightsync.transport import TransportOptions

    options = TransportOptions(max_bucket_bytes=1 << 16, direct_min_bytes=1024)
    model = DeviceModel(seed=7)
    result = run_pair("file", tmp_path, model=model, target="vllm:tp=1,replicas=2", options=options)
    assert result.errors == [] and result.bad == [] and len(result.received) == 4 and model.violations == []
    assert sorted(what for _, what in model.pinned) == [
        "reader 0's file staging buffer", "reader 1's file staging buffer", "writer 0's file staging buffer"]
    assert {n for n, _ in model.pinned} == {options.message_bytes}


def test_the_staging_arena_is_refused_with_its_figure_when_the_engine_left_no_room():
    """Defect 7 (vLLM staging): vLLM sizes its KV cache out of what it measured free, then the
    arena came lazily, as an out-of-memory error. It is refused before anything is allocated,
    naming the figure and the setting to change."""
    import torch

    from weightsync.configs import load_spec
    from weightsync.engines.staging import StagedWeights
    from weightsync.ports.device import DeviceMemoryError

    model = DeviceModel(budget=64 << 20)
    model.reserve(48 << 20, "the engine's weights")
    model.reserve_rest("vLLM's KV cache")
    with device_port.use(model):
        staged = StagedWeights(load_spec("tiny-qwen3"), dtype=torch.float32, device="cpu", rank=0)
        with pytest.raises(DeviceMemoryError, match=r"the engine's staging arena needs [0-9.]+ MiB on cpu, and only "
                                                    r"0\.0 MiB of it is free: .*gpu_memory_utilization.*layer_phases"):
            staged.receive_buffers()
    assert model.peak == 0


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_version_slots_on_the_trainer_gpu_are_refused_with_their_figure(tmp_path, monkeypatch, transport):
    """Defect 7 (IPC and NIXL writers): ``slots`` x the exposed bytes on the trainer's GPU are
    refused at prepare, naming the figure and the setting, rather than failing mid-sync."""
    from weightsync.transport import TransportOptions

    model = DeviceModel(budget=1 << 20)
    monkeypatch.setattr(nixl_agent, "load_nixl", NixlModel(model).module)
    result = run_pair(transport, tmp_path, model=model, timeout=1.5, options=TransportOptions(
        slots=3, nixl_mode="pull", max_bucket_bytes=1 << 16, direct_min_bytes=1024))
    assert any(f"writer 0's {'CUDA IPC' if transport == 'shm' else 'NIXL'} version slots (3 x " in str(e)
               and "TransportOptions.slots" in str(e) for e in result.errors), result.errors


def weakly_ordered(monkeypatch, *, seed: int, gate: bool, stale: float = 0.5) -> WeakMemory:
    """Shared-memory control words as an aarch64 CPU may show them (tests/weak_memory.py);
    ``gate``: what ``_ORDERED_STORES`` says (False: what aarch64 gets)."""
    from weightsync.transport.shm import snapshot as shm_snapshot
    from weightsync.transport.shm import transport as shm

    weak = WeakMemory(seed=seed, stale=stale)
    monkeypatch.setattr(shm_snapshot, "_ORDERED_STORES", gate)
    monkeypatch.setattr(shm, "read_segment", weak.wrap_reader(shm.read_segment))
    monkeypatch.setattr(shm_snapshot, "OwnSegment", weak.wrap_segment(shm_snapshot.OwnSegment))
    return weak


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_cuda_ipc_readers_take_each_phase_as_it_completes(tmp_path, monkeypatch, machine):
    """Issue 23 defect 4, and issue 39 defect 2: with layer phases, a CUDA IPC reader waited for
    the whole slot at phase 0 while the writer sealed it at its last phase; the routed transport's
    torch route blocks each rank at every phase, so a trainer and an engine each waited on the
    other forever. Every rank here finishes a phase before any sends the next (the same
    interlock, in one pair). Per-phase publishing was gated on x86-64's store order, so on
    aarch64 (the gate off, and the control words weakly ordered) the hang came back."""
    weak = weakly_ordered(monkeypatch, seed=8, gate=False) if machine == "aarch64" else None
    model = DeviceModel(seed=8)
    result = run_pair("shm", tmp_path, model=model, phase_bytes=1 << 17, lockstep=True, timeout=8.0,
                      versions=(1, 2, 3))
    assert result.errors == [] and result.bad == [] and len(result.received) == 3 and model.violations == []
    assert weak is None or weak.stale_loads > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_ipc_readers_never_take_a_phase_announced_by_a_stale_word(tmp_path, monkeypatch, seed):
    """Issue 39, defect 2: the writer stored "progress = 0" and then "writing = V" in two words, and
    a reader loaded them without fences: on a weakly ordered CPU it could see V with the old
    version's progress, and copy that version's bytes as V's. Version and progress are one word
    now. Versions 1, 3 and 5 share a slot, so a stale progress word is there to be seen."""
    weak = weakly_ordered(monkeypatch, seed=seed, gate=True, stale=0.8)
    model = DeviceModel(seed=seed)
    result = run_pair("shm", tmp_path, model=model, phase_bytes=1 << 17, timeout=8.0, versions=(1, 2, 3, 4, 5))
    assert result.errors == [] and result.bad == [] and len(result.received) == 5 and model.violations == []
    assert weak.stale_loads > 0


def _engine_left_no_room(staging_fits: int = 0) -> DeviceModel:
    """A GPU as a running engine leaves it: weights, then the KV cache sized out of the rest,
    then ``staging_fits`` bytes (what the user's setting left free)."""
    model = DeviceModel(budget=64 << 20)
    model.reserve(40 << 20, "the engine's weights")
    model.reserve((24 << 20) - staging_fits, "the KV cache")
    return model


def test_sglang_staging_that_does_not_fit_is_refused_when_the_adapter_is_built():
    """Defect 7 (SGLang stages the whole model: its update call takes a version at once and
    flushes its cache): the staging was allocated at the first update; now when the adapter is
    built, refused there with the figure and ``mem_fraction_static``."""
    import torch

    from weightsync.engines.sglang import SGLangEngine
    from weightsync.ports.device import DeviceMemoryError
    from weightsync.tools.tiny import tiny_config

    model = _engine_left_no_room(staging_fits=0)
    with device_port.use(model):
        with pytest.raises(DeviceMemoryError, match=r"the engine's staging arena needs [0-9.]+ MiB on cpu, and only "
                                                    r"0\.0 MiB of it is free: .*mem_fraction_static\)$"):
            SGLangEngine(object(), tiny_config(), dtype=torch.float32, device="cpu")
    assert model.peak == 0


def test_the_verl_actor_copy_that_does_not_fit_is_refused_with_its_figure_after_the_walk():
    """Defect 7 (verl: a full copy of the model on the trainer GPU): the actor copied each
    tensor verl yielded with ``.to(device)``, outside any budget, and ran out of memory partway.
    The copy is now taken within the device's free memory; when it does not fit, what was copied
    is freed, the generator is still walked to its end (each tensor is produced collectively by
    every actor rank), and the error gives the model's size and the setting to change."""
    import asyncio

    import torch

    from weightsync.integrations.actor_copy import copy_model
    from weightsync.ports.device import DeviceMemoryError

    walked: list[str] = []

    async def weights(n: int):
        for i in range(n):
            walked.append(f"w{i}")
            yield f"w{i}", torch.full((1 << 16,), float(i))  # 256 KiB each

    model = _engine_left_no_room(staging_fits=1 << 20)
    with device_port.use(model):
        with pytest.raises(DeviceMemoryError, match=r"the verl actor's copy of the model needs 2\.0 MiB on cpu, and "
                                                    r"only 1\.0 MiB of it is free: .*weightsync\.device=cpu"):
            asyncio.run(copy_model(weights(8), device="cpu"))
        assert walked == [f"w{i}" for i in range(8)] and model.used == 0
        copies = asyncio.run(copy_model(weights(3), device="cpu"))
    assert [float(t[0]) for t in copies.values()] == [0.0, 1.0, 2.0] and model.used == 3 << 18


def test_an_ipc_reader_context_on_the_writer_gpu_is_refused_with_its_figure(tmp_path):
    """Defect 7 (each CUDA IPC reader on another GPU makes a CUDA context on the writer's GPU,
    where the writer's slots already are): the context was never accounted for, and the first
    open failed for memory inside the first sync. It is checked before the open, refused with
    the figure and the settings to change."""
    context = 1 << 20
    model = DeviceModel(budget=2602496 + context // 2, context=context)  # the writer's slots, half a context
    result = run_pair("shm", tmp_path, model=model, timeout=5.0)
    assert any("reader 0's CUDA context on writer 0's GPU (CUDA IPC maps its slots there) needs 1.0 MiB on cpu, and "
               "only 0.5 MiB of it is free" in str(e) and "TransportOptions.slots" in str(e) for e in result.errors), \
        result.errors
    assert model.reserved == {}
    roomy = DeviceModel(budget=2602496 + context, context=context)
    result = run_pair("shm", tmp_path / "roomy", model=roomy, timeout=5.0)
    assert result.errors == [] and result.bad == [] and roomy.reserved == {"engine0's context on cpu": context}


@pytest.mark.parametrize(("processes", "reattach"), [(("trainer", "engine"), False), (("trainer", "engine"), True),
                                                     (None, False)],
                         ids=["two-readers", "re-attached-in-an-epoch", "in-the-writers-process"])
def test_cuda_ipc_slots_are_freed_once_every_reader_let_go(tmp_path, processes, reattach):
    """Issue 39, defect 1: torch counts each share's consumers (a counter that starts at 1 and each
    consumer's free decrements; the exporter's block stays allocated while it is above 0, read as
    unsigned). The writer shared its slots once and both readers opened that share (-1: never
    freed), a reader in the writer's process never opened it (1: never freed), and a reader that
    attached again in its epoch opened it twice. Across an epoch change the trainer's memory now
    returns to one set of slots, and nothing leaks once everyone closed."""
    model = DeviceModel(seed=9)
    result = run_pair("shm", tmp_path, model=model, processes=processes, target="vllm:tp=1,replicas=2",
                      versions=(1, 2, 3, 4, 5, 6), epoch_of=lambda v: 0 if v <= 3 else 1, reattach=reattach)
    assert result.errors == [] and result.bad == [] and len(result.received) == 12
    assert model.violations == [] and model.leaks() == []
    assert result.used[-1] == result.used[0] and model.used == 0


def test_routed_layer_phases_over_host_memory_are_refused_where_readers_cannot_stream(monkeypatch):
    """Issue 39, defect 2: on a CPU that does not keep store order, host-memory shm readers wait for
    whole slots, which the routed transport's per-phase torch route would never let the writer
    seal: refused, naming the CPU and the settings, instead of a hang. Device memory (published
    per phase after a synchronise) and single-phase jobs are fine."""
    from weightsync.transport.routed.transport import check_host_phases
    from weightsync.transport.shm import snapshot as shm_snapshot

    monkeypatch.setattr(shm_snapshot, "_ORDERED_STORES", False)
    with pytest.raises(ValueError, match=r"layer_phases with the routed transport on host memory needs a CPU that "
                                         r"keeps store order \(x86-64\).*layer_phases=False, or transport 'torch'"):
        check_host_phases("cpu", 3)
    check_host_phases("cpu", 1)
    with device_port.use(DeviceModel()):  # "cpu" is device memory under the model
        check_host_phases("cpu", 3)
