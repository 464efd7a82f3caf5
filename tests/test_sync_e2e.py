"""End to end: WeightWriter / WeightReader processes, a real meta server, every transport.

Each scenario launches real processes (forked by tests/launcher.py, free ports only) and checks the
product's promises: every reader holds exactly the writers' weights after each version
(bitwise), received exactly the bytes it needs, in place; a writer killed mid-transfer
makes the readers fail within their timeout without reporting the version, and the next
version (with the writer restarted) succeeds.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from launcher import launch as launch_process
from weightsync.clock.deadline import Deadline
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


@pytest.mark.parametrize(("transport", "options"), [
    # over gloo, writer 0 can take past two timeouts to fail version 1 under CI's load (the gloo
    # overrun of test_faults.py's _GLOO_FORMATION_OVERRUN): `make test-heavy`; the restarted writer's
    # wait for writer 0 is checked below on shm, and this case runs by default with a slow restart
    pytest.param("torch", {}, id="torch", marks=pytest.mark.heavy),
    # torch, writer 1's restart coming up only after writer 0 reached version 2's rendezvous:
    # writer 0 waits there for it (it gave version 2 up at once, since writer 1's lease had
    # expired, and the restart then waited for a version 2 no one wrote; 1 run in 4 under load)
    pytest.param("torch", {"start_delay": 6.0}, id="torch-slow-restart"),
    pytest.param("shm", {}, id="shm"),
    pytest.param("nixl", {"nixl_mode": "pull"}, id="nixl-pull"),
    # pull, writer 1's restart coming up only after writer 0 started version 2: writer 0 waits for
    # it (it had given version 2 up at once and closed its memory, which the restart's part then
    # completed, and readers failed: "remote agent ... was disconnected", seen in CI)
    pytest.param("nixl", {"nixl_mode": "pull", "start_delay": 6.0}, id="nixl-pull-slow-restart"),
    # push: writer 0's WRITEs of version 1 land, and its wait for readers ends when they report
    # failing version 1 (a failed reader is done with that version)
    pytest.param("nixl", {"nixl_mode": "push"}, id="nixl-push"),
])
def test_writer_killed_mid_transfer_then_next_version_succeeds(transport, options):
    if unavailable_reason(transport):
        pytest.skip(unavailable_reason(transport))
    timeout = 20.0  # generous: the restarted writer must import torch on a loaded 2-core machine
    options = dict(options)
    start_delay = options.pop("start_delay", 0.0)
    common = {"source": "megatron:tp=2", "target": "vllm:tp=1,replicas=2", "num_writers": 2, "num_readers": 2,
              "transport": transport, "config": "tiny-qwen3-moe", "timeout": timeout,
              "transport_options": options}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1, 2], **common),
                 ("writer", 1): launch(server, "writer", 1, versions=[0, 1], die_at=1, **common)}
        # each reader updates until it holds version 2 (three updates, or two when nixl pull skips 1)
        procs |= {("reader", r): launch(server, "reader", r, until=2, **common) for r in range(2)}
        first = procs.pop(("writer", 1))
        first.wait(timeout * 4)
        assert first.returncode == 3  # died part-way through version 1
        procs[("writer", 1)] = launch(server, "writer", 1, versions=[2], start_delay=start_delay, **common)  # restarted
        out = finish(procs, timeout * 6)
    for rank in range(2):
        code, records, stderr = out[("reader", rank)]
        assert code == 0, stderr[-3000:]
        if options.get("nixl_mode") == "pull" and records[1]["ok"]:
            # nixl pull: version 1 was never published (writer 1 died before it published), and
            # when the restarted writer 1 comes back within the reader's timeout, the reader's
            # next update takes version 2, the newest, without a failure on the way
            ok0, ok2 = records
            assert ok0["ok"] and ok0["exact"] and ok0["version"] == 0
            assert ok2["ok"] and ok2["exact"] and ok2["version"] == 2, (out, stderr[-3000:])
            continue
        ok0, failed, ok2 = records
        assert ok0["ok"] and ok0["exact"] and ok0["version"] == 0
        assert not failed["ok"]
        assert failed["seconds"] < timeout + 5
        if transport in ("torch", "shm") or options.get("nixl_mode") == "push":
            # torch and nixl push: bytes were arriving; shm: writers publish before packing and
            # readers copy while they pack. Either way the engine knows it is not at a valid version,
            assert failed["weight_version"] is None
            assert failed["reported"] is None  # and the meta server was told so
        elif failed["weight_version"] is None:
            # nixl pull, on a loaded machine: writer 0 learns of writer 1's death within seconds and
            # moves on to version 2 beside the restarted writer 1; a reader that began pulling an
            # attempt that then failed says its engine holds no valid version, as above
            assert failed["reported"] is None, failed
        else:  # nixl pull: version 1 was never published, so nothing was touched
            assert failed["weight_version"] == 0 and failed["reported"] == 0, failed
            assert "no version newer than 0" in failed["error"]
        assert ok2["ok"] and ok2["exact"] and ok2["version"] == 2, (out, stderr[-3000:])
    code, records, stderr = out[("writer", 1)]
    assert code == 0 and records[-1]["ok"], stderr[-3000:]


def test_a_restarted_writer_waits_for_writer_0_to_be_done_with_the_version_its_predecessor_died_in(tmp_path):
    """Writer 1 dies in version 1 and restarts at once to write version 2; writer 0 reaches
    version 2 only after more than one timeout (here it is held; in CI, failing version 1 on
    its transport's timeout did it). The restarted writer waits for it, as it would for a slow
    trainer step, and version 2 completes everywhere. (Before a restarted writer's first write
    waited one more timeout for writer 0, it failed: "writer 0 did not start version 2 in epoch 0
    or later in time", as CI saw in the torch case of the test above.)"""
    timeout = 6.0
    flags = tmp_path / "flags"
    flags.mkdir()
    common = {"source": "megatron:tp=2", "target": "vllm:tp=1,replicas=2", "num_writers": 2, "num_readers": 2,
              "transport": "shm", "config": "tiny-qwen3-moe", "timeout": timeout}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1, 2], pause_before=2, flag_dir=str(flags),
                                       **common)}
        procs |= {("reader", r): launch(server, "reader", r, versions=[0, 1, 2], **{**common, "timeout": 60.0})
                  for r in range(2)}
        first = launch(server, "writer", 1, versions=[0, 1], die_at=1, **common)
        first.wait(timeout * 8)
        assert first.returncode == 3  # died part-way through version 1
        procs[("writer", 1)] = launch(server, "writer", 1, versions=[2], **common)
        deadline = Deadline.after(timeout * 8)
        while not (flags / "held").exists():  # writer 0 failed version 1 and holds before version 2
            assert not deadline.expired, "writer 0 never reached version 2"
            time.sleep(0.1)
        time.sleep(timeout * 1.5)  # more than the restarted writer's own timeout
        (flags / "go").touch()
        out = finish(procs, timeout * 10)
    code, records, stderr = out[("writer", 1)]
    assert code == 0 and [(r["version"], r["ok"]) for r in records] == [(2, True)], (records, stderr[-3000:])
    for rank in range(2):
        code, records, stderr = out[("reader", rank)]
        assert code == 0 and records[-1]["version"] == 2 and records[-1]["ok"] and records[-1]["exact"], (
            records, stderr[-3000:])


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


