"""NIXL transport: real processes on CPU (2 writers, 2 readers), pull and push.

Writers hold ``megatron:tp=2`` shards of tiny-qwen3-moe, readers ``vllm:tp=1,replicas=2``
buffers; every rank builds its own local plan. Every version must arrive bitwise, in
place (same data_ptrs), with exactly the planned bytes; a killed writer must make its
readers fail within their timeout with an error naming it; nothing may be left behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from fake_meta import DirectoryMeta
from weightsync.clock.deadline import Deadline
from weightsync.transport import unavailable_reason

needs_nixl = pytest.mark.skipif(unavailable_reason("nixl") is not None,
                                reason=f"{unavailable_reason('nixl')}")

CONFIG = "tiny-qwen3-moe"
SOURCE = "megatron:tp=2"
TARGET = "vllm:tp=1,replicas=2"
TIMEOUT = 20.0


def _layouts(target: str):
    from weightsync.configs import load_spec
    from weightsync.layout import parse_layout

    spec = load_spec(CONFIG)
    return parse_layout(SOURCE).all_rank_layouts(spec), parse_layout(target).all_rank_layouts(spec)


def _tensors(arrays, layout):
    import torch

    from weightsync.tools.torch_layout import TORCH_DTYPES

    dtypes = {s.name: s.dtype for s in layout.shards}
    return {name: torch.from_numpy(a).view(TORCH_DTYPES[dtypes[name]]) for name, a in arrays.items()}


def _native_threads() -> list[str]:
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rank_main(role, rank, scenarios, meta_root, barrier, results, stop_after=None):
    """One rank runs every scenario (mode, target, versions) in turn, one epoch each.

    Per scenario: build the local plan, prepare once, then send or receive each version
    and check it; report. ``stop_after`` (writer 0 only): stop after sending that many
    versions and wait to be killed.
    """
    try:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        import torch

        from weightsync.job.channel import JobChannel
        from weightsync.plan import build_local_plan
        from weightsync.plan.reference import cut_shards, empty_shards, random_canonical
        from weightsync.transport import TransportContext, TransportError, TransportOptions, create_transport

        torch.set_num_threads(1)
        for epoch, (mode, target, versions) in enumerate(scenarios):
            writers, readers = _layouts(target)
            layout = (writers if role == "writer" else readers)[rank]
            plan = build_local_plan(writers, readers, role=role, rank=rank)
            # Small buckets: several staged messages per pair share one landing buffer.
            options = TransportOptions(nixl_mode=mode, max_bucket_bytes=64 << 10, direct_min_bytes=1 << 10)
            ctx = TransportContext(channel=JobChannel(DirectoryMeta(meta_root), role=role, rank=rank),
                                   num_writers=len(writers), num_readers=len(readers), options=options)
            canonical = writers[0].canonical
            arrays = cut_shards(layout, random_canonical(canonical, seed=0)) if role == "writer" else empty_shards(layout)
            tensors = _tensors(arrays, layout)
            ptrs = {n: t.data_ptr() for n, t in tensors.items()}
            threads0, fds0 = _native_threads(), _fds()
            transport = create_transport("nixl", ctx)
            transport.prepare(plan, tensors, epoch=epoch, deadline=Deadline.after(TIMEOUT))
            out = {"setup": dict(transport.setup), "received": [], "error": None}
            for i, v in enumerate(versions):
                values = random_canonical(canonical, seed=v)
                if role == "writer":
                    if stop_after is not None and i == stop_after:
                        time.sleep(3 * TIMEOUT)  # the test kills this process now
                    for name, t in _tensors(cut_shards(layout, values), layout).items():
                        tensors[name].copy_(t)
                    transport.send(v, deadline=Deadline.after(TIMEOUT))
                    results.put((role, rank, "sent", v))
                else:
                    t0 = time.monotonic()
                    try:
                        stats = transport.receive(v, deadline=Deadline.after(TIMEOUT))
                    except TransportError as exc:
                        out["error"] = (str(exc), time.monotonic() - t0)
                        barrier.wait(TIMEOUT)
                        break
                    # The reference runs in the writers' dtype; the transport converts like torch does.
                    ref = _layouts(TARGET)[1][rank]
                    want = {n: t.to(tensors[n].dtype) for n, t in _tensors(cut_shards(ref, values), ref).items()}
                    bad = [n for n, t in tensors.items() if not torch.equal(t.view(torch.uint8), want[n].view(torch.uint8))]
                    out["received"].append((v, stats.nbytes, bad))
                    results.put((role, rank, "received", v))
                barrier.wait(TIMEOUT)  # lockstep, so pull writers never run ``slots`` versions ahead
            transport.close()
            out["ptrs_same"] = ptrs == {n: t.data_ptr() for n, t in tensors.items()}
            out["needed"] = int(sum(op.nbytes for op in plan.ops))
            out["leaks"] = {"threads": [t for t in _native_threads() if t not in threads0], "fds": _fds() - fds0}
            results.put((role, rank, "done", (epoch, out)))
    except BaseException:
        results.put((role, rank, "crash", traceback.format_exc()))


class _NoBarrier:
    def wait(self, timeout=None):
        return 0


def _run_job(tmp_path: Path, scenarios, *, kill_writer0_after: int | None = None):
    """2 writers + 2 readers run ``scenarios``; returns {epoch: {(role, rank): report}}.

    With ``kill_writer0_after=n`` writer 0 stops after sending n versions and is SIGKILLed
    once every reader has received the n-th. No process survives this function.
    """
    # forked from a server that imported torch once (a spawned rank pays ~3 s of CPU for it)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    results = ctx.Queue()
    killing = kill_writer0_after is not None
    barrier = ctx.Barrier(3 if killing else 4)
    shm_before = set(os.listdir("/dev/shm"))
    procs = {}
    for role in ("writer", "reader"):
        for rank in range(2):
            doomed = killing and (role, rank) == ("writer", 0)
            procs[(role, rank)] = ctx.Process(
                target=_rank_main, daemon=True,
                args=(role, rank, scenarios, str(tmp_path / "meta"), _NoBarrier() if doomed else barrier, results,
                      kill_writer0_after if doomed else None))
    reports: dict[int, dict] = {g: {} for g in range(len(scenarios))}
    took: set[int] = set()
    expected = len(scenarios) * (len(procs) - killing)
    try:
        for p in procs.values():
            p.start()
        deadline = time.monotonic() + 45 + 15 * len(scenarios)
        while sum(map(len, reports.values())) < expected:
            role, rank, kind, payload = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            if kind == "crash":
                raise AssertionError(f"{role} {rank} crashed:\n{payload}")
            if killing and kind == "received" and payload == scenarios[0][2][kill_writer0_after - 1]:
                took.add(rank)
                if len(took) == 2:  # every reader has the last version writer 0 sends
                    os.kill(procs["writer", 0].pid, signal.SIGKILL)
            elif kind == "done":
                epoch, out = payload
                reports[epoch][role, rank] = out
        for p in procs.values():
            p.join(timeout=10)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not any(p.is_alive() for p in procs.values())
    # Other test processes on the host may create files meanwhile: judge only ours and UCX's.
    pids = {str(p.pid) for p in procs.values()}
    leftover = {n for n in set(os.listdir("/dev/shm")) - shm_before
                if n.startswith(("ucx", "nixl")) or any(pid in n for pid in pids)}
    assert not leftover, f"left in /dev/shm: {leftover}"
    return reports


def _global_needed(target: str) -> int:
    from weightsync.plan import build_plan

    writers, readers = _layouts(target)
    stats = build_plan(writers, readers).stats
    assert stats is not None
    return stats.needed_bytes


SCENARIOS = [
    ("pull", TARGET, [1, 2, 3]),
    ("push", TARGET, [1, 2, 3]),
    ("push", TARGET + ",dtype=bfloat16", [1, 2]),  # converting ops go through the writer's packed area
]


@needs_nixl
def test_versions_arrive_bitwise_in_place_pull_and_push(tmp_path):
    reports = _run_job(tmp_path, SCENARIOS)
    for epoch, (mode, target, versions) in enumerate(SCENARIOS):
        where = f"{mode} -> {target}"
        total = 0
        for (role, rank), out in reports[epoch].items():
            assert out["ptrs_same"], f"{where}: {role} {rank}: tensors moved"
            assert out["leaks"] == {"threads": [], "fds": 0}, f"{where}: {role} {rank} leaked {out['leaks']}"
            assert out["setup"]["registered_bytes"] > 0
            if role == "reader":
                assert out["error"] is None, f"{where}: reader {rank}: {out['error']}"
                assert [v for v, _, _ in out["received"]] == versions
                for v, nbytes, bad in out["received"]:
                    assert not bad, f"{where}: reader {rank} version {v}: wrong bytes in {bad[:5]}"
                    assert nbytes == out["needed"], f"{where}: reader {rank} version {v}: {nbytes} bytes"
                total += out["needed"]
        assert total == _global_needed(target), where


@needs_nixl
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_dead_writer_fails_reader_within_timeout(tmp_path, mode):
    reports = _run_job(tmp_path, [(mode, TARGET, [1, 2])], kill_writer0_after=1)[0]
    for rank in range(2):
        out = reports["reader", rank]
        assert [v for v, _, bad in out["received"] if not bad] == [1]
        message, seconds = out["error"]
        assert message.startswith(f"reader {rank}: ") and "writer 0 died or disconnected" in message, message
        assert seconds < TIMEOUT, f"reader {rank} took {seconds:.1f}s to notice"
        assert out["leaks"]["threads"] == []


def test_modes_and_options(tmp_path):
    from weightsync.job.channel import JobChannel
    from weightsync.transport import TransportContext, TransportOptions, create_transport
    from weightsync.transport.nixl.common import resolve_mode
    from weightsync.transport.nixl.pull import NixlPullTransport
    from weightsync.transport.nixl.push import NixlPushTransport

    # auto: push while each writer feeds few readers, pull on fan-out to more readers than writers
    assert resolve_mode("auto", num_writers=2, num_readers=2) == "push"
    assert resolve_mode("auto", num_writers=8, num_readers=1) == "push"
    assert resolve_mode("auto", num_writers=1, num_readers=4) == "pull"
    assert resolve_mode("pull", num_writers=2, num_readers=1) == "pull"
    assert NixlPullTransport.one_sided and not NixlPushTransport.one_sided
    assert NixlPullTransport.writes_in_place and NixlPushTransport.writes_in_place
    assert NixlPushTransport.publishes_before_send and not NixlPullTransport.publishes_before_send

    def make(mode, writers, readers):
        return create_transport("nixl", TransportContext(
            channel=JobChannel(DirectoryMeta(str(tmp_path)), role="reader", rank=0), num_writers=writers,
            num_readers=readers, options=TransportOptions(nixl_mode=mode)))

    # Constructing creates no agent, so this runs without NIXL installed.
    assert type(make("auto", 2, 2)) is NixlPushTransport and not make("auto", 2, 2).one_sided
    assert type(make("auto", 1, 2)) is NixlPullTransport and make("auto", 1, 2).one_sided
    assert type(make("pull", 2, 2)) is NixlPullTransport
    with pytest.raises(ValueError, match="nixl_mode"):
        TransportOptions(nixl_mode="sideways")  # type: ignore[arg-type]


@needs_nixl
def test_slots_stale_versions_and_mode_mismatch_in_one_process(tmp_path, monkeypatch):
    """Writer and reader agents in one process: registration once, seqlock checks, clear errors."""
    import torch

    from weightsync.configs import load_spec
    from weightsync.job.channel import JobChannel
    from weightsync.layout import parse_layout
    from weightsync.plan import build_plan
    from weightsync.transport import TransportContext, TransportError, TransportOptions
    from weightsync.transport.nixl.agent import NixlAgent
    from weightsync.transport.nixl.pull import NixlPullTransport
    from weightsync.transport.nixl.push import NixlPushTransport

    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    threads_before = threading_names()  # other tests in this worker may have left e.g. tqdm's monitor
    registrations = []
    original = NixlAgent.register
    monkeypatch.setattr(NixlAgent, "register", lambda self, *a, **k: (registrations.append(a), original(self, *a, **k)))
    spec = load_spec("tiny-qwen3")
    writers = parse_layout("hf").all_rank_layouts(spec)
    readers = parse_layout("hf").all_rank_layouts(spec)
    plan = build_plan(writers, readers)
    meta = DirectoryMeta(tmp_path)

    def ctx(role, mode="pull"):
        return TransportContext(channel=JobChannel(meta, role=role, rank=0), num_writers=1, num_readers=1,
                                options=TransportOptions(nixl_mode=mode, slots=2))

    src = {s.name: torch.zeros(s.numel) for s in writers[0].shards}
    dst = {s.name: torch.zeros(s.numel) for s in readers[0].shards}
    with NixlPullTransport(ctx("writer")) as w, NixlPullTransport(ctx("reader")) as r:
        w.prepare(plan, src, epoch=0, deadline=Deadline.after(10))
        r.prepare(plan, dst, epoch=0, deadline=Deadline.after(10))
        prepared = len(registrations)
        for v in (1, 2):
            for t in src.values():
                t.fill_(v)
            w.send(v, deadline=Deadline.after(5))
        assert r.receive(1, deadline=Deadline.after(5)).nbytes == plan.total_bytes
        assert all(bool((t == 1).all()) for t in dst.values())
        w.send(3, deadline=Deadline.after(5))  # overwrites version 1's slot
        with pytest.raises(TransportError, match="version 1 in writer 0's NIXL slot is already replaced by version 3"):
            r.receive(1, deadline=Deadline.after(5))
        r.receive(2, deadline=Deadline.after(5))
        assert all(bool((t == 2).all()) for t in dst.values())
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="version 4 in writer 0's NIXL slot is not written yet"):
            r.receive(4, deadline=Deadline.after(0.3))
        assert time.monotonic() - t0 < 2
        assert len(registrations) == prepared, "registration must happen once per plan, not per version"
        with NixlPushTransport(ctx("reader", "push")) as pushed:
            assert pushed.mode == "push"
            with pytest.raises(TransportError, match="writer 0 uses nixl_mode 'pull'"):
                pushed.prepare(plan, dst, epoch=0, deadline=Deadline.after(5))
    assert threading_names() == threads_before, "the NIXL agents left threads behind"


def threading_names():
    import threading

    return sorted(t.name for t in threading.enumerate())


def test_descriptor_geometry():
    from weightsync.transport.nixl.agent import Descriptors
    from weightsync.transport.nixl.common import contiguous_runs

    # A column half of a 4x6 row-major matrix, read from a packed 4x3 block.
    a, b, run = contiguous_runs((4, 3), (3, 1), (6, 1))
    assert run == 3 and a.tolist() == [0, 3, 6, 9] and b.tolist() == [0, 6, 12, 18]
    # Dense on both sides: one run; size-1 dimensions never split runs.
    a, b, run = contiguous_runs((1, 4, 3), (99, 3, 1), (7, 3, 1))
    assert run == 12 and a.tolist() == [0] and b.tolist() == [0]
    loc, rem, n = Descriptors.of([0, 10, 20, 50], [100, 110, 120, 130], [10, 10, 10, 5])
    assert loc.tolist() == [0, 50] and rem.tolist() == [100, 130] and n.tolist() == [30, 5]


@needs_nixl
def test_pull_deltas_move_exactly_the_published_changes(tmp_path, monkeypatch):
    """Deltas over NIXL pull READ exactly the published changes (tests/_delta_exact.py)."""
    from _delta_exact import delta_pair, run_exact_sequence
    from weightsync.job.channel import JobChannel
    from weightsync.transport import TransportContext, TransportOptions
    from weightsync.transport.nixl.pull import NixlPullTransport

    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    meta = DirectoryMeta(tmp_path)

    def make(role, options):
        return NixlPullTransport(TransportContext(channel=JobChannel(meta, role=role, rank=0), num_writers=1,
                                                  num_readers=1, options=TransportOptions(nixl_mode="pull", **options)))

    with delta_pair(make) as pair:
        run_exact_sequence(pair)


@needs_nixl
def test_push_deltas_write_exactly_the_changes(tmp_path, monkeypatch):
    """Deltas over NIXL push, in one process (the writer in a thread): the first version in
    full; 3 changed fp32 elements WRITTEN as one sparse encoding (3 int32 indices + 3 values =
    24 bytes) into the reader's inbox; an unchanged version 0 bytes; a reader that forgot its
    base, or failed a version (it gave up before the writer wrote), gets the next one in full.
    Every version bitwise; on main push refused deltas at init."""
    import threading

    import torch

    from weightsync.configs import load_spec
    from weightsync.job.channel import JobChannel
    from weightsync.layout import parse_layout
    from weightsync.plan import build_plan
    from weightsync.transport import TransportContext, TransportError, TransportOptions
    from weightsync.transport.nixl.push import NixlPushTransport

    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    spec = load_spec("tiny-qwen3")
    layouts = parse_layout("hf").all_rank_layouts(spec)
    plan = build_plan(layouts, layouts)
    meta = DirectoryMeta(tmp_path)

    def ctx(role):
        return TransportContext(channel=JobChannel(meta, role=role, rank=0), num_writers=1, num_readers=1,
                                options=TransportOptions(nixl_mode="push", delta_anchor_every=4))

    src = {s.name: torch.randn(s.numel, generator=torch.Generator().manual_seed(i))
           for i, s in enumerate(layouts[0].shards)}
    dst = {s.name: torch.zeros(s.numel) for s in layouts[0].shards}
    first = next(iter(src.values()))
    full = plan.total_bytes
    with NixlPushTransport(ctx("writer")) as w, NixlPushTransport(ctx("reader")) as r:
        prepared = threading.Thread(target=w.prepare, args=(plan, src), kwargs={"epoch": 0, "deadline": Deadline.after(10)})
        prepared.start()
        r.prepare(plan, dst, epoch=0, deadline=Deadline.after(10))
        prepared.join(10)

        def step(version, change=0, *, fail=False):
            first[:change] += 1.0
            sent = {}
            writer = threading.Thread(target=lambda: sent.update(stats=w.send(version, deadline=Deadline.after(10))))
            if fail:  # the reader asks for the version, gives up, then the writer writes it
                with pytest.raises(TransportError, match="did not arrive"):
                    r.receive(version, deadline=Deadline.after(0.2))
                writer.start()
                writer.join(10)
                return None
            writer.start()
            moved = r.receive(version, deadline=Deadline.after(10)).nbytes
            writer.join(10)
            assert sent["stats"].nbytes == moved, version
            assert all(torch.equal(dst[n], src[n]) for n in src), version
            return moved

        assert step(1) == full
        assert step(2, change=3) == 24  # anchors: full at 1 and 5
        assert step(3) == 0
        r.forget_received()  # the engine's version changed outside the reader
        assert step(4, change=3) == full
        step(5, change=3, fail=True)
        assert step(6, change=3) == full
        assert step(7, change=3) == 24


def _prepare_push_side(directory: str, role: str, anchor: int, tolerates: bool = False) -> None:
    """One side of a push job of tiny-qwen3 over NIXL, in a process of its own: prepares epoch 0
    with ``delta_anchor_every=anchor`` and prints ``REFUSED <error>`` or ``PREPARED``. Every
    connection to the peer's agent is refused, as a loaded host's UCX listener refuses some: the
    settings must be checked from the published endpoint, before connecting."""
    import torch

    from weightsync.configs import load_spec
    from weightsync.job.channel import JobChannel
    from weightsync.layout import parse_layout
    from weightsync.plan import build_plan
    from weightsync.transport import TransportContext, TransportError, TransportOptions
    from weightsync.transport.nixl.agent import NixlAgent
    from weightsync.transport.nixl.push import NixlPushTransport

    def refused(self, metadata, *, label, deadline=None):
        raise TransportError(f"{self.who}: cannot load the NIXL metadata of {label}: connect(...) failed")

    NixlAgent.connect = refused  # type: ignore[method-assign]
    layouts = parse_layout("hf").all_rank_layouts(load_spec("tiny-qwen3"))
    plan = build_plan(layouts, layouts)
    ctx = TransportContext(channel=JobChannel(DirectoryMeta(Path(directory)), role=role, rank=0), num_writers=1,
                           num_readers=1, options=TransportOptions(nixl_mode="push", delta_anchor_every=anchor),
                           tolerates_reader_loss=tolerates)
    with NixlPushTransport(ctx) as side:
        try:
            # the peer process may start seconds later on a loaded host; a refusal comes at once
            side.prepare(plan, {s.name: torch.zeros(s.numel) for s in layouts[0].shards}, epoch=0,
                         deadline=Deadline.after(30))
        except TransportError as exc:
            print("REFUSED " + str(exc).replace("\n", " "), flush=True)
            return
    print("PREPARED", flush=True)


@needs_nixl
@pytest.mark.parametrize("tolerates", [False, True], ids=["all", "quorum"])
def test_push_delta_ranks_refuse_a_peer_without_deltas(tmp_path, tolerates):
    """A delta setting that differs is named from the peer's published endpoint, even when no
    connection to its agent can be made. The writer and the reader in processes of their own, as
    in a job (two agents preparing at once in one process crashed natively, twice in about twenty
    runs of the suite, only late in a worker that had run hundreds of tests). Under a quorum too:
    a push writer goes on only without a reader that is dead, never past a setting that differs."""
    import sys

    from launcher import launch

    here = os.path.dirname(os.path.abspath(__file__))
    for epoch, (writer_anchor, reader_anchor, who) in enumerate(((0, 4, "reader 0: writer 0 sends no changes"),
                                                                 (4, 0, "writer 0: reader 0 takes no changes"))):
        directory = str(tmp_path / str(epoch))
        sides = [launch([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); "
                         "from test_transport_nixl import _prepare_push_side; "
                         f"_prepare_push_side({directory!r}, {role!r}, {anchor}, {tolerates})"],
                        env={**os.environ, "NIXL_LOG_LEVEL": "WARN"})
                 for role, anchor in (("writer", writer_anchor), ("reader", reader_anchor))]
        try:
            outputs = [side.communicate(timeout=60) for side in sides]
        finally:  # neither side outlives a failed wait
            for side in sides:
                if side.poll() is None:
                    side.kill()
                    side.wait(30)
        assert all(side.returncode == 0 for side in sides), outputs
        errors = [line[len("REFUSED "):] for out, _ in outputs for line in out.splitlines() if line.startswith("REFUSED ")]
        assert any(e.startswith(who) and e.endswith("set the same TransportOptions.delta_anchor_every on every "
                                                    "rank") for e in errors), outputs


@needs_nixl
def test_loading_a_peers_metadata_is_tried_again_when_its_listener_refuses(monkeypatch):
    """UCX's connect to a peer's listener fails now and then on a loaded host: the load is tried
    again, backing off, and an error names the peer and the tries once they run out."""
    from weightsync.transport import TransportError
    from weightsync.transport.nixl.agent import NixlAgent

    agent = NixlAgent(f"weightsync-test-{os.getpid()}", who="writer 0", loopback=True)
    try:
        calls = []

        def flaky(metadata):
            calls.append(metadata)
            if len(calls) < 3:
                raise agent._errors[0]("loadRemoteMD: error loading connection info")
            return b"peer-agent"

        monkeypatch.setattr(agent._agent, "add_remote_agent", flaky)
        monkeypatch.setattr(agent._agent, "make_connection", lambda name: None)
        assert agent.connect(b"md", label="reader 0", deadline=Deadline.after(10)) == "peer-agent"
        assert len(calls) == 3

        def refused(metadata):
            raise agent._errors[0]("connect failed")

        monkeypatch.setattr(agent._agent, "add_remote_agent", refused)
        with pytest.raises(TransportError, match=r"writer 0: cannot load the NIXL metadata of reader 0 "
                                                 r"\(tried 4 time\(s\)\): .*connect failed"):
            agent.connect(b"md", label="reader 0", deadline=Deadline.after(10))
    finally:
        agent.close()


@needs_nixl
def test_pull_delta_reader_refuses_a_writer_that_publishes_no_changes(tmp_path, monkeypatch):
    import torch

    from weightsync.configs import load_spec
    from weightsync.job.channel import JobChannel
    from weightsync.layout import parse_layout
    from weightsync.plan import build_plan
    from weightsync.transport import TransportContext, TransportError, TransportOptions
    from weightsync.transport.nixl.pull import NixlPullTransport

    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    layouts = parse_layout("hf").all_rank_layouts(load_spec("tiny-qwen3"))
    plan = build_plan(layouts, layouts)
    meta = DirectoryMeta(tmp_path)

    def ctx(role, anchor):
        return TransportContext(channel=JobChannel(meta, role=role, rank=0), num_writers=1, num_readers=1,
                                options=TransportOptions(nixl_mode="pull", delta_anchor_every=anchor))

    tensors = {s.name: torch.zeros(s.numel) for s in layouts[0].shards}
    with NixlPullTransport(ctx("writer", 0)) as w, NixlPullTransport(ctx("reader", 4)) as r:
        w.prepare(plan, tensors, epoch=0, deadline=Deadline.after(10))
        with pytest.raises(TransportError, match=r"reader 0: writer 0 publishes no changes; set the same "
                                                 r"TransportOptions\.delta_anchor_every on every rank"):
            r.prepare(plan, {n: torch.zeros_like(t) for n, t in tensors.items()}, epoch=0, deadline=Deadline.after(10))


@needs_nixl
def test_push_reader_takes_the_version_of_a_writer_that_closed_after_sending_it(tmp_path, monkeypatch):
    """A push writer that sent its last version closes and leaves (tests/_transport_worker.py's
    writers do). Its notification arrived before it disconnected, but the reader may take it
    late: here it arrives while the reader applies the other writer's changes, as on a loaded
    host. READing the gone writer's liveness word then fails (NIXL_ERR_REMOTE_DISCONNECT); the
    reader must take the version, not report "writer 1 died or disconnected" (which CI saw once
    in test_transport_delta's nixl-push case)."""
    import threading

    import torch

    from weightsync.configs import load_spec
    from weightsync.job.channel import JobChannel
    from weightsync.layout import parse_layout
    from weightsync.plan import build_plan
    from weightsync.tools.torch_layout import allocate, fill_from_canonical
    from weightsync.transport import TransportContext, TransportOptions
    from weightsync.transport.nixl.push import NixlPushTransport

    monkeypatch.setenv("NIXL_LOG_LEVEL", "ERROR")
    spec = load_spec("tiny-qwen3")
    writers, readers = parse_layout("megatron:tp=2").all_rank_layouts(spec), parse_layout("hf").all_rank_layouts(spec)
    plan = build_plan(writers, readers)
    meta = DirectoryMeta(tmp_path)

    def make(role, rank):
        return NixlPushTransport(TransportContext(
            channel=JobChannel(meta, role=role, rank=rank), num_writers=2, num_readers=1,
            options=TransportOptions(nixl_mode="push", delta_anchor_every=4)))

    generator = torch.Generator().manual_seed(0)
    values = {name: torch.randn(t.shape, generator=generator) for name, t in writers[0].canonical.items()}
    srcs = [allocate(layout) for layout in writers]
    for layout, src in zip(writers, srcs, strict=True):
        fill_from_canonical(layout, src, values)
    dst, want = allocate(readers[0]), allocate(readers[0])
    fill_from_canonical(readers[0], want, values)
    w0, w1, r = make("writer", 0), make("writer", 1), make("reader", 0)
    threads = [threading.Thread(target=w.prepare, args=(plan, src), kwargs={"epoch": 0, "deadline": Deadline.after(10)})
               for w, src in ((w0, srcs[0]), (w1, srcs[1]))]
    try:
        for t in threads:
            t.start()
        r.prepare(plan, dst, epoch=0, deadline=Deadline.after(10))
        for t in threads:
            t.join(10)
        take, sent = NixlPushTransport._take, {}

        def last_writer_sends_and_leaves():
            try:
                sent[1] = w1.send(1, deadline=Deadline.after(10)).nbytes
            finally:
                w1.close()

        def slow_take(self, peer, *args, **kwargs):
            if peer.rank == 0:  # writer 1 sends and leaves while the reader applies writer 0's version
                leaver = threading.Thread(target=last_writer_sends_and_leaves)
                leaver.start()
                leaver.join(10)
                time.sleep(0.1)  # past the reader's next liveness probe
            return take(self, peer, *args, **kwargs)

        monkeypatch.setattr(NixlPushTransport, "_take", slow_take)
        first = threading.Thread(target=lambda: sent.update({0: w0.send(1, deadline=Deadline.after(10)).nbytes}))
        first.start()
        received = r.receive(1, deadline=Deadline.after(10))
        first.join(10)
        assert sorted(sent) == [0, 1], "a writer failed to send (its error is printed above)"
        assert received.nbytes == sent[0] + sent[1] == plan.total_bytes
        assert all(torch.equal(dst[n], want[n]) for n in want)
    finally:
        for t in (w0, w1, r):
            t.close()


MOVES = {"pull": {"nixl_mode": "pull"}, "push": {"nixl_mode": "push"},
         "pull-delta": {"nixl_mode": "pull", "delta_anchor_every": 4},
         "push-delta": {"nixl_mode": "push", "delta_anchor_every": 4}}


@needs_nixl
@pytest.mark.parametrize("mode", list(MOVES))
def test_ranks_whose_memory_moves_within_an_epoch_still_exchange_every_version(tmp_path, mode):
    """A trainer may replace its weights' storage between two versions (``param.data = t``, an
    optimizer that swaps buffers), an engine its parameters': SyncSession.arm then re-prepares
    that rank in the same epoch, while its peers stay connected to the agent and memory it
    registered before (a pull reader reads a writer's slots, a push writer WRITEs into readers'
    tensors). Both writers move (at versions 1 and 2) and reader 1 gets new memory (at 2):
    every version must still arrive bitwise, in place."""
    from test_transport_contract import run_scenario

    delta = "delta" in mode
    out = run_scenario(tmp_path, "nixl", options=MOVES[mode], moved_at={"0": [1], "1": [2]},
                       new_memory_at={"1": [2]}, sparse_steps=delta, timeout=15.0)
    out.pop("pids")
    for (role, rank), (code, payload, stderr) in sorted(out.items()):  # readers first: their errors say most
        assert code == 0, f"{role} {rank} failed:\n{stderr[-3000:]}"
        if role == "reader":
            assert "error" not in payload, f"reader {rank}: {payload}"
            assert [r["version"] for r in payload["results"]] == [0, 1, 2]
            for r in payload["results"]:
                assert r["exact"] and r["in_place"], (rank, r)
                assert 0 < r["bytes"] <= r["needed"] if delta else r["bytes"] == r["needed"], (rank, r)


@needs_nixl
def test_a_peer_that_never_published_its_metadata_is_named_dead_when_its_lease_says_so():
    """A stopped or killed writer never publishes its NIXL metadata: the reader's error names it
    dead, with what the job knows of it, not only that the metadata is missing."""
    from fake_meta import FakeChannel
    from weightsync.transport import TransportContext, TransportError
    from weightsync.transport.nixl.pull import NixlPullTransport

    channel = FakeChannel("reader", 0)
    ctx = TransportContext(channel=channel, num_writers=2, num_readers=1)  # type: ignore[arg-type]
    side = NixlPullTransport(ctx)
    side._agent = object()  # type: ignore[assignment]  # never reached: the endpoint is missing
    with pytest.raises(TransportError, match=r"writer 1 did not publish its NIXL metadata for epoch 0 in time "
                                             r"\(is it running with transport 'nixl'\?\)"):
        side._connect_peer(0, "writer", 1, Deadline.after(0.05))
    channel.dead = {1: "pid 41 on n0, last heartbeat 3.0 s ago: the meta server's lease of it (ttl 2 s) expired"}
    with pytest.raises(TransportError, match=r"writer 1 did not publish its NIXL metadata for epoch 0 in time "
                                             r"\(writer 1 is dead: pid 41 on n0, last heartbeat 3.0 s ago"):
        side._connect_peer(0, "writer", 1, Deadline.after(0.05))


@contextlib.contextmanager
def _push_pair(tmp_path, monkeypatch, *, tolerates_reader_loss: bool):
    """One push writer and two readers of tiny-qwen3 (``vllm:tp=1,replicas=2``) in this process,
    prepared in epoch 0: (writer, readers, the readers' tensors, what they must hold); closed after."""
    from weightsync.configs import load_spec
    from weightsync.job.channel import JobChannel
    from weightsync.layout import parse_layout
    from weightsync.plan import build_plan
    from weightsync.tools.torch_layout import allocate, fill_from_canonical
    from weightsync.transport import TransportContext, TransportOptions
    from weightsync.transport.nixl.push import NixlPushTransport

    monkeypatch.setenv("NIXL_LOG_LEVEL", "ERROR")
    spec = load_spec("tiny-qwen3")
    writers = parse_layout("megatron:tp=1").all_rank_layouts(spec)
    readers = parse_layout("vllm:tp=1,replicas=2").all_rank_layouts(spec)
    plan = build_plan(writers, readers)
    meta = DirectoryMeta(tmp_path)

    def make(role, rank):
        return NixlPushTransport(TransportContext(
            channel=JobChannel(meta, role=role, rank=rank), num_writers=1, num_readers=2,
            options=TransportOptions(nixl_mode="push"), tolerates_reader_loss=tolerates_reader_loss))

    generator = torch.Generator().manual_seed(0)
    values = {name: torch.randn(t.shape, generator=generator) for name, t in writers[0].canonical.items()}
    src = allocate(writers[0])
    fill_from_canonical(writers[0], src, values)
    dsts, want = [allocate(layout) for layout in readers], allocate(readers[0])
    fill_from_canonical(readers[0], want, values)
    w, rs = make("writer", 0), [make("reader", 0), make("reader", 1)]
    try:
        ready, _ = _started(lambda: w.prepare(plan, src, epoch=0, deadline=Deadline.after(10)))
        for r, dst in zip(rs, dsts, strict=True):
            r.prepare(plan, dst, epoch=0, deadline=Deadline.after(10))
        ready.join(10)
        yield w, rs, dsts, want
    finally:
        for t in (w, *rs):
            t.close()


def _started(call) -> tuple[threading.Thread, dict]:
    """``call()`` running in a thread, and where its result lands (``"result"``) once it returns."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=call()))
    thread.start()
    return thread, out


@needs_nixl
def test_a_push_writer_serves_readers_in_the_order_they_ask_so_a_slow_one_holds_back_no_other(tmp_path, monkeypatch):
    """A push writer WROTE to its readers in turn, waiting for each to ask: reader 1, ready at
    once, waited for reader 0, here until its 5 s deadline (issue 36: "one slow reader holds back
    the others"). It now takes its bytes while reader 0 has not asked yet."""
    with _push_pair(tmp_path, monkeypatch, tolerates_reader_loss=False) as (w, (r0, r1), dsts, want):
        writing, sent = _started(lambda: w.send(1, deadline=Deadline.after(20)))
        started = time.monotonic()
        r1.receive(1, deadline=Deadline.after(5))  # reader 0 has not asked yet
        assert time.monotonic() - started < 3.0
        r0.receive(1, deadline=Deadline.after(10))
        writing.join(10)
        assert "result" in sent, "the writer failed (its error is printed above)"
        assert all(torch.equal(dst[n], want[n]) for dst in dsts for n in want)


@needs_nixl
@pytest.mark.parametrize("tolerates", [False, True], ids=["all", "quorum"])
def test_a_push_writer_gives_a_reader_that_never_asks_up_only_under_a_quorum(tmp_path, monkeypatch, tolerates):
    """Reader 0 never asks for version 1. Under ``all`` the writer's send fails at its deadline,
    naming it; under a quorum (or a fraction) it returns once reader 1 has its bytes, and the
    policy decides the write from the readers' reports."""
    from weightsync.transport import TransportError

    with _push_pair(tmp_path, monkeypatch, tolerates_reader_loss=tolerates) as (w, (_, r1), dsts, want):
        reading, got = _started(lambda: r1.receive(1, deadline=Deadline.after(10)))
        if tolerates:
            w.send(1, deadline=Deadline.after(2.0))
        else:
            with pytest.raises(TransportError, match=r"writer 0: reader 0 did not ask for version 1 phase 0 in time "
                                                     r"\(its last request was nothing\)"):
                w.send(1, deadline=Deadline.after(2.0))
        reading.join(10)
        assert "result" in got, "reader 1 failed (its error is printed above)"
        assert all(torch.equal(dsts[1][n], want[n]) for n in want)


@needs_nixl
def test_a_push_reader_that_asks_for_a_version_its_writer_already_sent_without_it_fails_at_once(tmp_path,
                                                                                               monkeypatch):
    """Under a quorum the writer sent version 1 to reader 1 and went on without reader 0, which
    asks for it only then (as a reader restarted after the writer's last version does). Reader 0
    waited until its timeout (20 s in the fault tests), missing the versions written meanwhile;
    it fails at once now, naming the writer, since the writer's own word says it sent version 1."""
    from weightsync.transport import TransportError

    with _push_pair(tmp_path, monkeypatch, tolerates_reader_loss=True) as (w, (r0, r1), _, _):
        reading, _ = _started(lambda: r1.receive(1, deadline=Deadline.after(10)))
        w.send(1, deadline=Deadline.after(1.0))  # gives reader 0 up at its deadline
        reading.join(10)
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"reader 0: writer 0 sent version 1 without this reader, so version 1 "
                                                 r"will not come from it"):
            r0.receive(1, deadline=Deadline.after(10))
        assert time.monotonic() - started < 2.0
