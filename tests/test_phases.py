"""Phases of whole layers: a reader stages one phase at a time (issue 14's bounded memory).

The pure part (which layers go together, the plan cut by phase) and the whole path: two
training processes write versions in phases, over every transport, into a staged engine
whose arena is the largest phase; every phase's tensors are checked bitwise as they arrive.
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

import pytest
import torch

from weightsync.configs import load_spec
from weightsync.engines.staging import StagedWeights
from weightsync.layout import ModelSpec, parse_layout
from weightsync.plan import PlanOptions, build_plan, layer_index, layer_phases, split_plan
from weightsync.tools.tiny import canonical_weights, checkpoint_tensors, tiny_config

HERE = Path(__file__).resolve().parent


def test_phases_hold_whole_fused_modules_in_layer_order_within_the_budget():
    from weightsync.plan.phases import module_unit

    spec = load_spec("tiny-qwen3-moe")
    canonical = spec.canonical_tensors()
    units: dict[str, list[str]] = {}
    for name in canonical:
        units.setdefault(module_unit(name), []).append(name)
    assert units["model.layers.1.self_attn.qkv_proj"] == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    assert len(units["model.layers.1.mlp.experts"]) == 3  # every expert's gate, up (w13) and down (w2): one FusedMoE
    largest = max(sum(canonical[n].nbytes for n in names) for names in units.values())
    for budget in (1, largest, 3 * largest, 10**12):
        phases = layer_phases(canonical, budget_bytes=budget)
        flat = [n for p in phases for n in p]
        assert sorted(flat) == sorted(canonical) and len(flat) == len(set(flat))  # every tensor once
        for phase in phases:  # a fused module never straddles phases; a phase fits, or is one module
            assert len({module_unit(n) for n in phase}) == 1 or sum(canonical[n].nbytes for n in phase) <= budget
            for names in units.values():
                assert set(names) <= set(phase) or not set(names) & set(phase)
        layers = [i for p in phases for n in p if (i := layer_index(n)) is not None]
        assert layers == sorted(layers)  # layer order
    assert len(layer_phases(canonical, budget_bytes=1)) == len(units)
    assert len(layer_phases(canonical, budget_bytes=10**12)) == 1
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        layer_phases(canonical, budget_bytes=0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.slow
@pytest.mark.xdist_group("vllm-layout")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "llama"])
def test_no_phase_splits_a_module_vllm_loads_as_one(family, monkeypatch):
    """vLLM's layerwise reload keeps the tensors a module was fed (views of the reader's staging) until
    the module's last tensor arrives, then builds it from them; a module split across phases is built
    from staging the next phase already overwrote. Every parameter-holding module of vLLM's own
    layout (its loaders, recorded: DeepSeek-V3's ``fused_qkv_a_proj`` = ``q_a_proj`` +
    ``kv_a_proj_with_mqa``, a FusedMoE's every expert's w13 and w2, MTP drafters included) is one unit."""
    from weightsync.engines.vllm_layout import record_rank
    from weightsync.plan.phases import module_unit

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    config = tiny_config(family=family)
    modules: dict[str, set[str]] = {}
    for shard in record_rank(config, mtp=bool(ModelSpec.from_hf_config(config).mtp_layers)):
        modules.setdefault(shard.name.rpartition(".")[0], set()).update(r.canonical for r in shard.regions)
    split = {m: sorted({module_unit(n) for n in names}) for m, names in modules.items()
             if len({module_unit(n) for n in names}) > 1}
    assert not split, f"vLLM modules whose tensors layer_phases may put in different phases: {split}"


def test_split_plan_keeps_every_op_once_in_wire_order():
    spec = load_spec("tiny-qwen3")
    plan = build_plan(parse_layout("megatron:tp=2").all_rank_layouts(spec),
                      parse_layout("vllm:tp=1,replicas=2").all_rank_layouts(spec),
                      options=PlanOptions(min_split_bytes=0))
    phases = layer_phases(spec.canonical_tensors(), budget_bytes=1)
    parts = split_plan(plan, phases)
    assert sum(len(p) for p in parts) == len(plan)
    for part, names in zip(parts, phases, strict=True):
        assert {op.canonical for op in part.ops} <= set(names)
        assert list(part.ops) == [op for op in plan.ops if op.canonical in names]
    with pytest.raises(ValueError, match="in no phase"):
        split_plan(plan, phases[1:])


class _PhaseChecker(StagedWeights):
    """A staged engine that checks each phase bitwise as it arrives, and what it holds at once."""

    def __init__(self, config, versions):
        super().__init__(ModelSpec.from_hf_config(config), dtype=torch.float32, device="cpu", rank=0)
        self.expected = {v: checkpoint_tensors(canonical_weights(config, seed)) for v, seed in versions.items()}
        self.checked: dict[int, list[str]] = {}
        self.wrong: list[str] = []

    def _begin(self, version):
        self.checked[version] = []

    def _load_items(self, items):
        for name, tensor in items:
            version = max(self.checked)
            if not torch.equal(tensor.view(torch.int32), self.expected[version][name].view(torch.int32)):
                self.wrong.append(f"v{version} {name}")
            self.checked[version].append(name)


TRANSPORTS = ["torch", "shm", "file", "routed"] + (["nixl"] if importlib.util.find_spec("nixl_cu12") else [])
#: routed: writer 0 and the reader on node a (shared memory), writer 1 on node b (torch)
HOSTS = {"routed": ("node-a,node-b", "node-a")}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_versions_arrive_phase_by_phase_into_one_arena(transport):
    sys.path.insert(0, str(HERE))
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig, TransportOptions
    from writer_process import writer_processes

    config = tiny_config()
    spec = ModelSpec.from_hf_config(config)
    bucket = 256 << 10
    phases = layer_phases(spec.canonical_tensors(), budget_bytes=bucket)
    assert len(phases) >= 3
    engine = _PhaseChecker(config, {1: 2, 2: 1})
    job = f"phases-{uuid.uuid4().hex[:8]}"
    writer_hosts, reader_host = HOSTS.get(transport, ("", ""))
    extra = ("--transport", transport, "--bucket", str(bucket), "--layer-phases", "--hosts", writer_hosts)
    with EmbeddedMetaServer() as server, writer_processes(server, config, "megatron:tp=2", job=job, seeds=[2, 1],
                                                          extra=extra):
        sync = SyncConfig(num_writers=2, num_readers=1, job=job, transport=transport, timeout=120, layer_phases=True,
                          host=reader_host, transport_options=TransportOptions(max_bucket_bytes=bucket))
        meta = MetaClient(server.address, job=job, token=server.token)
        with WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
            for version in (1, 2):
                result = reader.update(version)
                assert result.version == version and engine.weight_version == version
        meta.close()
    assert engine.wrong == []
    names = [s.name for s in engine.layout().shards]
    assert engine.checked == {1: names, 2: names}  # every tensor, once per version, in checkpoint order
    largest = max(sum(spec.canonical_tensors()[n].nbytes for n in p) for p in phases)
    assert engine.staging_bytes <= largest + 64 * len(names) < spec.num_parameters * 4  # a phase, not the model


@pytest.mark.parametrize("transport", ["torch", "shm", "nixl", "nixl-push", "file"])
def test_deltas_arrive_phase_by_phase_into_one_arena(transport):
    """Delta with layer phases: the staging arena holds one phase, so the reader applies each
    delta to its own host copy and stages whole phases from it. Version 3 equals version 2:
    nothing changed, next to nothing moves, and every phase still arrives bitwise."""
    sys.path.insert(0, str(HERE))
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig, TransportOptions
    from writer_process import writer_processes

    config = tiny_config()
    spec = ModelSpec.from_hf_config(config)
    bucket = 256 << 10
    engine = _PhaseChecker(config, {1: 2, 2: 1, 3: 1})
    job = f"phases-delta-{uuid.uuid4().hex[:8]}"
    transport, _, mode = transport.partition("-")  # nixl: auto picks pull with deltas
    extra = ("--transport", transport, "--bucket", str(bucket), "--layer-phases", "--delta", "100",
             "--nixl-mode", mode or "auto")
    with EmbeddedMetaServer() as server, writer_processes(server, config, "megatron:tp=2", job=job, seeds=[2, 1, 1],
                                                          extra=extra):
        sync = SyncConfig(num_writers=2, num_readers=1, job=job, transport=transport, timeout=120, layer_phases=True,
                          transport_options=TransportOptions(max_bucket_bytes=bucket, delta_anchor_every=100,
                                                             nixl_mode=mode or "auto"))
        meta = MetaClient(server.address, job=job, token=server.token)
        with WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
            moved = {}
            for version in (1, 2, 3):
                result = reader.update(version)
                assert result.version == version and engine.weight_version == version
                moved[version] = result.nbytes
            full = reader.session.planned.plan.total_bytes
        meta.close()
    assert engine.wrong == []
    names = [s.name for s in engine.layout().shards]
    assert engine.checked == {1: names, 2: names, 3: names}
    assert moved[1] == full and moved[3] < full // 20, (moved, full)
    assert engine.staging_bytes < spec.num_parameters * 4  # still a phase, not the model
