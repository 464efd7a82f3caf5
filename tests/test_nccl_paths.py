"""The NCCL transport's control flow without a GPU: a process group that behaves as torch 2.13's
``ProcessGroupNCCL`` does where it matters (``endCoalescing`` returns no work when nothing was
posted), so that each issue-23 defect of this transport has a test that runs in CI."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from fake_meta import DirectoryMeta
from gpu_harness import as_tensors
from weightsync.configs import load_spec
from weightsync.deadline import Deadline
from weightsync.device_port import TorchDevices
from weightsync.job import JobChannel
from weightsync.layout import parse_layout
from weightsync.plan.reference import empty_shards
from weightsync.transport import TransportContext, TransportError, TransportOptions
from weightsync.transport.tensors import flat_views
from weightsync.transport.torch_dist import Pair
from weightsync.transport.torch_nccl import NcclTransport


class FakeWork:
    def block_current_stream(self) -> None:
        pass


class FakeGroup:
    """Posts nothing anywhere; ``_end_coalescing`` as ``ProcessGroupNCCL::endCoalescing``: no
    coalesced operation, no work (``nullptr``, None in Python)."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, int, int]] = []
        self.aborted = False

    def _start_coalescing(self, device: Any) -> None:
        self.posted = []

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        self.posted.append(("send", peer, tag))

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        self.posted.append(("recv", peer, tag))

    def _end_coalescing(self, device: Any) -> FakeWork | None:
        return FakeWork() if self.posted else None

    def abort(self) -> None:
        self.aborted = True


def nccl(tmp_path: Any, role: str, **options: Any) -> NcclTransport:
    ctx = TransportContext(channel=JobChannel(DirectoryMeta(str(tmp_path)), role=role, rank=0),  # type: ignore[arg-type]
                           num_writers=1, num_readers=1, options=TransportOptions(**options))
    return NcclTransport(ctx)


@pytest.mark.parametrize("role", ["writer", "reader"])
def test_checksums_with_nothing_to_send_this_phase_complete(tmp_path, role):
    """Defect 6: a phase in which this rank exchanges no message with its peer, with
    ``checksum=True``: the checksum round posts nothing and NCCL returns no work."""
    t = nccl(tmp_path, role, checksum=True)
    group = FakeGroup()
    t._pg = group
    stats = t._move(3, Deadline.after(5), [Pair(0, 1 if role == "reader" else 0, [])], sending=role == "writer")
    assert (stats.version, stats.nbytes, stats.messages) == (3, 0, 0)
    assert t._pg is group and not group.aborted


def test_an_unexpected_failure_tears_the_group_down_and_raises_a_transport_error(tmp_path):
    """Defect 6's second half: whatever fails inside a sync (here an AttributeError, as
    ``None.block_current_stream()`` raised), the caller sees a TransportError and the
    communicator is aborted: the next epoch forms a new one."""
    t = nccl(tmp_path, "reader")
    group = FakeGroup()
    t._pg = group

    class Broken(TorchDevices):
        def record(self, device: Any) -> Any:
            raise AttributeError("'NoneType' object has no attribute 'block_current_stream'")

    t.dev = Broken()
    with pytest.raises(TransportError, match=r"reader 0: version 4 failed with writer 0: 'NoneType' object has no "
                                             "attribute 'block_current_stream'"):
        t._move(4, Deadline.after(5), [Pair(0, 1, [])], sending=False)
    assert group.aborted and t._pg is None


class HangingGroup(FakeGroup):
    """The end of a coalesced group blocks until the communicator is aborted, as NCCL's does when
    it connects a pair on first use and the peer never comes (bounded here, so a test on code
    without a watchdog there ends)."""

    def __init__(self) -> None:
        super().__init__()
        self._aborted = threading.Event()

    def _end_coalescing(self, device: Any) -> FakeWork | None:
        self._aborted.wait(6)
        return FakeWork()

    def abort(self) -> None:
        super().abort()
        self._aborted.set()


def one_message_schedule() -> list[Pair]:
    from weightsync.plan import build_local_plan
    from weightsync.transport.schedule import build_messages

    spec = load_spec("tiny-qwen3")
    writers = parse_layout("megatron:tp=1").all_rank_layouts(spec)
    readers = parse_layout("vllm:tp=1").all_rank_layouts(spec)
    plan = build_local_plan(writers, readers, role="reader", rank=0)
    messages = build_messages(plan.ops_between(0, 0), message_bytes=1 << 20, direct_min_bytes=1 << 30)
    return [Pair(0, 0, messages[:1])]


