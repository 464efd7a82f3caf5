"""The CPU device model's rules, each with a negative test: code that breaks it is caught.

The model (``tests/device_model.py``) stands in for :mod:`weightsync.ports.device` so that the GPU
paths of the transports and engines run on CPU tensors; these tests make sure it would notice
the mistakes it exists for.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from device_model import DeviceModel, HazardError, NixlModel
from weightsync.ports import device as device_port
from weightsync.ports.device import DeviceMemoryError, TorchDevices, check_fits


def test_the_real_port_is_installed_unless_a_test_installs_the_model():
    assert isinstance(device_port.current(), TorchDevices)
    model = DeviceModel()
    with device_port.use(model):
        assert device_port.current() is model
    assert isinstance(device_port.current(), TorchDevices)


def test_copies_complete_only_at_a_synchronise():
    model = DeviceModel(chance=0.0)
    src, dst = torch.arange(8.0), torch.zeros(8)
    model.copy(dst, src)
    assert torch.equal(dst, torch.zeros(8)) and model.pending() == 1  # queued, not done
    model.synchronize("cpu")
    assert torch.equal(dst, src) and model.pending() == 0


def test_copies_complete_in_stream_order_at_an_event_or_at_random():
    model = DeviceModel(chance=0.0)
    a, b, c = torch.ones(4), torch.zeros(4), torch.zeros(4)
    model.copy(b, a)
    event = model.record("cpu")
    model.copy(c, b)
    model.wait(event)
    assert torch.equal(b, a) and torch.equal(c, torch.zeros(4))  # only what the event covers
    model.synchronize("cpu")
    assert torch.equal(c, a)  # the second copy read b after the first wrote it: stream order
    random_model = DeviceModel(chance=1.0, seed=3)
    dst = torch.zeros(4)
    for _ in range(20):
        random_model.copy(dst, torch.ones(4))
    assert random_model.pending() < 20  # some completed without anyone synchronising


def test_a_write_into_memory_another_stream_still_reads_is_a_hazard():
    model = DeviceModel(chance=0.0)
    slot, out = torch.ones(16), torch.zeros(16)
    with model.as_process("engine"):
        model.copy(out, slot)  # the engine's kernels read the slot
    with pytest.raises(HazardError, match="writes into memory with pending reads"):
        with model.as_process("trainer"):
            model.copy(slot, torch.zeros(16))
    model.synchronize_all()
    with model.as_process("trainer"):
        model.copy(slot, torch.zeros(16))  # fine once the reads completed
    assert model.violations and "pending reads" in model.violations[0]


def test_reading_memory_another_stream_still_writes_is_a_hazard():
    model = DeviceModel(chance=0.0)
    slot = torch.zeros(16)
    with model.as_process("trainer"):
        model.copy(slot, torch.ones(16))
    with pytest.raises(HazardError, match="reads memory that pending work still writes"):
        with model.as_process("engine"):
            model.copy(torch.zeros(16), slot)


def test_same_stream_copies_are_ordered_and_never_a_hazard():
    model = DeviceModel(chance=0.0)
    buf = torch.zeros(16)
    model.copy(buf, torch.ones(16))
    model.copy(torch.zeros(16), buf)
    model.copy(buf, torch.full((16,), 2.0))
    model.synchronize("cpu")
    assert torch.equal(buf, torch.full((16,), 2.0)) and not model.violations


def test_the_cpu_or_a_nic_touching_pending_memory_is_a_hazard():
    model = DeviceModel(chance=0.0)
    buf = torch.zeros(16)
    model.copy(buf, torch.ones(16))
    with pytest.raises(HazardError, match=r"the CPU .* reads memory that pending work still writes"):
        model.touch(buf, write=False)
    with pytest.raises(HazardError, match=r"NIXL READ .* writes into memory with pending reads or writes"):
        model.dma([], [(buf.data_ptr(), buf.data_ptr() + 8)], "a NIXL READ of reader 0")
    model.synchronize("cpu")
    model.touch(buf, write=True)


def test_a_ready_signal_before_the_work_it_announces_is_a_hazard():
    model = DeviceModel(chance=0.0)
    words, slot = torch.full((4,), -1, dtype=torch.int64), torch.zeros(64)
    model.copy(slot, torch.ones(64))
    with pytest.raises(HazardError, match=r"raised a ready signal \(7\) before the work it announces"):
        model.signal(words, 1, 7, covers=[slot])
    assert int(words[1]) == -1  # the word was not raised
    model.synchronize("cpu")
    model.signal(words, 1, 7, covers=[slot])
    assert int(words[1]) == 7


def test_an_ipc_handle_cannot_be_opened_by_the_process_that_exported_it():
    model = DeviceModel()
    data = torch.arange(4.0)
    with model.as_process("trainer"):
        handle = model.share(data)
    with model.as_process("trainer"), pytest.raises(RuntimeError, match="exported by this process"):
        model.open(handle, "cpu")
    with model.as_process("engine"):
        assert model.open(handle, "cpu") is data
    unnamed = model.share(data)  # threads outside as_process are the real process
    with pytest.raises(RuntimeError, match="exported by this process"):
        model.open(unnamed, "cpu")


def test_an_allocation_past_what_the_engine_left_raises_out_of_memory():
    model = DeviceModel(budget=1000)
    weights = model.empty(300, "cpu", what="weights")
    assert model.free_bytes("cpu") == 700
    assert model.reserve_rest("vLLM KV cache") == 700 and model.free_bytes("cpu") == 0
    with pytest.raises(torch.OutOfMemoryError, match="staging needs 64 bytes, 0 free"):
        model.empty(64, "cpu", what="staging")
    with pytest.raises(DeviceMemoryError, match=r"staging needs 64\.0 MiB on cpu, and only 0\.0 MiB of it is free: "
                                                "lower it"):
        with device_port.use(model):
            check_fits(model, 64 << 20, "cpu", what="staging", fix="lower it")
    del weights  # freed memory returns to the budget
    assert model.free_bytes("cpu") == 300 and model.peak == 300


def test_a_process_first_use_of_a_device_takes_a_context_out_of_its_budget():
    """Opening an IPC handle on a device where this process has no CUDA context yet makes one
    there (CUDA IPC readers map the writer's memory on the writer's GPU): past the budget, an
    out-of-memory error; a process that allocated on the device already has its context."""
    model = DeviceModel(budget=1000, context=400)
    with model.as_process("trainer"):
        slots = model.empty(700, "cpu", what="slots")
        handle = model.share(slots)
        assert model.context_bytes("cpu") == 0  # its allocation made its context
    with model.as_process("engine0"):
        assert model.context_bytes("cpu") == 400
        with pytest.raises(torch.OutOfMemoryError, match="engine0's context on cpu needs 400 bytes, 300 free"):
            model.open(handle, "cpu")
    model.budget = 1100  # room for one context
    with model.as_process("engine1"):
        assert model.open(handle, "cpu") is not None and model.context_bytes("cpu") == 0
        model.open(handle, "cpu")  # once per process
    assert model.reserved == {"engine1's context on cpu": 400}


def test_host_memory_has_no_budget():
    model = DeviceModel(budget=10, gpu_types=("cuda",))
    assert model.free_bytes("cpu") is None and model.empty(100, "cpu", what="host").numel() == 100


def test_a_nixl_descriptor_spanning_two_registrations_is_refused():
    nixl = NixlModel(DeviceModel()).module()
    agent = nixl.nixl_agent("a", nixl.nixl_agent_config())
    buf = torch.zeros(64, dtype=torch.uint8)
    base = buf.data_ptr()
    agent.register_memory([(base, 32, 0, ""), (base + 32, 32, 0, "")], "DRAM")  # two, back to back
    agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[base, 32, 0], [base + 32, 32, 0]]), "DRAM")
    with pytest.raises(nixl._bindings.nixlNotFoundError, match="not inside one memory registration"):
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[base, 64, 0]]), "DRAM")
    with pytest.raises(nixl._bindings.nixlNotFoundError):
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[base, 32, 1]]), "DRAM")  # another device id


def test_nixl_transfers_are_nic_accesses_the_model_checks():
    model = DeviceModel(chance=0.0)
    nixl = NixlModel(model).module()
    a, b = nixl.nixl_agent("a", None), nixl.nixl_agent("b", None)
    src, dst = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    a.register_memory([(dst.data_ptr(), 16, 0, "")], "DRAM")
    b.register_memory([(src.data_ptr(), 16, 0, "")], "DRAM")
    lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.data_ptr(), 16, 0)], "DRAM")
    rh = a.prep_xfer_dlist(a.add_remote_agent(b.get_agent_metadata()).decode(), [(src.data_ptr(), 16, 0)], "DRAM")
    xfer = a.make_prepped_xfer("READ", lh, [0], rh, [0])
    model.copy(torch.zeros(16, dtype=torch.uint8), dst)  # queued work still reads the destination
    with pytest.raises(HazardError, match="NIXL READ"):
        a.transfer(xfer, b"v1")
    model.synchronize("cpu")
    assert a.transfer(xfer, b"v1") == "DONE" and torch.equal(dst, src)
    assert b.get_new_notifs() == {"a": [b"v1"]}


def test_the_model_is_safe_to_share_between_threads():
    model = DeviceModel(chance=0.5)
    bufs = [torch.zeros(1024) for _ in range(4)]

    def work(i: int) -> None:
        with model.as_process(f"p{i}"):
            for _ in range(50):
                model.copy(bufs[i], torch.ones(1024))
            model.synchronize("cpu")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(torch.equal(b, torch.ones(1024)) for b in bufs) and not model.violations
