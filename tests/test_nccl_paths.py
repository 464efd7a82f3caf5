"""The NCCL transport's control flow without a GPU, over a fake of its communicator
(:class:`weightsync.transport.torch.nccl_comm.Communicator`), so that each issue-23 defect of this
transport has a test that runs in CI. How the real communicator calls nccl4py:
tests/test_nccl_comm.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from fake_meta import DirectoryMeta
from gpu_harness import as_tensors
from weightsync.clock.deadline import Deadline
from weightsync.configs import load_spec
from weightsync.job.channel import JobChannel
from weightsync.layout import parse_layout
from weightsync.plan.reference import empty_shards
from weightsync.ports.device import TorchDevices
from weightsync.transport import TransportContext, TransportError, TransportOptions
from weightsync.transport.tensors import flat_views
from weightsync.transport.torch.common import Pair
from weightsync.transport.torch.nccl import NcclTransport
from weightsync.transport.torch.nccl_comm import P2P


class FakeComm:
    """Posts nothing anywhere; records each group's operations (op, peer, bytes)."""

    def __init__(self) -> None:
        self.groups: list[list[tuple[str, int, int]]] = []
        self.aborted = False

    def post(self, ops: Sequence[P2P]) -> None:
        if ops:
            self.groups.append([(p.op, p.peer, p.tensor.numel() * p.tensor.element_size()) for p in ops])

    def error(self) -> str | None:
        return None

    def abort(self) -> None:
        self.aborted = True


def nccl(tmp_path: Any, role: str, **options: Any) -> NcclTransport:
    ctx = TransportContext(channel=JobChannel(DirectoryMeta(str(tmp_path)), role=role, rank=0),  # type: ignore[arg-type]
                           num_writers=1, num_readers=1, options=TransportOptions(**options))
    return NcclTransport(ctx)


@pytest.mark.parametrize("role", ["writer", "reader"])
def test_checksums_with_nothing_to_send_this_phase_complete(tmp_path, role):
    """Defect 6: a phase in which this rank exchanges no message with its peer, with
    ``checksum=True``: the checksum round posts nothing (torch's ``endCoalescing`` returned no
    work then, and ``None.block_current_stream()`` raised)."""
    t = nccl(tmp_path, role, checksum=True)
    comm = FakeComm()
    t._pg = comm
    stats = t._move(3, Deadline.after(5), [Pair(0, 1 if role == "reader" else 0, [])], sending=role == "writer")
    assert (stats.version, stats.nbytes, stats.messages) == (3, 0, 0)
    assert t._pg is comm and not comm.aborted and comm.groups == []


def test_an_unexpected_failure_tears_the_group_down_and_raises_a_transport_error(tmp_path):
    """Defect 6's second half: whatever fails inside a sync (here an AttributeError, as
    ``None.block_current_stream()`` raised), the caller sees a TransportError and the
    communicator is aborted: the next epoch forms a new one."""
    t = nccl(tmp_path, "reader")
    comm = FakeComm()
    t._pg = comm

    class Broken(TorchDevices):
        def record(self, device: Any) -> Any:
            raise AttributeError("'NoneType' object has no attribute 'block_current_stream'")

    t.dev = Broken()
    with pytest.raises(TransportError, match=r"reader 0: version 4 failed with writer 0: 'NoneType' object has no "
                                             "attribute 'block_current_stream'"):
        t._move(4, Deadline.after(5), [Pair(0, 1, [])], sending=False)
    assert comm.aborted and t._pg is None


class HangingComm(FakeComm):
    """A post stays ``ncclInProgress`` until the communicator is aborted, as a non-blocking
    group end does when it connects a pair on first use and the peer never comes (bounded here,
    so a test on code without a watchdog there ends); ``failure`` is NCCL's asynchronous error."""

    def __init__(self, failure: str | None = None) -> None:
        super().__init__()
        self.failure = failure
        self._aborted = threading.Event()

    def post(self, ops: Sequence[P2P]) -> None:
        super().post(ops)
        self._aborted.wait(6)
        raise RuntimeError("the NCCL communicator was aborted")

    def error(self) -> str | None:
        return self.failure

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
    """Defect 5: the end of a group (where NCCL connects a pair on first use) blocked with no
    deadline: only the final event wait was under the watchdog."""
    t = nccl(tmp_path, "reader")
    t._pg = comm = HangingComm()
    t._flats = dict(flat_views(as_tensors(empty_shards(readers_layout()), readers_layout())))
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"reader 0: version 5 failed with writer 0: it did not complete in "
                                             "time; the NCCL communicator was aborted"):
        t._move(5, Deadline.after(0.5), one_message_schedule(), sending=False)
    assert time.monotonic() - t0 < 4 and comm.aborted and t._pg is None


def test_a_dead_peer_aborts_the_round_long_before_the_deadline(tmp_path, monkeypatch):
    """Defect 5: NCCL has no peer watch; the watchdog now asks the job channel (leases on the
    meta server) and aborts as soon as a peer is dead, naming it."""
    t = nccl(tmp_path, "reader")
    t._pg = comm = HangingComm()
    t._flats = dict(flat_views(as_tensors(empty_shards(readers_layout()), readers_layout())))
    monkeypatch.setattr(t.ctx.channel, "dead_peers", lambda role, ranks, **_: {0: "lease expired 2.0s ago"})
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"reader 0: version 6 failed with writer 0: writer 0 is dead \(lease "
                                             r"expired 2\.0s ago\); the NCCL communicator was aborted"):
        t._move(6, Deadline.after(60), one_message_schedule(), sending=False)
    assert time.monotonic() - t0 < 4 and comm.aborted


def readers_layout() -> Any:
    return parse_layout("vllm:tp=1").all_rank_layouts(load_spec("tiny-qwen3"))[0]


def test_an_nccl_error_aborts_the_round_long_before_the_deadline_and_is_named(tmp_path):
    """A peer that dies across the network makes NCCL report an asynchronous error (torch's
    watchdog answered it by ending the process): ours aborts the communicator and the sync names
    NCCL's error."""
    t = nccl(tmp_path, "reader")
    t._pg = comm = HangingComm("NCCL error 6 (remote process exited or there was a network error)")
    t._flats = dict(flat_views(as_tensors(empty_shards(readers_layout()), readers_layout())))
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"reader 0: version 7 failed with writer 0: NCCL error 6 \(remote "
                                             r"process exited or there was a network error\); the NCCL communicator "
                                             "was aborted"):
        t._move(7, Deadline.after(60), one_message_schedule(), sending=False)
    assert time.monotonic() - t0 < 4 and comm.aborted and t._pg is None


def test_a_round_posts_every_pairs_window_as_one_group(tmp_path):
    """A round is one NCCL group with window k of every pair, each message to the peer's rank in
    the communicator (NCCL matches a pair's messages in posting order: it has no tags)."""
    t = nccl(tmp_path, "reader")
    t._pg = comm = FakeComm()
    t._flats = dict(flat_views(as_tensors(empty_shards(readers_layout()), readers_layout())))
    (pair,) = one_message_schedule()
    schedule = [Pair(0, 0, pair.messages), Pair(1, 1, pair.messages)]
    stats = t._move(8, Deadline.after(30), schedule, sending=False)
    nbytes = pair.messages[0].nbytes
    assert comm.groups == [[("recv", 0, nbytes), ("recv", 1, nbytes)]]
    assert (stats.messages, stats.nbytes) == (2, 2 * nbytes)