#: on torch, shm and file, test_faults.py's SIGKILL case runs this scenario in the default run
_IN_FAULTS = pytest.mark.heavy


@pytest.mark.parametrize(("transport", "options"), [
    pytest.param("torch", {}, id="torch", marks=_IN_FAULTS),
    pytest.param("shm", {}, id="shm", marks=_IN_FAULTS),
    pytest.param("file", {}, id="file", marks=_IN_FAULTS),
    pytest.param("nixl", {"nixl_mode": "pull"}, id="nixl-pull"),
    pytest.param("nixl", {"nixl_mode": "push"}, id="nixl-push"),
])
def test_writer_killed_in_a_version_restarts_and_writes_it_again(transport, options):
    """Killed in V, restarted, writes V again: that attempt of V completes, bitwise, everywhere.

    As torchrun does, every writer restarts (from the trainer's checkpoint of V-1) and writes V
    again while the readers carry on; readers that failed V take the new attempt of V,
    published in a newer epoch."""
    if unavailable_reason(transport):
        pytest.skip(unavailable_reason(transport))
    timeout = 20.0
    common = {"source": "megatron:tp=2", "target": "vllm:tp=1,replicas=2", "num_writers": 2, "num_readers": 2,
              "transport": transport, "config": "tiny-qwen3-moe", "timeout": timeout,
              "transport_options": options}
    with EmbeddedMetaServer() as server:
        procs = {("writer", 0): launch(server, "writer", 0, versions=[0, 1], **common),
                 ("writer", 1): launch(server, "writer", 1, versions=[0, 1], die_at=1, **common)}
        procs |= {("reader", r): launch(server, "reader", r, until=1, **common) for r in range(2)}
        first = {rank: procs.pop(("writer", rank)) for rank in range(2)}
        for p in first.values():
            p.communicate(timeout=timeout * 4)
        assert first[1].returncode == 3  # died part-way through version 1
        for rank in range(2):  # restarted: both write 1 again
            procs[("writer", rank)] = launch(server, "writer", rank, versions=[1], **common)
        out = finish(procs, timeout * 8)
    for rank in range(2):
        code, records, stderr = out[("writer", rank)]
        assert code == 0 and [(r["version"], r["ok"]) for r in records] == [(1, True)], (out, stderr[-3000:])
    for rank in range(2):
        code, records, stderr = out[("reader", rank)]
        assert code == 0, stderr[-3000:]
        assert records[0]["ok"] and records[0]["exact"] and records[0]["version"] == 0
        last = records[-1]
        assert last["ok"] and last["exact"] and last["version"] == 1, (records, stderr[-3000:])
        assert all(not r["ok"] for r in records[1:-1])  # failures of the killed attempt only
