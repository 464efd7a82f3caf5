"""Expert placement (vLLM's EPLB): which logical expert each physical expert slot holds.

vLLM's expert-parallel load balancer gives every MoE layer ``E + R`` physical expert slots
(``R`` redundant copies of hot experts), ``(E + R) / ep`` on each EP rank (rank ``i`` holds
slots ``[i * L, (i + 1) * L)``), and moves logical experts between slots while serving. Its
state is ``physical_to_logical_map`` ``[moe_layers, E + R]`` (``EplbState``): a
:class:`Placement` is that map as plain data, per engine replica, handed to the core by an
adapter (``weightsync.engines.vllm_eplb``) or read from a JSON file::

    {"num_logical_experts": 384, "physical_to_logical_map": [[...416 ints...], ...]}

with one row per MoE layer of the target model, in layer order (vLLM's own array, dumped
with ``.tolist()``), or a list of such arrays, one per engine replica. ``-1`` marks a slot
that holds nothing (vLLM's elastic EP pads with it).

The ``vllm`` layout kind takes a placement as ``eplb=FILE`` (or the digest of a placement
registered in this process, which is what the wire carries) or ``redundant=R`` (vLLM's initial
placement: slot ``p`` holds expert ``p`` for ``p < E``, then ``(p - E) % E``). Each reader's
expert shards then hold, slot by slot, the logical expert the map names; a logical expert held
by several slots of one reader appears there as equal boxes, which the planner receives once
and copies locally (:mod:`weightsync.plan.planner`).

    placement = Placement.from_json(text)
    digest = register(placement)           # "vllm:tp=8,ep=16,eplb=<digest>" names it
    layout = parse_layout(f"vllm:tp=8,dp=2,ep=16,eplb={digest}")
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from weightsync.layout.model import ModelSpec
from weightsync.layout.quant_block import derived_bases
from weightsync.layout.roster import Roster

#: Roles of the tensors that hold experts along dimension 0 (stacked and whole experts).
EXPERT_ROLES = frozenset({"expert_gate", "expert_up", "expert_down", "experts_gate_up", "experts_gate_up_bias",
                          "experts_down", "experts_down_bias"})

_REGISTRY: dict[str, Placement] = {}


def initial_map(num_experts: int, num_redundant: int) -> list[int]:
    """vLLM's initial placement: the routed experts in order, then ``i % E`` for each redundant slot."""
    return list(range(num_experts)) + [i % num_experts for i in range(num_redundant)]


