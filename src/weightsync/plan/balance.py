"""Load balancing across replicated sources: integer water-filling and its lower bound.

When several writer ranks hold the same data (data-parallel replicas, norms replicated
over TP, experts replicated over expert-data-parallel groups), the planner chooses who
sends what. Sources are grouped into *holder classes* (the set of ranks holding an atom
of data). Classes are filled smallest first, each pouring its demand onto its currently
least-loaded ranks (water-filling). For nested (laminar) class families, the usual case
for DP x TP x PP x EP grids, this reaches the fractional optimum
``max_S demand(classes within S) / |S|`` over sets ``S`` of ranks, which
:func:`send_lower_bound` computes exactly (minimum cuts, by networkx);
for classes that cross, the refined fill comes close to it.

Everything is integer arithmetic, so every rank computes the same split bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction

import networkx as nx
from networkx.algorithms import flow

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
    """The least the busiest of ``num_sources`` sources can send, over every fractional split.

    The fractional optimum ``max_S D(S) / |S|`` over sets ``S`` of source ranks, ``D(S)`` the
    bytes of the classes whose ranks all lie in ``S``: only ranks of ``S`` can send those, so one
    of them sends at least their mean; and some fractional split of each class over its ranks
    reaches the bound (max-flow min-cut); a split in whole bytes sends no less. ``S`` = all
    sources gives the mean. For nested classes the densest ``S`` is one class or all sources, but
    for classes that cross it may be a union of classes and no class: Megatron TP 2 x PP 3 with
    tied embeddings, whose vocabulary halves pair a rank of stage 0 with one of stage 2, has
    stages 0 and 2 together as its densest set; no single class is denser than the mean there,
    10% under it (tests/test_planner.py).

    Computed exactly (rational arithmetic) on each connected component of the classes by
    :func:`_densest`: 1T's 1,168 classes over 1,024 ranks take 0.31-0.39 s (networkx's
    Dinitz; statistics only, never at job start).

    Args:
        class_bytes: holder class (sorted tuple of ranks) -> bytes its atoms must send.
        num_sources: how many source ranks there are (ranks in no class included).
    """
    demands = {cls: b for cls, b in class_bytes.items() if b > 0}
    best = Fraction(sum(demands.values()), num_sources) if num_sources else Fraction(0)
    for component in _components(demands):
        best = max(best, _densest(component))
    return float(best)


def _components(demands: Mapping[tuple[int, ...], int]) -> list[dict[tuple[int, ...], int]]:
    """The classes grouped by connected component (classes sharing a rank are connected).

    The densest set lies in one component: a set spread over several has at most the density of
    its densest part, since no class spans two components.
    """
    ranks = nx.Graph()
    for cls in demands:
        nx.add_path(ranks, cls)  # one class's ranks, connected (a class of one rank: a node)
    component = {r: i for i, ranks_of in enumerate(nx.connected_components(ranks)) for r in ranks_of}
    groups: dict[int, dict[tuple[int, ...], int]] = {}
    for cls, b in demands.items():
        groups.setdefault(component[cls[0]], {})[cls] = b
    return list(groups.values())


def _densest(demands: Mapping[tuple[int, ...], int]) -> Fraction:
    """``max_S D(S) / |S|`` over sets ``S`` of the ranks of one component, exactly.

    Dinkelbach's iteration: from a density ``x`` no greater than the optimum (the component's
    mean, or a class's own bytes over its ranks), a minimum cut (:func:`_denser_set`) finds a set
    denser than ``x`` or proves there is none; each set found is strictly denser, and in
    practice one to four cuts end it (one per component at 1T). Ranks in exactly the same classes (data-parallel
    replicas) are one node of the network, weighing their number: the densest set holds all of
    them or none (one without the others completes no class, and only dilutes the set).
    """
    classes = list(demands)
    if len(classes) == 1:
        return Fraction(demands[classes[0]], len(classes[0]))
    holders: dict[int, list[int]] = {}
    for i, cls in enumerate(classes):
        for r in cls:
            holders.setdefault(r, []).append(i)
    twins: dict[tuple[int, ...], int] = {}
    for held in holders.values():
        key = tuple(held)
        twins[key] = twins.get(key, 0) + 1
    weight = list(twins.values())
    class_nodes: list[list[int]] = [[] for _ in classes]
    for j, held_by in enumerate(twins):
        for i in held_by:
            class_nodes[i].append(j)
    demand = [demands[cls] for cls in classes]
    density = max(Fraction(sum(demand), sum(weight)), *(Fraction(demand[i], len(c)) for i, c in enumerate(classes)))
    while True:
        chosen = _denser_set(demand, class_nodes, weight, density)
        if chosen is None:
            return density
        inside = sum(d for d, nodes in zip(demand, class_nodes, strict=True) if all(chosen[j] for j in nodes))
        density = Fraction(inside, sum(w for w, c in zip(weight, chosen, strict=True) if c))


def _denser_set(demand: Sequence[int], class_nodes: Sequence[Sequence[int]], weight: Sequence[int],
                density: Fraction) -> list[bool] | None:
    """A set of nodes denser than ``density``, or None if there is none.

    The network: source -> class ``i`` (capacity ``demand[i]``), class -> each of its nodes
    (unbounded), node ``j`` -> sink (``density x weight[j]``), all scaled by the density's
    denominator to stay integer. A cut keeping classes ``C`` and nodes ``S`` on the source's side
    (every node of a class in ``C`` is in ``S``) costs ``D - D(C) + density x |S|``: a cut under
    ``D`` (a flow that does not carry every class's bytes) is a set with ``D(S) / |S| > density``,
    the source's side of a minimum cut (networkx's, in exact integers).
    """
    p, q = density.numerator, density.denominator
    net = nx.DiGraph()
    for i, d in enumerate(demand):
        net.add_edge("source", ("class", i), capacity=q * d)
        for j in class_nodes[i]:
            net.add_edge(("class", i), ("node", j))  # no capacity: unbounded
    for j, w in enumerate(weight):
        net.add_edge(("node", j), "sink", capacity=p * w)
    cut, (kept, _) = nx.minimum_cut(net, "source", "sink", flow_func=flow.dinitz)
    if cut == q * sum(demand):
        return None
    return [("node", j) in kept for j in range(len(weight))]
