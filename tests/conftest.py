"""Suite-wide hygiene: shared memory of processes a test killed is swept after each test.

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