@dataclass(frozen=True, eq=False)
class Placement:
    """Physical-to-logical expert maps of one or more engine replicas (see module docstring).

    ``maps`` is ``[replicas, moe_layers, physical]`` (int64); a model's MoE layers are matched
    to its rows in layer order (:meth:`layer_maps`).
    """

    num_experts: int
    maps: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        maps = np.array(self.maps, dtype=np.int64)  # a copy: the caller's array stays writable
        if maps.ndim == 2:
            maps = maps[None]
        if maps.ndim != 3 or maps.shape[1] == 0 or maps.shape[2] == 0:
            raise ValueError(f"an expert placement is [moe_layers, physical] per replica, got shape {maps.shape}")
        if self.num_experts <= 0:
            raise ValueError(f"an expert placement needs num_logical_experts > 0, got {self.num_experts}")
        if maps.shape[2] < self.num_experts:
            raise ValueError(f"an expert placement has {maps.shape[2]} physical slots per layer, fewer than the "
                             f"{self.num_experts} logical experts")
        bad = (maps < -1) | (maps >= self.num_experts)
        if bad.any():
            r, layer, slot = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(f"expert placement: replica {r}, MoE layer {layer}, slot {slot} names logical expert "
                             f"{int(maps[r, layer, slot])}, outside 0..{self.num_experts - 1} (-1: an empty slot)")
        maps.setflags(write=False)
        object.__setattr__(self, "maps", maps)

    @property
    def replicas(self) -> int:
        return int(self.maps.shape[0])

    @property
    def moe_layers(self) -> int:
        return int(self.maps.shape[1])

    @property
    def num_physical(self) -> int:
        return int(self.maps.shape[2])

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_experts

    @classmethod
    def initial(cls, num_experts: int, num_redundant: int, moe_layers: int) -> Placement:
        """vLLM's placement at start-up, for ``moe_layers`` layers."""
        row = initial_map(num_experts, num_redundant)
        return cls(num_experts, np.array([[row] * moe_layers], dtype=np.int64))

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Placement:
        """``{"num_logical_experts": E, "physical_to_logical_map": [...]}`` (see module docstring)."""
        if not isinstance(doc, Mapping) or "physical_to_logical_map" not in doc:
            raise ValueError('an expert placement is a JSON object with "physical_to_logical_map" (vLLM\'s '
                             '[moe_layers, physical] array, or one per replica) and "num_logical_experts"')
        try:
            maps = np.array(doc["physical_to_logical_map"], dtype=np.int64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"expert placement: physical_to_logical_map is not a rectangular array of ints ({exc})"
                             ) from None
        experts = doc.get("num_logical_experts")
        if not isinstance(experts, int):
            raise ValueError('expert placement: "num_logical_experts" (an int) is missing')
        return cls(experts, maps)

    @classmethod
    def from_json(cls, text: str | bytes) -> Placement:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"expert placement is not valid JSON: {exc}") from None
        return cls.from_dict(doc)

    @classmethod
    def from_file(cls, path: str | Path) -> Placement:
        try:
            return cls.from_json(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"expert placement file {str(path)!r} does not exist") from None

    def to_json(self) -> str:
        """The canonical text of this placement (its digest hashes it)."""
        return json.dumps({"num_logical_experts": self.num_experts,
                           "physical_to_logical_map": self.maps.tolist()}, separators=(",", ":"))

    @property
    def digest(self) -> str:
        return "eplb-" + hashlib.blake2b(self.to_json().encode(), digest_size=8).hexdigest()

    def replica(self, replica: int) -> np.ndarray:
        """The maps of engine ``replica`` (one placement serves every replica when it has one)."""
        return self.maps[replica if self.replicas > 1 else 0]

    def layer_maps(self, moe_layers: Sequence[int], total_layers: int) -> np.ndarray:
        """``[replicas, total_layers, physical]``: each MoE layer's map (layer order), vLLM's initial
        placement for the MoE layers after the placement's rows (an MTP drafter's), -1 elsewhere."""
        out = np.full((self.replicas, total_layers, self.num_physical), -1, dtype=np.int64)
        initial = np.array(initial_map(self.num_experts, self.num_redundant), dtype=np.int64)
        for k, layer in enumerate(moe_layers):
            out[:, layer] = self.maps[:, k] if k < self.moe_layers else initial
        return out


def register(placement: Placement) -> str:
    """Make ``placement`` known to layout kinds in this process; returns the digest that names it."""
    digest = placement.digest
    _REGISTRY.setdefault(digest, placement)
    return digest


def lookup(name: str) -> Placement:
    """A registered placement by digest, or one read from a JSON file (then registered)."""
    found = _REGISTRY.get(name)
    if found is not None:
        return found
    if name.startswith("eplb-") and not Path(name).exists():
        raise ValueError(f"expert placement {name!r} is not known in this process: register it "
                         "(weightsync.layout.eplb.register) or pass a placement file (eplb=PATH)")
    placement = Placement.from_file(name)
    register(placement)
    return placement


def attachments(names: Sequence[str]) -> dict[str, bytes]:
    """The placements ``names`` as wire attachments (digest -> JSON) for a layout descriptor."""
    return {n: lookup(n).to_json().encode() for n in names}


