"""Every device decision, on fake device indices (no GPU here: these rules are what protects
the first GPU run). Each test names the defect of issue 16 it pins."""

from __future__ import annotations

import pytest
import torch

from fake_meta import FakeChannel
from weightsync.ports.device import parse_device
from weightsync.tools.devices import (
    RankPlacement,
    TransportChoice,
    check_serves,
    choose_transport,
    gpu_duplicates,
    ipc_attach_device,
    nixl_device_id,
    resolve_device,
    sglang_staging_device,
    shared_gpus,
    shm_pairs,
    tensors_device,
    torch_backend,
)
from weightsync.transport import TransportContext, TransportOptions, create_transport, transport_class_path
from weightsync.transport.base import check_tensors_device


def place(role, rank, node="h0", device="cpu", gpu=""):
    return RankPlacement(role, rank, node, device, gpu)


def test_parse_and_resolve_devices():
    assert parse_device("cuda:3") == ("cuda", 3) and parse_device("cpu") == ("cpu", None)
    for bad in ("gpu", "cuda:x", "cpu:0", ""):
        with pytest.raises(ValueError, match="device must be"):
            parse_device(bad)
    # 6: "cuda" means the process's current device, never silently cuda:0 for everyone
    assert resolve_device("cuda", current_cuda_index=5) == "cuda:5"
    assert resolve_device("cuda:2", current_cuda_index=5) == "cuda:2"
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda", current_cuda_index=None)


def test_one_device_per_rank():
    assert tensors_device(["cuda:1", "cuda:1"]) == "cuda:1"
    with pytest.raises(ValueError, match=r"several devices \(cuda:0 and cuda:1\)"):
        tensors_device(["cuda:0", "cuda:1"], what="writer 0's tensors")
    with pytest.raises(ValueError, match="no tensors"):
        tensors_device([])


def test_transports_refuse_devices_they_do_not_serve():
    # 1: gloo over GPU pointers, host shared memory over GPU memory
    with pytest.raises(ValueError, match="transport 'torch' moves cpu memory, but the tensors it was given live on "
                                         "cuda:0"):
        check_serves("torch", serves_cpu=True, serves_cuda=False, device="cuda:0")
    with pytest.raises(ValueError, match=r"moves cuda memory, but .* live on cpu"):
        check_serves("torch", serves_cpu=False, serves_cuda=True, device="cpu")
    check_serves("shm", serves_cpu=True, serves_cuda=True, device="cuda:7")


def test_prepare_refuses_tensors_elsewhere_than_the_context_device():
    ctx = TransportContext(channel=FakeChannel(), num_writers=1, num_readers=1, device="cpu")
    gloo = create_transport("torch", ctx)
    check_tensors_device(gloo, ctx, {"a": torch.zeros(2)})
    meta = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="set up for cpu, but the tensors it was given live on meta"):
        check_tensors_device(gloo, ctx, {"a": meta})
    with pytest.raises(ValueError, match="several devices"):
        check_tensors_device(gloo, ctx, {"a": torch.zeros(2), "b": meta})


def test_torch_transport_backend_follows_the_device():
    def path(device):
        ctx = TransportContext(channel=FakeChannel(), num_writers=1, num_readers=1, device=device,
                               options=TransportOptions())
        return transport_class_path("torch", ctx)

    assert torch_backend("cpu") == "gloo" and torch_backend("cuda:1") == "nccl"
    assert path("cpu").endswith(":GlooTransport") and path("cuda:1").endswith(":NcclTransport")


def test_auto_picks_cuda_ipc_for_ranks_sharing_one_gpu_and_explains_why():
    # 6: a co-located trainer and engine on one GPU can never use NCCL
    ranks = [place("writer", 0, device="cuda:0"), place("reader", 0, device="cuda:0")]
    assert shared_gpus(ranks) == [(ranks[0], ranks[1])]
    choice = choose_transport("auto", ranks)
    assert choice.name == "shm" and "NCCL refuses two ranks on one GPU" in choice.reason
    with pytest.raises(ValueError, match="writer 0 and reader 0 both use cuda:0 on h0, and NCCL refuses"):
        choose_transport("torch", ranks)
    # the same GPU index on two nodes is two GPUs
    apart = [place("writer", 0, "h0", "cuda:0"), place("reader", 0, "h1", "cuda:0")]
    assert shared_gpus(apart) == [] and choose_transport("auto", apart).name == "torch"


def test_auto_on_one_node_and_across_nodes():
    one = [place("writer", 0), place("reader", 0), place("reader", 1)]
    assert choose_transport("auto", one).name == "shm"
    assert choose_transport("auto", one, unavailable={"shm": "no /dev/shm"}).name == "torch"
    two = [place("writer", 0, "h0"), place("reader", 0, "h1")]
    assert choose_transport("auto", two).name == "torch"
    with pytest.raises(ValueError, match="'shm' needs every rank on one node"):
        choose_transport("shm", two)
    with pytest.raises(ValueError, match="writer 0 holds its weights on cpu and reader 0 on cuda:0"):
        choose_transport("auto", [place("writer", 0), place("reader", 0, device="cuda:0")])
    with pytest.raises(ValueError, match="cannot be used: not installed"):
        choose_transport("nixl", two, unavailable={"nixl": "not installed"})


