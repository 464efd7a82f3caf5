"""FSDP2 and DTensor tensor-parallel models with Hugging Face parameter names.

``DTensorSource`` reads each parameter's local shard (``DTensor._local_tensor``, no copy)
and where it sits in the global tensor from the placements and the device mesh, so nothing
is gathered. It covers FSDP2 ``fully_shard`` (also HSDP), DTensor TP (``parallelize_module``,
transformers' own TP plans) and 2-D FSDP x TP. A parameter that is not a DTensor (a norm
under TP only) is a whole copy; every replicated copy is one more holder, which the
planner spreads the load over.

    fully_shard(...) / parallelize_module(...)
    source = DTensorSource(model, hf_config, rank=dist.get_rank())
    for step in range(steps):
        train_step(model); optimizer.step()
        writer.push(version=step)      # between steps, while the parameters are sharded

Read between optimizer steps: FSDP2 swaps a module's parameters for unsharded plain
tensors during its forward and backward (and after ``unshard()``); the source raises then.

Placements: ``Shard(d)`` splits like ``torch.chunk`` (trailing ranks may be short or empty);
``_StridedShard`` is read in torch's convention (cut into ``split_factor`` pieces, keep chunk
``i`` of each; transformers' packed ``gate_up_proj``), except the one FSDP2 writes over a
TP-sharded dimension. That one's split factor equals the number of shards to its right on
the same dimension, and FSDP2 physically chunks the TP-local tensor, so it is applied after
them (torch's left-to-right reading of that label disagrees with the stored rows for some
uneven sizes). ``Partial`` placements are not slices and are refused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightsync.layout import Box, ModelSpec, RankLayout, Shard
from weightsync.layout.params import (
    ParamParts,
    Runs,
    chunk_runs,
    hf_param,
    run_boxes,
    runs_length,
    strided_runs,
)
from weightsync.sources.param_mapping import check_known, clean_name, matching_descriptor, read_config, uniform_dtype
from weightsync.tools.torch_layout import dtype_name, named_tensors


def placement_runs(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                   placements: Sequence[Any]) -> list[Runs]:
    """The global indices each local dimension holds, from DTensor placements.

    Raises:
        ValueError: on ``Partial`` (or unknown) placements, which are not slices.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard

    ndim = len(shape)

    def sharded_dim(p: Any) -> int | None:
        return p.dim % ndim if isinstance(p, (DShard, _StridedShard)) else None

    runs: list[Runs] = [((0, int(n)),) for n in shape]
    deferred: list[int] = []
    for i, p in enumerate(placements):
        dim = sharded_dim(p)
        if dim is not None and isinstance(p, _StridedShard):
            right = math.prod(mesh_shape[j] for j in range(i + 1, len(placements))
                              if sharded_dim(placements[j]) == dim)
            if p.split_factor == right:  # FSDP2 over TP: chunk after the placements to the right
                deferred.append(i)
            else:
                runs[dim] = strided_runs(runs[dim], mesh_shape[i], coordinate[i], int(p.split_factor))
        elif dim is not None:
            runs[dim] = chunk_runs(runs[dim], mesh_shape[i], coordinate[i])
        elif not isinstance(p, Replicate):
            raise ValueError(f"placement {p} is not a slice of the global tensor (only Shard, "
                             "_StridedShard and Replicate are)")
    for i in reversed(deferred):
        dim = sharded_dim(placements[i])
        assert dim is not None
        runs[dim] = chunk_runs(runs[dim], mesh_shape[i], coordinate[i])
    return runs


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    local = param._local_tensor if isinstance(param, DTensor) else param
    return local.detach()


