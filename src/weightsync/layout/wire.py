"""Layout metadata on the wire: compact, versioned msgpack, never pickle.

A participant publishes its layout in one of two forms:

* a **descriptor**, ``{"layout": "megatron:tp=8,pp=16,dp=8,ep=64,etp=1", "model": <model digest>}``,
  when it was built from a layout kind: a few dozen bytes, identical for every rank of a
  group (the rank travels separately), so a thousand ranks share one blob;
* an **explicit** shard list, for layouts read out of a live framework (FSDP2 DTensors,
  ZeRO-3 partitions, an engine's parameters): canonical names are listed once and regions
  refer to them by index.

The model config (Hugging Face ``config.json``) is stored once per job by the job channel
(:meth:`weightsync.job.channel.JobChannel.publish_model_config`), which returns the content digest
descriptors name it by.

    blob = encode_descriptor("vllm:tp=2", digest)
    layout = decode_layout(blob, rank=3, load_model=lambda digest: cfg)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack

from weightsync.layout.box import Box
from weightsync.layout.eplb import attachments, receive_attachments
from weightsync.layout.kinds import LayoutKind, parse_layout
from weightsync.layout.model import ModelSpec
from weightsync.layout.roster import Roster
from weightsync.layout.types import CanonicalTensor, RankLayout, Region, Shard

WIRE_VERSION = 1


def encode_descriptor(layout: str, model: str) -> bytes:
    """A rank-free descriptor blob; validated by parsing the layout string. The data the layout
    names beside its text (an expert placement's digest) travels in the blob."""
    kind = parse_layout(layout)
    blob: dict[str, Any] = {"v": WIRE_VERSION, "form": "descriptor", "layout": kind.describe(), "model": model}
    names = kind.attachments()
    if names:
        blob["eplb"] = attachments(names)
    return msgpack.packb(blob)


def check_rank(layout: str, rank: int, who: str) -> None:
    """Raises ValueError when ``rank`` is no rank of ``layout``: every other rank rebuilds this
    rank's layout from its descriptor at ``rank`` (:class:`LayoutDecoder`), so the rank refuses
    the pair itself, before it publishes it, rather than have its peers fail on it."""
    kind = parse_layout(layout)
    if not 0 <= rank < kind.world_size:
        raise ValueError(f"{who}: its layout {kind.describe()} has ranks 0..{kind.world_size - 1}, not {rank}: give "
                         "the layout the job's whole world (an elastic set: replicas above the highest seat)")


def encode_explicit(layout: RankLayout) -> bytes:
    """All shards and regions of one rank, canonical names deduplicated."""
    names: dict[str, int] = {}
    shards = []
    for shard in layout.shards:
        regions = []
        for r in shard.regions:
            idx = names.setdefault(r.canonical, len(names))
            regions.append([idx, list(r.box.offsets), list(r.box.sizes), r.offset, list(r.strides)])
        shards.append([shard.name, list(shard.shape), shard.dtype, regions])
    canonical = [[n, list(layout.canonical[n].shape), layout.canonical[n].dtype] for n in names]
    return msgpack.packb({"v": WIRE_VERSION, "form": "explicit", "canonical": canonical, "shards": shards})


def decode_layout(blob: bytes, *, rank: int, load_model: Callable[[str], Mapping[str, Any]]) -> RankLayout:
    """Rebuild a rank's layout; raises ValueError naming the malformed part."""
    return LayoutDecoder(load_model)(blob, rank=rank)


class LayoutDecoder:
    """Rebuilds the layouts of a whole roster.

    Every rank of a layout kind publishes the same descriptor, so a roster of a thousand
    ranks holds a handful of distinct blobs: each is parsed, and its model config turned
    into a :class:`ModelSpec`, once. Sharing the spec also shares what the layout kinds
    cache on it (the canonical tensors, the shard templates).

        decode = LayoutDecoder(load_model)
        layouts = [decode(blob, rank=r) for r, blob in roster]   # objects, rank by rank
        side = decode.roster(roster)                             # or all of them as columns
    """

    def __init__(self, load_model: Callable[[str], Mapping[str, Any]]) -> None:
        self._load_model = load_model
        self._specs: dict[str, ModelSpec] = {}
        self._kinds: dict[bytes, tuple[LayoutKind, ModelSpec]] = {}

    def __call__(self, blob: bytes, *, rank: int) -> RankLayout:
        """One rank's layout; raises ValueError naming the malformed part."""
        known = self._kinds.get(blob)
        if known is not None:
            kind, spec = known
            return kind.rank_layout(spec, rank)
        obj = self._unpack(blob, rank)
        form = obj.get("form")
        try:
            if form == "descriptor":
                kind, spec = self._descriptor(blob, obj)
                return kind.rank_layout(spec, rank)
            if form == "explicit":
                return _explicit(obj, rank)
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"layout metadata of rank {rank} is malformed ({form} form): {exc!r}") from None
        raise ValueError(f"layout metadata of rank {rank} has unknown form {form!r}")

    def roster(self, members: Sequence[tuple[int, bytes]]) -> Roster:
        """The layouts of ``members`` (rank, blob) as one roster, without an object per rank.

        The ranks that publish one descriptor are built together by their layout kind
        (:meth:`LayoutKind.roster`); explicit shard lists are decoded rank by rank.
        """
        by_blob: dict[bytes, list[int]] = {}
        for rank, blob in members:
            by_blob.setdefault(blob, []).append(rank)
        parts = []
        for blob, ranks in by_blob.items():
            known = self._kinds.get(blob)
            if known is None:
                obj = self._unpack(blob, ranks[0])
                form = obj.get("form")
                try:
                    if form == "explicit":
                        parts.append(Roster.from_layouts([_explicit(obj, rank) for rank in ranks]))
                        continue
                    if form == "descriptor":
                        known = self._descriptor(blob, obj)
                except (KeyError, TypeError, IndexError) as exc:
                    raise ValueError(f"layout metadata of rank {ranks[0]} is malformed ({form} form): "
                                     f"{exc!r}") from None
                if known is None:
                    raise ValueError(f"layout metadata of rank {ranks[0]} has unknown form {form!r}")
            kind, spec = known
            parts.append(kind.roster(spec, ranks))
        if not parts:
            raise ValueError("no layouts to decode")
        return Roster.concat(parts)

    def _descriptor(self, blob: bytes, obj: Mapping[str, Any]) -> tuple[LayoutKind, ModelSpec]:
        spec = self._spec(str(obj["model"]))
        attached = obj.get("eplb") or {}
        if not isinstance(attached, dict):
            raise TypeError("the expert placements attached to a descriptor are not a map")
        receive_attachments({str(k): bytes(v) for k, v in attached.items()})
        kind = parse_layout(str(obj["layout"]))
        kind.validate(spec)
        self._kinds[blob] = (kind, spec)
        return kind, spec

    def _spec(self, digest: str) -> ModelSpec:
        spec = self._specs.get(digest)
        if spec is None:
            spec = self._specs[digest] = ModelSpec.from_hf_config(self._load_model(digest))
        return spec

    @staticmethod
    def _unpack(blob: bytes, rank: int) -> dict[str, Any]:
        try:
            obj = msgpack.unpackb(blob, raw=False, strict_map_key=True)
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
            raise ValueError(f"layout metadata of rank {rank} is not valid msgpack: {exc}") from None
        if not isinstance(obj, dict) or obj.get("v") != WIRE_VERSION:
            raise ValueError(f"layout metadata of rank {rank} has unsupported wire version "
                             f"{obj.get('v') if isinstance(obj, dict) else None!r} (expected {WIRE_VERSION})")
        return obj


def _explicit(obj: Mapping[str, Any], rank: int) -> RankLayout:
    canonical = {str(n): CanonicalTensor(str(n), tuple(int(x) for x in s), str(d)) for n, s, d in obj["canonical"]}
    names = list(canonical)
    shards = []
    for name, shape, dtype, regions in obj["shards"]:
        regs = tuple(Region(names[int(i)], Box(tuple(map(int, off)), tuple(map(int, sz))), int(lo),
                            tuple(map(int, st))) for i, off, sz, lo, st in regions)
        shards.append(Shard(str(name), tuple(map(int, shape)), str(dtype), regs))
    return RankLayout(rank, tuple(shards), canonical)
