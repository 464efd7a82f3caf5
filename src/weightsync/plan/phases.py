"""Phases: a version moved a few modules at a time, so a reader's staging stays bounded.

An engine that must run its own loader (vLLM on CPU repacks every linear layer) receives a
version into staging buffers. Moved at once, staging is a whole-model copy; moved in
*phases* of whole modules, each at most ``budget_bytes``, one staging arena of the largest
phase serves them all: the reader receives a phase, hands it to the loader (vLLM's
layerwise reload rebuilds a module as soon as all its tensors arrived, so a fused module's
parts, q/k/v, gate/up, a layer's routed experts, travel together), and the next phase lands in
the same memory.
Peak staging is ``budget_bytes``, or one module when a module alone is larger.

Both sides compute the same phases from the canonical tensors alone, in their canonical
order: tensors before the first layer (embeddings), then layers in ascending order, their
modules greedily packed while they fit, then the rest (final norm, ``lm_head``).

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


#: Checkpoint modules an engine fuses into one (vLLM: ``qkv_proj``, ``gate_up_proj``, DeepSeek's
#: ``fused_qkv_a_proj``; experts, Mixtral's ``w1``/``w3`` included, are one unit per layer in
#: :func:`module_unit`): their tensors must arrive in one phase. vLLM's layerwise reload keeps the
#: tensors a module was fed (views of the reader's staging, not copies) until its last one arrives,
#: then builds the module from them: a module split across phases would be built from staging the
#: next phase already overwrote.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
          "q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}


def module_unit(name: str) -> str:
    """The engine module a canonical tensor loads into (weight and bias together, fused parts together;
    a layer's routed experts, ``experts.*.<any>`` or ``experts.<e>.<any>``, are one unit: vLLM's
    FusedMoE holds every expert's w13 and w2 in one module)."""
    parts = name.split(".")[:-1]  # drop "weight" / "bias"
    for i, part in enumerate(parts[:-1]):
        if part == "experts" and (parts[i + 1] == "*" or parts[i + 1].isdigit()):
            parts = parts[: i + 1]
            break
    return ".".join(_FUSED.get(p, p) for p in parts)


def layer_phases(canonical: Mapping[str, CanonicalTensor], *, budget_bytes: int) -> tuple[tuple[str, ...], ...]:
    """Canonical tensors grouped into phases of whole modules, at most ``budget_bytes`` each
    (a module alone may exceed it), in layer order (see module docstring)."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    pre: dict[str, list[str]] = {}
    post: dict[str, list[str]] = {}
    layers: dict[int, dict[str, list[str]]] = {}
    for name in canonical:
        index = layer_index(name)
        target = (post if layers else pre) if index is None else layers.setdefault(index, {})
        target.setdefault(module_unit(name), []).append(name)

    def nbytes(names: Sequence[str]) -> int:
        return sum(canonical[n].numel * itemsize(canonical[n].dtype) for n in names)

    units = [*pre.values(), *(u for index in sorted(layers) for u in layers[index].values()), *post.values()]
    phases: list[tuple[str, ...]] = []
    current: list[str] = []
    for names in units:
        if current and nbytes(current) + nbytes(names) > budget_bytes:
            phases.append(tuple(current))
            current = []
        current.extend(names)
    if current:
        phases.append(tuple(current))
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
    copy_tensor = plan.copies.tensor if plan.copies is not None else np.zeros(0, dtype=np.int64)
    copy_phase = tensor_phase[copy_tensor]
    if (op_phase < 0).any() or (copy_phase < 0).any():
        missing = sorted({plan.tensors[t] for t in plan.columns.tensor[op_phase < 0]}
                         | {plan.tensors[t] for t in copy_tensor[copy_phase < 0]})
        raise ValueError(f"plan tensors in no phase: {missing[:5]}")
    return [plan.subset(np.flatnonzero(op_phase == i), tag=f"phase{i}", copies=np.flatnonzero(copy_phase == i))
            for i in range(len(phases))]
