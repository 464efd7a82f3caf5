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