def test_a_round_that_never_connects_is_aborted_at_the_deadline(tmp_path):
    """Defect 5: the end of a coalesced group (where NCCL connects a pair on first use) blocked
    with no deadline: only the final event wait was under the watchdog."""
    t = nccl(tmp_path, "reader")
    t._pg = group = HangingGroup()
    t._flats = dict(flat_views(as_tensors(empty_shards(readers_layout()), readers_layout())))
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"reader 0: version 5 failed with writer 0: it did not complete in "
                                             "time; the NCCL communicator was aborted"):
        t._move(5, Deadline.after(0.5), one_message_schedule(), sending=False)
    assert time.monotonic() - t0 < 4 and group.aborted and t._pg is None


def test_a_dead_peer_aborts_the_round_long_before_the_deadline(tmp_path, monkeypatch):
    """Defect 5: NCCL has no peer watch; the watchdog now asks the job channel (leases on the
    meta server) and aborts as soon as a peer is dead, naming it."""
    t = nccl(tmp_path, "reader")
    t._pg = group = HangingGroup()
    t._flats = dict(flat_views(as_tensors(empty_shards(readers_layout()), readers_layout())))
    monkeypatch.setattr(t.ctx.channel, "dead_peers", lambda role, ranks: {0: "lease expired 2.0s ago"})
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"reader 0: version 6 failed with writer 0: writer 0 is dead \(lease "
                                             r"expired 2\.0s ago\); the NCCL communicator was aborted"):
        t._move(6, Deadline.after(60), one_message_schedule(), sending=False)
    assert time.monotonic() - t0 < 4 and group.aborted


class HangingBackend:
    def __init__(self) -> None:
        self.aborted = threading.Event()

    def eager_connect_single_device(self, device: Any) -> None:
        self.aborted.wait(6)

    def abort(self) -> None:
        self.aborted.set()


def test_the_eager_connect_is_aborted_at_the_deadline():
    """Defect 5: ``eager_connect_single_device`` (NCCL's bootstrap waits for every rank) had no
    deadline."""
    from weightsync.transport.torch_nccl import connect_eagerly

    backend = HangingBackend()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="did not connect on cuda:0 in time"):
        connect_eagerly(backend, torch.device("cuda:0"), Deadline.after(0.3))
    assert time.monotonic() - t0 < 4 and backend.aborted.is_set()


def readers_layout() -> Any:
    return parse_layout("vllm:tp=1").all_rank_layouts(load_spec("tiny-qwen3"))[0]


class _Options:
    is_high_priority_stream = True
    _timeout: Any = None


class _ConstructedGroup:
    """``dist.ProcessGroup`` / ``ProcessGroupNCCL`` where ``nccl_group`` touches them, on CPU torch."""

    class BackendType:
        NCCL = "nccl"

    Options = _Options
    seen: list[tuple[str | None, str | None]] = []
    both_inside = threading.Event()

    def __init__(self, store: Any, rank: int, size: int, options: Any = None) -> None:
        if options is not None:  # the backend: what torch's constructor would read, then a pause
            import os

            type(self).seen.append((os.environ.get("TORCH_NCCL_BLOCKING_WAIT"),
                                    os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")))
            if len(type(self).seen) == 2:  # the second one in leaves last
                type(self).both_inside.set()
                time.sleep(0.2)
            # long enough for another thread's construction to start here if nothing prevents it
            type(self).both_inside.wait(0.5)

    def _set_sequence_number_for_group(self) -> None: ...
    def _set_default_backend(self, kind: Any) -> None: ...
    def _register_backend(self, device: Any, kind: Any, backend: Any) -> None: ...
    def _set_group_name(self, name: str) -> None: ...
    def eager_connect_single_device(self, device: Any) -> None: ...
    def abort(self) -> None: ...


def test_two_groups_built_at_once_leave_the_environment_as_it_was(monkeypatch):
    """Defect 10: ``scoped_env`` around each construction, two at once (two transports in one
    process: an in-process trainer and engine, routed): the second saved the first's values and
    restored them last, leaving ``TORCH_NCCL_BLOCKING_WAIT=1`` in the process for good. Every
    construction still sees the settings torch 2.13 only takes from the environment."""
    import os

    import torch.distributed as dist

    from weightsync.transport import torch_nccl

    monkeypatch.setattr(dist, "ProcessGroupNCCL", _ConstructedGroup, raising=False)
    monkeypatch.setattr(dist, "ProcessGroup", _ConstructedGroup)
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: store)
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    _ConstructedGroup.seen = []
    _ConstructedGroup.both_inside = threading.Event()
    errors: list[BaseException] = []

    def build(i: int) -> None:
        try:
            torch_nccl.nccl_group(None, i, 2, torch.device("cuda:0"), name=f"g{i}",  # type: ignore[arg-type]
                                  deadline=Deadline.after(5))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and _ConstructedGroup.seen == [("1", "3"), ("1", "3")]
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_nothing_is_written_when_the_environment_already_holds_the_settings(monkeypatch):
    """Defect 10: a process launched with ``TORCH_NCCL_BLOCKING_WAIT=1`` has its environment
    read, never written."""
    import os

    import torch.distributed as dist

    from weightsync.transport import torch_nccl

    writes: list[str] = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _ConstructedGroup, raising=False)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setattr(os, "environ", _Watched(os.environ, writes))
    _ConstructedGroup.seen = []
    torch_nccl.construct_backend(None, 0, 2, _Options())  # type: ignore[arg-type]
    assert _ConstructedGroup.seen == [("1", None)] and writes == []


