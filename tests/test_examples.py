"""The examples run and do what they say."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher import run as run_process

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_two_threads_example_syncs_bitwise():
    proc = run_process([sys.executable, os.path.join(ROOT, "examples", "two_threads.py")], timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("reader applied version") == 3
    assert "weights identical: True" in proc.stdout


def test_async_grpo_example_runs_sync_and_async_with_the_staleness_bound():
    pytest.importorskip("transformers")
    proc = run_process([sys.executable, os.path.join(ROOT, "examples", "async_grpo.py"), "--steps", "3"],
                       timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    assert [(r["mode"], r["staleness"]) for r in results] == [("sync", 0), ("async", 1)]
    for r in results:
        assert r["samples"] == 3 * 16 and r["samples_per_s"] > 0
        assert r["max_version_lag"] <= r["staleness"]  # every batch generated within the bound
        assert r["staging_bytes"] > 0
    assert "async/sync samples/s ratio" in proc.stdout


def test_agent_rollouts_example_resumes_every_rollout_on_the_surviving_engine_with_its_kv():
    pytest.importorskip("vllm", reason="vllm is not installed")
    proc = run_process([sys.executable, os.path.join(ROOT, "examples", "agent_rollouts.py")], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("resumed at turn 5: e0 -> e1 (engine-died)") == 2, out[-2000:]
    for rollout in ("agent-0", "agent-1"):
        assert f"{rollout}: prompt[80] generated[24]@e0/v1 tool[4] generated[24]@e0/v1 tool[4] generated[24]@e1/v1" in out
    # e0 computed the KV of 131 tokens per rollout (80 + 24 + 4 + 24, less the last): 4 full blocks of 32, saved by e0,
    # loaded by e1 (the ledger and e1's Prometheus counters agree), then dropped when the rollouts finished
    assert "KV store: 8 blocks saved, 8 loaded by the resuming engine, 8 dropped when the rollouts finished, " \
           "0 bytes left" in out
    assert "e1's vllm:weightsync_kv_* metrics: 8 blocks loaded" in out and ", 0 missed" in out


@pytest.mark.ray
@pytest.mark.xdist_group("ray")
@pytest.mark.heavy  # 80 s of Ray actors and a meta-server actor: `make test-heavy` (test_ray_multinode runs by default)
def test_ray_grpo_example_trains_on_ray_actors_within_the_staleness_bound():
    pytest.importorskip("ray", reason="needs ray (pip install 'weightsync[ray]')")
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ray_grpo.py"), "--steps", "3"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["steps"] == 3 and result["max_version_lag"] <= result["staleness"] == 1
    assert proc.stdout.count("written") == 3
