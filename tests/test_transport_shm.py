"""Shared-memory transport, zero-copy mode: what the multi-process contract does not reach."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from fake_meta import DirectoryMeta, FakeChannel
from weightsync.clock.deadline import Deadline
from weightsync.configs import load_spec
from weightsync.job.channel import JobChannel
from weightsync.layout import parse_layout
from weightsync.plan import PlanOptions, build_local_plan
from weightsync.tools.torch_layout import allocate
from weightsync.transport import TransportContext, TransportError, TransportOptions, create_transport
from weightsync.transport.shm.files import SHM_DIR, share_tensors
from weightsync.transport.shm.segment import RETIRED, SegmentRetiredError, check_live
from weightsync.transport.shm.snapshot import SnapshotWriter
from weightsync.transport.shm.zero_copy import EXPOSED_WORD, ZeroCopyWriter

pytestmark = pytest.mark.timeout(60)


def _writer(tmp_path, tensors, *, moves=None):
    """A prepared shm writer of tiny-qwen3 for two readers; ``moves(layout)`` (optional): prepare it
    again in the same epoch on those tensors, as SyncSession.arm does when the weights moved."""
    spec = load_spec("tiny-qwen3")
    writers = parse_layout("megatron:tp=1").all_rank_layouts(spec)
    readers = parse_layout("vllm:tp=1,replicas=2").all_rank_layouts(spec)
    plan = build_local_plan(writers, readers, role="writer", rank=0, options=PlanOptions(min_split_bytes=0))
    ctx = TransportContext(channel=JobChannel(DirectoryMeta(str(tmp_path)), role="writer", rank=0), num_writers=1,
                           num_readers=2, options=TransportOptions())
    transport = create_transport("shm", ctx)
    transport.prepare(plan, tensors(writers[0]), epoch=0, deadline=Deadline.after(5))
    if moves is not None:
        first = transport.writer_side
        transport.prepare(plan, moves(writers[0]), epoch=0, deadline=Deadline.after(5))
        return transport, first
    return transport


def test_share_tensors_copies_into_one_file_and_close_unlinks_it():
    tensors = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 4, dtype=torch.bfloat16)}
    with share_tensors(tensors) as shared:
        assert shared.path is not None and os.path.exists(shared.path)
        assert shared.path.startswith(SHM_DIR + "/weightsync-")
        for name, t in tensors.items():
            assert torch.equal(shared.tensors[name], t) and shared.tensors[name].dtype == t.dtype
            assert shared.tensors[name].untyped_storage().filename == shared.path
        path = shared.path
    assert not os.path.exists(path)
    shared.tensors["a"].add_(1)  # still usable after close
    with pytest.raises(ValueError, match="only CPU tensors"):
        share_tensors({"m": torch.zeros(2, device="meta")})


def test_zero_copy_writer_names_readers_that_never_copied(tmp_path):
    shared = None

    def in_shm(layout):
        nonlocal shared
        shared = share_tensors(allocate(layout))
        return shared.tensors

    transport = _writer(tmp_path, in_shm)
    try:
        assert isinstance(transport.writer_side, ZeroCopyWriter), "sources in /dev/shm must select zero-copy mode"
        with pytest.raises(TransportError, match=r"readers \[0, 1\] did not copy version 0"):
            transport.send(0, deadline=Deadline.after(0.3))
        # no longer exposed: the trainer may write again
        assert int(transport.writer_side.segment.words[EXPOSED_WORD]) == -1
    finally:
        transport.close()
        shared.close()


class _Superseded(FakeChannel):
    """Writer 1's restarted trainer writes version 2: writer 0's retry of version 1 is never
    published by writer 1, so no reader comes to copy it."""

    def writers_out_of_epoch(self, epoch, ranks):
        return {1: "it writes version 2 now, so version 1 is superseded"} if 1 in ranks else {}


def test_a_zero_copy_writer_stops_holding_a_version_once_another_writer_will_never_publish_it():
    """Writer 0 retried version 1 after writer 1's restart went on to version 2 and held its
    weights for readers until its 20 s timeout (the shm-zero-copy cell of the kill-both fault
    test: recovery in 22.6 s, 3 runs in 3): readers come only to a version every writer
    published. It stops at its next look now, naming writer 1, and unexposes its weights."""
    import time

    spec = load_spec("tiny-qwen3")
    writers = parse_layout("megatron:tp=1").all_rank_layouts(spec)
    readers = parse_layout("vllm:tp=1,replicas=2").all_rank_layouts(spec)
    plan = build_local_plan(writers, readers, role="writer", rank=0, options=PlanOptions(min_split_bytes=0))
    ctx = TransportContext(channel=_Superseded("writer", 0, lease_seconds=3.0), num_writers=2, num_readers=2,
                           options=TransportOptions())
    transport = create_transport("shm", ctx)
    shared = share_tensors(allocate(writers[0]))
    try:
        transport.prepare(plan, shared.tensors, epoch=4, deadline=Deadline.after(5))
        assert isinstance(transport.writer_side, ZeroCopyWriter)
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"writer 0: stopped waiting for readers \[0, 1\] to copy version 1: "
                                                 "writer 1 will not take part in epoch 4: it writes version 2 now"):
            transport.send(1, deadline=Deadline.after(10.0))
        assert time.monotonic() - started < 1.5
        assert int(transport.writer_side.segment.words[EXPOSED_WORD]) == -1  # the trainer may write again
    finally:
        transport.close()
        shared.close()


class _WritesOn(FakeChannel):
    """Writer 0's live process writes version 2: it gave version 1 up (superseded) before this
    reader came to it."""

    def writer_writes(self, rank):
        return 2 if rank == 0 else None


def test_a_zero_copy_reader_stops_waiting_for_a_version_its_writer_went_past():
    """The restarted reader of the kill-both fault cell (shm-zero-copy, once in three CI runs)
    took version 1, which writer 0 had just given up as superseded, and waited 20 s for writer
    0 to expose it, while the writers waited for that reader in version 2. A writer exposes
    versions in order, so once its live process writes a newer one the wait stops at its next
    look, naming the writer and the version."""
    import time

    from weightsync.transport.base import PeerWatch
    from weightsync.transport.shm.segment import CONTROL_BYTES
    from weightsync.transport.shm.zero_copy import ZeroCopyPeer

    ctx = TransportContext(channel=_WritesOn("reader", 1, lease_seconds=3.0), num_writers=2, num_readers=2,
                           options=TransportOptions())
    control = torch.zeros(CONTROL_BYTES // 8, dtype=torch.int64)
    control[EXPOSED_WORD] = -1  # writer 0 gave version 1 up: it exposes nothing
    peer = ZeroCopyPeer(control, None, {}, writer=0, reader=1, watch=PeerWatch(ctx, "writer", [0]))
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"reader 1: writer 0 writes version 2 now, so it will not expose "
                                             r"version 1 again"):
        peer.begin(1, Deadline.after(10.0))
    assert time.monotonic() - started < 1.5


def test_private_sources_keep_snapshot_slots(tmp_path):
    transport = _writer(tmp_path, allocate)
    try:
        assert isinstance(transport.writer_side, SnapshotWriter)
        stats = transport.send(0, deadline=Deadline.after(5))  # packs into its slot, does not wait for anyone
        assert stats.peak_extra_bytes >= stats.nbytes > 0
    finally:
        transport.close()


def test_weights_moved_within_an_epoch_keep_snapshot_slots_and_retire_a_zero_copy_segment(tmp_path):
    """Readers attach once per epoch: a snapshot writer keeps its segment for new storage (it packs
    from wherever the weights are); a zero-copy one whose files changed marks its old segment
    retired (readers waiting on it look for the new one) and exposes a new one."""
    transport, first = _writer(tmp_path, allocate, moves=allocate)
    try:
        assert transport.writer_side is first and first.segment.path is not None
    finally:
        transport.close()
    shares = []

    def in_shm(layout):
        shares.append(share_tensors(allocate(layout)))
        return shares[-1].tensors

    for moves in (in_shm, allocate):  # to new shared files (zero-copy again), to private memory (snapshot)
        transport, first = _writer(tmp_path, in_shm, moves=moves)
        try:
            assert isinstance(first, ZeroCopyWriter) and first.segment.path is None  # unlinked
            assert int(first.segment.words[0]) == RETIRED
            assert isinstance(transport.writer_side, ZeroCopyWriter if moves is in_shm else SnapshotWriter)
            with pytest.raises(SegmentRetiredError, match="reader 1: writer 0 replaced its shared memory segment "
                                                          r"\(its weights moved to new storage\)"):
                check_live(first.segment.words, 0, 1)
        finally:
            transport.close()
            for shared in shares:
                shared.close()
            shares.clear()


def test_a_segment_never_unlinked_removes_its_file_when_the_process_exits():
    """A writer not closed must not leave a model-sized file in /dev/shm."""
    import subprocess

    code = ("from weightsync.transport.shm.segment import OwnSegment; import os; "
            "s = OwnSegment(0, {'k': 1}, 1 << 16); assert os.path.exists(s.path); print(s.path)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    assert path.startswith(SHM_DIR) and not os.path.exists(path)


def test_the_sweep_spares_files_a_live_process_holds_whatever_pid_their_name_carries():
    """A weightsync process in another pid namespace that shares /dev/shm sees no process with
    the pid in a live writer's file names: the sweep judged by pid and deleted live segments
    and zero-copy parameter files (issue 28). It judges by the creator's lock now."""
    import subprocess

    from weightsync.transport.shm.files import create_shared, remove_shared, sweep_stale_segments

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60)
    name = f"weightsync-{int(gone.stdout)}-{os.getpid()}sweep-w0"  # a pid no process here has
    path = os.path.join(SHM_DIR, name)
    create_shared(path, 64)  # as the process of the other namespace would: held while it lives
    try:
        assert name not in sweep_stale_segments(min_age=0.0) and os.path.exists(path)
    finally:
        remove_shared(path)
    with open(path, "wb") as f:  # the same file once its creator is gone: nobody holds it
        f.write(b"x" * 64)
    assert name in sweep_stale_segments(min_age=0.0) and not os.path.exists(path)


