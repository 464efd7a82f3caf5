"""FP8 quantize-on-send: writers turn the weights they send into FP8 values and scales.

The quantizer is one fixed function, the same on every rank and device, so that an FP8
weight assembled from many writers' pieces is bit for bit the reference applied to the
whole tensor (:func:`reference_quantize`):

    amax  = max |x| over the tile (exact in fp32), floored at 1e-4   (vLLM / DeepSeek-V3)
    scale = amax / 448                      (fp32; ``weight_scale_inv`` / ``weight_scale``)
    q     = clamp(x.float() / scale, -448, 448).to(float8_e4m3fn)   (IEEE division, RNE cast)

Every step is correctly rounded in eager torch on CPU and GPU, and the clamp makes the cast
independent of torch's saturation behaviour. A :class:`WriterQuantizer` fills a writer's
FP8 twins and scale shards (``layout.quant_offers``) before each version is sent: it computes the
tile maxima of what it holds, exchanges the maxima of tiles that writers share (one small
document per writer and version through the job channel), and quantizes only the boxes its
plan sends.

    quantizer = WriterQuantizer(quant_sources, planned_layout, plan)
    tensors = quantizer.derive(source.tensors(), exchange=lambda payload, publishers: ...)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import msgpack
import numpy as np
import torch

from weightsync.layout.box import Box
from weightsync.layout.quant import QuantScheme, tile_box
from weightsync.layout.quant_offers import QuantSources
from weightsync.layout.types import RankLayout
from weightsync.plan import Plan, TransferOp
from weightsync.tools.torch_layout import TORCH_DTYPES, strided_view

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
#: elements per chunk of fp32 work (bounds the quantizer's scratch memory to ~64 MiB)
CHUNK_ELEMENTS = 1 << 24

#: Exchange(payload, publishers) publishes this writer's payload (when it is a publisher)
#: and returns the payloads of ``publishers`` (its own included).
Exchange = Callable[[bytes | None, Sequence[int]], list[bytes]]


def _chunks(values: torch.Tensor, box: Box, tile: Sequence[int]) -> Iterator[tuple[torch.Tensor, Box]]:
    """Pieces of a box along dim 0, cut on tile boundaries, of at most ~CHUNK_ELEMENTS."""
    if box.ndim == 0 or box.empty:
        yield values, box
        return
    per_row = max(1, box.numel // max(box.sizes[0], 1))
    t = tile[0]
    step = max(t, (CHUNK_ELEMENTS // per_row) // t * t)
    lo = box.offsets[0]
    end = box.ends[0]
    while lo < end:
        hi = min(end, (lo // step + 1) * step)
        offs = (lo, *box.offsets[1:])
        yield values[lo - box.offsets[0]: hi - box.offsets[0]], Box(offs, (hi - lo, *box.sizes[1:]))
        lo = hi


def _tiled(values: torch.Tensor, box: Box, tile: Sequence[int], dtype: torch.dtype | None
           ) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """``values`` (one chunk) as a ``(c0, t0, c1, t1, ...)`` view of whole tiles.

    A box that starts and ends on tile boundaries is viewed as it is (converted to ``dtype``
    when given); any other is copied into a zero buffer of whole tiles first, and the slices
    that select the box in that buffer are returned too.
    """
    pre = [o % t for o, t in zip(box.offsets, tile, strict=True)]
    counts = [-(-(p + s) // t) for p, s, t in zip(pre, box.sizes, tile, strict=True)]
    split = [x for c, t in zip(counts, tile, strict=True) for x in (c, t)]
    if not any(pre) and all(c * t == s for c, t, s in zip(counts, tile, box.sizes, strict=True)):
        data = values if dtype is None else values.to(dtype)
        return data.contiguous().view(split), None
    buf = torch.zeros([c * t for c, t in zip(counts, tile, strict=True)], dtype=dtype or values.dtype,
                      device=values.device)
    inside = tuple(slice(p, p + s) for p, s in zip(pre, box.sizes, strict=True))
    buf[inside] = values
    return buf.view(split), inside


def tile_maxima(values: torch.Tensor, box: Box, tile: Sequence[int]) -> torch.Tensor:
    """max |x| of each tile ``box`` touches, over the part of it ``values`` (the box) holds.

    Returns a float32 tensor shaped like ``tile_box(box)``. Padding up to tile boundaries
    is zero, which never raises a maximum of absolute values; ``abs`` and ``max`` are exact
    in the source dtype, so they run there and only the maxima become float32.
    """
    parts = []
    for chunk, sub in _chunks(values, box, tile):
        tiles, _ = _tiled(chunk, sub, tile, None)
        parts.append(tiles.abs().amax(dim=tuple(range(1, 2 * len(tile), 2))).float() if tile else tiles.float())
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def scales_of(maxima: torch.Tensor) -> torch.Tensor:
    """Per-tile scales (``weight_scale_inv``: dequantized = q * scale) from tile maxima."""
    return maxima.float().clamp(min=AMAX_FLOOR) / FP8_MAX


def _expand(scales: torch.Tensor, box: Box, tile: Sequence[int]) -> torch.Tensor:
    """Per-element scales of ``box`` from the scales of the tiles it touches."""
    out = scales
    for d, (o, s, t) in enumerate(zip(box.offsets, box.sizes, tile, strict=True)):
        first, last = o // t, (o + s - 1) // t
        if first == last:
            out = out.expand(*out.shape[:d], s, *out.shape[d + 1:]) if out.shape[d] == 1 else out
            continue
        counts = [min(o + s, (i + 1) * t) - max(o, i * t) for i in range(first, last + 1)]
        out = out.repeat_interleave(torch.tensor(counts, device=out.device), dim=d)
    return out


def quantize_box(values: torch.Tensor, box: Box, tile: Sequence[int], scales: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Write FP8 values of ``box`` into ``out`` (same sizes) given the full scale grid.

    Each tile is divided by its own scale through a broadcast over the tiled view (no
    per-element scale tensor is built).
    """
    for chunk, sub in _chunks(values, box, tile):
        tiles, inside = _tiled(chunk, sub, tile, torch.float32)
        grid = scales[tile_box(sub, tile, ()).slices()]
        per_tile = grid.reshape([x for c in grid.shape for x in (c, 1)])
        q = (tiles / per_tile).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        q = q.view([c * t for c, t in zip(grid.shape, tile, strict=True)])
        at = tuple(slice(a - b, a - b + n) for a, b, n in zip(sub.offsets, box.offsets, sub.sizes, strict=True))
        out[at].copy_(q if inside is None else q[inside])