def test_auto_picks_cuda_ipc_only_for_pairs_whose_reader_sees_the_writers_gpu():
    """Issue 39, defect 6: ``auto`` picked CUDA IPC for every job on one node, and a reader that does
    not see the writer's GPU (Ray actors with one GPU each) then failed to map it, where NCCL works.
    Pairs are judged by the GPUs each rank's process sees."""
    def gpu(role, rank, uuid, sees):
        return RankPlacement(role, rank, "h0", "cuda:0", uuid, sees)

    ray = [gpu("writer", 0, "GPU-a", ("GPU-a",)), gpu("reader", 0, "GPU-b", ("GPU-b",))]
    assert choose_transport("auto", ray) == TransportChoice(
        "torch", "readers that do not see their writer's GPU")
    seeing = [gpu("writer", 0, "GPU-a", ("GPU-a", "GPU-b")), gpu("reader", 0, "GPU-b", ("GPU-a", "GPU-b"))]
    assert choose_transport("auto", seeing).name == "shm"
    mixed = [gpu("writer", 0, "GPU-a", ("GPU-a",)), gpu("reader", 0, "GPU-b", ("GPU-a", "GPU-b")),
             gpu("reader", 1, "GPU-c", ("GPU-c",))]
    assert shm_pairs(mixed) == {(0, 0): True, (0, 1): False}
    assert choose_transport("auto", mixed) == TransportChoice(
        "routed", "readers that do not see their writer's GPU: shm between the pairs that do, torch between the "
                  "others")
    with pytest.raises(ValueError, match=r"transport 'shm' \(CUDA IPC\) maps writer 0's memory on its GPU GPU-a, which "
                                         r"reader 0 does not see \(its process sees 1 GPU\(s\).*use 'auto' or 'torch'"):
        choose_transport("shm", ray)
    unknown = [gpu("writer", 0, "GPU-a", ()), gpu("reader", 0, "GPU-b", ())]  # registered by hand
    assert choose_transport("auto", unknown).name == "shm"


def test_cuda_ipc_attaches_on_the_writers_device():
    # 3: TP2 -> TP1 across GPUs: writer 1's memory lives on cuda:1, whatever the reader's device
    assert ipc_attach_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="with its index"):
        ipc_attach_device("cuda")


def test_cuda_ipc_finds_the_writers_gpu_by_identity_under_other_visible_devices():
    # The writer runs with CUDA_VISIBLE_DEVICES=1 (its cuda:0); this reader sees GPUs 0 and 1.
    visible = ["GPU-aaaa", "GPU-bbbb"]
    assert ipc_attach_device("cuda:0", "GPU-bbbb", visible) == "cuda:1"
    with pytest.raises(ValueError, match=r"writer's GPU GPU-cccc \(cuda:0 in its process\) is not one of the 2 GPUs"):
        ipc_attach_device("cuda:0", "GPU-cccc", visible)
    assert ipc_attach_device("cuda:0", "", visible) == "cuda:0"  # a writer that published no identity


def test_ranks_compare_gpus_by_identity_and_nccl_refuses_any_two_ranks_on_one():
    # cuda:0 in two processes with different CUDA_VISIBLE_DEVICES: two GPUs, not one
    apart = [place("writer", 0, device="cuda:0", gpu="GPU-a"), place("reader", 0, device="cuda:0", gpu="GPU-b")]
    assert gpu_duplicates(apart) == [] and choose_transport("torch", apart).name == "torch"
    # cuda:1 and cuda:0 naming one physical GPU: the same GPU
    same = [place("writer", 0, device="cuda:1", gpu="GPU-a"), place("reader", 0, device="cuda:0", gpu="GPU-a")]
    assert gpu_duplicates(same) == [(same[0], same[1])]
    # two engines (readers) on one GPU break NCCL just as a trainer and an engine do
    readers = [place("writer", 0, "h0", "cuda:0", gpu="GPU-w"), place("reader", 0, "h1", "cuda:0", gpu="GPU-r"),
               place("reader", 1, "h1", "cuda:0", gpu="GPU-r")]
    assert shared_gpus(readers) == []
    with pytest.raises(ValueError, match="reader 0 and reader 1 both use GPU GPU-r on h1, and NCCL refuses"):
        choose_transport("auto", readers)  # several nodes: auto means NCCL, refused before NCCL would be


def test_nixl_descriptors_carry_each_sides_own_device_id():
    # 2: the remote list must name the peer's GPU, not ours
    assert nixl_device_id("cuda:3") == 3 and nixl_device_id("cpu") == 0


