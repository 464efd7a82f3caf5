"""The tiers' own rules (tests/tiers.py, tests/budget.py, tests/conftest.py): which files a run of
one tier reads, how many examples the fast tier draws, and what every process of the suite runs with."""

from __future__ import annotations

import os

import pytest

import budget
from tiers import TIERS, may_select, tier_of


@pytest.mark.parametrize(("filename", "markexpr", "read"), [
    ("test_leases.py", "fast", True),                # unit
    ("test_transport_contract.py", "fast", True),    # the contract, on one transport
    ("test_transport_nixl.py", "fast", False),       # contract, but not the contract file
    ("test_engine_matrix.py", "fast", False),        # e2e: vLLM's import is not paid
    ("test_faults.py", "faults", True),
    ("test_faults.py", "unit", False),
    ("test_engine_matrix.py", "not heavy", True),    # any other expression reads every file
    ("test_engine_matrix.py", "fast or heavy", True),
    ("test_not_in_a_tier.py", "fast", True),         # read, so that the run names it
])
def test_a_run_of_one_tier_reads_only_that_tiers_files(filename, markexpr, read):
    assert may_select(filename, markexpr) is read


def test_every_file_a_fast_run_reads_holds_fast_tests():
    fast = {f for f in set().union(*TIERS.values()) if may_select(f, "fast")}
    assert fast == TIERS["unit"] | {"test_transport_contract.py"}
    assert all(tier_of(f) in ("unit", "contract") for f in fast)


def test_a_unit_test_that_builds_a_stack_runs_in_make_test_not_in_make_test_fast(request):
    """``pytest.mark.stack`` leaves a test to ``make test``: mypy's build of the tree and megatron-core's
    import cost more CPU than the rest of the fast tier's unit files together (tiers.py)."""
    from tiers import is_fast

    assert is_fast("test_architecture.py", "test_no_import_circle")
    assert not is_fast("test_architecture.py", "test_no_port_is_probed_with_hasattr_or_getattr", stack=True)
    items = {i.name: i for i in request.session.items}
    for name in ("test_no_port_is_probed_with_hasattr_or_getattr",
                 "test_gpt_oss_from_megatron_plans_have_zero_redundancy_and_cover_every_element_once"):
        if name in items:  # collected in this run: marked unit, never fast
            assert items[name].get_closest_marker("unit") and not items[name].get_closest_marker("fast")


def test_the_fast_tier_draws_a_fifth_of_the_examples(monkeypatch):
    monkeypatch.setattr(budget, "FAST", False)
    assert [budget.examples(n) for n in (3, 30, 300, 1000)] == [3, 30, 300, 1000]
    monkeypatch.setattr(budget, "FAST", True)
    assert [budget.examples(n) for n in (3, 30, 300, 1000)] == [3, 10, 60, 200]


def test_every_process_of_the_suite_lets_idle_openmp_threads_sleep():
    """Set before any worker, rank or engine loads torch's OpenMP (it reads the variable once)."""
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_pytest_randomly_reseeds_torch_without_importing_deepspeed():
    import pytest_randomly
    import torch

    assert [f.__module__ for f in pytest_randomly.entrypoint_reseeds or []] == ["conftest"]
    (reseed,) = pytest_randomly.entrypoint_reseeds
    reseed(7)
    first = torch.rand(3)
    reseed(7)
    assert torch.equal(first, torch.rand(3))


def test_each_process_collects_its_garbage_once_as_it_ends(request):
    """pytest's default is five full collections (conftest._collect_once_at_exit says why one)."""
    from _pytest.unraisableexception import gc_collect_iterations_key

    import conftest

    assert request.config.stash[gc_collect_iterations_key] == conftest.EXIT_COLLECTIONS == 1


def test_a_worker_that_crashes_ends_the_run_naming_its_test(tmp_path):
    """With the suite's own options (pyproject.toml: two workers under ``--dist loadgroup``), a worker
    that dies natively fails its test and ends the run. Without ``--max-worker-restart=0`` xdist
    replaced the worker, never gave the replacement work, and the run waited forever."""
    import contextlib
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "test_dies.py").write_text(
        "import os\nimport pytest\n\n\n@pytest.mark.parametrize('i', range(6))\n"
        "def test_one(i):\n    if i == 2:\n        os.abort()\n")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-c", os.path.join(root, "pyproject.toml"), "--rootdir",
                             str(tmp_path), "-n", "2", "-p", "no:randomly", "-p", "no:cacheprovider", "-q",
                             str(tmp_path / "test_dies.py")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:  # a hung run and its workers go with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == 1, out[-2000:]
    assert "crashed while running" in out and "test_one[2]" in out, out[-2000:]
