"""Our NCCL communicator (transport/torch/nccl_comm.py) against a fake nccl4py that records every call:
how weightsync forms it (without touching the process environment: issue 23, defect 10), how it
calls nccl4py, and that nccl4py, where installed, has the names it calls."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fake_nccl4py
from fake_meta import DirectoryMeta
from weightsync.clock.deadline import Deadline
from weightsync.job.channel import JobChannel
from weightsync.transport import TransportContext, TransportError, TransportOptions, create_transport
from weightsync.transport.torch.nccl import NcclTransport
from weightsync.transport.torch.nccl_comm import MISSING, P2P, NcclComm, Watchdog, connect


class _Watched(dict):  # type: ignore[type-arg]
    """``os.environ`` that records every write."""

    def __init__(self, env: Any, writes: list[str]) -> None:
        super().__init__(env)
        self.writes = writes

    def __setitem__(self, key: str, value: str) -> None:
        self.writes.append(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.writes.append(key)
        super().__delitem__(key)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.writes.extend(dict(*args, **kwargs))
        super().update(*args, **kwargs)

    def pop(self, key: str, *default: Any) -> Any:  # type: ignore[override]
        self.writes.append(key)
        return super().pop(key, *default)

    def setdefault(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key not in self:
            self.writes.append(key)
        return super().setdefault(key, default)


def transport(tmp_path: Any, role: str) -> NcclTransport:
    ctx = TransportContext(channel=JobChannel(DirectoryMeta(str(tmp_path)), role=role, rank=0),  # type: ignore[arg-type]
                           num_writers=1, num_readers=1, options=TransportOptions())
    return NcclTransport(ctx)


def test_building_our_nccl_group_never_writes_the_environment(tmp_path, monkeypatch):
    """Defect 10: the group was a torch ``ProcessGroupNCCL`` built with ``TORCH_NCCL_BLOCKING_WAIT=1``
    written into ``os.environ`` around its constructor, which native threads reading the
    environment and groups built meanwhile on other threads saw. Now a writer and a reader form
    the epoch's communicator through the transport's own path (rendezvous on a real TCPStore,
    the unique id through it as raw bytes, a non-blocking nccl4py init) and nothing writes the
    environment, through ``os.environ`` or ``os.putenv``/``os.unsetenv``."""
    nccl = fake_nccl4py.install(monkeypatch)
    built: list[Any] = []

    class TorchNcclGroup:  # torch's ProcessGroupNCCL, as a CUDA build of torch has it: never built now
        class Options:
            is_high_priority_stream = True
            _timeout: Any = None

        def __init__(self, *args: Any) -> None:
            built.append(args)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", TorchNcclGroup, raising=False)
    writes: list[str] = []
    monkeypatch.setattr(os, "environ", _Watched(os.environ, writes))
    monkeypatch.setattr(os, "putenv", lambda key, value: writes.append(key))
    monkeypatch.setattr(os, "unsetenv", writes.append)
    ranks = [transport(tmp_path, "writer"), transport(tmp_path, "reader")]
    formed: dict[int, Any] = {}
    errors: list[BaseException] = []

    def form(t: NcclTransport) -> None:
        try:
            formed[t.ctx.global_rank] = t._form_group(0, Deadline.after(20))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=form, args=(t,)) for t in ranks]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert writes == [], f"the process environment was written: {writes}"
    assert not errors, errors
    assert built == []  # no torch process group: no torch watchdog
    inits = sorted(call for call in nccl.calls if call[0] == "init")
    assert inits == [("init", 2, 0, bytes(range(128)), False), ("init", 2, 1, bytes(range(128)), False)]
    assert [call[0] for call in nccl.calls].count("get_unique_id") == 1  # rank 0's, read by rank 1 from the store
    assert sorted(formed) == [0, 1] and all(isinstance(c, NcclComm) for c in formed.values())
    for t in ranks:
        t._pg = formed[t.ctx.global_rank]
        t.close()


def test_the_adapter_posts_one_group_on_the_current_stream_and_aborts_from_another_thread(monkeypatch):
    """How ``NcclComm`` calls nccl4py: ``group_start``, each send/recv with the peer's rank, the
    tensor (so its dtype and element count) and the current stream's handle, ``group_end``, then
    ``get_async_error`` until NCCL enqueued the group; ``abort`` from the watchdog's thread ends
    the communicator once, and a post after it fails instead of touching a freed handle."""
    nccl = fake_nccl4py.install(monkeypatch)
    raw = nccl.Communicator.init(4, 2, nccl.get_unique_id(), config=nccl.NCCLConfig(blocking=False))
    raw.pending = 0
    comm = NcclComm(nccl, raw, stream=lambda: 0xBEEF)
    payload = torch.arange(40, dtype=torch.uint8)
    header = torch.zeros(5, dtype=torch.int64)
    nccl.calls.clear()
    comm.post([P2P("send", payload, 3), P2P("recv", header, 0)])
    assert nccl.calls[:4] == [("group_start",),
                              ("send", 3, torch.uint8, 40, payload.data_ptr(), 0xBEEF),
                              ("recv", 0, torch.int64, 5, header.data_ptr(), 0xBEEF),
                              ("group_end",)]
    assert raw.pending == 0  # polled past ncclInProgress: the group is enqueued
    comm.post([])  # nothing to post: no NCCL call
    with pytest.raises(ValueError, match=r"NCCL moves contiguous memory only; a send to rank 1 got a strided tensor"):
        comm.post([P2P("send", torch.zeros(4, 4).t(), 1)])

    raw.state = fake_nccl4py.REMOTE_ERROR  # a peer's process died across the network
    assert comm.error() == "NCCL error 6 (remote process exited or there was a network error)"
    aborter = threading.Thread(target=comm.abort, name="weightsync-nccl-watchdog")
    aborter.start()
    aborter.join(5)
    comm.abort()  # teardown after the watchdog: no second ncclCommAbort
    assert [call for call in nccl.calls if call[0] == "abort"] == [("abort", 2, "weightsync-nccl-watchdog")]
    assert comm.error() is None
    with pytest.raises(RuntimeError, match="the NCCL communicator was aborted"):
        comm.post([P2P("send", payload, 3)])


def test_a_connect_that_never_completes_is_aborted_at_the_deadline(monkeypatch):
    """Defect 5, on the new communicator: a rank that never joins leaves the non-blocking init
    ``ncclInProgress`` forever; the watchdog aborts it at the deadline and ``prepare`` fails
    naming the device."""
    nccl = fake_nccl4py.install(monkeypatch, fake_nccl4py.FakeNccl(connect_polls=None))
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"the NCCL communicator did not connect on cuda:0 in time \(every rank "
                                             r"of the job must reach prepare\); it was aborted"):
        connect(dist.HashStore(), rank=0, size=2, device=torch.device("cuda", 0), deadline=Deadline.after(0.3))
    assert time.monotonic() - t0 < 4
    assert [call[:2] for call in nccl.calls if call[0] == "abort"] == [("abort", 0)]


def test_the_watchdog_aborts_on_an_nccl_error_before_any_lease_expires():
    """NCCL reports a dead peer across the network as an asynchronous error long before its
    lease expires: the watchdog polls it, aborts, and names it."""
    aborted = threading.Event()
    errors = iter([None, None, "NCCL error 6 (remote process exited or there was a network error)"])
    with Watchdog(Deadline.after(30), aborted.set, health=lambda: next(errors, None)) as dog:
        assert aborted.wait(5)
    assert dog.fired and dog.reason() == "NCCL error 6 (remote process exited or there was a network error)"


def test_the_nccl_transport_without_nccl4py_is_refused_at_init(tmp_path, monkeypatch):
    """Selecting the NCCL transport (torch between GPUs) where nccl4py is missing fails when the
    transport is created, with the package to install, before any rendezvous."""
    monkeypatch.setitem(__import__("sys").modules, "nccl.core", None)  # import nccl.core raises ImportError
    ctx = TransportContext(channel=JobChannel(DirectoryMeta(str(tmp_path)), role="writer", rank=0),  # type: ignore[arg-type]
                           num_writers=1, num_readers=1, options=TransportOptions(), device="cuda:0")
    with pytest.raises(ValueError, match=re.escape(f"transport 'torch' cannot be used: {MISSING}")):
        create_transport("torch", ctx)
    cpu = TransportContext(channel=ctx.channel, num_writers=1, num_readers=1, options=TransportOptions())
    assert type(create_transport("torch", cpu)).__name__ == "GlooTransport"  # gloo needs no nccl4py


@pytest.mark.skipif(importlib.util.find_spec("nccl") is None,
                    reason="nccl4py is not installed (a GPU-only extra: pip install weightsync[gpu])")
def test_the_nccl4py_names_weightsync_calls_exist():
    """The real nccl4py has every name and parameter transport/torch/nccl_comm.py (and the fake above)
    use, and the two ``ncclResult_t`` values it compares against."""
    import nccl.core as nccl
    from nccl.bindings import nccl as bindings

    for name in ("Communicator", "NCCLConfig", "UniqueId", "get_unique_id", "group_start", "group_end",
                 "get_error_string"):
        assert name in nccl.__all__, name
    for method in ("init", "send", "recv", "abort", "get_async_error", "get_last_error"):
        assert callable(getattr(nccl.Communicator, method)), method
    assert list(inspect.signature(nccl.Communicator.init).parameters) == ["nranks", "rank", "unique_id", "config"]
    for method in (nccl.Communicator.send, nccl.Communicator.recv):
        stream = inspect.signature(method).parameters["stream"]
        assert stream.kind is inspect.Parameter.KEYWORD_ONLY
    assert nccl.NCCLConfig(blocking=False).blocking is False
    uid = nccl.UniqueId.from_bytes(bytes(range(128)))
    assert uid.as_bytes == bytes(range(128))
    assert (int(bindings.Result.Success), int(bindings.Result.InProgress)) == (0, 7)
