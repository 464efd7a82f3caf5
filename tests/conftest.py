"""Suite-wide hygiene: shared memory of processes a test killed is swept after each test, and
no test changes the process (environment, CPU affinity, torch threads) for the tests after it.

(``.ci/run`` checks after the whole suite that no weightsync segment is left at all.)
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(autouse=True)
def sweep_dead_writers_segments():
    yield
    from weightsync.transport.shm_files import sweep_stale_segments

    sweep_stale_segments()


#: variables that shape the ranks a process starts (added ones are leaks; other added ones are
#: libraries' one-time import settings such as TORCHINDUCTOR_CACHE_DIR)
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_RANK_PREFIXES = ("VLLM_", "TORCHELASTIC_", "NCCL_", "GLOO_", "WEIGHTSYNC_")


def _leak(change: str) -> bool:
    if not change.startswith("environment "):
        return True
    key, _, values = change[len("environment "):].partition(": ")
    if key == "PYTEST_CURRENT_TEST":
        return False  # pytest's own
    added = values.startswith("None -> ")
    return not added or key in _RANK_VARIABLES or key.startswith(_RANK_PREFIXES)


@pytest.fixture(autouse=True)
def process_state_unchanged(request):
    """A test leaves this process's environment, CPU affinity and torch threads as it found them
    (what it sets through fixtures is undone by them first): leaks made later tests, and the
    ranks they start, depend on order. A leak fails the test that made it, and is undone."""
    from weightsync.engines.process_state import ProcessState

    before = ProcessState.capture()
    yield
    changed = [c for c in before.differences(ProcessState.capture()) if _leak(c)]
    if changed:
        before.restore()
        pytest.fail(f"{request.node.nodeid} changed the process for later tests: {'; '.join(changed[:6])}",
                    pytrace=False)


#: (fault, transport) -> [injected, survived, hangs] of tests/test_faults.py (see its ``tally``)
FAULT_TABLE: dict[tuple[str, str], list[int]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Count fault-injection outcomes from the call reports (they carry the test's user properties
    from xdist workers to the controller). A hang is a failure on a timeout: every wait is bounded."""
    if report.when != "call" or report.skipped:
        return
    for key, value in report.user_properties:
        if key == "fault":
            fault, transport = str(value).split("|", 1)
            row = FAULT_TABLE.setdefault((fault, transport), [0, 0, 0])
            row[0] += 1
            row[1] += report.passed
            row[2] += report.failed and "Timeout" in str(report.longrepr)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FAULT_TABLE:
        return
    terminalreporter.section("faults injected / survived / hangs")
    terminalreporter.write_line("| fault | transport | injected | survived | hangs |")
    terminalreporter.write_line("|---|---|---|---|---|")
    for (fault, transport), (injected, survived, hangs) in sorted(FAULT_TABLE.items()):
        terminalreporter.write_line(f"| {fault} | {transport} | {injected} | {survived} | {hangs} |")
