"""DTensorSource on real FSDP2 and 2-D FSDP2 x TP models: forked gloo ranks on CPU.

The model is a tiny transformers Qwen3-MoE (layer 0 dense, layer 1 with 3 fused experts)
whose sizes do not divide by the ranks. Every region the source reports is read from the
live local shard and compared, bit for bit, with the canonical tensor rebuilt from
``full_tensor()`` (the only gather, test side), and the layout must equal the pure
``fsdp:`` layout kind.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from _sources import HF, assert_covered, check_source, hf_canonical, module_with, run_ranks, tiny_model
from weightsync.layout import ModelSpec, parse_layout
from weightsync.layout.params import run_boxes
from weightsync.sources.param_mapping import same_layout

pytestmark = pytest.mark.xdist_group("sources-dtensor")


def import_frameworks() -> None:
    """Import what the ranks need once, in the test process (forked ranks inherit it)."""
    pytest.importorskip("torch.distributed.fsdp", reason="this torch build has no FSDP2")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install weightsync[transformers])")
    import torch.distributed.tensor.parallel  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401


def checked(model: torch.nn.Module, config: dict, rank: int, kind: str) -> tuple[list, object]:
    """The source's regions checked against full_tensor(); its layout against ``kind``."""
    from torch.distributed.tensor import DTensor

    from weightsync.sources.dtensor import DTensorSource

    source = DTensorSource(model, config, rank=rank)
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
    live = {n: p._local_tensor if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    held = check_source(source, hf_canonical(full, source.spec), live)
    assert same_layout(source.layout(), parse_layout(kind).rank_layout(source.spec, rank))
    return held, source.descriptor()


# -- FSDP2, 2 ranks ---------------------------------------------------------------------

def _fsdp_rank(rank: int, world: int) -> tuple[list, object, list]:
    from torch.distributed.fsdp import fully_shard

    from weightsync.sources.dtensor import DTensorSource

    model = tiny_model(HF)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = DTensorSource(model, HF, rank=rank)  # built before training: the shards stay put
    ids = torch.randint(0, HF["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    held, descriptor = checked(model, HF, rank, "fsdp:dp=2")
    assert source.layout() == DTensorSource(model, HF, rank=rank).layout()
    errors = []
    model.unshard()  # what forward does: the root's parameters become whole plain tensors
    try:
        source.tensors()
    except ValueError as exc:
        errors.append(str(exc))
    model.reshard()
    source.tensors()
    sizes = [tuple(p._local_tensor.shape) for n, p in model.named_parameters() if n == "model.embed_tokens.weight"]
    return held, descriptor, errors + sizes


def test_fsdp2_two_ranks_uneven_after_training_steps():
    import_frameworks()
    results = run_ranks(_fsdp_rank, 2)
    spec = ModelSpec.from_hf_config(HF)
    assert_covered([held for held, _, _ in results], {n: t.shape for n, t in spec.canonical_tensors().items()})
    for _, descriptor, (error, embed) in results:
        assert descriptor[0] == "fsdp:dp=2"
        assert "read the weights between optimizer steps" in error
    assert [r[2][1] for r in results] == [(51, 31), (50, 31)]  # 101 rows, torch.chunk style


# -- FSDP2 x TP, 4 ranks ------------------------------------------------------------------

def _fsdp_tp_rank(rank: int, world: int, config: dict) -> tuple[list, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tiny_model(config)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(2):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel()})
    plan.update({"model.layers.0.mlp.gate_proj": ColwiseParallel(), "model.layers.0.mlp.up_proj": ColwiseParallel(),
                 "model.layers.0.mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    # fused experts as transformers' TP plan shards them: packed [gate_t; up_t], down by columns
    experts = model.model.layers[1].mlp.experts
    for name, placement in (("gate_up_proj", _StridedShard(1, split_factor=2)), ("down_proj", Shard(2))):
        weight = distribute_tensor(getattr(experts, name).detach(), mesh["tp"], [placement], src_data_rank=None)
        experts.register_parameter(name, torch.nn.Parameter(weight))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return checked(model, config, rank, "fsdp:dp=2,tp=2")


def test_fsdp2_x_tp_four_ranks_strided_shards_and_an_empty_shard():
    import_frameworks()
    config = {**HF, "vocab_size": 3}  # 3 rows: TP 2 + 1, then FSDP 1 + 1 and 1 + 0 (empty)
    results = run_ranks(_fsdp_tp_rank, 4, config)
    spec = ModelSpec.from_hf_config(config)
    assert_covered([held for held, _ in results], {n: t.shape for n, t in spec.canonical_tensors().items()})
    assert {d[0] for _, d in results} == {"fsdp:dp=2,tp=2"}
    embed_boxes = [[box for name, box in held if name == "model.embed_tokens.weight"] for held, _ in results]
    assert [len(b) for b in embed_boxes] == [1, 1, 1, 0]  # rank (d=1, t=1) holds nothing


# -- placements, without processes -----------------------------------------------------

def _chunk(indices: list[int], parts: int, index: int) -> list[int]:
    pieces = [c.tolist() for c in torch.tensor(indices, dtype=torch.long).chunk(parts)] if indices else []
    return pieces[index] if index < len(pieces) else []


@pytest.mark.parametrize("n", [1, 3, 5, 7, 10, 13])
def test_placement_runs_match_torch_chunk_index_lists(n):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from weightsync.sources.dtensor import placement_runs

    def indices(runs):
        return [s + i for s, length in runs for i in range(length)]

    for dp, tp in itertools.product((1, 2, 3), (1, 2, 3)):
        for d, t in itertools.product(range(dp), range(tp)):
            rows = list(range(n))
            # FSDP2 over TP (physically: TP chunk, then FSDP chunk of it)
            fsdp_tp = (_StridedShard(0, split_factor=tp) if tp > 1 else Shard(0), Shard(0))
            runs = placement_runs((n, 2), (dp, tp), (d, t), fsdp_tp)
            assert indices(runs[0]) == _chunk(_chunk(rows, tp, t), dp, d)
            assert runs[1] == ((0, 2),)
            # transformers' packed [gate; up]: two halves, chunk t of each (torch's convention)
            packed = placement_runs((2 * n,), (tp,), (t,), (_StridedShard(0, split_factor=2),))
            assert indices(packed[0]) == _chunk(rows, tp, t) + [n + i for i in _chunk(rows, tp, t)]
            # HSDP: replicated over dim 0 of the mesh, sharded over dim 1
            hsdp = placement_runs((n,), (dp, tp), (d, t), (Replicate(), Shard(0)))
            assert indices(hsdp[0]) == _chunk(rows, tp, t)
            if not indices(runs[0]):
                assert run_boxes(runs) == []  # an empty shard holds no region


def test_whole_models_unknown_names_wrong_shapes_and_partial_placements():
    from torch.distributed.tensor import Partial

    from weightsync.layout.params import hf_params
    from weightsync.sources.dtensor import DTensorSource, placement_runs

    spec = ModelSpec.from_hf_config(HF)
    shapes = {name: parts.shape for name, parts in hf_params(spec).items()}
    source = DTensorSource(module_with(shapes), HF, rank=0)  # no DTensor: one whole copy
    assert same_layout(source.layout(), parse_layout("hf").rank_layout(spec, 0)) is False  # fused names
    assert same_layout(source.layout(), parse_layout("fsdp:dp=1").rank_layout(spec, 0))
    with pytest.raises(ValueError, match=r"1 model parameter\(s\) match no canonical tensor .*'extra.weight'"):
        DTensorSource(module_with({**shapes, "extra.weight": (2,)}), HF, rank=0)
    with pytest.raises(ValueError, match=r"model\.norm\.weight: global shape"):
        DTensorSource(module_with({**shapes, "model.norm.weight": (30,)}), HF, rank=0)
    with pytest.raises(ValueError, match="not a slice"):
        placement_runs((4,), (2,), (0,), (Partial(),))
