"""EPLB expert placement (issue 40): readers whose expert slots follow vLLM's load balancer.

Placements come from vLLM 0.32's own structures, run on CPU: its initial arrangement
(``EplbState.build_initial_global_physical_to_logical_map``), its rebalance policy
(``DefaultEplbPolicy.rebalance_experts`` on random loads) and its logical maps
(``compute_logical_maps``). Each placed layout is planned and run by the numpy reference
executor: every physical slot holds its logical expert's bytes, bitwise, every destination
element is written exactly once, and the wire carries no byte twice (sent == needed; an expert
a reader holds on two slots is received once and copied locally). A placement change of one
reader changes no other reader's ops, and the ``vllm`` kind refuses placements it cannot hold.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher import run as run_process
from weightsync.layout import ModelSpec, parse_layout
from weightsync.layout.eplb import Placement, initial_map, register
from weightsync.layout.wire import LayoutDecoder, encode_descriptor
from weightsync.plan import PlanOptions, build_local_plan, build_plan
from weightsync.plan.reference import check_destinations, cut_shards, empty_shards, random_canonical, run_plan
from weightsync.tools.tiny import tiny_config

#: 2 MoE layers of 8 experts, small enough to run every plan in numpy
CONFIG = {**tiny_config(moe=True), "num_experts": 8, "moe_intermediate_size": 32, "intermediate_size": 32,
          "hidden_size": 32, "head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64}
SPEC = ModelSpec.from_hf_config(CONFIG)
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def run_and_check(source: str, target: str) -> tuple:
    """Plan ``source`` -> ``target``, run it in numpy, check every reader region bitwise and each
    element written once; returns (plan, writers, readers)."""
    writers = parse_layout(source).all_rank_layouts(SPEC)
    readers = parse_layout(target).all_rank_layouts(SPEC)
    plan = build_plan(writers, readers, PlanOptions(min_split_bytes=0))
    values = random_canonical(SPEC.canonical_tensors(), seed=3)
    dst = {r.rank: empty_shards(r) for r in readers}
    writes = run_plan(plan, {w.rank: cut_shards(w, values) for w in writers}, dst)
    check_destinations(readers, dst, values)
    for r in readers:
        for shard in r.shards:
            covered = sum(reg.numel for reg in shard.regions)
            assert int(writes[r.rank][shard.name].sum()) == covered, shard.name
            assert writes[r.rank][shard.name].max(initial=0) <= 1, shard.name
    stats = plan.stats
    assert stats is not None and stats.sent_bytes == stats.needed_bytes  # nothing travels twice
    every_region = sum(reg.numel * 4 for r in readers for s in r.shards for reg in s.regions)  # float32
    assert stats.needed_bytes + stats.copied_bytes == every_region
    return plan, writers, readers


def slots_of(layout, layer: int) -> list[int]:
    """The logical expert each slot of a reader's ``w2_weight`` holds (its down projections)."""
    shard = layout.shard(f"model.layers.{layer}.mlp.experts.routed_experts.w2_weight")
    per_slot = shard.numel // shard.shape[0]
    out = [-1] * shard.shape[0]
    for region in shard.regions:
        for k in range(region.box.sizes[0]):
            out[region.offset // per_slot + k] = region.box.offsets[0] + k
    return out


def placement_file(tmp_path, placement: Placement) -> str:
    path = tmp_path / "placement.json"
    path.write_text(placement.to_json())
    return str(path)


# -- placements drawn here (no vLLM) ---------------------------------------------------------

@st.composite
def placements(draw):
    ep = draw(st.sampled_from([2, 4]))
    redundant = draw(st.sampled_from([0, ep, 2 * ep]))
    replicas = draw(st.integers(1, 2))
    physical = 8 + redundant
    # every logical expert once, then hot ones again, shuffled: duplicates within a rank included
    maps = []
    for _ in range(replicas):
        rows = []
        for _layer in range(2):
            extra = draw(st.lists(st.integers(0, 7), min_size=redundant, max_size=redundant))
            row = draw(st.permutations(list(range(8)) + extra))
            rows.append(row)
        maps.append(rows)
    return ep, replicas, Placement(8, np.array(maps, dtype=np.int64).reshape(replicas, 2, physical))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placements(), st.sampled_from(["fsdp:dp=3", "megatron:tp=2,dp=2,ep=4,etp=1", "vllm:tp=2"]))
