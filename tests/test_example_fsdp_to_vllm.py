"""examples/fsdp_to_vllm.py runs: FSDP2 trainers sync every step into a vLLM engine."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp_to_vllm.py"


# CI's budget (45-65 s): `make test-heavy`; FSDP2 trainers in processes of their own sync a vLLM engine
# by default in test_engine_matrix.py::TestMatrix_deepseek_v3::test_cell[engine-fsdp2-full]
@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.xdist_group("vllm-example")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None,
                    reason="needs vllm and transformers (pip install -e '.[vllm]')")
def test_fsdp_to_vllm_example():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "4"], capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[vllm]    step")]
    assert len(lines) == 4 and lines[-1].endswith("weights ['4']"), proc.stdout
    # The engine generates what the trainers' model now generates: the target, learnt by step 4.
    assert "8/8 on target" in lines[-1], proc.stdout
