"""vLLM adapter: an engine synced to checkpoint B generates exactly like a fresh engine on B.

Engines run in-process on CPU (tiny Qwen3 and Qwen3-MoE, float32, eager). Each model gets
one engine under test, started on checkpoint A, shared by every test of this module (all
of them run in one xdist worker); each test first puts the engine in the state it needs.
The prompt is 300 tokens, more than two KV blocks (128 tokens on CPU), so a stale prefix
cache would show. Engines start as tests/vllm_in_process.py says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import random
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from weightsync.engines import vllm as vllm_engine
from weightsync.engines import vllm_reload
from weightsync.engines.process_state import preserved_process_state
from weightsync.engines.staging import StagedWeights
from weightsync.engines.vllm import VLLMEngine, check_supported
from weightsync.layout import ModelSpec
from weightsync.tools.tiny import canonical_weights, checkpoint_tensors, tiny_config, write_checkpoint
from writer_process import writer_processes

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
PROMPT = [random.Random(0).randrange(4, 512) for _ in range(300)]
NEW_TOKENS = 24
HERE = Path(__file__).resolve().parent


def vllm_test(group: str):
    """Needs vLLM. A vLLM process holds one engine at a time (its parallel state is global), so
    each model's tests form one xdist group, run by one worker in order."""
    def mark(cls):
        for m in (pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install -e '.[vllm]')"),
                  pytest.mark.xdist_group(f"vllm-{group}"), pytest.mark.slow):
            cls = m(cls)
        return cls
    return mark


