"""preserved_process_state: the host process is as before after an in-process engine's changes."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from weightsync.engines.process_state import ProcessState, preserved_process_state


def test_changes_an_in_process_engine_makes_are_named_and_undone():
    before = ProcessState.capture()
    cores = sorted(os.sched_getaffinity(0))
    with preserved_process_state():
        os.environ["WEIGHTSYNC_TEST_LEAK"] = "1"           # what vLLM's CPU worker does, in kind
        os.sched_setaffinity(0, {cores[0]})
        torch.set_num_threads(1)
        torch.set_num_threads = lambda n: None             # vLLM's no-op replacement
        changed = before.differences(ProcessState.capture())
        assert any("WEIGHTSYNC_TEST_LEAK" in c for c in changed)
        assert any("set_num_threads was replaced" in c for c in changed)
        if len(cores) > 1:
            assert any("CPU affinity" in c for c in changed)
    assert before.differences(ProcessState.capture()) == []


def test_ranks_started_after_the_block_inherit_the_original_affinity():
    cores = sorted(os.sched_getaffinity(0))
    with preserved_process_state():
        os.sched_setaffinity(0, {cores[0]})
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == str(cores)
