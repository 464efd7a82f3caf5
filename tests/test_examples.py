"""The examples run and do what they say."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_two_threads_example_syncs_bitwise():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "two_threads.py")], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("reader applied version") == 3
    assert "weights identical: True" in proc.stdout