def test_every_slot_holds_its_logical_expert_and_nothing_travels_twice(drawn, source):
    ep, replicas, placement = drawn
    digest = register(placement)
    plan, _, readers = run_and_check(source, f"vllm:tp=2,dp={ep // 2},ep={ep},replicas={replicas},eplb={digest}")
    for r in readers:
        replica, i = divmod(r.rank, ep)
        slots = placement.num_physical // ep
        for k, layer in enumerate((0, 1)):
            want = placement.replica(replica)[k][i * slots:(i + 1) * slots].tolist()
            assert slots_of(r, layer) == want
    # local plans: each reader's ops and copies are the global plan's
    for rank in (0, len(readers) - 1):
        local = build_local_plan(parse_layout(source).all_rank_layouts(SPEC), readers, role="reader", rank=rank,
                                 options=PlanOptions(min_split_bytes=0))
        mine = plan.columns.dst_rank == rank
        assert np.array_equal(local.columns.nbytes, plan.columns.nbytes[mine])
        copies = plan.copies.dst_rank == rank if plan.copies is not None else np.zeros(0, dtype=bool)
        assert local.num_copies == int(copies.sum())


def test_a_hot_expert_on_two_slots_of_one_reader_arrives_once():
    # reader 0 holds expert 3 in slots 0 and 2; reader 1 holds it in slot 4
    placement = Placement(8, [[3, 0, 3, 1, 2, 4, 3, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
    plan, _, readers = run_and_check("fsdp:dp=2", f"vllm:tp=2,ep=2,eplb={register(placement)}")
    assert slots_of(readers[0], 0) == [3, 0, 3, 1, 2] and slots_of(readers[1], 0) == [4, 3, 5, 6, 7]
    layer0 = {i for i, t in enumerate(plan.tensors) if t.startswith("model.layers.0.mlp.experts.")}
    copies = [op for op in plan.copy_ops if op.canonical.startswith("model.layers.0.mlp.experts.")]
    assert {(op.dst_rank, op.box.offsets[0], op.box.sizes[0]) for op in copies} == {(0, 3, 1)}
    assert len(copies) == 3  # gate, up and down of expert 3, once each
    got = {(int(r), int(o)) for r, o, t in zip(plan.columns.dst_rank, plan.columns.off[:, 0], plan.columns.tensor,
                                                strict=True) if int(t) in layer0}
    assert (0, 3) in got  # expert 3 reaches reader 0 once (slot 0), the copy fills slot 2
    # layer 1, the initial placement: slots 8 and 9 (reader 1) hold experts 0 and 1 again, no copy
    assert slots_of(readers[1], 1) == [5, 6, 7, 0, 1]


def test_redundant_slots_alone_place_experts_as_vllm_starts():
    _, _, readers = run_and_check("fsdp:dp=2", "vllm:tp=2,ep=2,redundant=2")
    assert slots_of(readers[0], 0) + slots_of(readers[1], 0) == initial_map(8, 2)


def test_a_placement_change_changes_only_that_readers_ops():
    base = np.array([[initial_map(8, 4)] * 2] * 2)  # two engine replicas, each with its own maps
    moved = base.copy()
    moved[0, 1, 6:12] = [7, 7, 6, 5, 4, 3]  # replica 0 rebalanced layer 1 of its EP rank 1 (slots 6..11)
    source = parse_layout("fsdp:dp=3").all_rank_layouts(SPEC)
    plans = []
    for maps in (base, moved):
        readers = parse_layout(f"vllm:tp=2,ep=2,replicas=2,eplb={register(Placement(8, maps))}").all_rank_layouts(SPEC)
        plans.append(build_plan(source, readers, PlanOptions(min_split_bytes=0)))
    before, after = plans
    changed = before.columns.dst_rank == 1
    assert not np.array_equal(before.columns.off[changed], after.columns.off[after.columns.dst_rank == 1])
    for rank in (0, 2, 3):  # every other reader is untouched
        a, b = before.columns.dst_rank == rank, after.columns.dst_rank == rank
        for field in ("src_rank", "tensor", "off", "size", "src_off", "dst_off"):
            assert np.array_equal(getattr(before.columns, field)[a], getattr(after.columns, field)[b]), (rank, field)


def test_fp8_readers_with_a_placement_get_slot_scales_too():
    spec = ModelSpec.from_hf_config({**CONFIG, "hidden_size": 256, "head_dim": 128, "moe_intermediate_size": 128})
    placement = Placement(8, [[3, 0, 3, 1, 2, 4, 3, 5, 6, 7]] * 2)
    kind = parse_layout(f"vllm:dp=2,ep=2,quant=fp8_block,eplb={register(placement)}")
    layout = kind.rank_layout(spec, 0)
    scale = layout.shard("model.layers.0.mlp.experts.routed_experts.w2_weight_scale_inv")
    assert sorted((r.box.offsets[0], r.box.sizes[0]) for r in scale.regions) == [(0, 1), (1, 2), (3, 1), (3, 1)]


def test_placed_descriptors_travel_with_their_placement():
    placement = Placement(8, [[7, 6, 5, 4, 3, 2, 1, 0, 0, 7]] * 2)
    text = f"vllm:tp=2,ep=2,eplb={register(placement)}"
    blob = encode_descriptor(text, "model")
    from weightsync.layout import eplb

    eplb._REGISTRY.pop(placement.digest)  # another process: it knows the placement only from the blob
    decoded = LayoutDecoder(lambda _: CONFIG)(blob, rank=1)
    assert slots_of(decoded, 1) == [2, 1, 0, 0, 7]


@pytest.mark.parametrize("target, message", [
    ("vllm:tp=2,redundant=2", "needs expert parallelism"),
    ("vllm:tp=2,ep=2,redundant=3", "not divisible by ep=2"),
    ("vllm:tp=2,ep=2,redundant=10", "exceed the 8 logical experts"),
])
def test_placements_the_kind_cannot_hold_are_refused(target, message):
    with pytest.raises(ValueError, match=message):
        parse_layout(target).roster(SPEC)


def test_bad_placements_are_refused_naming_the_fault(tmp_path):
    with pytest.raises(ValueError, match=r"names logical expert 9, outside 0\.\.7"):
        Placement(8, [[0, 1, 2, 3, 4, 5, 6, 9]])
    wrong = register(Placement(6, [[0, 1, 2, 3, 4, 5]] * 2))
    with pytest.raises(ValueError, match="places 6 logical experts, the model has 8"):
        parse_layout(f"vllm:tp=2,ep=2,eplb={wrong}").roster(SPEC)
    with pytest.raises(ValueError, match="does not exist"):
        parse_layout(f"vllm:tp=2,ep=2,eplb={tmp_path / 'missing.json'}")
    three = register(Placement(8, [initial_map(8, 2)] * 3))
    with pytest.raises(ValueError, match="maps of 3 MoE layers, the model 2"):
        parse_layout(f"vllm:tp=2,ep=2,eplb={three}").roster(SPEC)


def test_weightsync_plan_takes_a_placement_file_and_reports_copies(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    path = placement_file(tmp_path, Placement(8, [[3, 0, 3, 1, 2, 4, 3, 5, 6, 7]] * 2))
    out = run_process([sys.executable, "-m", "weightsync.cli", "plan", "--config", str(config), "--source",
                          "fsdp:dp=2", "--target", f"vllm:tp=2,ep=2,eplb={path}", "--json"],
                         timeout=120, check=True)
    report = json.loads(out.stdout)
    assert report["sent_bytes"] == report["needed_bytes"]
    assert report["copied_bytes"] == 2 * 3 * 32 * 32 * 4  # expert 3's gate, up, down, in both layers
    assert report["target"].startswith("vllm:ep=2,eplb=eplb-")
    assert report["max_recv_bytes"] > 0 and report["max_send_bytes"] > 0


# -- vLLM's own structures, on CPU -------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_eplb():
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    from vllm.distributed.eplb import eplb_state
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    return eplb_state, DefaultEplbPolicy


# with tests/test_vllm_layout.py: one xdist worker imports vLLM for both
@pytest.mark.xdist_group("vllm-layout")
def test_the_initial_placement_is_vllms(vllm_eplb):
    eplb_state, _ = vllm_eplb
    for experts, redundant in ((8, 0), (8, 4), (8, 12), (384, 32)):
        assert initial_map(experts, redundant) == list(
            eplb_state.EplbState.build_initial_global_physical_to_logical_map(experts, redundant))


@pytest.mark.xdist_group("vllm-layout")
def test_vllms_rebalance_results_plan_and_land_bitwise(vllm_eplb, tmp_path):
    import torch

    eplb_state, policy = vllm_eplb
    rng = np.random.default_rng(0)
    maps = []
    for _ in range(2):  # two engine replicas, each balancing its own load
        load = torch.from_numpy(rng.pareto(1.5, size=(2, 8)) * 100)
        maps.append(policy.rebalance_experts(load, num_replicas=12, num_groups=1, num_nodes=1, num_ranks=4).numpy())
    placement = Placement(8, np.stack(maps))
    _, _, readers = run_and_check("megatron:tp=2,dp=2,ep=4,etp=1", f"vllm:tp=2,dp=2,ep=4,replicas=2,eplb={placement_file(tmp_path, placement)}")
    for replica in range(2):
        # vLLM's own count of each logical expert's replicas equals the slots our layouts hold it on
        _, counts = eplb_state.compute_logical_maps(torch.from_numpy(maps[replica]), 8)
        for k, layer in enumerate((0, 1)):
            held = [e for r in readers[replica * 4:(replica + 1) * 4] for e in slots_of(r, layer)]
            assert np.bincount(held, minlength=8).tolist() == counts[k].tolist()
        assert maps[replica].tolist() != [initial_map(8, 4)] * 2  # the loads moved experts


@pytest.mark.xdist_group("vllm-layout")
def test_the_adapter_reads_a_workers_eplb_state(vllm_eplb):
    import types

    import torch

    from weightsync.engines.vllm_eplb import placement_of

    eplb_state, _ = vllm_eplb
    state = eplb_state.EplbState.__new__(eplb_state.EplbState)
    target = types.SimpleNamespace(compute_hash=lambda: "target", model="m")
    current = torch.tensor([[3, 0, 3, 1, 2, 4, 3, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
    model = types.SimpleNamespace(num_logical_experts=8)
    fields = dict.fromkeys(eplb_state.EplbModelState.__dataclass_fields__)
    state.model_states = {"target": eplb_state.EplbModelState(**{**fields, "physical_to_logical_map": current,
                                                                 "model": model})}
    placement = placement_of(state, types.SimpleNamespace(model_config=target, speculative_config=None))
    assert placement.num_experts == 8 and placement.maps.tolist() == [current.tolist()]


def test_a_replan_after_a_placement_change_equals_a_fresh_plan():
    source = parse_layout("fsdp:dp=3").roster(SPEC)  # one roster object, as a session keeps it
    maps = np.array([[initial_map(8, 4)] * 2] * 2)
    targets = []
    for change in (None, [7, 7, 6, 5, 4, 3]):
        if change is not None:
            maps[0, 1, 6:12] = change
        targets.append(parse_layout(f"vllm:tp=2,ep=2,replicas=2,eplb={register(Placement(8, maps))}").roster(SPEC))
    for role, rank in (("reader", 1), ("reader", 2), ("writer", 0), ("writer", 2)):
        before = build_local_plan(source, targets[0], role=role, rank=rank)
        replanned = build_local_plan(source, targets[1], role=role, rank=rank, previous=before)
        fresh = build_local_plan(source, targets[1], role=role, rank=rank)
        assert replanned.fingerprint == fresh.fingerprint != before.fingerprint
        for field in ("src_rank", "dst_rank", "tensor", "off", "size", "src_off", "dst_off", "nbytes"):
            assert np.array_equal(getattr(replanned.columns, field), getattr(fresh.columns, field)), (role, field)
        assert replanned.num_copies == fresh.num_copies


# -- a live job: readers whose placement moves between versions --------------------------------

def engine_holds(engine, values) -> bool:
    """Every region of the engine's layout holds its box of ``values``, bitwise."""
    import torch

    from weightsync.tools.torch_layout import strided_view

    for shard in engine.layout().shards:
        flat = engine.tensors[shard.name].view(-1)
        for r in shard.regions:
            got = strided_view(flat, r.box.sizes, r.strides, r.offset)
            if not torch.equal(got, values[r.canonical][r.box.slices()]):
                return False
    return True


@pytest.mark.xdist_group("vllm-layout")
def test_readers_follow_a_rebalance_between_versions_bitwise(vllm_eplb):
    """Two engine replicas (EP 2 each) with slots placed by vLLM's rebalance; replica 0 rebalances
    again after version 1: version 2 lands in its new slots, bitwise, the other replica's too."""
    import threading

    import torch

    from weightsync.engines.buffers import ShardedEngine
    from weightsync.meta import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.tools.tiny import CanonicalSource, canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    _, policy = vllm_eplb
    rng = np.random.default_rng(1)

    def rebalanced() -> np.ndarray:
        load = torch.from_numpy(rng.pareto(1.2, size=(2, 8)) * 100)
        return policy.rebalance_experts(load, num_replicas=12, num_groups=1, num_nodes=1, num_ranks=2).numpy()

    first = Placement(8, np.stack([rebalanced(), rebalanced()]))
    moved = Placement(8, np.stack([rebalanced(), first.maps[1]]))
    target = "vllm:dp=2,ep=2,replicas=2,eplb={}"
    config = SyncConfig(num_writers=1, num_readers=4, transport="torch", timeout=60)
    engines = [ShardedEngine(target.format(register(first)), CONFIG, rank) for rank in range(4)]
    assert any(op.dst_rank in (0, 1) for op in build_plan(  # the rebalance put an expert twice on one reader
        parse_layout("hf").all_rank_layouts(SPEC), [e.layout() for e in engines]).copy_ops)
    errors: list[BaseException] = []
    results: dict[int, list] = {}
    step = threading.Barrier(5, timeout=60)

    def write(server) -> None:
        try:
            source = CanonicalSource(CONFIG)
            with WeightWriter(source, rank=0, config=config, meta=MetaClient(server.address, token=server.token)) as w:
                for version in (1, 2):
                    fill_from_canonical(source.layout(), source.tensors(), canonical_weights(CONFIG, version))
                    results.setdefault(-1, []).append(w.write(version))
                    step.wait()  # readers applied it; replica 0 rebalances before the next
                    step.wait()
        except BaseException as exc:
            errors.append(exc)
            step.abort()

    def read(server, rank: int) -> None:
        try:
            with WeightReader(engines[rank], rank=rank, config=config,
                              meta=MetaClient(server.address, token=server.token)) as reader:
                for version in (1, 2):
                    results.setdefault(rank, []).append(reader.update(version, timeout=60))
                    step.wait()
                    if rank < 2 and version == 1:  # vLLM's EPLB moved replica 0's experts
                        engines[rank].relayout(target.format(register(moved)))
                        assert reader.follow_layout(timeout=60)  # the engine's rebalance step tells it
                    step.wait()
        except BaseException as exc:
            errors.append(exc)
            step.abort()

    with EmbeddedMetaServer() as server:
        threads = [threading.Thread(target=write, args=(server,))]
        threads += [threading.Thread(target=read, args=(server, r)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    values = canonical_weights(CONFIG, 2)
    assert all(engine_holds(e, values) for e in engines)
    assert [slots_of(e.layout(), 1) for e in engines[:2]] != [slots_of(e.layout(), 1) for e in engines[2:]]
    assert "replan" in results[-1][1].phases  # the writer re-planned version 2 at the new generation
    assert all(r[1].version == 2 for rank, r in results.items() if rank >= 0)
