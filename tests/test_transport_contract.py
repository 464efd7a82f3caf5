"""The transport contract, run against every transport: same scenario, same assertions.

2 writers (Megatron TP2, fp32 master weights) -> 2 readers (vLLM-style TP1 x 2 replicas,
bf16), several versions with changing weights. Every reader must hold exactly the
writers' weights (bitwise, after the sender-side dtype conversion), receive exactly the
bytes it needs, and keep its tensors' storage (in place). A writer that dies makes the
readers fail within their timeout with an error naming it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

from launcher import launch as launch_process
from weightsync.transport import unavailable_reason
from weightsync.transport.shm.files import sweep_stale_segments

HERE = os.path.dirname(__file__)
TRANSPORTS = ["torch", "shm", "shm-zero-copy", "file", "nixl-pull", "nixl-push", "routed"]
#: Contract names of transport variants: (registry name, TransportOptions overrides, worker args).
VARIANTS = {"nixl-pull": ("nixl", {"nixl_mode": "pull"}, {}), "nixl-push": ("nixl", {"nixl_mode": "push"}, {}),
            # trainer weights allocated in /dev/shm: readers copy straight from them
            "shm-zero-copy": ("shm", {}, {"shared_sources": True}),
            # writers and reader 0 on node a, reader 1 on node b: shm to reader 0, gloo to reader 1
            "routed": ("routed", {}, {"nodes": {"writer": ["a", "a"], "reader": ["a", "b"]}})}


def run_scenario(tmp_path, transport, *, versions=3, timeout=30.0, **extra):
    transport, options, worker_args = VARIANTS.get(transport, (transport, {}, {}))
    base = {"transport": transport, "options": options, **worker_args, "config": "tiny-qwen3-moe",
            "source": "megatron:tp=2,dtype=float32",
            "target": "vllm:tp=1,replicas=2,dtype=bfloat16", "source_dtype": "float32",
            "target_dtype": "bfloat16", "versions": versions, "meta_dir": str(tmp_path / "meta"),
            "timeout": timeout, **extra}
    procs = []
    for role in ("writer", "reader"):
        for rank in range(2):
            args = json.dumps({**base, "role": role, "rank": rank})
            procs.append((role, rank, launch_process([sys.executable, os.path.join(HERE, "_transport_worker.py"), args])))
    out = {}
    try:
        for role, rank, p in procs:
            stdout, stderr = p.communicate(timeout=timeout * (versions + 3))
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            out[(role, rank)] = (p.returncode, json.loads(lines[-1]) if lines else None, stderr)
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        # a killed writer cannot unlink its segment itself; every process is reaped, but a child one
        # of them forked may hold the segment's lock a moment longer
        pids, until = {p.pid for _, _, p in procs}, time.monotonic() + 10.0
        while True:
            sweep_stale_segments(min_age=0.0)
            if not own_segments(pids) or time.monotonic() > until:
                break
            time.sleep(0.1)
    out["pids"] = pids
    return out


def own_segments(pids):
    """Segments named by one of ``pids`` (``weightsync-<pid>-...``); other weightsync files, such as a
    rollout KV store's directory, name no process."""
    pids = {str(p) for p in pids}
    return [n for n in os.listdir("/dev/shm") if n.startswith("weightsync-") and n.split("-")[1] in pids]


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    reason = unavailable_reason(VARIANTS.get(request.param, (request.param,))[0])
    if reason:
        pytest.skip(reason)
    return request.param


def test_versions_arrive_bitwise_in_place_with_exact_bytes(tmp_path, transport):
    out = run_scenario(tmp_path, transport, checksum=transport == "torch")
    assert not own_segments(out.pop("pids"))
    for (role, rank), (code, payload, stderr) in out.items():
        assert code == 0, f"{role} {rank} failed:\n{stderr[-3000:]}"
        if transport == "torch":  # staging stays within max_bucket_bytes (the worker's bucket: 64 KiB)
            assert all(0 < r["peak_extra_bytes"] <= 1 << 16 for r in payload["results"]), payload["results"]
        if role == "writer" and transport.startswith("shm"):  # zero-copy: no snapshot slot at all
            extra = [r["peak_extra_bytes"] for r in payload["results"]]
            assert (extra == [0, 0, 0]) if transport == "shm-zero-copy" else all(b > 0 for b in extra), extra
        if role == "reader":
            assert len(payload["results"]) == 3
            for r in payload["results"]:
                assert r["exact"], f"reader {rank} version {r['version']} differs"
                assert r["bytes"] == r["needed"] > 0
                assert r["in_place"]


def test_lora_adapter_versions_arrive_bitwise_over_every_transport(tmp_path, transport):
    """Adapter-only versions (issue 25): two TP ranks of a LoRA adapter (fp32 slices) into two
    readers of the whole adapter (bf16), bitwise, each byte a reader needs once, in place."""
    lora = {"r": 8, "alpha": 16, "tp": 2, "readers": 2}
    out = run_scenario(tmp_path, transport, versions=2, lora=lora)
    assert not own_segments(out.pop("pids"))
    for (role, rank), (code, payload, stderr) in out.items():
        assert code == 0, f"{role} {rank} failed:\n{stderr[-3000:]}"
        if role == "reader":
            assert [r["version"] for r in payload["results"]] == [0, 1]
            for r in payload["results"]:
                assert r["exact"] and r["in_place"], (rank, r)
                assert r["bytes"] == r["needed"] > 0


