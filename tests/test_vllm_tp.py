"""A tensor-parallel vLLM engine (2 CPU workers, ``mp`` executor) synced through the ``weightsync``
backend by two FSDP trainer ranks (issue 41): each worker receives only the slices its loaders
read, each trainer rank sends only what it holds, and the engine generates what a fresh engine
on the target weights generates.

One engine: started on checkpoint B (its greedy tokens are a fresh engine's on B), synced to
version 1 (seed 1: every tensor differs from B) and version 2 (B's weights, from the trainers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.layout import ModelSpec
from weightsync.tools.tiny import tiny_config, write_checkpoint

HERE = Path(__file__).resolve().parent
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm-tp"),
    pytest.mark.timeout(900),
]


def _worker_bytes(config: dict, t: int) -> int:
    """What TP worker ``t`` reads: vLLM's loaders, recorded (its slice of each sharded tensor,
    the whole of each replicated one)."""
    from weightsync.engines.vllm_layout import record_rank

    return sum(r.numel * 4 for s in record_rank(config, tp=2, rank=t, dtype="float32")
               for r in {(reg.canonical, reg.box): reg for reg in s.regions}.values())


def test_a_tp2_engine_is_synced_by_two_fsdp_ranks_each_worker_receiving_its_slices(tmp_path):
    config = tiny_config()
    write_checkpoint(tmp_path / "B", config, seed=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_tp.py"), "tp-engine", "--checkpoint",
                           str(tmp_path / "B"), "--seeds", "1,2"], capture_output=True, text=True, timeout=840,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    start, one, two = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert one["tokens"] != start["tokens"]  # version 1 (other weights in every tensor) took effect
    assert two["tokens"] == start["tokens"]  # version 2 (B's weights) generates as a fresh engine on B
    assert (one["weight_version"], two["weight_version"]) == ("1", "2")
    model = sum(t.nbytes for t in ModelSpec.from_hf_config(config).canonical_tensors().values())
    reads = [_worker_bytes(config, t) for t in (0, 1)]
    assert model < sum(reads) < 1.1 * model  # the slices make one model, plus the norms on both workers
    for r in (one, two):
        assert all(0 < sent <= held for sent, held in zip(r["sent"], r["held"], strict=True)), r  # no gather
        assert sum(r["sent"]) == model, r  # shared memory: each byte packed once, both workers copy their slices
        assert [r["received"][str(t)] for t in (0, 1)] == reads, r  # each worker received its slices, no more
