"""The transport contract's middle (issue 35 §2): :class:`weightsync.transport.base.TransportBase`
and the session that drives it.

A session tells its transport which step a version needs: ``connect`` once per epoch (and
after a failure), ``bind`` when it connected or the buffers' storage moved within the epoch, so
no transport compares epochs itself. The base refuses tensors on another device and phases the
bound plan does not have before any transport's own code runs, naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import pytest
import torch

from fake_meta import FakeChannel
from weightsync.clock.deadline import Deadline
from weightsync.configs import load_spec
from weightsync.layout import parse_layout
from weightsync.plan import Plan, build_local_plan
from weightsync.session.sync_session import PlannedSync, SyncSession
from weightsync.transport.base import TransferStats, TransportBase, TransportContext

SPEC = load_spec("tiny-qwen3")
PLAN = build_local_plan(parse_layout("megatron:tp=1").all_rank_layouts(SPEC),
                        parse_layout("vllm:tp=1").all_rank_layouts(SPEC), role="writer", rank=0)


class RecordingTransport(TransportBase):
    """Records the steps it is asked to take; moves nothing."""

    name: ClassVar[str] = "recording"
    serves_cpu: ClassVar[bool] = True
    serves_cuda: ClassVar[bool] = False

    def __init__(self, ctx: TransportContext, *, fail_bind: bool = False) -> None:
        super().__init__(ctx)
        self.calls: list[tuple[str, object]] = []
        self.fail_bind = fail_bind

    def _connect(self, epoch: int, deadline: Deadline) -> None:
        self.calls.append(("connect", epoch))

    def _bind(self, plan: Plan, parts: Sequence[Plan], tensors: Mapping[str, torch.Tensor],
              deadline: Deadline) -> None:
        if self.fail_bind:
            raise RuntimeError("bind failed")
        self.calls.append(("bind", tuple(t.data_ptr() for t in tensors.values())))

    def send(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        self.check_phase(phase)
        stats, timer = self.new_stats(version)
        with timer("pack"):
            stats.nbytes += 1
        return stats


def ctx(device: str = "cpu") -> TransportContext:
    return TransportContext(channel=FakeChannel(), num_writers=1, num_readers=1, device=device)  # type: ignore[arg-type]


def session_over(transport: RecordingTransport) -> SyncSession:
    """A session already planned (no meta server): only what ``arm`` reads."""
    session = SyncSession.__new__(SyncSession)
    session.planned = PlannedSync(PLAN, transport, "recording", "fingerprint", 0.0, "cpu", "requested")
    session.timings = {}
    session.disarm()
    return session


def test_the_session_connects_once_per_epoch_and_binds_when_only_the_memory_moved():
    transport = RecordingTransport(ctx())
    session = session_over(transport)
    deadline = Deadline.after(5)
    first, moved = {"w": torch.zeros(4)}, {"w": torch.ones(4)}
    at_first, at_moved = (first["w"].data_ptr(),), (moved["w"].data_ptr(),)

    session.arm(first, 0, deadline)
    session.arm(first, 0, deadline)  # nothing changed: nothing to do
    assert transport.calls == [("connect", 0), ("bind", at_first)]
    assert transport.epoch == 0

    transport.calls.clear()
    session.arm(moved, 0, deadline)  # the storage moved within the epoch: memory only
    assert transport.calls == [("bind", at_moved)]

    transport.calls.clear()
    session.arm(moved, 1, deadline)  # a new epoch: every connection again, then the memory
    assert transport.calls == [("connect", 1), ("bind", at_moved)]

    transport.calls.clear()
    session.disarm()  # after a failure: connect again even in the same epoch
    session.arm(moved, 1, deadline)
    assert transport.calls == [("connect", 1), ("bind", at_moved)]


def test_a_bind_that_fails_leaves_the_session_to_connect_again():
    transport = RecordingTransport(ctx(), fail_bind=True)
    session = session_over(transport)
    tensors = {"w": torch.zeros(4)}
    with pytest.raises(RuntimeError, match="bind failed"):
        session.arm(tensors, 0, Deadline.after(5))
    transport.fail_bind = False
    session.arm(tensors, 0, Deadline.after(5))
    assert transport.calls == [("connect", 0), ("connect", 0), ("bind", (tensors["w"].data_ptr(),))]


def test_prepare_is_connect_then_bind_and_connects_only_for_a_new_epoch():
    transport = RecordingTransport(ctx())
    tensors = {"w": torch.zeros(4)}
    transport.prepare(PLAN, tensors, epoch=3, deadline=Deadline.after(5))
    transport.prepare(PLAN, tensors, epoch=3, deadline=Deadline.after(5))
    ptrs = (tensors["w"].data_ptr(),)
    assert transport.calls == [("connect", 3), ("bind", ptrs), ("bind", ptrs)]


def test_the_base_refuses_tensors_on_another_device_before_connecting():
    transport = RecordingTransport(ctx("cuda:0"))
    with pytest.raises(ValueError, match=r"writer 0: the transport was set up for cuda:0, but the tensors it was "
                                         r"given live on cpu"):
        transport.prepare(PLAN, {"w": torch.zeros(4)}, epoch=0, deadline=Deadline.after(5))
    assert transport.calls == []
    transport.connect(0, deadline=Deadline.after(5))
    with pytest.raises(ValueError, match="set up for cuda:0"):
        transport.bind(PLAN, {"w": torch.zeros(4)}, deadline=Deadline.after(5))


def test_the_base_refuses_a_phase_the_bound_plan_does_not_have_and_a_bind_before_connect():
    transport = RecordingTransport(ctx())
    with pytest.raises(RuntimeError, match="recording transport bound before it connected"):
        transport.bind(PLAN, {"w": torch.zeros(4)}, deadline=Deadline.after(5))
    transport.prepare(PLAN, {"w": torch.zeros(4)}, epoch=0, deadline=Deadline.after(5), phases=[PLAN, PLAN])
    assert transport.send(1, deadline=Deadline.after(5), phase=1).phases.keys() == {"pack"}
    with pytest.raises(ValueError, match=r"writer 0: phase 2 of a plan prepared with 2 phase\(s\)"):
        transport.send(1, deadline=Deadline.after(5), phase=2)