def receive_attachments(docs: Mapping[str, bytes]) -> None:
    """Register placements that came with a descriptor, checking each against its digest."""
    for digest, text in docs.items():
        placement = Placement.from_json(text)
        if placement.digest != digest:
            raise ValueError(f"expert placement attached as {digest!r} hashes to {placement.digest!r}")
        register(placement)


# -- the layout of placed experts -----------------------------------------------------------

@dataclass(frozen=True)
class PlacedRows:
    """Expert rows cut slot by slot: per output row, the input row, its slot and logical expert."""

    source: np.ndarray  # input row
    first_slot: np.ndarray  # slot (within the rank) of the output row's first slot
    expert: np.ndarray  # logical expert of the first slot
    count: np.ndarray  # consecutive slots merged (holding consecutive experts)


def expert_name_info(names: Sequence[str], spec: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per canonical name: whether it holds experts along dim 0 (a quantized reader's values and
    scales of one too), and its layer (-1: none)."""
    roles = spec.roles()
    derived = derived_bases(names, spec)
    is_expert = np.zeros(len(names), dtype=bool)
    layer = np.full(len(names), -1, dtype=np.int64)
    for i, name in enumerate(names):
        found = roles.get(name)
        if found is None and name in derived:
            found = roles.get(derived[name][0])
        if found is not None and found[0] in EXPERT_ROLES and found[1] is not None:
            is_expert[i], layer[i] = True, found[1]
    return is_expert, layer


def place_rows(slot_maps: np.ndarray) -> PlacedRows:
    """Cut rows that each hold a rank's ``L`` slots (dim 0 = ``[0, L)``) into runs of slots.

    ``slot_maps`` is ``[rows, L]``: the logical expert of each slot of the row's rank and layer
    (-1: empty). A run is consecutive slots holding consecutive experts, none of which the rank
    holds twice; an expert held twice is a one-slot row wherever it is, so that its copies are
    equal boxes (received once, copied locally). Empty slots are dropped.
    """
    n, slots = slot_maps.shape
    row = np.repeat(np.arange(n, dtype=np.int64), slots)
    slot = np.tile(np.arange(slots, dtype=np.int64), n)
    flat = slot_maps.reshape(-1).astype(np.int64)
    keep = flat >= 0
    span = int(flat.max(initial=0)) + 2
    _, inverse, counts = np.unique(row * span + flat + 1, return_inverse=True, return_counts=True)
    dup = (counts[inverse.reshape(-1)] > 1) & keep
    cont = np.zeros(n * slots, dtype=bool)  # continues the previous slot's run
    cont[1:] = ((row[1:] == row[:-1]) & (flat[1:] == flat[:-1] + 1) & keep[1:] & keep[:-1]
                & ~dup[1:] & ~dup[:-1])
    start = keep & ~cont
    starts = np.flatnonzero(start)
    run = np.cumsum(start) - 1
    lengths = np.bincount(run[keep], minlength=len(starts)).astype(np.int64)
    return PlacedRows(row[starts], slot[starts], flat[starts], lengths)


def moe_layers(spec: ModelSpec) -> list[int]:
    """The decoder layers (MTP layers after them) whose experts a placement places, in order."""
    return [layer for layer in range(spec.total_layers) if spec.is_moe_layer(layer)]


def check_fits(placement: Placement, spec: ModelSpec, *, replicas: int, ep: int) -> None:
    """Raise ValueError (saying what to change) if ``placement`` cannot describe ``spec`` served on
    ``replicas`` engines of ``ep`` expert-parallel ranks."""
    if placement.num_experts != spec.num_experts:
        raise ValueError(f"expert placement: it places {placement.num_experts} logical experts, the model has "
                         f"{spec.num_experts}")
    if placement.replicas not in (1, replicas):
        raise ValueError(f"expert placement: it has maps of {placement.replicas} engine replicas, the layout "
                         f"{replicas} (give one map for all, or one per replica)")
    target = [layer for layer in moe_layers(spec) if layer < spec.num_layers]
    if placement.moe_layers not in (len(target), len(moe_layers(spec))):
        raise ValueError(f"expert placement: it has maps of {placement.moe_layers} MoE layers, the model "
                         f"{len(target)} (vLLM's physical_to_logical_map has one row per MoE layer)")
    if placement.num_physical % ep:
        raise ValueError(f"expert placement: {placement.num_physical} physical experts per layer are not divisible "
                         f"by ep={ep} (vLLM's EPLB spreads them evenly over the EP ranks)")
    per = placement.num_physical // ep
    if per > spec.num_experts:
        raise ValueError(f"expert placement: {per} expert slots per EP rank exceed the {spec.num_experts} logical "
                         f"experts (use fewer redundant experts: at most {spec.num_experts * (ep - 1)} at ep={ep})")


def place_experts(roster: Roster, spec: ModelSpec, placement: Placement, *, group: int) -> Roster:
    """``roster`` (every rank holding expert slots ``[0, L)`` along dim 0 of each expert tensor)
    with each rank's slots holding the logical experts ``placement`` names.

    ``group`` is the ranks of one engine replica (its EP group): rank ``r`` is EP rank
    ``r % group`` of replica ``r // group`` and holds that replica's slots ``[i * L, (i + 1) * L)``.
    Columnar: the expert rows of every rank are cut at once (:func:`place_rows`).
    """
    slots = placement.num_physical // group
    is_expert, layer_of = expert_name_info(roster.names, spec)
    rows = np.flatnonzero(is_expert[roster.name_idx])
    if not len(rows):
        return roster
    bad = rows[(roster.off[rows, 0] != 0) | (roster.size[rows, 0] != slots)]
    if len(bad):
        raise ValueError(f"expert placement: rank {int(roster.rank[bad[0]])} holds "
                         f"{roster.names[int(roster.name_idx[bad[0]])]!r} experts "
                         f"[{int(roster.off[bad[0], 0])}, +{int(roster.size[bad[0], 0])}), not its {slots} slots")
    maps = placement.layer_maps(moe_layers(spec), spec.total_layers)
    rank = roster.rank[rows]
    replica = np.minimum(rank // group, placement.replicas - 1)
    first = (rank % group) * slots
    slot_maps = maps[replica[:, None], layer_of[roster.name_idx[rows]][:, None],
                     first[:, None] + np.arange(slots)[None, :]]
    placed = place_rows(slot_maps)
    src = rows[placed.source]
    off, size = roster.off[src].copy(), roster.size[src].copy()
    off[:, 0], size[:, 0] = placed.expert, placed.count
    loff = roster.loff[src] + placed.first_slot * roster.stride[src, 0]
    others = np.setdiff1d(np.arange(len(roster)), rows, assume_unique=True)
    position = np.concatenate([others, src])
    order = np.lexsort((np.concatenate([np.zeros(len(others), dtype=np.int64), placed.first_slot]), position))
    take = np.concatenate([others, src])[order]

    def column(a: np.ndarray, new: np.ndarray) -> np.ndarray:
        return np.concatenate([a[others], new])[order]

    return Roster(
        ranks=roster.ranks, canonical=roster.canonical, rank_canonical=roster.rank_canonical, names=roster.names,
        rank=roster.rank[take], shard=roster.shard[take], name_idx=roster.name_idx[take],
        off=column(roster.off, off), size=column(roster.size, size), loff=column(roster.loff, loff),
        stride=roster.stride[take], ndim=roster.ndim[take], dtype=roster.dtype[take], shards=roster.shards)


__all__ = [
    "EXPERT_ROLES",
    "PlacedRows",
    "Placement",
    "attachments",
    "check_fits",
    "expert_name_info",
    "initial_map",
    "lookup",
    "moe_layers",
    "place_experts",
    "place_rows",
    "receive_attachments",
    "register",
]
