"""MXFP8, MXFP4 and NVFP4 quantize-on-send: writers fill their values twins and scale shards.

A :class:`BlockQuantizer` fills one writer's derived shards (``layout.quant_block_offers``)
before each version is sent, with the arithmetic of :mod:`weightsync.tools.codecs.mx_math`:

1. the block maxima (and, for NVFP4, each expert's or tensor's maximum) of what it holds;
2. one exchange through the job channel (as the FP8 tile maxima): writers publish the partial
   maxima of blocks and global cells that writers' boxes cut, and take the maximum of all;
3. scales from the maxima, then each twin box's values, quantized and packed.

Values and scales of a version come from the same maxima in the same call, and travel in the
same version (and phase: a weight's values, scales and global scales belong to one module,
:func:`weightsync.plan.phases.module_unit`), so a reader never holds values of one version with
scales of another: a version whose scales do not arrive fails whole.

    quantizer = BlockQuantizer(block_sources, rank=3)
    tensors = quantizer.derive(source.tensors(), exchange=lambda payload, publishers: ...)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgpack
import numpy as np
import torch

from weightsync.layout.quant import tile_box
from weightsync.layout.quant_block import GLOBAL, SCALE, BlockTensor
from weightsync.layout.quant_block_offers import BlockSources, TwinRegion
from weightsync.tools.codecs.fp8 import Exchange, tile_maxima
from weightsync.tools.codecs.mx_math import (
    mx_elements,
    mx_scale_codes,
    nvfp4_block_scales,
    nvfp4_elements,
    nvfp4_global_scale,
    pack_nibbles,
)
from weightsync.tools.torch_layout import TORCH_DTYPES, strided_view


class BlockQuantizer:
    """Fills one writer's block-format twins and scale shards for each version (see module docstring)."""

    def __init__(self, sources: BlockSources, *, rank: int) -> None:
        self.rank = rank
        self.sources = sources
        self.derived = dict(sources.derived_of(rank))  # planned shard name -> (what, values name)
        self.twins: list[TwinRegion] = sources.twin_regions(rank)
        self.tensors = sorted({values for _, values in self.derived.values()})
        offers = sources.offers
        self.publishes = [v for v in self.tensors if rank in offers[v].publishers]
        self.listen = sorted({p for v in self.tensors for p in offers[v].publishers
                              if offers[v].exchanged.any() or offers[v].global_exchanged.any()})
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return bool(self.derived)

    def _tensor(self, values: str) -> BlockTensor:
        return self.sources.offers[values].tensor

    def derive(self, tensors: Mapping[str, torch.Tensor], exchange: Exchange) -> dict[str, torch.Tensor]:
        """``tensors`` plus this version's values twins, block scales and global scales."""
        flats = {name: t.detach().reshape(-1) for name, t in tensors.items()}
        device = next(iter(flats.values())).device if flats else torch.device("cpu")
        blocks, cells = self._local_maxima(flats, device)
        payload = self._payload(blocks, cells) if self.publishes else None
        if self.listen or payload is not None:
            for blob in exchange(payload, self.listen):
                self._merge(blob, blocks, cells)
        scales = {v: self._scales(v, blocks[v], cells[v]) for v in self.tensors}
        out = dict(tensors)
        for name, (what, values) in self.derived.items():
            t = self._tensor(values)
            if what == SCALE:
                buf = self._buffer(name, t.scale_shape, t.scheme.scale_dtype, device)
                buf.copy_(scales[values][0])
            elif what == GLOBAL:
                buf = self._buffer(name, t.global_shape, "float32", device)
                buf.copy_(scales[values][1].reshape(t.global_shape))
            else:
                size = sum(r.values_box.numel for r in self.twins if r.twin == name)
                buf = self._buffer(name, (size,), t.scheme.values_dtype, device)
            out[name] = buf
        for region in self.twins:
            self._quantize(region, flats, scales, out)
        return out

    # -- maxima -----------------------------------------------------------------------------
    def _local_maxima(self, flats: Mapping[str, torch.Tensor], device: torch.device
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per weight: the maxima of |x| of the blocks this writer holds (the weight's grid), and of
        each global cell (NVFP4: expert or tensor), over the parts it holds."""
        blocks = {v: torch.zeros(self._tensor(v).grid, dtype=torch.float32, device=device) for v in self.tensors}
        cells = {v: torch.zeros(self._tensor(v).global_shape, dtype=torch.float32, device=device)
                 for v in self.tensors}
        for region in self.twins:
            t = self._tensor(_values_of(self.derived, region.twin))
            values = self._base_values(region, flats)
            at = tile_box(region.base_box, t.tile, t.shape).slices()
            grid = blocks[t.values_name]
            grid[at] = torch.maximum(grid[at], tile_maxima(values, region.base_box, t.tile))
            if t.scheme.global_scale:
                lead = t.lead
                amax = values.abs().float().amax(dim=tuple(range(lead, values.ndim))) if values.numel() else None
                if amax is not None:
                    cell = cells[t.values_name]
                    at_cell = t.global_box(region.base_box).slices()
                    cell[at_cell] = torch.maximum(cell[at_cell], amax.reshape(cell[at_cell].shape))
        return blocks, cells

    def _base_values(self, region: TwinRegion, flats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return strided_view(flats[region.base_shard], region.base_box.sizes, region.base_strides, region.base_offset)

    def _payload(self, blocks: Mapping[str, torch.Tensor], cells: Mapping[str, torch.Tensor]) -> bytes:
        doc = {}
        for values in self.publishes:
            offer = self.sources.offers[values]
            t = offer.tensor
            touched = np.zeros(t.grid, dtype=bool)
            touched_cells = np.zeros(t.global_shape, dtype=bool)
            for region in self.twins:
                if _values_of(self.derived, region.twin) == values:
                    touched[tile_box(region.base_box, t.tile, t.shape).slices()] = True
                    touched_cells[t.global_box(region.base_box).slices()] = True
            idx = np.flatnonzero(touched & offer.exchanged).astype(np.int64)
            cidx = np.flatnonzero(touched_cells & offer.global_exchanged).astype(np.int64)
            block_max = blocks[values].detach().cpu().numpy().reshape(-1)[idx].astype(np.float32)
            cell_max = cells[values].detach().cpu().numpy().reshape(-1)[cidx].astype(np.float32)
            doc[values] = [idx.tobytes(), block_max.tobytes(), cidx.tobytes(), cell_max.tobytes()]
        return msgpack.packb(doc)

    def _merge(self, blob: bytes, blocks: dict[str, torch.Tensor], cells: dict[str, torch.Tensor]) -> None:
        doc = msgpack.unpackb(blob)
        if not isinstance(doc, dict):
            raise ValueError("malformed block-maxima document (not a map)")
        for values in self.tensors:
            entry = doc.get(values)
            if entry is None:
                continue
            if not (isinstance(entry, list) and len(entry) == 4 and all(isinstance(e, bytes) for e in entry)):
                raise ValueError(f"malformed block-maxima entry for {values!r}")
            offer = self.sources.offers[values]
            for grid, mask, (idx_raw, max_raw) in ((blocks[values], offer.exchanged, entry[:2]),
                                                   (cells[values], offer.global_exchanged, entry[2:])):
                idx = np.frombuffer(idx_raw, dtype=np.int64)
                maxima = np.frombuffer(max_raw, dtype=np.float32)
                if idx.size != maxima.size or (idx.size and (idx.min() < 0 or idx.max() >= mask.size)):
                    raise ValueError(f"block-maxima entry for {values!r} does not fit its {mask.shape} grid")
                mine = mask.reshape(-1)[idx]  # only shared cells take others' maxima
                flat = grid.view(-1)
                at = torch.from_numpy(idx[mine]).to(flat.device)
                flat[at] = torch.maximum(flat[at], torch.from_numpy(maxima[mine].copy()).to(flat.device))

    # -- scales and values ------------------------------------------------------------------
    def _scales(self, values: str, blocks: torch.Tensor, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block scales in the scale tensor's order, global scales) of one weight."""
        t = self._tensor(values)
        if not t.scheme.global_scale:
            return mx_scale_codes(blocks, t.scheme.elements).permute(t.perm), cells
        gs = nvfp4_global_scale(cells)
        per_block = gs.reshape(*t.global_shape, *(1,) * (len(t.shape) - t.lead)) if t.lead else gs
        return nvfp4_block_scales(blocks, per_block).permute(t.perm), gs

    def _quantize(self, region: TwinRegion, flats: Mapping[str, torch.Tensor],
                  scales: Mapping[str, tuple[torch.Tensor, torch.Tensor]], out: Mapping[str, torch.Tensor]) -> None:
        t = self._tensor(_values_of(self.derived, region.twin))
        box = region.base_box
        values = self._base_values(region, flats).float().permute(t.perm)
        # each element's block scale: the scale tensor at its head indices and block
        head = [slice(box.offsets[d], box.ends[d]) for d in t.perm[:-1]]
        k0, k1 = box.offsets[t.axis], box.ends[t.axis]
        kb = torch.arange(k0, k1, device=values.device) // t.scheme.block
        block_scales, gs = scales[t.values_name]
        per_element = block_scales[tuple(head)].index_select(-1, kb)
        if t.scheme.global_scale:
            g = gs[box.offsets[0]:box.ends[0]].reshape(-1, *(1,) * (values.ndim - 1)) if t.lead else gs
            codes = nvfp4_elements(values, per_element, g)
        else:
            codes = mx_elements(values, per_element, t.scheme.elements)
        data = pack_nibbles(codes) if t.scheme.pack == 2 else codes
        flat = out[region.twin].view(-1)
        flat[region.offset: region.offset + region.values_box.numel].copy_(data.reshape(-1))

    def _buffer(self, name: str, shape: Sequence[int], dtype: str, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.device != device:
            buf = torch.zeros(tuple(shape), dtype=TORCH_DTYPES[dtype], device=device)
            self._buffers[name] = buf
        return buf


def _values_of(derived: Mapping[str, tuple[str, str]], twin: str) -> str:
    return derived[twin][1]


__all__ = ["BlockQuantizer"]
