"""End to end: WeightWriter / WeightReader processes, a real meta server, every transport.

Each scenario launches real processes (forked by tests/launcher.py, free ports only) and checks the
product's promises: every reader holds exactly the writers' weights after each version
(bitwise), received exactly the bytes it needs, in place. Faults (ranks killed, stopped and
restarted) are tests/test_faults.py's matrix.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from launcher import launch as launch_process
from weightsync.layout import parse_layout
from weightsync.meta.client import EmbeddedMetaServer
from weightsync.transport import unavailable_reason

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "_sync_worker.py")


def launch(server, role, rank, **args):
    env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
           "OMP_NUM_THREADS": "1"}
    payload = json.dumps({"role": role, "rank": rank, **args})
    return launch_process([sys.executable, WORKER, payload], env=env)


def finish(procs, timeout):
    out = {}
    try:
        for key, p in procs.items():
            stdout, stderr = p.communicate(timeout=timeout)
            records = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
            out[key] = (p.returncode, records, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return out


def run_job(source, target, *, transport="auto", versions=(0, 1), config="tiny-qwen3-moe", timeout=60.0, **extra):
    src, dst = parse_layout(source), parse_layout(target)
    common = {"source": source, "target": target, "num_writers": src.world_size, "num_readers": dst.world_size,
              "transport": transport, "versions": list(versions), "config": config, "timeout": timeout, **extra}
    with EmbeddedMetaServer() as server:
        procs = {("writer", r): launch(server, "writer", r, **common) for r in range(src.world_size)}
        procs |= {("reader", r): launch(server, "reader", r, **common) for r in range(dst.world_size)}
        return finish(procs, timeout * (len(versions) + 2))


def assert_all_exact(out, versions):
    for (role, rank), (code, records, stderr) in out.items():
        assert code == 0, f"{role} {rank}:\n{stderr[-3000:]}"
        assert [r["version"] for r in records] == list(versions), (role, rank, records, stderr[-2000:])
        for r in records:
            assert r["ok"], r
            if role == "reader":
                assert r["exact"], f"reader {rank} version {r['version']} is not bitwise equal"
                assert r["bytes"] == r["needed"] > 0
                assert r["in_place"]


#: Each layout pair runs once, transports alternating (the contract suite covers every
#: transport on one pair; this covers every pair on a real transport, end to end).
PAIRS = [
    pytest.param("megatron:tp=2", "vllm:tp=1,replicas=2", "torch", id="tp2-to-tp1x2-torch"),
    pytest.param("megatron:tp=2", "vllm:tp=1,replicas=2", "shm", id="tp2-to-tp1x2-shm"),
    pytest.param("hf", "vllm:tp=2", "torch", id="tp1-to-tp2-torch"),
    pytest.param("hf:replicas=2", "vllm:tp=2", "shm", id="dp-replicated-sources-shm"),
    pytest.param("megatron:tp=2,dp=2,ep=2,etp=1", "vllm:tp=2,ep=2", "torch", id="ep-experts-torch"),
    pytest.param("megatron:pp=2", "vllm:tp=1", "shm", id="pp-stages-shm"),
    pytest.param("fsdp:dp=2", "vllm:tp=2", "torch", id="fsdp-to-tp2-torch"),
]


@pytest.mark.parametrize(("source", "target", "transport"), PAIRS)
def test_layout_pairs(source, target, transport):
    out = run_job(source, target, transport=transport)
    assert_all_exact(out, (0, 1))


@pytest.mark.parametrize(("transport", "options"), [
    pytest.param("file", {}, id="file"),
    pytest.param("nixl", {}, id="nixl-auto-push"),  # 2 writers, 2 readers: auto picks push
    pytest.param("nixl", {"nixl_mode": "pull"}, id="nixl-pull"),
])
def test_other_transports_end_to_end(transport, options):
    if unavailable_reason(transport):
        pytest.skip(unavailable_reason(transport))
    out = run_job("megatron:tp=2", "vllm:tp=1,replicas=2", transport=transport, transport_options=options)
    assert_all_exact(out, (0, 1))


def test_readers_reject_a_different_plan():
    src, dst = parse_layout("megatron:tp=2"), parse_layout("vllm:tp=1")
    common = {"source": "megatron:tp=2", "target": "vllm:tp=1", "num_writers": 2, "num_readers": 1,
              "transport": "shm", "config": "tiny-qwen3-moe", "timeout": 15.0, "versions": [0]}
    with EmbeddedMetaServer() as server:
        procs = {("writer", r): launch(server, "writer", r, **common) for r in range(src.world_size)}
        procs[("reader", 0)] = launch(server, "reader", 0, **{**common, "min_split_bytes": 7})
        out = finish(procs, 60)
    del dst
    (record,) = out[("reader", 0)][1]
    assert not record["ok"]
    # the settings that shape the plan are compared when the ranks register, naming the ones that
    # differ among those registered by then (the writers start at the same time: either may be first)
    assert re.match(r"ValueError: reader 0 runs job 'default' with other settings than writer [01] "
                    r"\(min_split_bytes: 7 here, 1048576 there\)", record["error"]), record["error"]