def test_a_construction_writes_blocking_wait_and_nothing_else(monkeypatch):
    """Defect 10: the construction wrote ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` too, which torch
    never acts on for a group without a watchdog (blocking wait starts none): one more altered
    variable for whatever read the process environment meanwhile. The user's own value is now
    never written; torch's constructor still sees blocking wait."""
    import os

    import torch.distributed as dist

    from weightsync.transport import torch_nccl

    writes: list[str] = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _ConstructedGroup, raising=False)
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.setattr(os, "environ", _Watched(os.environ, writes))
    _ConstructedGroup.seen = []
    _ConstructedGroup.both_inside = threading.Event()
    _ConstructedGroup.both_inside.set()  # one construction: no pause
    torch_nccl.construct_backend(None, 0, 2, _Options())  # type: ignore[arg-type]
    assert _ConstructedGroup.seen == [("1", "3")]
    assert set(writes) == {"TORCH_NCCL_BLOCKING_WAIT"}
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


class _Watched(dict):  # type: ignore[type-arg]
    """``os.environ`` that records every write."""

    def __init__(self, env: Any, writes: list[str]) -> None:
        super().__init__(env)
        self.writes = writes

    def __setitem__(self, key: str, value: str) -> None:
        self.writes.append(key)
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.writes.extend(dict(*args, **kwargs))
        super().update(*args, **kwargs)

    def pop(self, key: str, *default: Any) -> Any:  # type: ignore[override]
        self.writes.append(key)
        return super().pop(key, *default)


def _options_fields(header: str) -> set[str]:
    """Data members of ``ProcessGroupNCCL::Options`` in torch's header: declarations that end in
    ``;`` and call nothing (constructors, ``create`` and its body all have parentheses)."""
    import re

    body = header.split("struct Options : Backend::Options {", 1)[1].split("\n  };", 1)[0]
    body = re.sub(r"//[^\n]*", "", body)
    return {re.split(r"[\s{=;]+", decl.strip().split("{")[0].split("=")[0].strip())[-1]
            for decl in body.split(";") if decl.strip() and "(" not in decl and ")" not in decl}


def test_torch_still_takes_blocking_wait_from_the_environment_only():
    """Defect 10 (open): weightsync writes ``TORCH_NCCL_BLOCKING_WAIT`` to the environment around
    its group's construction because torch offers no other way (docs/gpu.md, "Why through the
    environment"). This reads the installed torch's header, the evidence for that: the day a
    torch upgrade gives ``ProcessGroupNCCL::Options`` a field of its own (or the setting another
    source), this fails, and weightsync should pass it there and stop writing ``os.environ``."""
    from pathlib import Path

    header = (Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp").read_text()
    assert _options_fields(header) == {"is_high_priority_stream", "config", "split_from", "split_color"}
    assert ('static std::vector<std::string> TORCH_NCCL_BLOCKING_WAIT = {\n    "TORCH_NCCL_BLOCKING_WAIT",\n'
            '    "NCCL_BLOCKING_WAIT"};') in header
    assert "  bool blockingWait_ = false;" in header  # a private member, with no setter:
    assert not any(f"{verb}BlockingWait" in header for verb in ("set", "enable", "disable"))


def test_only_the_settings_the_environment_lacks_are_written():
    """Defect 10: what a construction writes is decided by one function of the environment; a
    process launched with blocking wait is never written to, a user's other value of it is
    replaced for the constructor only (restored: the tests above), and nothing else is touched."""
    from weightsync.transport.torch_nccl import settings_to_write

    blocking = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert settings_to_write({}) == blocking
    assert settings_to_write({**blocking, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_DEBUG": "INFO"}) == {}
    assert settings_to_write({"TORCH_NCCL_BLOCKING_WAIT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == blocking
