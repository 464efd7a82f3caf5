"""Phases: a version moved a few whole layers at a time, so a reader's staging stays bounded.

An engine that must run its own loader (vLLM on CPU repacks every linear layer) receives a
version into staging buffers. Moved at once, staging is a whole-model copy; moved in
*phases* of whole decoder layers, each at most ``budget_bytes``, one staging arena of the
largest phase serves them all: the reader receives a phase, hands it to the loader (a layer
is rebuilt as soon as all its tensors arrived), and the next phase lands in the same memory.
Peak staging is ``budget_bytes``, or one layer when a layer alone is larger.

Both sides compute the same phases from the canonical tensors alone, in their canonical
order: tensors before the first layer (embeddings), then layers in ascending order, greedily
packed while they fit, then the rest (final norm, ``lm_head``).

    phases = layer_phases(canonical, budget_bytes=64 << 20)      # tuple of tuples of names
    sub_plans = split_plan(plan, phases)                         # one plan per phase, wire order kept
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from weightsync.layout.types import CanonicalTensor, itemsize
from weightsync.plan.ops import Plan


def layer_index(name: str) -> int | None:
    """The decoder layer a canonical name belongs to: its first integer segment."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def layer_phases(canonical: Mapping[str, CanonicalTensor], *, budget_bytes: int) -> tuple[tuple[str, ...], ...]:
    """Canonical tensors grouped into phases of whole layers (see module docstring)."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    pre: list[str] = []
    post: list[str] = []
    layers: dict[int, list[str]] = {}
    for name in canonical:
        index = layer_index(name)
        if index is None:
            (post if layers else pre).append(name)
        else:
            layers.setdefault(index, []).append(name)

    def nbytes(names: Sequence[str]) -> int:
        return sum(canonical[n].numel * itemsize(canonical[n].dtype) for n in names)

    phases: list[tuple[str, ...]] = [tuple(pre)] if pre else []
    current: list[str] = []
    for index in sorted(layers):
        names = layers[index]
        if current and nbytes(current) + nbytes(names) > budget_bytes:
            phases.append(tuple(current))
            current = []
        current.extend(names)
    if current:
        phases.append(tuple(current))
    if post:
        phases.append(tuple(post))
    return tuple(phases)


def split_plan(plan: Plan, phases: Sequence[Sequence[str]]) -> list[Plan]:
    """One plan per phase: the ops of its tensors, in the plan's (wire) order.

    Raises:
        ValueError: a tensor of the plan is in no phase, or in two.
    """
    where: dict[str, int] = {}
    for i, names in enumerate(phases):
        for name in names:
            if name in where:
                raise ValueError(f"{name} is in phases {where[name]} and {i}")
            where[name] = i
    tensor_phase = np.array([where.get(t, -1) for t in plan.tensors], dtype=np.int64)
    op_phase = tensor_phase[plan.columns.tensor] if len(plan) else np.zeros(0, dtype=np.int64)
    if (op_phase < 0).any():
        missing = sorted({plan.tensors[t] for t in plan.columns.tensor[op_phase < 0]})
        raise ValueError(f"plan tensors in no phase: {missing[:5]}")
    return [plan.subset(np.flatnonzero(op_phase == i), tag=f"phase{i}") for i in range(len(phases))]