def _shard(name: str, param: torch.Tensor, parts: ParamParts) -> Shard:
    from torch.distributed.tensor import DTensor

    if tuple(param.shape) != parts.shape:
        raise ValueError(f"{name}: global shape {tuple(param.shape)} differs from {parts.shape}, "
                         "the shape the model config gives")
    local = _local(param)
    if not local.is_contiguous():
        raise ValueError(f"{name}: the local tensor (strides {local.stride()}) is not contiguous")
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"{name}: this rank is not in the parameter's device mesh {mesh}")
        runs = placement_runs(param.shape, mesh.shape, coordinate, param.placements)
        if tuple(runs_length(r) for r in runs) != tuple(local.shape):
            raise ValueError(f"{name}: placements {param.placements} on mesh {tuple(mesh.shape)} give a "
                             f"local shape {tuple(runs_length(r) for r in runs)}, the local tensor is "
                             f"{tuple(local.shape)}")
        pairs = run_boxes(runs)
    else:
        pairs = [(Box.full(local.shape), Box.full(local.shape))]
    regions = [r for lbox, gbox in pairs for r in parts.box_regions(gbox, local.shape, lbox.offsets)]
    return Shard(name, tuple(local.shape), dtype_name(local.dtype), tuple(regions))


def _unsharded_fsdp_params(model: torch.nn.Module) -> list[str]:
    """Names of parameters FSDP2 manages that are plain tensors now (unsharded)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    managed: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            managed.update(id(p) for p in module.parameters())
    return [n for n, p in model.named_parameters() if id(p) in managed and not isinstance(p, DTensor)]


class DTensorSource:
    """A model sharded with FSDP2 and/or DTensor TP, parameters named like transformers'.

    Args:
        model: the module after ``fully_shard``/``parallelize_module``; its parameter names
            (wrapper segments such as ``_orig_mod.`` removed) are transformers names, fused
            (transformers >= 5) or per-expert MoE experts alike.
        config: the Hugging Face config (dict) or a ModelSpec.
        rank: this writer's rank.

    Raises:
        ValueError: listing parameter names no canonical tensor matches, on shapes that
            disagree with the config, on ``Partial`` placements, or when FSDP2 has the
            parameters unsharded (build the source between optimizer steps).
    """

    def __init__(self, model: torch.nn.Module, config: Mapping[str, Any] | ModelSpec, *, rank: int) -> None:
        self.model = model
        self.spec, self.config = read_config(config)
        params = self._named_params()
        parts = {name: hf_param(self.spec, name) for name in params}
        check_known([name for name, p in parts.items() if p is None], self.spec, "model")
        shards = [_shard(name, params[name], p) for name, p in parts.items() if p is not None]
        self._layout = RankLayout(rank, tuple(shards), self.spec.canonical_tensors())
        self._shapes = {s.name: s.shape for s in shards}

    def _named_params(self) -> dict[str, torch.Tensor]:
        unsharded = _unsharded_fsdp_params(self.model)
        if unsharded:
            raise ValueError(
                f"FSDP2 has {len(unsharded)} parameter(s) unsharded right now ({unsharded[:3]}...): "
                "read the weights between optimizer steps, not inside forward/backward or after unshard()"
            )
        return named_tensors(self.model, self.spec, clean_name)

    def layout(self) -> RankLayout:
        return self._layout

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The live local shards (re-read from the model on every call, no copies)."""
        out = {}
        for name, param in self._named_params().items():
            local = _local(param)
            if tuple(local.shape) != self._shapes[name]:
                raise ValueError(f"{name}: the local tensor is now {tuple(local.shape)}, the layout "
                                 f"says {self._shapes[name]}; was the model re-sharded?")
            out[name] = local
        return out

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        """``fsdp:dp=..,tp=..`` when this rank's shards are exactly that kind's."""
        return self._descriptor

    @functools.cached_property
    def _descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return matching_descriptor(self._layout, self.spec, self.config, self._candidates())

    def _candidates(self) -> list[str]:
        from torch.distributed.tensor import DTensor

        meshes = [tuple(p.device_mesh.shape) for p in self.model.parameters() if isinstance(p, DTensor)]
        if not meshes:
            return []
        shape = max(meshes, key=len)
        if len(shape) == 1:  # FSDP2 alone, or TP alone
            kinds = [f"fsdp:dp={shape[0]}", f"fsdp:tp={shape[0]}"]
        elif len(shape) == 2:  # (dp, tp)
            kinds = [f"fsdp:dp={shape[0]},tp={shape[1]}"]
        else:
            return []
        suffix = uniform_dtype(self._layout, self.spec)
        if self.spec.is_moe and any(".experts.0." in s.name for s in self._layout.shards):
            suffix += ",per_expert=1"
        return [k + suffix for k in kinds]
