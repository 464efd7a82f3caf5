"""Delta sync on the torch (gloo), NIXL pull and push and file transports: bitwise versions, full on a new base, anchors; and
``delta_anchor_every`` refused, naming the transport, where it would be ignored (issue 23, defect 9).

Each scenario runs 2 writers (megatron tp=2, fp32) and 1 or 2 readers (vLLM tp=1, bf16) as
processes of tests/_transport_worker.py; between versions ~2% of the elements change.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from fake_meta import FakeChannel
from launcher import launch as launch_process
from weightsync.clock.deadline import Deadline
from weightsync.transport import unavailable_reason

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.skipif(bool(unavailable_reason("torch")), reason=str(unavailable_reason("torch")))


#: Transports (and their options) that carry deltas between these processes.
CARRIERS = {"torch": ("torch", {}), "nixl-pull": ("nixl", {"nixl_mode": "pull"}),
            "nixl-push": ("nixl", {"nixl_mode": "push"}), "file": ("file", {})}


def run(tmp_path, *, readers: int, versions: int, anchor: int, timeout: float = 30.0, carrier: str = "torch",
        **extra):
    target = "vllm:tp=1,replicas=2,dtype=bfloat16" if readers == 2 else "vllm:tp=1,dtype=bfloat16"
    transport, options = CARRIERS[carrier]
    if unavailable_reason(transport):
        pytest.skip(str(unavailable_reason(transport)))
    base = {"transport": transport, "options": {"delta_anchor_every": anchor, **options},
            "config": "tiny-qwen3-moe", "source": "megatron:tp=2,dtype=float32", "target": target,
            "source_dtype": "float32", "target_dtype": "bfloat16", "versions": versions,
            "meta_dir": str(tmp_path / "meta"), "timeout": timeout, "sparse_steps": True,
            "checksum": transport == "torch", **extra}
    procs = []
    for role, count in (("writer", 2), ("reader", readers)):
        for rank in range(count):
            args = json.dumps({**base, "role": role, "rank": rank})
            procs.append((role, rank, launch_process([sys.executable, os.path.join(HERE, "_transport_worker.py"), args])))
    out = {}
    try:
        for role, rank, p in procs:
            stdout, stderr = p.communicate(timeout=timeout * (versions + 3))
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            assert p.returncode == 0, f"{role} {rank} failed:\n{stderr[-3000:]}"
            last = json.loads(lines[-1]) if lines else {}
            assert "results" in last, f"{role} {rank} reported {last or 'nothing'}:\n{stderr[-3000:]}"
            out[(role, rank)] = last["results"]
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return out


def _full(results: list[dict]) -> list[bool]:
    for r in results:
        assert r["exact"], f"version {r['version']} differs"
        assert r["in_place"]
        assert 0 < r["bytes"] <= r["needed"]
    return [r["bytes"] == r["needed"] for r in results]


@pytest.mark.parametrize(("carrier", "readers"), [pytest.param("torch", 1, id="torch-1"),
                                                   pytest.param("torch", 2, id="torch-2"),
                                                   pytest.param("nixl-pull", 2, id="nixl-pull"),
                                                   pytest.param("nixl-push", 2, id="nixl-push"),
                                                   pytest.param("file", 2, id="file")])
def test_deltas_arrive_bitwise_and_small_with_anchors(tmp_path, carrier, readers):
    out = run(tmp_path, readers=readers, versions=5, anchor=3, carrier=carrier)
    for rank in range(readers):
        results = out[("reader", rank)]
        # full at 0 and at the anchor 3; the deltas carry a fraction of the bytes
        assert _full(results) == [True, False, False, True, False]
        assert all(r["bytes"] < r["needed"] // 4 for r in results if r["version"] in (1, 2, 4))


@pytest.mark.parametrize("carrier", list(CARRIERS))
def test_reader_with_new_memory_gets_full_versions(tmp_path, carrier):
    """A reader whose destination no longer holds the last version (restart, staging) gets it in full.

    A NIXL push reader keeps the memory its writers WRITE into for the epoch and copies through
    it (nixl_common, "Memory that moves"); one whose memory changed in place is covered by
    tests/test_faults.py's pokes, one that failed a version by
    tests/test_transport_nixl.py::test_push_deltas_write_exactly_the_changes."""
    out = run(tmp_path, readers=2, versions=4, anchor=100, new_memory_at={"1": [2]}, carrier=carrier)
    assert _full(out[("reader", 0)]) == [True, False, False, False]
    assert _full(out[("reader", 1)]) == [True, False, True, False]


def test_delta_is_refused_where_it_would_be_ignored(monkeypatch):
    """On 3ee4748 transports took ``delta_anchor_every`` and sent every version in full; each
    then refused it until it carried deltas (NIXL push last). Every transport carries them now,
    so the refusal is checked on a transport class that says it does not."""
    from weightsync.transport import TransportContext, TransportOptions, check_delta_carried
    from weightsync.transport.nixl.push import NixlPushTransport

    monkeypatch.setattr(NixlPushTransport, "carries_deltas", False)
    name, device, options, words = "nixl", "cpu", {"nixl_mode": "push"}, "the nixl transport (NixlPushTransport, on cpu)"
    for anchor, refused in ((0, False), (4, True)):
        ctx = TransportContext(channel=FakeChannel("writer", 1), num_writers=2,
                               num_readers=2, device=device,
                               options=TransportOptions(delta_anchor_every=anchor, **options))
        if not refused:
            check_delta_carried(name, ctx)
            continue
        with pytest.raises(ValueError) as info:
            check_delta_carried(name, ctx)
        assert str(info.value) == (f"writer 1: delta_anchor_every=4 is not supported by {words}: it would send every "
                                   "version in full. Deltas run over torch (gloo between CPU ranks, NCCL between GPUs), "
                                   "and over shm, nixl, file and routed between CPU ranks; use one of those, or "
                                   "delta_anchor_every=0")


def test_delta_over_nccl_is_taken_and_routed_between_gpus_refused_naming_its_shm_route():
    """NCCL carries deltas (tests/test_nccl_delta.py); the routed transport between GPUs is
    still refused at creation, for its CUDA IPC route (shm deltas need host memory)."""
    from weightsync.transport import TransportContext, TransportOptions, check_delta_carried

    ctx = TransportContext(channel=FakeChannel("writer", 1), num_writers=2,
                           num_readers=2, device="cuda:0", options=TransportOptions(delta_anchor_every=4))
    check_delta_carried("torch", ctx)
    with pytest.raises(ValueError) as info:
        check_delta_carried("routed", ctx)
    assert str(info.value) == ("writer 1: delta_anchor_every=4 over the routed transport needs host memory, but the "
                               "tensors live on cuda:0 (deltas between GPUs run over the torch transport, NCCL); use "
                               "transport='torch', or delta_anchor_every=0")


def test_shm_delta_between_gpus_is_refused():
    from weightsync.transport import TransportContext, TransportOptions
    from weightsync.transport.delta.published import check_delta

    ctx = TransportContext(channel=FakeChannel("reader", 0), num_writers=1,
                           num_readers=1, device="cuda:0", options=TransportOptions(delta_anchor_every=4))
    with pytest.raises(ValueError, match=r"reader 0: delta_anchor_every=4 over the shm transport needs host memory, "
                                         r"but the tensors live on cuda:0"):
        check_delta("shm", ctx)
    with pytest.raises(ValueError, match="needs slots >= 2"):
        check_delta("shm", TransportContext(channel=ctx.channel, num_writers=1, num_readers=1,
                                            options=TransportOptions(delta_anchor_every=4, slots=1)))


def test_nixl_delta_on_gpu_memory_is_refused_in_both_modes():
    from weightsync.transport import TransportContext, TransportOptions
    from weightsync.transport.nixl.pull import NixlPullTransport
    from weightsync.transport.nixl.push import NixlPushTransport

    ctx = TransportContext(channel=FakeChannel("writer", 0), num_writers=1,
                           num_readers=1, device="cuda:0", options=TransportOptions(delta_anchor_every=4))
    for cls, mode in ((NixlPullTransport, "pull"), (NixlPushTransport, "push")):
        with pytest.raises(ValueError, match=rf"writer 0: delta_anchor_every=4 over the nixl \({mode}\) transport "
                                             r"needs host memory, but the tensors live on cuda:0"):
            cls(ctx)


def test_nixl_auto_mode_with_deltas_is_pull():
    """``nixl_mode='auto'`` picks push for as many readers as writers; with deltas it picks pull
    (both modes carry them, but a pull writer publishes its changes once and never waits for
    readers, while a push writer with deltas packs every op and waits for each reader)."""
    from weightsync.transport import TransportContext, TransportOptions, check_delta_carried, transport_class_path

    for anchor, cls in ((0, "NixlPushTransport"), (4, "NixlPullTransport")):
        ctx = TransportContext(channel=FakeChannel("reader", 0), num_writers=2,
                               num_readers=2, options=TransportOptions(delta_anchor_every=anchor))
        check_delta_carried("nixl", ctx)
        assert transport_class_path("nixl", ctx).endswith(f":{cls}")


def test_file_deltas_read_exactly_the_changes_and_old_change_files_go(tmp_path):
    """Deltas over the file transport read exactly the changes (tests/_delta_exact.py), and the
    directory keeps ``slots`` versions, change files included (on main the file transport refused
    deltas at init)."""
    from _delta_exact import delta_pair, run_exact_sequence
    from fake_meta import DirectoryMeta
    from weightsync.job.channel import JobChannel
    from weightsync.transport import TransportContext, TransportOptions
    from weightsync.transport.file.transport import FileTransport

    meta, files = DirectoryMeta(tmp_path / "meta"), tmp_path / "files"

    def make(role, options):
        return FileTransport(TransportContext(channel=JobChannel(meta, role=role, rank=0), num_writers=1,
                                              num_readers=1, options=TransportOptions(file_dir=str(files), **options)))

    with delta_pair(make) as pair:
        run_exact_sequence(pair)
        assert sorted(p.relative_to(files).as_posix() for p in files.rglob("*.safetensors")) == [
            "v6/writer-0.p0.changes.safetensors", "v6/writer-0.p0.safetensors",
            "v7/writer-0.p0.changes.safetensors", "v7/writer-0.p0.safetensors"]
    assert not list(files.rglob("*.safetensors"))


def test_file_delta_reader_refuses_a_writer_that_writes_no_change_files(tmp_path):
    import torch

    from fake_meta import DirectoryMeta
    from weightsync.configs import load_spec
    from weightsync.job.channel import JobChannel
    from weightsync.layout import parse_layout
    from weightsync.plan import build_plan
    from weightsync.transport import TransportContext, TransportError, TransportOptions
    from weightsync.transport.file.transport import FileTransport

    layouts = parse_layout("hf").all_rank_layouts(load_spec("tiny-qwen3"))
    plan = build_plan(layouts, layouts)
    meta, files = DirectoryMeta(tmp_path / "meta"), str(tmp_path / "files")
    w = FileTransport(TransportContext(channel=JobChannel(meta, role="writer", rank=0), num_writers=1, num_readers=1,
                                       options=TransportOptions(file_dir=files)))
    r = FileTransport(TransportContext(channel=JobChannel(meta, role="reader", rank=0), num_writers=1, num_readers=1,
                                       options=TransportOptions(file_dir=files, delta_anchor_every=4)))
    try:
        w.prepare(plan, {s.name: torch.ones(s.numel) for s in layouts[0].shards}, epoch=0, deadline=Deadline.after(10))
        r.prepare(plan, {s.name: torch.zeros(s.numel) for s in layouts[0].shards}, epoch=0, deadline=Deadline.after(10))
        w.send(1, deadline=Deadline.after(5))
        with pytest.raises(TransportError, match=r"^reader 0: writer 0 publishes no changes next to .*v1/writer-0\.p0"
                                                 r"\.safetensors; set the same TransportOptions\.delta_anchor_every "
                                                 "on every rank"):
            r.receive(1, deadline=Deadline.after(5))
    finally:
        w.close()
        r.close()
