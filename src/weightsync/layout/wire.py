"""Layout metadata on the wire: compact, versioned msgpack, never pickle.

A participant publishes its layout in one of two forms:

* a **descriptor**, ``{"layout": "megatron:tp=8,pp=16,dp=8,ep=64,etp=1", "model": <model digest>}``,
  when it was built from a layout kind: a few dozen bytes, identical for every rank of a
  group (the rank travels separately), so a thousand ranks share one blob;
* an **explicit** shard list, for layouts read out of a live framework (FSDP2 DTensors,
  ZeRO-3 partitions, an engine's parameters): canonical names are listed once and regions
  refer to them by index.

The model config (Hugging Face ``config.json``) is stored once per job by the job channel
(:meth:`weightsync.job.JobChannel.publish_model_config`), which returns the content digest
descriptors name it by.

    blob = encode_descriptor("vllm:tp=2", digest)
    layout = decode_layout(blob, rank=3, load_model=lambda digest: cfg)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from weightsync.layout.box import Box
from weightsync.layout.kinds import parse_layout
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import CanonicalTensor, RankLayout, Region, Shard

WIRE_VERSION = 1


def encode_descriptor(layout: str, model: str) -> bytes:
    """A rank-free descriptor blob; validated by parsing the layout string."""
    parse_layout(layout)
    return msgpack.packb({"v": WIRE_VERSION, "form": "descriptor", "layout": layout, "model": model})


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
    try:
        obj = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise ValueError(f"layout metadata of rank {rank} is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict) or obj.get("v") != WIRE_VERSION:
        raise ValueError(f"layout metadata of rank {rank} has unsupported wire version "
                         f"{obj.get('v') if isinstance(obj, dict) else None!r} (expected {WIRE_VERSION})")
    form = obj.get("form")
    try:
        if form == "descriptor":
            spec = ModelSpec.from_hf_config(load_model(str(obj["model"])))
            kind = parse_layout(str(obj["layout"]))
            kind.validate(spec)
            return kind.rank_layout(spec, rank)
        if form == "explicit":
            canonical = {str(n): CanonicalTensor(str(n), tuple(int(x) for x in s), str(d))
                         for n, s, d in obj["canonical"]}
            names = list(canonical)
            shards = []
            for name, shape, dtype, regions in obj["shards"]:
                regs = tuple(Region(names[int(i)], Box(tuple(map(int, off)), tuple(map(int, sz))), int(lo),
                                    tuple(map(int, st))) for i, off, sz, lo, st in regions)
                shards.append(Shard(str(name), tuple(map(int, shape)), str(dtype), regs))
            return RankLayout(rank, tuple(shards), canonical)
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"layout metadata of rank {rank} is malformed ({form} form): {exc!r}") from None
    raise ValueError(f"layout metadata of rank {rank} has unknown form {form!r}")
