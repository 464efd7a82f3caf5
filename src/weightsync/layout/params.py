"""Framework parameters as canonical parts, and the index runs their shards hold.

A training framework's parameter, unsharded, is a concatenation of boxes of canonical
tensors along one dimension: a transformers ``experts.gate_up_proj`` is ``[gate; up]``
stacks along dim 1, a Megatron ``linear_qkv`` is ``[q_g; k_g; v_g]`` per query group, a
per-expert ``experts.3.up_proj.weight`` is slice 3 of an expert stack. :class:`ParamParts`
records that once; its ``regions`` methods turn "this local view holds box B of the
parameter" into canonical regions, cut at part boundaries. A sharded adapter (or a layout
kind) then only has to say which boxes of the parameter a rank holds:

    parts = hf_params(spec)["model.layers.1.mlp.experts.gate_up_proj"]
    regions = parts.box_regions(Box((0, 0, 0), (4, 12, 64)), local_shape=(4, 12, 64))

Which boxes a rank holds follows from per-dimension *runs*: the global indices a local
dimension holds, as ``(start, length)`` pairs in local order. ``chunk_runs`` and
``strided_runs`` are ``torch.chunk`` and DTensor's ``_StridedShard`` on runs;
``run_boxes`` turns runs into (local box, parameter box) pairs.

The transformers names: since transformers 5 an MoE layer keeps its experts fused, as
``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj
[E, H, I]``, and Mixtral's ``block_sparse_moe`` is renamed ``mlp`` (its checkpoint
conversion merges the per-expert ``w1``/``w3``/``w2``). ``hf_params(spec, fused=False)``
gives the per-expert modules of transformers 4 (the checkpoint names).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.layout.box import Box, chunk_bounds, contiguous_strides
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import (
    CanonicalTensor,
    Region,
    expert_name,
    flat_range_regions,
    is_expert_stack,
)

#: Global indices one local dimension holds: ``(start, length)`` runs in local order.
Runs = tuple[tuple[int, int], ...]

#: transformers >= 5 in-memory names of an MoE layer's fused experts and router.
FUSED_NAMES = {
    "router": "model.layers.{L}.mlp.gate.weight",
    "experts_gate_up": "model.layers.{L}.mlp.experts.gate_up_proj",
    "experts_down": "model.layers.{L}.mlp.experts.down_proj",
}


@dataclass(frozen=True, slots=True)
class ParamParts:
    """A whole (unsharded) framework parameter as canonical boxes laid along ``dim``.

    ``shape`` may exceed the parts along ``dim`` (a padded vocabulary): the excess maps to
    nothing. ``drop_leading`` unit dims of every part's box have no parameter dim (a
    per-expert matrix holding one slice of an expert stack). ``role`` names the tensor's
    role (``q``, ``experts_gate_up``, ...) for layouts that shard by role.
    """

    shape: tuple[int, ...]
    parts: tuple[tuple[str, Box], ...]
    dim: int = 0
    drop_leading: int = 0
    role: str = ""

    @classmethod
    def concat(
        cls,
        parts: Sequence[tuple[CanonicalTensor, Box]],
        *,
        dim: int = 0,
        drop_leading: int = 0,
        role: str = "",
        shape: Sequence[int] | None = None,
    ) -> ParamParts:
        """Parts laid one after another along ``dim`` (the parameter shape follows)."""
        sizes = [list(box.sizes[drop_leading:]) for _, box in parts]
        whole = list(sizes[0])
        whole[dim] = sum(s[dim] for s in sizes)
        for (tensor, _), s in zip(parts, sizes, strict=True):
            if any(a != b for d, (a, b) in enumerate(zip(s, whole, strict=True)) if d != dim):
                raise ValueError(f"{tensor.name}: part {tuple(s)} does not fit a parameter of {tuple(whole)}")
        if shape is not None:
            if len(shape) != len(whole) or any(a < b for a, b in zip(shape, whole, strict=True)):
                raise ValueError(f"parameter shape {tuple(shape)} cannot hold parts of {tuple(whole)}")
            whole = list(shape)
        return cls(tuple(whole), tuple((t.name, box) for t, box in parts), dim, drop_leading, role)

    @classmethod
    def whole(cls, tensor: CanonicalTensor, role: str = "") -> ParamParts:
        return cls(tensor.shape, ((tensor.name, Box.full(tensor.shape)),), role=role)

    @classmethod
    def expert(cls, stack: CanonicalTensor, expert: int, role: str = "") -> ParamParts:
        """Expert ``expert``'s matrix of an expert stack, as its own parameter."""
        box = Box((expert,) + (0,) * (len(stack.shape) - 1), (1, *stack.shape[1:]))
        return cls(stack.shape[1:], ((stack.name, box),), drop_leading=1, role=role)

    def padded(self, shape: Sequence[int]) -> ParamParts:
        """The same parts in a larger parameter (padding past the parts maps to nothing)."""
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(self.shape) or any(a < b for a, b in zip(shape, self.shape, strict=True)):
            raise ValueError(f"a parameter of shape {shape} cannot hold parts of {self.shape}")
        return ParamParts(shape, self.parts, self.dim, self.drop_leading, self.role)

    def regions(self, box: Box, offset: int, strides: Sequence[int]) -> list[Region]:
        """Canonical regions of a strided local view holding ``box`` of this parameter.

        Element ``i`` of the box lives at ``offset + sum(i[d] * strides[d])`` of the local
        storage. Parts of the box that map to nothing (padding) yield no region.
        """
        if box.ndim != len(self.shape) or any(e > s for e, s in zip(box.ends, self.shape, strict=True)):
            raise ValueError(f"box {box} lies outside a parameter of shape {self.shape}")
        lead = self.drop_leading
        strides = tuple(strides)
        if len(self.parts) == 1 and self.parts[0][1].sizes[lead:] == self.shape:  # one whole part
            name, part = self.parts[0]
            if box.empty:
                return []
            offsets = tuple(p + b for p, b in zip(part.offsets[lead:], box.offsets, strict=True))
            canonical = Box(part.offsets[:lead] + offsets, part.sizes[:lead] + box.sizes)
            return [Region(name, canonical, offset, (0,) * lead + strides)]
        ends = box.ends
        out = []
        cursor = 0
        for name, part in self.parts:
            sizes = part.sizes[lead:]
            start = [0] * len(sizes)
            start[self.dim] = cursor
            cursor += sizes[self.dim]
            lo = [b if b > s else s for b, s in zip(box.offsets, start, strict=True)]
            hi = [e if e < s + n else s + n for e, s, n in zip(ends, start, sizes, strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            canonical = Box(
                part.offsets[:lead] + tuple(o + a - s for o, a, s in zip(part.offsets[lead:], lo, start, strict=True)),
                part.sizes[:lead] + tuple(h - a for a, h in zip(lo, hi, strict=True)),
            )
            local = offset + sum((a - b) * st for a, b, st in zip(lo, box.offsets, strides, strict=True))
            out.append(Region(name, canonical, local, (0,) * lead + strides))
        return out

    def box_regions(self, box: Box, local_shape: Sequence[int],
                    local_offsets: Sequence[int] | None = None) -> list[Region]:
        """Regions of a contiguous local tensor whose box at ``local_offsets`` holds ``box``."""
        strides = contiguous_strides(local_shape)
        offs = local_offsets if local_offsets is not None else (0,) * len(strides)
        return self.regions(box, sum(o * s for o, s in zip(offs, strides, strict=True)), strides)

    def flat_regions(self, start: int, stop: int) -> list[Region]:
        """Regions of a 1-D local run holding flat elements ``[start, stop)`` (ZeRO-3)."""
        out = []
        for run in flat_range_regions(("", self.shape), start, stop):
            out.extend(self.regions(run.box, run.offset, run.strides))
        return out


# -- runs: which global indices a sharded dimension holds ------------------------------

def take_runs(runs: Runs, lo: int, hi: int) -> Runs:
    """Local positions ``[lo, hi)`` of ``runs``."""
    out = []
    pos = 0
    for start, length in runs:
        a, b = max(lo, pos), min(hi, pos + length)
        if b > a:
            out.append((start + a - pos, b - a))
        pos += length
    return tuple(out)


def runs_length(runs: Runs) -> int:
    return sum(length for _, length in runs)


def chunk_runs(runs: Runs, parts: int, index: int) -> Runs:
    """``torch.chunk`` (DTensor ``Shard``): chunk ``index`` of ``parts``, trailing ones short."""
    size = runs_length(runs)
    step = -(-size // parts)
    lo = min(index * step, size)
    if len(runs) == 1:  # the common case, without the general walk
        start, _ = runs[0]
        hi = min(lo + step, size)
        return ((start + lo, hi - lo),) if hi > lo else ()
    return take_runs(runs, lo, min(lo + step, size))


def strided_runs(runs: Runs, parts: int, index: int, split_factor: int) -> Runs:
    """DTensor ``_StridedShard``: cut into ``split_factor`` pieces, keep chunk ``index`` of each."""
    out: list[tuple[int, int]] = []
    for lo, hi in chunk_bounds(runs_length(runs), split_factor):
        out.extend(chunk_runs(take_runs(runs, lo, hi), parts, index))
    return tuple(out)


def run_boxes(per_dim: Sequence[Runs]) -> list[tuple[Box, Box]]:
    """(local box, global box) pairs covering a local tensor whose dims hold ``per_dim``."""
    placed = []
    for runs in per_dim:
        local = 0
        dim = []
        for start, length in runs:
            if length:
                dim.append((local, start, length))
            local += length
        placed.append(dim)
    return [
        (Box(tuple(c[0] for c in combo), tuple(c[2] for c in combo)),
         Box(tuple(c[1] for c in combo), tuple(c[2] for c in combo)))
        for combo in itertools.product(*placed)
    ]


# -- transformers models ---------------------------------------------------------------

def hf_params(spec: ModelSpec, *, fused: bool = True) -> dict[str, ParamParts]:
    """Every parameter of a transformers model of ``spec``, by in-memory name, in order.

    ``fused=True`` is transformers >= 5 (fused 3-D experts); ``fused=False`` gives one
    parameter per expert matrix under its checkpoint name (transformers 4). Tied models
    have no ``lm_head.weight`` (transformers' ``named_parameters`` lists it once).
    """
    key = f"hf_params_fused={fused}"
    cached = spec._cache.get(key)
    if cached is not None:
        return cached
    roles = spec.roles()
    out: dict[str, ParamParts] = {}
    for name, tensor in spec.canonical_tensors().items():
        role, layer = roles[name]
        if not is_expert_stack(name):
            # transformers 5 renames Mixtral's block_sparse_moe to mlp; gpt-oss keeps its own router name
            stacked = spec.family_info.experts == "stacked"
            local = FUSED_NAMES["router"].format(L=layer) if fused and stacked and role == "router" else name
            out[local] = ParamParts.whole(tensor, role)
        elif not fused:
            for e in range(tensor.shape[0]):
                out[expert_name(name, e)] = ParamParts.expert(tensor, e, role)
        elif role == "expert_gate":
            gate, up = tensor, spec.tensor("expert_up", layer)
            out[FUSED_NAMES["experts_gate_up"].format(L=layer)] = ParamParts.concat(
                [(gate, Box.full(gate.shape)), (up, Box.full(up.shape))], dim=1, role="experts_gate_up")
        elif role == "expert_down":
            out[FUSED_NAMES["experts_down"].format(L=layer)] = ParamParts.whole(tensor, "experts_down")
    spec._cache[key] = out
    return out


def hf_param(spec: ModelSpec, name: str) -> ParamParts | None:
    """The parts of a transformers parameter of either naming, or None if none matches.

    A tied model's ``lm_head.weight`` (listed when a wrapper unties the module) maps to
    the embedding: it is one more copy of it.
    """
    found = hf_params(spec, fused=True).get(name)
    if found is None and spec.is_moe:
        found = hf_params(spec, fused=False).get(name)
    if found is None and name == "lm_head.weight" and spec.tie_word_embeddings:
        found = ParamParts.whole(spec.tensor("embed"), "lm_head")
    return found