def test_sglang_stages_outside_the_engines_tp_gpus():
    # 7: the update group's rank 0 must not share a GPU with SGLang's TP rank 0
    assert sglang_staging_device(None, engine_gpus=[0, 1], visible_gpus=4) == "cuda:2"
    assert sglang_staging_device("cuda:3", engine_gpus=[0, 1], visible_gpus=4) == "cuda:3"
    with pytest.raises(ValueError, match="cuda:0 is one of the engine's TP GPUs"):
        sglang_staging_device("cuda:0", engine_gpus=[0, 1], visible_gpus=4)
    with pytest.raises(ValueError, match="needs a GPU outside the engine's TP GPUs"):
        sglang_staging_device(None, engine_gpus=[0, 1], visible_gpus=2)


def test_nccl_rounds_cover_every_message_once_with_at_most_one_staged_per_window():
    """4: each pair's messages grouped per round, pairs concurrent, staging bounded per pair."""
    from weightsync.configs import load_spec
    from weightsync.layout import parse_layout
    from weightsync.plan import PlanOptions, build_plan
    from weightsync.transport.schedule import build_messages
    from weightsync.transport.torch.nccl import WINDOW, needs_buffer, rounds_of, windows_of

    spec = load_spec("tiny-qwen3-moe")
    writers = parse_layout("megatron:tp=2,ep=2,etp=1").all_rank_layouts(spec)
    readers = parse_layout("vllm:tp=1,replicas=2").all_rank_layouts(spec)
    plan = build_plan(writers, readers, options=PlanOptions(min_split_bytes=0))
    schedule = [build_messages(plan.ops_between(w, r), message_bytes=1 << 14, direct_min_bytes=1 << 10)
                for w in range(2) for r in range(2)]
    assert any(not m.direct for ms in schedule for m in ms) and any(m.direct for ms in schedule for m in ms)
    rounds = rounds_of(schedule)
    for k, windows in enumerate(rounds):
        assert len({w.pair for w in windows}) == len(windows)  # one window per pair per round
        for w in windows:
            assert w == windows_of(schedule[w.pair], w.pair)[k]  # both ends cut the same windows
            assert 1 <= len(w.messages) <= WINDOW and sum(map(needs_buffer, w.messages)) <= 1
    for pair, messages in enumerate(schedule):
        got = [m for windows in rounds for w in windows if w.pair == pair for m in w.messages]
        assert got == list(messages)


def test_watchdog_aborts_at_the_deadline_and_only_then():
    import threading
    import time

    from weightsync.clock.deadline import Deadline
    from weightsync.transport.torch.nccl_comm import Watchdog

    aborted = threading.Event()
    with Watchdog(Deadline.after(0.05), aborted.set) as dog:
        assert aborted.wait(5)  # a "hung" transfer: the communicator is aborted at the deadline
    assert dog.fired
    calls = []
    with Watchdog(Deadline.after(30), lambda: calls.append(1)) as dog:
        time.sleep(0.01)  # finished in time
    assert not dog.fired and not calls


def test_megatron_expert_tp_defaults_to_tp_like_megatron_core():
    """8: Megatron-core's expert_tensor_parallel_size defaults to the TP size."""
    from weightsync.configs import load_spec
    from weightsync.layout import parse_layout

    spec = load_spec("tiny-qwen3-moe")
    assert parse_layout("megatron:tp=2,dp=2,ep=2").expert_tp == 2
    assert parse_layout("megatron:tp=2,dp=2,ep=2,etp=1").expert_tp == 1
    with pytest.raises(ValueError, match="ep=2 x etp=2 must divide tp x dp = 2"):
        parse_layout("megatron:tp=2,ep=2").validate(spec)


def test_vllm_expert_parallelism_is_what_vllm_runs():
    """8: vLLM's EP group is tp x dp ranks, experts whole; 1 < ep < tp is refused."""
    from weightsync.configs import load_spec
    from weightsync.layout import parse_layout

    spec = load_spec("tiny-qwen3-moe")
    with pytest.raises(ValueError, match=r"ep=2 is not a parallelism vLLM runs.*ep = tp x dp = 4"):
        parse_layout("vllm:tp=4,ep=2").validate(spec)
    kind = parse_layout("vllm:tp=2,dp=2,ep=4")
    kind.validate(spec)
    assert kind.world_size == 4
    w13 = {r: next(s for s in kind.rank_layout(spec, r).shards if s.name.endswith("mlp.experts.routed_experts.w13_weight"))
           for r in range(4)}
    per = spec.num_experts // 4
    for r in range(4):  # rank d*tp+t holds experts [r*E/4, (r+1)*E/4), whole
        (gate, up) = w13[r].regions
        assert gate.box.offsets[0] == r * per and gate.box.sizes[:2] == (per, spec.moe_intermediate_size)
