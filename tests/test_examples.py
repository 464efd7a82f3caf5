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
