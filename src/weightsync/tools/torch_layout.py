"""Torch glue for the pure layout types: dtype names, views of regions, allocation.

The core (``layout/``, ``plan/``) names dtypes with strings and describes shard memory as
offsets and strides; everything that holds real tensors (sources, engines, transports,
the tensor store, the bench) turns those into torch objects through this one module.

    tensors = allocate(layout)                       # zeroed shards of a RankLayout
    view = region_view(tensors[name], region)        # the canonical box a region maps
    fill_from_canonical(layout, tensors, values)     # shards from full canonical tensors
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from weightsync.layout import Box, ModelSpec, RankLayout, Shard
from weightsync.layout.params import hf_param

TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES: Mapping[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The layout name of a torch dtype; ValueError for dtypes weightsync does not move."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {dtype}; supported: {sorted(TORCH_DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name; ValueError naming the known ones."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known: {sorted(TORCH_DTYPES)}") from None


def check_tensors(layout: RankLayout, tensors: Mapping[str, torch.Tensor], who: str) -> None:
    """Every shard of ``layout`` is in ``tensors`` with the shard's shape and dtype, contiguous.

    Transports address shards through their flat storage by the layout's offsets, so a
    tensor that disagrees would be read as the wrong bytes (fp16 read as fp32, the first
    rows of a larger tensor) without any error of its own.

    Raises:
        ValueError: naming each tensor that disagrees and how to fix it.
    """
    problems = []
    for shard in layout.shards:
        t = tensors.get(shard.name)
        if t is None:
            problems.append(f"{shard.name}: missing (the layout has it, the tensors do not)")
        elif tuple(t.shape) != tuple(shard.shape) or DTYPE_NAMES.get(t.dtype) != shard.dtype:
            problems.append(f"{shard.name}: {DTYPE_NAMES.get(t.dtype, t.dtype)}{list(t.shape)}, the layout says "
                            f"{shard.dtype}{list(shard.shape)}")
        elif not t.is_contiguous():
            problems.append(f"{shard.name}: not contiguous (strides {t.stride()}, a transposed view?); weightsync "
                            "reads shards through their flat storage: hand it t.contiguous() or lay the tensor out "
                            "contiguously")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ValueError(f"{who}: {len(problems)} tensor(s) disagree with the layout, nothing was sent: {shown}. "
                         "Fix the source (or the model config / layout it was built from) so that they agree")


def strided_view(flat: torch.Tensor, sizes: Sequence[int], strides: Sequence[int], offset: int) -> torch.Tensor:
    """The ``as_strided`` view of a flat tensor's storage that a plan op or region describes."""
    return flat.as_strided(tuple(sizes), tuple(strides), flat.storage_offset() + offset)


def allocate(layout: RankLayout, *, device: str | torch.device = "cpu", fill: float | None = None
             ) -> dict[str, torch.Tensor]:
    """Fresh contiguous tensors for every shard of ``layout`` (zeros, or ``fill``)."""
    out = {}
    for shard in layout.shards:
        t = torch.zeros(shard.shape, dtype=TORCH_DTYPES[shard.dtype], device=device)
        if fill is not None:
            t.fill_(fill)
        out[shard.name] = t
    return out


def fill_from_canonical(layout: RankLayout, tensors: Mapping[str, torch.Tensor],
                        values: Mapping[str, torch.Tensor]) -> None:
    """Copy each region's box of the canonical ``values`` into the local tensors, in place.

    For programs (tests, the demo, benchmarks) that hold full canonical weights and need
    any rank's shards of them.
    """
    for shard in layout.shards:
        flat = tensors[shard.name].detach().view(-1)
        for region in shard.regions:
            view = strided_view(flat, region.box.sizes, region.strides, region.offset)
            view.copy_(values[region.canonical][region.box.slices()])


def named_tensors(module: torch.nn.Module, spec: ModelSpec,
                  clean: Callable[[str], str] = lambda n: n) -> dict[str, torch.Tensor]:
    """A module's parameters, and the buffers that are canonical tensors, by clean name.

    Some canonical tensors are buffers (DeepSeek-V3's and GLM-4.5's router
    ``e_score_correction_bias``: load balancing updates it outside the optimizer); FSDP2 and
    ZeRO-3 leave buffers whole on every rank. Other buffers (rotary tables) are not weights.
    ``clean`` strips what wrappers insert into names.
    """
    out: dict[str, torch.Tensor] = {clean(n): p for n, p in module.named_parameters()}
    for raw, buffer in module.named_buffers():
        name = clean(raw)
        if name not in out and hf_param(spec, name) is not None:
            out[name] = buffer
    return out


def module_layout(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, rank: int) -> RankLayout:
    """Match named tensors (transformers names) to the canonical model; every name must be known.

    Both namings of MoE experts are understood: per-expert checkpoint names and the fused
    ``experts.gate_up_proj``/``experts.down_proj`` of transformers >= 5. Used by training
    sources and engines alike (a whole HF model is the same layout on both sides).

    Raises:
        ValueError: listing names no canonical tensor maps, or shape mismatches.
    """
    shards: list[Shard] = []
    unknown, wrong = [], []
    for name, tensor in named:
        parts = hf_param(spec, name)
        if parts is None:
            unknown.append(name)
            continue
        if tuple(tensor.shape) != parts.shape:
            wrong.append(f"{name}: {tuple(tensor.shape)} != {parts.shape}")
            continue
        regions = parts.box_regions(Box.full(parts.shape), parts.shape)
        shards.append(Shard(name, parts.shape, dtype_name(tensor.dtype), tuple(regions)))
    if unknown:
        raise ValueError(f"{len(unknown)} parameter name(s) match no canonical tensor of the {spec.family} "
                         f"name map: {unknown[:8]}")
    if wrong:
        raise ValueError(f"parameter shapes disagree with the model config: {wrong[:5]}")
    return RankLayout(rank, tuple(shards), spec.canonical_tensors())