def test_the_sweep_takes_the_files_of_a_killed_process_its_parent_has_not_reaped_yet():
    """A trainer killed under a launcher that has not waited for it yet is a zombie: it answers
    ``kill(pid, 0)`` but holds no file or lock any more. The sweep kept its segments until the
    launcher reaped it; it takes them at once now (``weightsync.tools.processes``)."""
    import subprocess
    import time

    from weightsync.tools.processes import process_alive
    from weightsync.transport.shm.files import sweep_stale_segments

    child = subprocess.Popen([sys.executable, "-c", "import os, sys; sys.stdout.write(str(os.getpid())); "
                              f"open('{SHM_DIR}/weightsync-' + str(os.getpid()) + '-zombie-w0', 'wb').write(b'x')"],
                             stdout=subprocess.PIPE)
    name = f"weightsync-{child.pid}-zombie-w0"
    try:
        assert child.stdout is not None and child.stdout.read() == str(child.pid).encode()  # it wrote and exited
        deadline = time.monotonic() + 30
        while open(f"/proc/{child.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":  # not reaped
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        assert not process_alive(child.pid) and process_alive(os.getpid())
        assert name in sweep_stale_segments(min_age=0.0) and not os.path.exists(os.path.join(SHM_DIR, name))
    finally:
        child.wait(30)
        if os.path.exists(os.path.join(SHM_DIR, name)):
            os.unlink(os.path.join(SHM_DIR, name))


MOVES = {  # writer 0's weights move before version 1, writer 1's before version 2
    "snapshot": {},  # private memory to private memory: the writer keeps its slots
    # (and readers that wait for whole slots)
    "snapshot-delta": {"options": {"delta_anchor_every": 4, "shm_streaming": False}, "sparse_steps": True},
    "zero-copy-to-private": {"shared_sources": True},  # readers move to the writer's new snapshot slots
    "zero-copy-to-shared": {"shared_sources": True, "moved_shared": True},  # readers map the new files
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("move", MOVES)
def test_a_writer_whose_weights_move_to_new_storage_still_reaches_its_readers(tmp_path, move):
    """A trainer may replace its weights' storage between two versions (``param.data = t``, an
    optimizer that swaps buffers): SyncSession.arm then re-prepares the writer in the same epoch,
    while its readers stay attached to what it exposed before. Every version must still arrive
    bitwise, in place, in every mode."""
    from test_transport_contract import own_segments, run_scenario

    out = run_scenario(tmp_path, "shm", moved_at={"0": [1], "1": [2]}, **MOVES[move])
    assert not own_segments(out.pop("pids"))
    for (role, rank), (code, payload, stderr) in sorted(out.items()):  # readers first: their errors say most
        assert code == 0, f"{role} {rank} failed:\n{stderr[-3000:]}"
        if role == "writer" and move.startswith("zero-copy"):  # snapshot slots only after a move to private memory
            moved = [r["peak_extra_bytes"] > 0 for r in payload["results"]]
            assert moved == ([False, True, True] if rank == 0 else [False, False, True]) \
                if move == "zero-copy-to-private" else [False] * 3, moved
        if role == "reader":
            assert "error" not in payload, f"reader {rank}: {payload}"
            assert [r["version"] for r in payload["results"]] == [0, 1, 2]
            for r in payload["results"]:
                assert r["exact"] and r["in_place"], (rank, r)
                assert 0 < r["bytes"] <= r["needed"] if move == "snapshot-delta" else r["bytes"] == r["needed"]


def test_a_segment_gone_because_the_job_re_planned_is_named_superseded_not_removed_by_another_process():
    """A reader that maps a writer's segment of an older epoch (it adopted a version planned before
    it joined an elastic set, and the writers re-planned for the join) finds the file gone while
    the writer lives: the message says the writer retired it for the newer plan. Only when the job
    did not move on is a file gone under a live writer someone else's doing."""
    from fake_meta import FakeChannel
    from weightsync.transport.shm.transport import gone_why

    channel = FakeChannel("reader", 1)
    ctx = TransportContext(channel=channel, num_writers=1, num_readers=2)
    assert "another process removed it" in gone_why(ctx, 0, 3)
    channel.epoch = 4
    why = gone_why(ctx, 0, 3)
    assert "writer 0 retired it, as the job re-planned (epoch 4, past this reader's 3" in why, why
    assert "another process" not in why
    channel.dead = {0: "its lease expired"}
    assert gone_why(ctx, 0, 3) == " (writer 0 exited: its lease expired)"


def test_a_segment_whose_maker_holds_the_writer_rank_no_more_fails_at_once_naming_both():
    """Issue 36's kill-both case on shared memory: a restarted reader took the version its dead
    writer 1 began, mapped that writer's segment and watched writer 1's lease, which writer 1's
    restart holds: alive, so it waited in dead memory until its timeout. A segment names the
    process that made it; a reader compares it with the rank's lease holder when it attaches."""
    from fake_meta import FakeChannel
    from weightsync.ports.coordinator import Holder
    from weightsync.transport.shm.segment import OwnSegment, read_segment
    from weightsync.transport.shm.transport import maker_watch

    restart = Holder("restart", 222, "vm")

    class Leases(FakeChannel):
        def lease_holders(self, *, max_age=0.25) -> dict:
            return {("writer", 1): restart}

    ctx = TransportContext(channel=Leases("reader", 0), num_writers=2, num_readers=1)
    with pytest.raises(TransportError, match=r"reader 0: writer 1's shared memory /dev/shm/w1 was made by pid 111, "
                                             r"which holds the rank no more: a restarted process does \(pid 222 on "
                                             r"vm\), so what that memory holds will not complete"):
        maker_watch(ctx, 1, "/dev/shm/w1", {"pid": 111})
    # made by the holder: watched as that process (a restart from now on is its death)
    assert maker_watch(ctx, 1, "/dev/shm/w1", {"pid": 222}).known == {("writer", 1): restart}
    assert maker_watch(ctx, 1, "/dev/shm/w1", {}).known == {("writer", 1): restart}  # a segment that says nothing
    segment = OwnSegment(1, {"mode": "snapshot"}, 64)
    try:
        segment.seal()
        assert segment.path is not None
        assert read_segment(segment.path, 1)[2] == {"mode": "snapshot", "pid": os.getpid()}
    finally:
        segment.unlink()
