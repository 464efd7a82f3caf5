"""Suite-wide hygiene: shared memory of processes a test killed is swept after each test.

(``.ci/run`` checks after the whole suite that no weightsync segment is left at all.)
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def sweep_dead_writers_segments():
    yield
    from weightsync.transport.shm_files import sweep_stale_segments

    sweep_stale_segments()
