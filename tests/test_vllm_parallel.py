"""A TP worker's reader receives only the slices its vLLM loaders read (issue 41): the layout
restriction (pure), and the reads of each TP rank of a tiny Qwen3 recorded from vLLM's loaders.
The engines themselves run in tests/test_vllm_tp.py."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from weightsync.layout import ModelSpec
from weightsync.layout.box import Box
from weightsync.layout.kinds.hf import HFLayout
from weightsync.layout.restrict import disjoint, restrict
from weightsync.tools.tiny import tiny_config

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def _covered(layout, name):
    """Per element of canonical tensor ``name``: how many regions of ``layout`` hold it."""
    shape = layout.canonical[name].shape
    count = np.zeros(shape, dtype=np.int64)
    for shard in layout.shards:
        for region in shard.regions:
            if region.canonical == name:
                count[region.box.slices()] += 1
    return count


def test_restrict_keeps_the_shards_and_cuts_their_regions_to_the_boxes_read():
    spec = ModelSpec.from_hf_config(tiny_config())
    full = HFLayout(replicas=1).rank_layout(spec, 0)
    name = "model.layers.0.mlp.down_proj.weight"
    rows, cols = full.canonical[name].shape
    half = Box((0, cols // 2), (rows, cols // 2))
    cut = restrict(full, {name: [half], "model.norm.weight": [Box.full(full.canonical["model.norm.weight"].shape)]})
    assert [(s.name, s.shape, s.dtype) for s in cut.shards] == [(s.name, s.shape, s.dtype) for s in full.shards]
    shard = next(s for s in cut.shards if s.name == name)
    (region,) = shard.regions
    assert region.box == half and region.offset == cols // 2 and region.strides == (cols, 1)  # in the whole tensor
    assert _covered(cut, "model.norm.weight").min() == 1
    assert not any(s.regions for s in cut.shards if s.name not in (name, "model.norm.weight"))  # nobody reads them


def test_overlapping_boxes_keep_the_whole_region():
    a, b = Box((0, 0), (4, 4)), Box((2, 2), (4, 4))
    assert disjoint([a, b]) is None
    assert disjoint([a, a, Box((4, 0), (4, 4))]) == [a, Box((4, 0), (4, 4))]


@needs_vllm
def test_two_tp_workers_read_each_sharded_element_once_and_every_replicated_one_both():
    from weightsync.engines import vllm_parallel

    config = tiny_config()
    spec = ModelSpec.from_hf_config(config)
    full = HFLayout(replicas=1).rank_layout(spec, 0)

    def engine(t):
        parallel = SimpleNamespace(tensor_parallel_size=2, data_parallel_size=1, data_parallel_rank=0,
                                   enable_expert_parallel=False, pipeline_parallel_size=1)
        model = SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: config), dtype=torch.float32)
        return SimpleNamespace(parallel_config=parallel, model_config=model)

    from unittest import mock

    layouts = []
    for t in (0, 1):
        # the worker's TP rank, as vLLM's parallel state says it in a worker (vLLM's own function is not
        # patched: its layers bind it when first imported, and the recording imports them)
        with mock.patch.object(vllm_parallel, "tensor_rank", return_value=(2, t)):
            reads = vllm_parallel.worker_reads(engine(t))
        assert reads is not None
        layouts.append(restrict(full, reads))
    total = full_bytes = 0
    for name, tensor in full.canonical.items():
        both = _covered(layouts[0], name) + _covered(layouts[1], name)
        sharded = any(part in name for part in ("proj", "embed", "lm_head"))
        assert both.min() == both.max() == (1 if sharded else 2), name
        full_bytes += tensor.nbytes
        total += sum(_covered(lay, name).sum() for lay in layouts) * tensor.nbytes // both.size
    assert full_bytes < total < 2 * full_bytes  # the norms twice, everything else once


@needs_vllm
def test_every_worker_of_a_tp_dp_engine_is_its_own_reader_rank():
    """Worker ``t`` of DP replica ``d`` is reader ``first + d * TP + t``: DP replicas used to share
    the engine's first rank (issue 39, item 3), and TP workers had none of their own."""
    from unittest import mock

    from weightsync.engines import vllm_parallel
    from weightsync.integrations.vllm_backend import reader_rank

    def engine(d):
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, data_parallel_size=2,
                                                               data_parallel_rank=d, pipeline_parallel_size=1))

    ranks = []
    for d in (0, 1):
        for t in (0, 1):
            with mock.patch.object(vllm_parallel, "tensor_rank", return_value=(2, t)):
                ranks.append(reader_rank(4, 8, engine(d)))
    assert ranks == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"this engine has 4 workers \(TP x DP\), each a weightsync reader, from "
                                         r"reader rank 5: num_readers=8 must be at least 9"):
        reader_rank(5, 8, engine(0))