# -- engines ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_env():
    """vLLM's environment, and afterwards this process as it was before the engines.

    vLLM's CPU worker binds this process's threads to cores and replaces
    ``torch.set_num_threads`` with a no-op for the rest of the process. Tests that run
    later in the same xdist worker fork training ranks, which would inherit both and
    crawl: undo them when the engines are gone (:func:`preserved_process_state`, the library's
    own guard for programs that host vLLM in-process).
    """
    with preserved_process_state(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: tensors by reference
        mp.setenv("VLLM_HOST_IP", "127.0.0.1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


def start_llm(path: Path, **kwargs: Any) -> Any:
    from vllm import LLM

    from vllm_in_process import before_engine_start

    before_engine_start()
    kwargs.setdefault("dtype", "float32")
    return LLM(model=str(path), enforce_eager=True, max_model_len=512, max_num_seqs=2, seed=0,
               kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True, **kwargs)


def greedy(llm: Any) -> tuple[list[int], Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()  # also tears down vLLM's process-global parallel state
    gc.collect()


@dataclasses.dataclass
class Case:
    """One model: the engine under test (started on A) and the reference outputs."""

    config: dict[str, Any]
    a: dict[str, torch.Tensor]  # canonical tensors
    b: dict[str, torch.Tensor]
    ref_a: list[int]
    ref_b: list[int]
    llm: Any
    engine: VLLMEngine

    def greedy(self) -> tuple[list[int], Any]:
        return greedy(self.llm)

    def load(self, canonical: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update(checkpoint_tensors(canonical), version=version)


def make_case(tmp: Path, *, moe: bool, tie: bool) -> Case:
    config = tiny_config(moe=moe, tie=tie)
    a = write_checkpoint(tmp / "A", config, seed=1)
    b = write_checkpoint(tmp / "B", config, seed=2)
    fresh_b = start_llm(tmp / "B")
    ref_b, _ = greedy(fresh_b)
    shutdown(fresh_b)
    llm = start_llm(tmp / "A", weight_transfer_config={"backend": "weightsync"})
    ref_a, _ = greedy(llm)
    assert ref_a != ref_b, "A and B must generate differently for the proofs to mean anything"
    return Case(config, a, b, ref_a, ref_b, llm, VLLMEngine(llm))


# -- the proof: B synced into an engine started on A == a fresh engine on B -------------------------

class EngineProofs:
    """Run for every model (subclasses provide ``case`` and the trainers' ``layout``)."""

    layout = ""

    def test_sync_from_training_ranks_matches_fresh_engine(self, case):
        from weightsync.meta import client as meta
        from weightsync.roles.reader import WeightReader
        from weightsync.session.sync_session import SyncConfig

        case.load(case.a, version=0)
        assert case.greedy()[0] == case.ref_a
        job = f"vllm-{uuid.uuid4().hex[:8]}"
        with meta.EmbeddedMetaServer() as server, writer_processes(server, case.config, self.layout, job=job,
                                                                   seeds=[2]):
            config = SyncConfig(num_writers=2, num_readers=1, job=job, timeout=120)
            client = meta.MetaClient(server.address, job=job, token=server.token)
            with WeightReader(case.engine, rank=0, config=config, meta=client) as reader:
                result = reader.update(timeout=120)
            client.close()
        assert result.version == 1
        assert result.nbytes == case.engine.layout().nbytes  # every byte exactly once
        # the norms need no processing on CPU: received straight into the model, never staged
        in_place = case.engine.in_place_names
        assert in_place and all(n.endswith("norm.weight") for n in in_place), in_place
        assert case.engine.staging_bytes <= case.engine.layout().nbytes - sum(
            case.engine.layout().shard(n).nbytes for n in in_place)
        tokens, out = case.greedy()
        assert tokens == case.ref_b
        assert [span.version for span in out.weight_versions] == ["1"]

    def test_a_local_copy_of_a_whole_float32_replica_matches_fresh_engine(self, case):
        """``load_local`` (a co-located DDP rank's copy, TRL's colocate mode): the trainer's float32
        tensors go straight through the engine's loader, no staging; what it serves equals a fresh
        engine on B. Everything is checked before the engine is touched."""
        case.load(case.a, version=1)
        replica = {n: t.float() for n, t in checkpoint_tensors(case.b).items()}  # the trainer's dtype
        missing = {n: t for n, t in replica.items() if n != "model.norm.weight"}
        with pytest.raises(ValueError, match=r"model.norm.weight"):
            case.engine.load_local(missing, version=2)
        assert case.engine.weight_version == 1 and case.engine.invalid is None and case.greedy()[0] == case.ref_a
        case.engine.load_local(replica, version=2)
        tokens, out = case.greedy()
        assert tokens == case.ref_b and case.engine.weight_version == 2
        assert [span.version for span in out.weight_versions] == ["2"]

    def test_direct_update_matches_fresh_engine(self, case):
        case.load(case.b, version=1)
        tokens, out = case.greedy()
        assert tokens == case.ref_b
        assert case.engine.weight_version == 1
        assert [span.version for span in out.weight_versions] == ["1"]
        case.load(case.a, version=2)
        assert case.greedy()[0] == case.ref_a


def _vanilla_reload(worker, items, fix=None):
    """vLLM's own reload path, optionally with one of the adapter's fixes around it."""
    model = worker.model_runner.get_model()
    with fix(model) if fix is not None else contextlib.nullcontext():
        worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)


@contextlib.contextmanager
def _moe_prepack_fix(model):
    stashed = vllm_reload._stash_cpu_moe_kernels(model)
    try:
        yield
    finally:
        vllm_reload._restore_cpu_moe_kernels(stashed)


@vllm_test("dense")
class TestDenseQwen3(EngineProofs):
    layout = "megatron:tp=2"

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, vllm_env, tmp_path_factory):
        # Tied embeddings, like the small real Qwen3 models (exercises the lm_head fix).
        case = make_case(tmp_path_factory.mktemp("dense"), moe=False, tie=True)
        yield case
        shutdown(case.llm)

    def test_invalid_update_is_rejected_before_anything_is_applied(self, case):
        case.load(case.a, version=3)
        good = checkpoint_tensors(case.b)
        wrong_shape = {**good, "model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 64)}
        with pytest.raises(ValueError, match=r"wrong shape: \['model.layers.1.self_attn.k_proj.weight: shape \(32, 64\)"):
            case.engine.update(wrong_shape, version=4)
        with pytest.raises(ValueError, match=r"does not have: \['model.layers.0.mlp.bogus.weight'"):
            case.engine.update({**good, "model.layers.0.mlp.bogus.weight": torch.zeros(3)}, version=4)
        with pytest.raises(ValueError, match="unusable dtype"):
            case.engine.update({"model.norm.weight": torch.ones(64, dtype=torch.int64)}, version=4)
        assert case.engine.weight_version == 3
        tokens, out = case.greedy()
        assert tokens == case.ref_a
        assert [span.version for span in out.weight_versions] == ["3"]

    def test_failed_load_marks_engine_invalid_and_a_full_update_recovers(self, case, monkeypatch):
        case.load(case.a, version=5)

        def dies_half_way(worker, items):
            def stream():
                yield from items[: len(items) // 2]
                raise RuntimeError("trainer connection lost")
            worker._weightsync_reload.load(stream())

        with monkeypatch.context() as mp:
            mp.setattr(vllm_engine, "_reload_load", dies_half_way)
            with pytest.raises(RuntimeError, match="trainer connection lost"):
                case.load(case.b, version=6)
        assert case.engine.weight_version is None
        assert case.llm.get_weight_version() == "invalid:6"
        _, out = case.greedy()  # the reload session was closed: the engine still runs (on mixed weights)
        assert [span.version for span in out.weight_versions] == ["invalid:6"]
        with pytest.raises(ValueError, match="must cover the whole model"):
            case.engine.update({"model.norm.weight": case.b["model.norm.weight"]}, version=7)
        case.load(case.b, version=7)
        assert case.engine.weight_version == 7
        assert case.greedy()[0] == case.ref_b

    def test_cpu_fix_tied_lm_head(self, case):
        case.load(case.a, version=8)
        case.llm.collective_rpc(_vanilla_reload, args=(list(checkpoint_tensors(case.b).items()),))
        case.llm.reset_prefix_cache()
        assert case.greedy()[0] != case.ref_b, "vLLM now refreshes a tied lm_head: drop _cpu_retie_lm_head"
        case.llm.collective_rpc(lambda worker: vllm_reload._cpu_retie_lm_head(worker.model_runner.get_model()))
        case.llm.reset_prefix_cache()
        assert case.greedy()[0] == case.ref_b

    def test_weightsync_backend_receives_from_training_ranks(self, case):
        from weightsync.meta import client as meta
        case.load(case.a, version=0)
        job = f"vllm-backend-{uuid.uuid4().hex[:8]}"
        with meta.EmbeddedMetaServer() as server, writer_processes(server, case.config, "fsdp:dp=2", job=job,
                                                                   seeds=[2, 1]):
            case.llm.init_weight_transfer_engine({"init_info": {
                "meta_address": server.address, "meta_token": server.token, "job": job,
                "rank": 0, "num_writers": 2, "num_readers": 1, "timeout": 120}})
            try:
                vllm_engine.update_llm(case.llm, 1)
                tokens, out = case.greedy()
                assert tokens == case.ref_b
                assert [span.version for span in out.weight_versions] == ["1"]
                vllm_engine.update_llm(case.llm, 2)
                assert case.greedy()[0] == case.ref_a
            finally:
                case.llm.shutdown_weight_transfer_engine()

    def test_weightsync_backend_prefetches_while_the_engine_generates(self, case):
        """start_weight_update starts the receive in the worker and returns: greedy tokens generated
        meanwhile, and once the next version fully arrived in staging, still come from the old
        version (its stamp says so); update_weights only applies, and then they come from the new
        one, token for token as a fresh engine."""
        from weightsync.meta import client as meta
        case.load(case.a, version=0)
        job = f"vllm-prefetch-{uuid.uuid4().hex[:8]}"
        with meta.EmbeddedMetaServer() as server, writer_processes(server, case.config, "fsdp:dp=2", job=job,
                                                                   seeds=[2, 1]):
            info = {"meta_address": server.address, "meta_token": server.token, "job": job, "rank": 0,
                    "num_writers": 2, "num_readers": 1, "timeout": 120, "prefetch": True}
            with pytest.raises(Exception, match="prefetch=True with layer_phases=True"):
                case.llm.init_weight_transfer_engine({"init_info": {**info, "layer_phases": True}})
            case.llm.init_weight_transfer_engine({"init_info": info})
            try:
                for version, old, new in ((1, case.ref_a, case.ref_b), (2, case.ref_b, case.ref_a)):
                    case.llm.start_weight_update()  # returns at once: the worker receives in the background
                    tokens, out = case.greedy()
                    assert tokens == old and [s.version for s in out.weight_versions] == [str(version - 1)]
                    assert _wait_prefetched(case.llm, version) == version
                    tokens, out = case.greedy()  # the whole new version sits in staging, unused
                    assert tokens == old and [s.version for s in out.weight_versions] == [str(version - 1)]
                    case.llm.update_weights({"update_info": {"version": version}})
                    case.llm.finish_weight_update(weight_version=str(version))
                    assert case.llm.reset_prefix_cache()
                    tokens, out = case.greedy()
                    assert tokens == new and [s.version for s in out.weight_versions] == [str(version)]
            finally:
                with contextlib.suppress(Exception):  # a failure between start and finish left it open
                    case.llm.finish_weight_update()
                case.llm.shutdown_weight_transfer_engine()


def _wait_prefetched(llm: Any, version: int, timeout: float = 120.0) -> int | None:
    """The version the worker's prefetch holds in staging, once it is ``version`` (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        got = llm.collective_rpc(lambda worker: worker.weight_transfer_engine.prefetch.received)[0]
        if got == version or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@vllm_test("moe")
class TestQwen3MoE(EngineProofs):
    layout = "megatron:tp=2,ep=2,etp=1"

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, vllm_env, tmp_path_factory):
        case = make_case(tmp_path_factory.mktemp("moe"), moe=True, tie=False)
        yield case
        shutdown(case.llm)

    def test_cpu_fix_moe_prepack(self, case):
        case.load(case.a, version=8)
        same = list(checkpoint_tensors(case.a).items())
        case.llm.collective_rpc(_vanilla_reload, args=(same,))  # reloading the very same weights...
        case.llm.reset_prefix_cache()
        assert case.greedy()[0] != case.ref_a, "vLLM now re-prepacks MoE experts on reload: drop _stash_cpu_moe_kernels"
        items = list(checkpoint_tensors(case.b).items())
        case.llm.collective_rpc(_vanilla_reload, args=(items, _moe_prepack_fix))
        case.llm.reset_prefix_cache()
        assert case.greedy()[0] == case.ref_b


#: compressed-tensors FP8_DYNAMIC: FP8 weights with per-channel static scales (served by vLLM's CPU build)
FP8_CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                   "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                         "dynamic": True}}},
               "ignore": ["lm_head"]}


def write_fp8_checkpoint(path: Path, config: dict[str, Any], seed: int) -> None:
    """An FP8 checkpoint of ``canonical_weights(config, seed)`` in bf16, quantized by the reference."""
    import json

    from safetensors.torch import save_file

    from weightsync.layout.quant import SCHEMES, quantized_tensors
    from weightsync.tools.codecs.fp8 import reference_quantize

    spec = ModelSpec.from_hf_config(config)
    quantized = set(quantized_tensors(spec))
    tensors = {}
    for name, value in canonical_weights(config, seed).items():
        weight = value.to(torch.bfloat16)
        if name in quantized:
            q, scale = reference_quantize(weight, SCHEMES["fp8_channel"])
            tensors[name], tensors[name[: -len("weight")] + "weight_scale"] = q, scale
        else:
            tensors[name] = weight
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CHANNEL}))
    save_file(tensors, str(path / "model.safetensors"))


@vllm_test("fp8")
class TestFP8Channel:
    """Trainers hold bf16; the engine serves compressed-tensors FP8: writers quantize on send."""

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, vllm_env, tmp_path_factory):
        tmp = tmp_path_factory.mktemp("fp8")
        config = {**tiny_config(), "torch_dtype": "bfloat16"}
        write_fp8_checkpoint(tmp / "A", config, seed=1)
        write_fp8_checkpoint(tmp / "B", config, seed=2)
        fresh_b = start_llm(tmp / "B", dtype="bfloat16")
        ref_b, _ = greedy(fresh_b)
        shutdown(fresh_b)
        llm = start_llm(tmp / "A", dtype="bfloat16")
        ref_a, _ = greedy(llm)
        assert ref_a != ref_b
        yield SimpleNamespace(config=config, llm=llm, engine=VLLMEngine(llm), ref_a=ref_a, ref_b=ref_b)
        shutdown(llm)

    def test_fp8_from_bf16_training_ranks_matches_fresh_fp8_engine(self, case):
        from weightsync.meta import client as meta
        from weightsync.roles.reader import WeightReader
        from weightsync.session.sync_session import SyncConfig

        assert case.engine.layout_text == "hf:dtype=bfloat16,quant=fp8_channel"
        job = f"vllm-fp8-{uuid.uuid4().hex[:8]}"
        with meta.EmbeddedMetaServer() as server, writer_processes(server, case.config, "fsdp:dp=2", job=job,
                                                                   seeds=[2]):
            config = SyncConfig(num_writers=2, num_readers=1, job=job, timeout=120)
            client = meta.MetaClient(server.address, job=job, token=server.token)
            with WeightReader(case.engine, rank=0, config=config, meta=client) as reader:
                result = reader.update(timeout=120)
            client.close()
        assert result.version == 1
        spec = ModelSpec.from_hf_config(case.config)
        from weightsync.layout.quant import quantized_tensors

        linear = sum(spec.canonical_tensors()[n].numel for n in quantized_tensors(spec))
        assert result.nbytes < spec.num_parameters * 2 - linear + linear // 8  # FP8 on the wire, not bf16
        assert greedy(case.llm)[0] == case.ref_b


# -- without vLLM ---------------------------------------------------------------------------------

class _Recorder(StagedWeights):
    def __init__(self, config):
        super().__init__(ModelSpec.from_hf_config(config), dtype=torch.float32, device="cpu", rank=0)
        self.loads = []
        self.current = None

    def _begin(self, version):
        self.current = (version, [])

    def _load_items(self, items):
        self.current[1].extend(name for name, _ in items)

    def _end(self, version, *, failed=False):
        if not failed:
            self.loads.append(self.current)


@pytest.mark.parametrize("is_moe", [False, True])
def test_staging_is_the_checkpoint_under_its_own_names(is_moe):
    config = tiny_config(moe=is_moe)
    engine = _Recorder(config)
    names = list(checkpoint_tensors(canonical_weights(config, seed=0)))
    assert [s.name for s in engine.layout().shards] == names
    assert engine.descriptor() == ("hf:dtype=float32", ModelSpec.from_hf_config(config).to_hf_config())
    engine.receive_buffers()  # lays the staging out: the whole model (no phases)
    model_bytes = 4 * ModelSpec.from_hf_config(config).num_parameters
    assert model_bytes <= engine.staging_bytes <= model_bytes + 64 * len(names)
    with pytest.raises(ValueError, match="must cover the whole model"):
        engine.update({names[0]: torch.zeros(engine.receive_buffers()[names[0]].shape)}, version=1)
    assert engine.loads == []
    engine.apply(1)  # what the reader calls once every op arrived
    engine.update({names[0]: torch.ones(engine.receive_buffers()[names[0]].shape)}, version=2)
    assert [v for v, _ in engine.loads] == [1, 2] and engine.loads[1][1] == names  # a partial update reloads all
    assert engine.weight_version == 2
    engine.abort(3, RuntimeError("peer died"))  # before any load: only staging was written
    assert engine.weight_version == 2 and engine.invalid is None
    with pytest.raises(ValueError, match="must cover the whole model"):  # staging may hold a mix
        engine.update({names[0]: torch.ones(engine.receive_buffers()[names[0]].shape)}, version=4)


def test_in_place_parameters_follow_vllms_direct_load_rules():
    from weightsync.engines.vllm import ParamFacts, in_place_names

    ckpt = {"m.layers.0.input_layernorm.weight": ((8,), "float32"), "m.layers.0.o_proj.weight": ((8, 8), "float32"),
            "m.layers.0.o_proj.bias": ((8,), "float32"), "m.embed.weight": ((16, 8), "float32")}

    def facts(name, shape, loader="", dtype="float32", contiguous=True, repacked=False):
        return ParamFacts(name, shape, dtype, contiguous, loader, repacked)

    gpu = [facts("m.layers.0.input_layernorm.weight", (8,)),
           facts("m.layers.0.o_proj.weight", (8, 8), "RowParallelLinear.weight_loader_v2"),
           facts("m.layers.0.o_proj.bias", (8,), "RowParallelLinear.weight_loader"),
           facts("m.embed.weight", (16, 8), "VocabParallelEmbedding.weight_loader"),
           facts("m.layers.0.qkv_proj.weight", (24, 8), "QKVParallelLinear.weight_loader_v2")]
    assert in_place_names(gpu, ckpt, quantized=False) == [
        "m.layers.0.input_layernorm.weight", "m.layers.0.o_proj.bias", "m.layers.0.o_proj.weight"]
    # CPU: vLLM empties linear weights into oneDNN handles; a module is in place only as a whole
    cpu = [gpu[0], facts("m.layers.0.o_proj.weight", (0,), "RowParallelLinear.weight_loader_v2"), gpu[2]]
    assert in_place_names(cpu, ckpt, quantized=False) == ["m.layers.0.input_layernorm.weight"]
    assert in_place_names([gpu[0], facts("m.layers.0.input_layernorm.weight", (8,), "<opaque>")], ckpt,
                          quantized=False) == []
    assert in_place_names([facts("m.layers.0.input_layernorm.weight", (8,), repacked=True)], ckpt,
                          quantized=False) == []
    assert in_place_names(gpu, ckpt, quantized=True) == []


def test_unsupported_engine_configurations_are_rejected():
    def config(tp=1, pp=1, quantization=None, lora=None, qc=None):
        return SimpleNamespace(parallel_config=SimpleNamespace(world_size=tp * pp, tensor_parallel_size=tp,
                                                               pipeline_parallel_size=pp),
                               model_config=SimpleNamespace(quantization=quantization,
                                                            hf_config=SimpleNamespace(quantization_config=qc)),
                               lora_config=lora)

    check_supported(config())
    check_supported(config(tp=2))  # each TP worker is a reader of the slices it loads (engines/vllm_parallel.py)
    with pytest.raises(ValueError, match=r"serves tensor and data parallel engines, not pipeline parallel ones "
                                         r"\(PP=2\): a stage would receive layers it never loads"):
        check_supported(config(tp=2, pp=2))
    with pytest.raises(ValueError, match=r"quantized models \(awq\) are not supported"):
        check_supported(config(quantization="awq", qc={"quant_method": "awq"}))
    with pytest.raises(ValueError, match="weight_block_size=\\[64, 64\\]"):
        check_supported(config(quantization="fp8", qc={"quant_method": "fp8", "weight_block_size": [64, 64]}))
    with pytest.raises(ValueError, match=r"leaves .*o_proj.* unquantized"):
        check_supported(config(quantization="compressed-tensors", qc={**FP8_CHANNEL, "ignore": ["lm_head", "o_proj"]}))
    assert vllm_engine.staging_quant(config(quantization="compressed-tensors", qc=FP8_CHANNEL)) == "fp8_channel"
    assert vllm_engine.staging_quant(config(quantization="fp8", qc={
        "quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]})) == "fp8_block"
    with pytest.raises(ValueError, match="LoRA"):
        check_supported(config(lora=object()))
    if not HAVE_VLLM:  # which platform runs the engine is vLLM's to say
        return
    gpt_oss = config()
    gpt_oss.model_config.dtype = torch.float16
    gpt_oss.model_config.hf_config.to_dict = lambda: tiny_config(family="gpt_oss")
    with pytest.raises(ValueError, match=r"gpt_oss in float16 on vLLM's CPU build: .* no reload refreshes"):
        check_supported(gpt_oss)


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install -e '.[vllm]')")
def test_a_draft_update_takes_only_the_version_the_target_holds():
    """The MTP drafter's layers arrive, and are loaded, with the target's version: a draft session
    asking for another version is refused with what to do, before anything is loaded."""
    from weightsync.integrations.vllm_backend import _WorkerEngine

    worker = _WorkerEngine.__new__(_WorkerEngine)
    worker.draft, worker._version = torch.nn.Module(), 2  # both hold version 2
    worker.load_draft(2)  # nothing left to do
    worker.load_draft(None)
    with pytest.raises(ValueError, match="holds version 2, and the drafter is updated with the target, not alone"):
        worker.load_draft(3)


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install -e '.[vllm]')")
def test_an_mtp_engine_whose_drafter_the_backend_cannot_find_is_refused_at_init():
    """The backend takes the MTP drafter from the worker creating it (vLLM hands it over only in a
    draft session, which the trainer-side client cannot open): created anywhere else, it refuses at
    init, naming why, rather than leave the drafter's weights stale."""
    from types import SimpleNamespace

    from weightsync.integrations.vllm_backend import WeightSyncInitInfo, WeightSyncTransferEngine, _creator

    target, drafter = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    class Worker:  # vLLM 0.32's Worker.load_model creates the engine with its model runner's model
        def get_model(self):
            return target

        def get_draft_model(self):
            return drafter

        def load_model(self):
            return _creator(target)

    worker = Worker()
    assert worker.load_model() is worker and worker.get_draft_model() is drafter
    assert _creator(target) is None  # not created by a worker of that model
    engine = WeightSyncTransferEngine.__new__(WeightSyncTransferEngine)
    engine.reader, engine._drafter, engine._default_model = None, None, target
    from vllm.config import ParallelConfig

    engine.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(method="mtp"),
                                         parallel_config=ParallelConfig())  # vLLM's own: one worker
    with pytest.raises(RuntimeError, match=r"drafts with the model's MTP layers .* did not find its drafter.*stale"):
        engine.init_transfer_engine(WeightSyncInitInfo.from_wire({"num_writers": 1, "num_readers": 1}))



def test_an_engine_drafting_with_weights_of_its_own_is_told_they_stay_as_started():
    """A separate drafter (EAGLE, a draft model) is not the job's: said once at set-up, never
    silently; MTP (the model's own layers, synced) and weightless drafting say nothing."""
    from weightsync.engines.vllm_model import separate_drafter

    def config(method, model=None):
        return SimpleNamespace(speculative_config=SimpleNamespace(method=method,
                                                                  draft_model_config=SimpleNamespace(model=model)))

    notice = separate_drafter(config("eagle3", "org/eagle3-head"))
    assert notice is not None and notice.startswith(
        "the engine drafts with eagle3 (org/eagle3-head): weightsync syncs the target model only, and the drafter "
        "keeps the weights it was started with")
    assert "draft_model" in (separate_drafter(config("draft_model", "Qwen/Qwen3-0.6B")) or "")
    assert [separate_drafter(config(m)) for m in ("mtp", "deepseek_mtp", "ngram", "suffix")] == [None] * 4
    assert separate_drafter(SimpleNamespace(speculative_config=None)) is None
