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


# -- over gloo, a rank that left on purpose is not a dead one (issue 36) ---------------------------

class LeaseMeta:
    """Leases as the meta server reports them, set by the test; ``polled`` is set each time a
    guard has read them ``wanted`` times since the test last cleared it."""

    def __init__(self) -> None:
        import threading

        self.rows: dict[tuple[str, int], bool] = {}  # (role, rank) -> released (else live)
        self.expired: set[tuple[str, int]] = set()
        self.polled = threading.Event()
        self.reads_left = 0

    def leases(self) -> list:
        from weightsync.ports.records import LeaseRow

        self.reads_left -= 1
        if self.reads_left <= 0:
            self.polled.set()
        return [LeaseRow(role, rank, f"inc-{role}-{rank}", 100 + rank, "h", 3.0, 0.1,
                         alive=not released and (role, rank) not in self.expired,
                         released=released, detail=f"{role} {rank}: " + ("released" if released else "expired"))
                for (role, rank), released in self.rows.items()]

    def guards_read(self, times: int = 3) -> None:
        """Wait (bounded) until the running call's guards read the leases ``times`` more times."""
        self.reads_left = times
        self.polled.clear()
        assert self.polled.wait(10.0), "the guards never read the leases"


def _gloo(role: str, rank: int, meta: LeaseMeta) -> tuple[object, list]:
    from weightsync.job.channel import JobChannel
    from weightsync.transport.torch.gloo import GlooTransport

    channel = JobChannel(meta, role=role, rank=rank)  # type: ignore[arg-type]
    transport = GlooTransport(TransportContext(channel=channel, num_writers=2, num_readers=2))
    transport._pg = object()  # the group the lanes would use: _run_lanes is the test's
    broken: list = []
    transport._break_group = broken.append  # type: ignore[method-assign]
    for r in range(2):
        meta.rows[("writer", r)] = meta.rows[("reader", r)] = False
    return transport, broken


def _schedule(*peers: int) -> list:
    from weightsync.transport.torch.common import Pair

    return [Pair(peer=p, peer_global=p, messages=[]) for p in peers]


@pytest.mark.parametrize("left", ["released", "expired"])
def test_over_gloo_a_mate_that_left_on_purpose_does_not_fail_a_rank_still_receiving(left):
    """Reader 1 is done with the version and closes (its lease released) while reader 0 still
    receives from writer 0: readers exchange no bytes, so reader 0 goes on. A mate that died
    (its lease expired) still breaks the group, naming it (CI of wave 9: a reader that left
    failed the other's FP8 delta version)."""
    meta = LeaseMeta()
    transport, broken = _gloo("reader", 0, meta)

    def lanes(version, deadline, pg, move, schedule, *, broken):
        meta.rows[("reader", 1)] = left == "released"
        if left == "expired":
            meta.expired.add(("reader", 1))
        meta.guards_read()
        for pair in schedule:
            move(pair, None)
        return TransferStats(version)

    transport._run_lanes = lanes  # type: ignore[method-assign]
    moved = []
    if left == "released":
        transport._run_pairs(3, Deadline.after(30), lambda pair, run: moved.append(pair.peer), _schedule(0))
        assert moved == [0] and broken == []
    else:
        with pytest.raises(Exception, match="reader 1 died while this rank waited for version 3: reader 1: expired"):
            transport._run_pairs(3, Deadline.after(30), lambda pair, run: moved.append(pair.peer), _schedule(0))
        assert broken


@pytest.mark.parametrize("when", ["after its pairs", "before its pairs"])
def test_over_gloo_a_peer_that_leaves_after_its_pairs_does_not_fail_the_rest(when):
    """Writer 0 sends to reader 1, which applies the version and closes, then to reader 0. The
    reader that left had all it needed: the write goes on. A reader that leaves before its pairs
    are done fails the version, naming it."""
    meta = LeaseMeta()
    transport, broken = _gloo("writer", 0, meta)

    def lanes(version, deadline, pg, move, schedule, *, broken):
        first, rest = schedule[0], schedule[1:]
        if when == "after its pairs":
            move(first, None)
        meta.rows[("reader", 1)] = True
        meta.guards_read()
        for pair in rest if when == "after its pairs" else schedule:
            move(pair, None)
        return TransferStats(version)

    transport._run_lanes = lanes  # type: ignore[method-assign]
    moved = []
    if when == "after its pairs":
        transport._run_pairs(3, Deadline.after(30), lambda pair, run: moved.append(pair.peer), _schedule(1, 0))
        assert moved == [1, 0] and broken == []
    else:
        with pytest.raises(Exception, match="reader 1 died while this rank waited for version 3: reader 1: released"):
            transport._run_pairs(3, Deadline.after(30), lambda pair, run: moved.append(pair.peer), _schedule(1, 0))
        assert broken