def reference_quantize(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole tensor quantized at once: (FP8 values, float32 scales of ``scheme.grid``)."""
    box = Box.full(tuple(weight.shape))
    tile = scheme.tile(weight.shape)
    scales = scales_of(tile_maxima(weight, box, tile))
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    quantize_box(weight, box, tile, scales, q)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """float32 weights back from FP8 values and their scales (for checks and HF engines)."""
    box = Box.full(tuple(q.shape))
    return q.float() * _expand(scales, box, scheme.tile(q.shape))


class WriterQuantizer:
    """Fills one writer's FP8 twins and scale shards for each version (see module docstring)."""

    def __init__(self, sources: QuantSources, layout: RankLayout, plan: Plan) -> None:
        self.rank = layout.rank
        self.sources = sources
        self.plan = plan
        self.twins = sources.twins(self.rank)
        self.scale_shards = sources.scales(self.rank)
        shards = {s.name: s for s in layout.shards}
        #: fp8 canonical -> [(base shard, region)] this writer holds
        self.held: dict[str, list[tuple[str, Box, int, tuple[int, ...]]]] = {}
        for twin, base in self.twins.items():
            for r in shards[twin].regions:
                self.held.setdefault(r.canonical, []).append((base, r.box, r.offset, r.strides))
        # This runs at job start on every writer: read the plan's columns, not its op objects.
        c = plan.columns
        mine = np.flatnonzero(c.src_rank == self.rank)
        names = {i: plan.src_shards[i].name for i in np.unique(c.src_shard[mine]).tolist()}
        self._value_rows = mine[np.isin(c.src_shard[mine], [i for i, n in names.items() if n in self.twins])]
        scale_rows = mine[np.isin(c.src_shard[mine], [i for i, n in names.items() if n in self.scale_shards])]
        #: the FP8 tensors whose tiles this writer's ops need
        self.needed = sorted({plan.tensors[t] for t in np.unique(c.tensor[self._value_rows]).tolist()}
                             | {self.scale_shards[names[i]] for i in np.unique(c.src_shard[scale_rows]).tolist()})
        #: tensors whose needed tiles include exchanged ones, and the writers to hear from
        self.exchanged = [n for n in self.needed if sources.tensors[n].publishers
                          and (self._needed_tiles(n, scale_rows) & sources.tensors[n].exchanged).any()]
        self.listen = sorted({w for n in self.exchanged for w in sources.tensors[n].publishers})
        self.publishes = sorted(n for n, qt in sources.tensors.items()
                                if self.rank in qt.publishers and n in self.held)
        self._active = bool(len(self._value_rows) or len(scale_rows) or self.publishes)
        self._buffers: dict[str, torch.Tensor] = {}

    def _needed_tiles(self, fp8: str, scale_rows: np.ndarray) -> np.ndarray:
        """The tiles of ``fp8`` this writer's ops need (its values' tiles, its scale boxes)."""
        qt = self.sources.tensors[fp8]
        c, tensors = self.plan.columns, self.plan.tensors
        mask = np.zeros(qt.grid, dtype=bool)
        ndim = len(qt.shape)
        for i in self._value_rows[[tensors[t] == fp8 for t in c.tensor[self._value_rows].tolist()]].tolist():
            box = Box(tuple(c.off[i, :ndim].tolist()), tuple(c.size[i, :ndim].tolist()))
            mask[tile_box(box, qt.tile, qt.shape).slices()] = True
        scale = qt.scheme.scale_name(qt.base)
        for i in scale_rows[[tensors[t] == scale for t in c.tensor[scale_rows].tolist()]].tolist():
            mask[tuple(slice(o, o + n) for o, n in zip(c.off[i, :ndim].tolist(), c.size[i, :ndim].tolist(),
                                                        strict=True))] = True
        return mask

    @functools.cached_property
    def value_ops(self) -> list[TransferOp]:
        """The ops that send this writer's FP8 values (expanded at the first version, with the
        plan's ops the transport expands anyway)."""
        ops = self.plan.ops
        return [ops[i] for i in self._value_rows.tolist()]

    @property
    def active(self) -> bool:
        return self._active

    def _buffer(self, name: str, like: torch.Tensor | None, shape: Sequence[int], dtype: str) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or (like is not None and buf.device != like.device):
            device = like.device if like is not None else torch.device("cpu")
            buf = torch.zeros(tuple(shape), dtype=TORCH_DTYPES[dtype], device=device)
            self._buffers[name] = buf
        return buf

    def derive(self, tensors: Mapping[str, torch.Tensor], exchange: Exchange) -> dict[str, torch.Tensor]:
        """``tensors`` plus this version's FP8 twins and scale shards."""
        flats = {name: t.detach().reshape(-1) for name, t in tensors.items()}
        maxima = {n: self._local_maxima(n, flats) for n in sorted(set(self.needed) | set(self.publishes))}
        payload = self._payload(maxima) if self.publishes else None
        if self.exchanged or payload is not None:
            for blob in exchange(payload, self.listen):
                self._merge(blob, maxima)
        scales = {n: scales_of(m) for n, m in maxima.items()}
        out = dict(tensors)
        for twin, base in self.twins.items():
            out[twin] = self._buffer(twin, tensors[base], tuple(tensors[base].shape), "float8_e4m3fn")
        for shard, fp8 in self.scale_shards.items():
            buf = self._buffer(shard, tensors[self.held[fp8][0][0]], self.sources.tensors[fp8].grid, "float32")
            if fp8 in scales:
                buf.copy_(scales[fp8])
            out[shard] = buf
        for op in self.value_ops:
            qt = self.sources.tensors[op.canonical]
            base = self.twins[op.src_shard]
            values = strided_view(flats[base], op.box.sizes, op.src_strides, op.src_offset)
            dst = strided_view(out[op.src_shard].view(-1), op.box.sizes, op.src_strides, op.src_offset)
            quantize_box(values, op.box, qt.tile, scales[op.canonical], dst)
        return out

    def _local_maxima(self, fp8: str, flats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        qt = self.sources.tensors[fp8]
        held = self.held.get(fp8, [])
        device = flats[held[0][0]].device if held else torch.device("cpu")
        grid = torch.zeros(qt.grid, dtype=torch.float32, device=device)
        for base, box, offset, strides in held:
            values = strided_view(flats[base], box.sizes, strides, offset)
            at = tile_box(box, qt.tile, qt.shape).slices()
            grid[at] = torch.maximum(grid[at], tile_maxima(values, box, qt.tile))
        return grid

    def _payload(self, maxima: Mapping[str, torch.Tensor]) -> bytes:
        doc = {}
        for fp8 in self.publishes:
            qt = self.sources.tensors[fp8]
            touched = np.zeros(qt.grid, dtype=bool)
            for _, box, _, _ in self.held[fp8]:
                touched[tile_box(box, qt.tile, qt.shape).slices()] = True
            idx = np.flatnonzero(touched & qt.exchanged).astype(np.int64)
            values = maxima[fp8].detach().cpu().numpy().reshape(-1)[idx].astype(np.float32)
            doc[fp8] = [idx.tobytes(), values.tobytes()]
        return msgpack.packb(doc)

    def _merge(self, blob: bytes, maxima: dict[str, torch.Tensor]) -> None:
        doc = msgpack.unpackb(blob)
        if not isinstance(doc, dict):
            raise ValueError("malformed tile-maxima document (not a map)")
        for fp8 in self.exchanged:
            entry = doc.get(fp8)
            if entry is None:
                continue
            if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, bytes) for e in entry)):
                raise ValueError(f"malformed tile-maxima entry for {fp8!r}")
            qt = self.sources.tensors[fp8]
            idx = np.frombuffer(entry[0], dtype=np.int64)
            values = np.frombuffer(entry[1], dtype=np.float32)
            size = int(np.prod(qt.grid))
            if idx.size != values.size or (idx.size and (idx.min() < 0 or idx.max() >= size)):
                raise ValueError(f"tile-maxima entry for {fp8!r} does not fit its {qt.grid} grid")
            mine = qt.exchanged.reshape(-1)[idx]  # only shared tiles take others' maxima
            flat = maxima[fp8].view(-1)
            at = torch.from_numpy(idx[mine]).to(flat.device)
            flat[at] = torch.maximum(flat[at], torch.from_numpy(values[mine].copy()).to(flat.device))


__all__ = ["FP8_MAX", "WriterQuantizer", "dequantize", "quantize_box", "reference_quantize", "scales_of",
           "tile_maxima"]
