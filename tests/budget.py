"""How much each property test draws: every example in ``make test``, a fifth in ``make test-fast``.

The fast tier runs before every commit and must stay within 90 s on two cores; the full counts
run in ``make test`` (and CI) on the same code. A property that fails only on a rare draw is found
there, and the fast tier keeps every property's shape and its shrinking. ``tests/conftest.py`` sets
:data:`FAST` from the run's ``-m`` before any test module is imported.
"""

from __future__ import annotations

#: whether this run is ``make test-fast`` (``-m fast``)
FAST = False
#: the share of the examples the fast tier draws
FAST_SHARE = 5
#: the fewest examples a property draws in the fast tier
FAST_MIN = 10


def examples(full: int) -> int:
    """``full`` examples, or in the fast tier a fifth of them (never fewer than ``FAST_MIN``)."""
    return max(min(full, FAST_MIN), full // FAST_SHARE) if FAST else full
