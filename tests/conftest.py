"""Suite-wide hygiene: shared memory of processes a test killed is swept after each test, and
no test changes the process (environment, CPU affinity, torch threads) for the tests after it.

(``.ci/run`` checks after the whole suite that no weightsync segment is left at all.)
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import time
from typing import Any

import pytest

#: OpenMP threads that wait for work sleep instead of spinning. The suite runs three xdist workers
#: on two cores, each starting ranks and vLLM engines whose torch threads, spinning in every
#: barrier, took the cores the other processes needed. Set before any process (worker, rank or
#: engine) loads torch's OpenMP, which reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def sweep_dead_writers_segments():
    yield
    from weightsync.transport.shm.files import sweep_stale_segments

    sweep_stale_segments()


#: variables that shape the ranks a process starts: adding one is a leak. Other added variables
#: are libraries' one-time import settings (TORCHINDUCTOR_CACHE_DIR); changing or removing any
#: variable is a leak.
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_RANK_PREFIXES = ("VLLM_", "TORCHELASTIC_", "NCCL_", "GLOO_", "WEIGHTSYNC_")


def _comparable(before, now):
    """``now`` without the variables a test may add, and without pytest's own; ``before`` likewise."""
    from dataclasses import replace

    benign = {key for key in now.environ.keys() - before.environ.keys()
              if key not in _RANK_VARIABLES and not key.startswith(_RANK_PREFIXES)} | {"PYTEST_CURRENT_TEST"}
    return (replace(before, environ={k: v for k, v in before.environ.items() if k not in benign}),
            replace(now, environ={k: v for k, v in now.environ.items() if k not in benign}))


@pytest.fixture(autouse=True)
def process_state_unchanged(request):
    """A test leaves this process's environment, CPU affinity and torch threads as it found them
    (what it sets through fixtures is undone by them first): leaks made later tests, and the
    ranks they start, depend on order. A leak fails the test that made it, and is undone."""
    from weightsync.engines.process_state import ProcessState

    before = ProcessState.capture()
    yield
    expected, now = _comparable(before, ProcessState.capture())
    changed = expected.differences(now)
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


def _seed_torch(seed: int) -> None:
    """What deepspeed's seeder for pytest-randomly does beyond random and numpy (which
    pytest-randomly seeds itself): torch's generator, once a test module has imported torch."""
    import sys

    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed % 2**63)


def pytest_configure(config: pytest.Config) -> None:
    """``make test-fast`` (``-m fast``) draws fewer examples per property (tests/budget.py).

    pytest-randomly loads every package's ``pytest_randomly.random_seeder`` entry point at the
    start of each process, and deepspeed declares one: importing deepspeed took 3.8 s of CPU in the
    controller and in every xdist worker, before any test. Its seeder is replaced by what it
    does beyond pytest-randomly's own seeding (``_seed_torch``)."""
    import pytest_randomly
    from hypothesis import settings

    import budget

    pytest_randomly.entrypoint_reseeds = [_seed_torch]

    budget.FAST = (config.getoption("markexpr") or "").strip() == "fast"
    if budget.FAST:  # properties that name no count of their own draw hypothesis's default (100)
        settings.register_profile("fast", max_examples=budget.examples(100))
        settings.load_profile("fast")
    _collect_once_at_exit(config)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        atexit.register(_end_worker_unfinalized)  # registered before the tests': it runs after theirs


#: how many full garbage collections pytest runs as each process ends (tests/test_tiers.py checks it)
EXIT_COLLECTIONS = 1


def _end_worker_unfinalized() -> None:
    """End an xdist worker once every exit handler ran, without tearing down its interpreter.

    A worker that imported vLLM, transformers, Ray or mypy's build took up to 7 s here to free its
    heap object by object after its last test, and the controller waits for every worker to end
    (``make test-fast`` ended 7-9 s after its last test). Nothing a test needs happens there: the
    tests' own teardowns and the exit handlers (shared memory, servers, processes) have run, the
    worker's results went to the controller over its channel, and the controller does not read a
    worker's exit status. Registered in ``pytest_configure``, it runs after every handler registered
    once the tests began (multiprocessing's, weakref finalizers', torch's); of those registered
    before it, logging's is run here and execnet's concerns only a controller."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _collect_once_at_exit(config: pytest.Config) -> None:
    """pytest's unraisable-exception plugin runs ``gc.collect()`` five times as each process ends
    (a constant from Trio), then reports what ``__del__`` methods raised. A worker that imported
    vLLM, transformers or mypy's build holds millions of objects, and each collection took 1-2.4 s
    here: up to 12 s per worker at the end of ``make test-fast``, which the controller waits for.
    One collection still finalizes every cycle unreachable by then; only garbage that a finalizer
    itself leaves behind would need another pass."""
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:  # another pytest: its own default
        return
    config.stash[gc_collect_iterations_key] = EXIT_COLLECTIONS


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests of an xdist group named ``vllm...`` start vLLM in this worker (an engine, or a model
    built to read its layout): vLLM inspects model classes in this process from then on
    (tests/vllm_in_process.py), instead of a fresh process per architecture."""
    group = item.get_closest_marker("xdist_group")
    name = str(group.args[0] if group.args else group.kwargs.get("name", "")) if group else ""
    if name.startswith("vllm") and importlib.util.find_spec("vllm") is not None:
        from vllm_in_process import inspect_models_here

        inspect_models_here()


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """A run of one tier (``-m fast``, ``-m unit``, ...) skips the other tiers' test files unread."""
    from tiers import may_select

    name = collection_path.name
    if not (name.startswith("test_") and name.endswith(".py")):
        return None
    return None if may_select(name, config.getoption("markexpr") or "") else True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its file's tier (tests/tiers.py), and ``fast`` for `make test-fast`."""
    from tiers import is_fast, tier_of

    for item in items:
        name = item.path.name
        item.add_marker(tier_of(name))
        if is_fast(name, item.name, stack=item.get_closest_marker("stack") is not None):
            item.add_marker("fast")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """With ``WEIGHTSYNC_TEST_TIMELINE=FILE``, append one JSON line per test (its xdist worker, start
    and end on the wall clock) to FILE: where a run's time went, and which worker waited on which
    group at the end (docs/benchmarks.md, "Where the suite's time went")."""
    path = os.environ.get("WEIGHTSYNC_TEST_TIMELINE")
    start = time.time()
    yield
    if path:
        line = json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid,
                           "start": start, "end": time.time()})
        with open(path, "a") as f:
            f.write(line + "\n")