def test_a_writer_waiting_for_a_readers_endpoint_stops_once_another_writer_is_out_of_the_epoch():
    """NIXL push: readers come to an epoch once every writer published the version there. Writer 0,
    retrying a version that writer 1's trainer went past, waited for the readers' metadata until
    its timeout (the kill-both fault case with writer 0 retrying); it stops at its next look, and
    a live writer out of the epoch is named when it is the peer awaited."""
    import time

    from weightsync.transport import TransportError
    from weightsync.transport.endpoint_wait import peer_endpoint
    from weightsync.transport.endpoints import NixlEndpoint

    class Superseded(FakeChannel):
        def wait_endpoint(self, kind, epoch, role, rank, *, deadline):  # none ever comes
            time.sleep(deadline.remaining(0.0))

        def writers_out_of_epoch(self, epoch, ranks):
            return {1: "it writes version 2 now, so version 1 is superseded"} if 1 in ranks else {}

    ctx = TransportContext(channel=Superseded("writer", 0, lease_seconds=3.0), num_writers=2, num_readers=1)
    started = time.monotonic()
    with pytest.raises(TransportError, match="writer 0: stopped waiting for reader 0's nixl endpoint: writer 1 will "
                                             "not take part in epoch 4: it writes version 2 now"):
        peer_endpoint(ctx, NixlEndpoint, 4, "reader", 0, deadline=Deadline.after(10.0))
    assert time.monotonic() - started < 1.5
    ctx = TransportContext(channel=Superseded("reader", 0, lease_seconds=3.0), num_writers=2, num_readers=1)
    with pytest.raises(TransportError, match="reader 0: writer 1 will not publish its nixl endpoint of epoch 4: it "
                                             "writes version 2 now"):
        peer_endpoint(ctx, NixlEndpoint, 4, "writer", 1, deadline=Deadline.after(10.0))


def test_a_reader_whose_lease_ended_before_it_published_its_endpoint_is_named_within_a_second():
    """A reader that died (or stalled past its lease, or left) before it published its endpoint of
    the epoch never will: no version waits for a reader's restart. A writer waiting for it (NIXL
    push) used to wait until the deadline, naming no rank; it names the reader at its next look
    at the leases. A live reader that is late is still waited for. A dead writer used to be
    waited for too (its restart might join the version's epoch): it is named once it is out of
    the epoch, and only a restart that took its seat there first is waited for. Without leases
    the wait is the deadline's."""
    import time

    from weightsync.transport import TransportError
    from weightsync.transport.endpoint_wait import peer_endpoint
    from weightsync.transport.endpoints import NixlEndpoint

    class Blocking(FakeChannel):  # waits for an endpoint as the job channel does: until it comes or the deadline
        def wait_endpoint(self, kind, epoch, role, rank, *, deadline):
            time.sleep(deadline.remaining(0.0))
            return super().wait_endpoint(kind, epoch, role, rank, deadline=deadline)

    channel = Blocking("writer", 0, lease_seconds=3.0)
    ctx = TransportContext(channel=channel, num_writers=1, num_readers=1)
    started = time.monotonic()
    assert peer_endpoint(ctx, NixlEndpoint, 4, "reader", 0, deadline=Deadline.after(1.2)) is None  # alive, late
    assert time.monotonic() - started >= 1.2
    channel.dead[0] = "pid 7 on vm, last heartbeat 3.2 s ago: its lease expired"
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"writer 0: reader 0 died while this rank waited for its nixl endpoint "
                                             r"of epoch 4: pid 7 on vm, last heartbeat 3\.2 s ago: its lease expired"):
        peer_endpoint(ctx, NixlEndpoint, 4, "reader", 0, deadline=Deadline.after(10.0))
    assert time.monotonic() - started < 1.5
    reader_side = TransportContext(channel=Blocking("reader", 0, lease_seconds=3.0), num_writers=1, num_readers=1)
    reader_side.channel.dead[0] = "its lease expired"  # writer 0, dead before it published: out of the epoch
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"reader 0: writer 0 died while this rank waited for its nixl endpoint "
                                             r"of epoch 4: it has no live process \(its lease expired\) and never "
                                             "joined epoch 4"):
        peer_endpoint(reader_side, NixlEndpoint, 4, "writer", 0, deadline=Deadline.after(10.0))
    assert time.monotonic() - started < 1.5
    reader_side.channel.seated.add(0)  # its restart took its seat in the epoch first: waited for
    assert peer_endpoint(reader_side, NixlEndpoint, 4, "writer", 0, deadline=Deadline.after(0.6)) is None
    unleased = TransportContext(channel=Blocking("writer", 0), num_writers=1, num_readers=1)
    unleased.channel.dead[0] = "gone"
    assert peer_endpoint(unleased, NixlEndpoint, 4, "reader", 0, deadline=Deadline.after(0.3)) is None


def test_waiting_for_every_rank_reads_one_endpoint_per_step_whatever_the_worlds_size():
    """The torch rendezvous waits for every rank's arrival. It read every missing rank's record at
    each step: a world of N ranks cost each rank N reads a step while they gathered, N squared
    reads of the coordinator in all. It reads one per step now (a long poll on the first
    missing), and each of the others once when its turn comes."""
    import threading
    import time

    from weightsync.transport.endpoint_wait import every_endpoint
    from weightsync.transport.endpoints import TorchArrival

    class Counting(FakeChannel):
        reads = 0

        def wait_endpoint(self, kind, epoch, role, rank, *, deadline):
            Counting.reads += 1
            return super().wait_endpoint(kind, epoch, role, rank, deadline=deadline)

    channel = Counting("writer", 0, lease_seconds=3.0)
    ctx = TransportContext(channel=channel, num_writers=1, num_readers=32)

    def everyone_arrives() -> None:
        time.sleep(1.2)  # past two looks
        for r in range(32):
            channel.peer_publishes(5, "reader", r, TorchArrival(f"r{r}"))

    arriving = threading.Thread(target=everyone_arrives)
    arriving.start()
    try:
        found = every_endpoint(ctx, TorchArrival, 5, deadline=Deadline.after(10.0), what="the process group of epoch 5")
    finally:
        arriving.join(timeout=10)
    assert sorted(found) == [("reader", r) for r in range(32)]
    assert Counting.reads <= 32 + 4, Counting.reads  # about 3 steps on reader 0, then each one once
