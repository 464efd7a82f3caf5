"""Load balancing across replicated sources: integer water-filling and its lower bound.

When several writer ranks hold the same data (data-parallel replicas, norms replicated
over TP, experts replicated over expert-data-parallel groups), the planner chooses who
sends what. Sources are grouped into *holder classes* (the set of ranks holding an atom
of data). Classes are filled smallest first, each pouring its demand onto its currently
least-loaded ranks (water-filling). For nested (laminar) class families, the usual case
for DP x TP x PP x EP grids, this reaches the fractional optimum
``max_S demand(classes within S) / |S|``, which :func:`send_lower_bound` computes.

Everything is integer arithmetic, so every rank computes the same split bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: Passes of re-pouring after the first fill (see :func:`water_fill`); each pass that does not
#: lower the busiest rank's load ends them.
REFINE_PASSES = 8


def water_fill(
    demands: Mapping[tuple[int, ...], int],
) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Split each class's demand over its ranks so the busiest rank is as idle as possible.

    Classes are poured smallest first. For nested classes that is optimal; for classes that
    cross (PP stages of TP ranks whose tied embedding's vocabulary shards pair rank 0 of one
    stage with rank 0 of the other), a class poured early sees ranks that later classes will
    fill, and lands on them: 8-13% over the bound on such a tiny Megatron job. So the fill is
    refined: each class in turn is taken out and poured again onto the others' loads, pass after
    pass, as long as a pass lowers the busiest rank's load (a nested family's first fill is
    optimal, and stays as it is).

    Args:
        demands: holder class (sorted tuple of ranks) -> bytes its atoms must send.

    Returns:
        class -> bytes per rank, aligned with the class tuple; sums equal the demand.
    """
    order = sorted(demands, key=lambda c: (len(c), c))
    loads: dict[int, int] = {}
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    for cls in order:
        _place(cls, _pour([loads.get(r, 0) for r in cls], demands[cls]), loads, out)
    for _ in range(REFINE_PASSES):
        again, moved = dict(out), dict(loads)
        for cls in order:
            for r, a in zip(cls, again[cls], strict=True):
                moved[r] -= a
            _place(cls, _pour([moved[r] for r in cls], demands[cls]), moved, again)
        if not loads or max(moved.values()) >= max(loads.values()):
            break
        out, loads = again, moved
    return out


def _place(cls: tuple[int, ...], alloc: list[int], loads: dict[int, int],
           out: dict[tuple[int, ...], tuple[int, ...]]) -> None:
    for r, a in zip(cls, alloc, strict=True):
        loads[r] = loads.get(r, 0) + a
    out[cls] = tuple(alloc)


def _pour(levels: Sequence[int], amount: int) -> list[int]:
    """Integer amounts raising the lowest ``levels`` evenly by ``amount`` in total."""
    k = len(levels)
    if amount <= 0:
        return [0] * k
    order = sorted(range(k), key=lambda i: (levels[i], i))
    filled = 0  # number of lowest entries being raised together
    below = 0  # sum of their levels
    level = 0
    for m in range(1, k + 1):
        below += levels[order[m - 1]]
        filled = m
        next_level = levels[order[m]] if m < k else None
        # Amount needed to raise the first m entries to next_level.
        if next_level is None or next_level * m - below >= amount:
            level = (amount + below) // m
            break
    remainder = amount + below - level * filled
    alloc = [0] * k
    for j in range(filled):
        i = order[j]
        alloc[i] = level - levels[i] + (1 if j < remainder else 0)
    return alloc


def send_lower_bound(class_bytes: Mapping[tuple[int, ...], int], num_sources: int) -> float:
    """A lower bound on the busiest source's bytes, whatever the assignment.

    For every class ``S``, the bytes of all classes contained in ``S`` can only be sent by
    ranks of ``S``; and some rank sends at least the mean.
    """
    total = sum(class_bytes.values())
    bound = total / num_sources if num_sources else 0.0
    sets = {cls: frozenset(cls) for cls in class_bytes}
    for outer, outer_set in sets.items():
        inside = sum(b for cls, b in class_bytes.items()
                     if len(cls) <= len(outer) and sets[cls] <= outer_set)
        bound = max(bound, inside / len(outer))
    return bound