@pytest.mark.parametrize("carrier", ["torch", "nixl-pull", "nixl-push", "file"])
def test_lora_adapter_deltas_arrive_bitwise(tmp_path, carrier):
    """Adapter-only versions with deltas: ~2% of the adapter's elements move per version, and
    each reader gets version 0 in full, then only what changed, bitwise."""
    transport, options, _ = VARIANTS.get(carrier, (carrier, {}, {}))
    if unavailable_reason(transport):
        pytest.skip(unavailable_reason(transport))
    lora = {"r": 8, "alpha": 16, "tp": 2, "readers": 2}
    out = run_scenario(tmp_path, carrier, versions=3, lora=lora, options={**options, "delta_anchor_every": 4},
                       sparse_steps=True)
    assert not own_segments(out.pop("pids"))
    for (role, rank), (code, payload, stderr) in out.items():
        assert code == 0, f"{role} {rank} failed:\n{stderr[-3000:]}"
        if role == "reader":
            results = payload["results"]
            assert all(r["exact"] and r["in_place"] for r in results), (rank, results)
            assert results[0]["bytes"] == results[0]["needed"]  # the first version: full
            assert all(0 < r["bytes"] < r["needed"] // 4 for r in results[1:]), results


def test_dead_writer_fails_the_readers_within_their_timeout(tmp_path, transport):
    out = run_scenario(tmp_path, transport, versions=2, timeout=8.0, die_at=1, die_rank=1)
    assert not own_segments(out.pop("pids"))  # even the killed writer's segment is gone
    assert out[("writer", 1)][0] == 3
    for rank in range(2):
        code, payload, stderr = out[("reader", rank)]
        assert code == 0, stderr[-2000:]
        if payload.get("error") is None:
            continue  # the reader may not need anything from the dead writer in this plan
        assert payload["error"] in ("TransportError", "TimeoutError")
        assert "writer 1" in payload["message"]
        assert payload["seconds"] < 8.0 + 5.0


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize(("transport", "device", "gpus"), [("shm", "cuda", 1), ("torch", "cuda-per-rank", 4)],
                         ids=["cuda-ipc", "nccl"])
def test_gpu_versions_arrive_bitwise_in_place(tmp_path, transport, device, gpus):
    """The same contract on GPU: CUDA IPC between processes sharing one GPU; NCCL, one GPU per rank."""
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s); this machine has {GPUS}")
    from weightsync.transport.torch.nccl_comm import nccl4py_missing

    if transport == "torch" and (missing := nccl4py_missing()):
        pytest.skip(missing)
    out = run_scenario(tmp_path, transport, device=device, timeout=60.0)
    out.pop("pids")
    for (role, rank), (code, payload, stderr) in out.items():
        assert code == 0, f"{role} {rank} failed:\n{stderr[-3000:]}"
        if role == "reader":
            assert [r["exact"] for r in payload["results"]] == [True] * 3
            assert all(r["bytes"] == r["needed"] > 0 and r["in_place"] for r in payload["results"])


# -- endpoints: every transport's typed record, checked on receipt ------------------------------------------------

def test_every_transports_endpoint_round_trips_and_a_malformed_one_is_named(tmp_path):
    """Each transport's endpoint crosses the job channel as a typed record (msgpack); one of another
    shape fails where it is read, naming the peer, the transport, the epoch and the field."""
    import msgpack

    from fake_meta import DirectoryMeta
    from weightsync.clock.deadline import Deadline
    from weightsync.job.channel import JobChannel
    from weightsync.transport.base import TransportContext, TransportError
    from weightsync.transport.endpoint_wait import peer_endpoint
    from weightsync.transport.endpoints import FileEndpoint, NixlEndpoint, NixlSlots, ShmEndpoint, TorchRendezvous

    meta = DirectoryMeta(str(tmp_path))
    writer = JobChannel(meta, role="writer", rank=1)
    reader = JobChannel(meta, role="reader", rank=0)
    records = [TorchRendezvous("10.0.0.1", 29500), ShmEndpoint("/dev/shm/weightsync-1-ab"), FileEndpoint("/shared/x"),
               NixlEndpoint("pull", b"agent", 4096, "cpu", slots=NixlSlots(8192, 2, 64, b"index")),
               NixlEndpoint("push", b"agent", 4096, "cuda:1", shards={"w": (1 << 40, 512)})]
    for epoch, record in enumerate(records):
        writer.publish_endpoint(epoch, record)
        assert reader.wait_endpoint(type(record), epoch, "writer", 1, deadline=Deadline.after(1)) == record
    assert reader.wait_endpoint(ShmEndpoint, 9, "writer", 1, deadline=Deadline.after(0.05)) is None  # not yet

    meta.put_document("transport/shm/7/writer1", msgpack.packb({"path": 42}))
    with pytest.raises(ValueError, match=r"reader 0: writer 1's shm endpoint for epoch 7 is malformed \(field 'path' "
                                         r"must be a str, not int 42\)"):
        reader.wait_endpoint(ShmEndpoint, 7, "writer", 1, deadline=Deadline.after(1))
    meta.put_document("transport/torch/7/writer1", msgpack.packb({"host": "h", "port": 70000}))
    ctx = TransportContext(channel=reader, num_writers=2, num_readers=1)
    with pytest.raises(TransportError, match=r"torch endpoint for epoch 7 is malformed \(field 'port' must be a TCP"):
        peer_endpoint(ctx, TorchRendezvous, 7, "writer", 1, deadline=Deadline.after(1))
    meta.put_document("transport/nixl/7/writer1", msgpack.packb(NixlEndpoint("push", b"a", 1, "cpu").to_wire()))
    peer = reader.wait_endpoint(NixlEndpoint, 7, "writer", 1, deadline=Deadline.after(1))
    with pytest.raises(ValueError, match="writer 1's nixl endpoint exposes no version slots: is it a pull writer"):
        peer.exposed_slots("writer 1")
