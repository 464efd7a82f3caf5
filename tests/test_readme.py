"""The README's snippets run as written: every ``python`` block, and the ``weightsync plan`` command.

Each runs in a fresh interpreter (a subprocess with a timeout) from an empty directory, so a
snippet that relies on anything not in it fails here before a new user finds out.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest

from launcher import run as run_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TIMEOUT = 180.0


def blocks(language: str) -> list[str]:
    with open(README) as f:
        text = f.read()
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.S | re.M)


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_META")}
    out["OMP_NUM_THREADS"] = "1"
    return out


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_block_runs(index, tmp_path):
    code = blocks("python")[index]
    proc = run_process([sys.executable, "-c", code], cwd=str(tmp_path), env=env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_readme_has_a_runnable_python_block():
    assert blocks("python"), "the README lost its usage example"


def test_readme_plan_command_runs_and_reports_the_plan(tmp_path):
    (command,) = [line for block in blocks("bash") for line in [block.replace("\\\n", " ")]
                  if line.lstrip().startswith("weightsync plan")]
    args = shlex.split(command)
    assert args[0] == "weightsync"
    proc = run_process([sys.executable, "-m", "weightsync.cli", *args[1:]], cwd=str(tmp_path), env=env(),
                       timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"writers": 1024' in proc.stdout and '"readers": 256' in proc.stdout
