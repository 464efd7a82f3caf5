"""The machinery of the engine matrix (tests/test_engine_matrix.py): checkpoints that differ in every
element, engines, trainers of each source, and the oracle's check after every sync.

One family's cells share one live engine (per API that needs an engine of its own). The engine
starts on checkpoint X; every cell syncs it to the checkpoint it does not hold (X -> Y -> X ...),
and after each sync :meth:`Live.check` compares, against a fresh engine on that checkpoint:

* greedy tokens of a prompt longer than a KV block, token for token;
* the whole engine state (:func:`weightsync.engines.vllm_state.engine_state`: parameters, buffers,
  tensors held by module attributes, quant configs and closures, each linear layer's probe),
  bitwise. A tensor the sync skipped still holds the other checkpoint's values, which differ in
  every element: the report names it ("equal to X").

The fresh references cost one engine start per checkpoint: the engine on X, before any sync, is
the fresh engine on X; a short-lived engine on Y gives Y's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import launcher
from weightsync.layout import ModelSpec
from weightsync.tools.engine_state import compare_states
from weightsync.tools.tiny import canonical_weights, checkpoint_tensors, tiny_config

HERE = Path(__file__).resolve().parent
PROMPT = [5 + (7 * i) % 480 for i in range(40)]  # longer than one KV block (16 tokens with MLA on CPU)
NEW_TOKENS = 12
SEEDS = {"X": 1, "Y": 2}

#: Every family, and the config switches that change its tensors.
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": tiny_config(family="llama"),
    "qwen2": tiny_config(family="qwen2"),
    "qwen3": tiny_config(),
    "qwen3_moe": tiny_config(moe=True),
    "mixtral": tiny_config(family="mixtral"),
    "deepseek_v3": tiny_config(family="deepseek_v3"),
    "deepseek_v3-no-mtp": {**tiny_config(family="deepseek_v3"), "num_nextn_predict_layers": 0},
    # bf16: on a CPU with AMX tiles vLLM serves MLA with its AMX backend, which keeps packed copies of
    # W_UK and W_UV (elsewhere the reference CPU MLA, as the float32 variants everywhere)
    "deepseek_v3-bf16": {**tiny_config(family="deepseek_v3"), "torch_dtype": "bfloat16"},
    "glm4_moe": tiny_config(family="glm4_moe"),
    "glm4_moe-no-attention-bias": {**tiny_config(family="glm4_moe"), "attention_bias": False},
    "gpt_oss": tiny_config(family="gpt_oss"),
    # an FP8 engine (compressed-tensors, per-channel scales) fed by bf16 trainers: writers quantize on send
    "qwen3-fp8": {**tiny_config(), "torch_dtype": "bfloat16"},
}
FP8_VARIANTS = frozenset({"qwen3-fp8"})

#: compressed-tensors FP8_DYNAMIC: FP8 weights with per-channel static scales (served by vLLM's CPU build)
FP8_CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                   "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                         "dynamic": True}}},
               "ignore": ["lm_head"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- checkpoints -------------------------------------------------------------------------------------

def write_pair(tmp: Path, config: dict[str, Any], *, fp8: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoints X and Y of ``config`` under ``tmp``: every element of every tensor differs (norms,
    biases, sinks, the router's correction bias included). Returns their canonical tensors."""
    out = {}
    for label, seed in SEEDS.items():
        out[label] = canonical_weights(config, seed)
        if fp8:
            write_fp8_checkpoint(tmp / label, config, seed)
        else:
            (tmp / label).mkdir(parents=True, exist_ok=True)
            (tmp / label / "config.json").write_text(json.dumps(config))
            from safetensors.torch import save_file

            save_file(checkpoint_tensors(out[label]), str(tmp / label / "model.safetensors"))
    same = [n for n in out["X"] if bool((out["X"][n] == out["Y"][n]).any())]
    assert not same, f"X and Y must differ in every element; equal somewhere in {same[:4]}"
    return out


def write_fp8_checkpoint(path: Path, config: dict[str, Any], seed: int) -> None:
    """An FP8 checkpoint of ``canonical_weights(config, seed)`` in bf16, quantized by the reference."""
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
    save_file(checkpoint_tensors(tensors), str(path / "model.safetensors"))


# -- engines -----------------------------------------------------------------------------------------

def engine_kwargs(config: dict[str, Any], *, backend: bool = True) -> dict[str, Any]:
    spec = ModelSpec.from_hf_config(config)
    from vllm_in_process import cpu_attention

    kwargs: dict[str, Any] = {"dtype": "bfloat16" if config.get("torch_dtype") == "bfloat16" else "float32"}
    attention = cpu_attention(config, kwargs["dtype"])
    if attention:
        kwargs["attention_config"] = {"backend": attention}
    if spec.mtp_layers:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 1}
        if attention:
            kwargs["speculative_config"]["attention_backend"] = attention
    if backend:
        kwargs["weight_transfer_config"] = {"backend": "weightsync"}
    return kwargs


def start_llm(path: Path, config: dict[str, Any], *, backend: bool = True) -> Any:
    from vllm import LLM

    from vllm_in_process import before_engine_start

    before_engine_start()
    return LLM(model=str(path), enforce_eager=True, max_model_len=512, max_num_seqs=2, seed=0,
               kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True, **engine_kwargs(config, backend=backend))


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()  # also tears down vLLM's process-global parallel state
    gc.collect()


def greedy(llm: Any) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    return list(llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0].token_ids)


@dataclasses.dataclass
class Reference:
    """A fresh engine on one checkpoint: its greedy tokens and its whole state."""

    tokens: list[int]
    state: dict[str, Any]


def reference(llm: Any) -> Reference:
    from weightsync.engines.vllm_state import engine_state

    return Reference(greedy(llm), dict(engine_state(llm)[1]))


@dataclasses.dataclass
class Live:
    """One family's live in-process engine (started on X) and everything its cells share."""

    name: str
    config: dict[str, Any]
    tmp: Path
    canonical: dict[str, dict[str, torch.Tensor]]
    refs: dict[str, Reference]
    llm: Any
    server: Any  # the family's embedded meta server
    held: str = "X"
    #: the last version any cell wrote: versions go on increasing across cells (an engine keeps its
    #: version from one job to the next, and a reader waits for a newer one)
    version: int = 0
    log: list[str] = dataclasses.field(default_factory=list)
    _engine: Any = None
    _hf: Any = None

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(self.config)

    @property
    def engine(self) -> Any:
        """The in-process ``VLLMEngine`` on the live ``LLM`` (staging allocated once)."""
        from weightsync.engines.vllm import VLLMEngine

        if self._engine is None:
            self._engine = VLLMEngine(self.llm)
        return self._engine

    def hf_model(self) -> Any:
        """The trainer's transformers model of the family, in this process (MTP layers appended)."""
        if self._hf is None:
            import transformers

            from _frontier_trainer import add_mtp_layers

            hf = transformers.AutoConfig.for_model(**{k: v for k, v in self.config.items() if k != "architectures"})
            dtype = torch.bfloat16 if self.config.get("torch_dtype") == "bfloat16" else torch.float32
            self._hf = transformers.AutoModelForCausalLM.from_config(hf, dtype=dtype)
            # as from_pretrained would: the family's float32 modules stay float32 in a bf16 model
            # (DeepSeek-V3's e_score_correction_bias), which from_config leaves to the caller
            add_mtp_layers(self._hf, self.config)
            keep = [*(getattr(self._hf, "_keep_in_fp32_modules_strict", None) or ()),
                    *(getattr(self._hf, "_keep_in_fp32_modules", None) or ())]
            for name, tensor in [*self._hf.named_parameters(), *self._hf.named_buffers()]:
                if any(k in name.split(".") for k in keep):
                    tensor.data = tensor.data.float()
        return self._hf

    def next_target(self) -> str:
        return "Y" if self.held == "X" else "X"

    def check(self, target: str, what: str) -> None:
        """The engine now serves ``target``: greedy tokens and every tensor as a fresh engine's on it."""
        from weightsync.engines.vllm_state import engine_state

        tokens, state = greedy(self.llm), engine_state(self.llm)[1]
        before, self.held = self.held, target  # what the engine was sent, whatever it holds
        self.log.append(f"{what}: {before} -> {target}")
        verify(self, before, target, f"{self.name}, {what}", tokens, state)


def verify(live: Live, before: str, target: str, what: str, tokens: list[int], state: Any) -> None:
    """An engine that held ``before`` and was sent ``target`` serves exactly what a fresh engine on
    ``target`` does: its state (tensors, or digests from another process) and its greedy tokens."""
    report = compare_states(state, live.refs[target].state, others={before: live.refs[before].state})
    assert report.ok, f"{what}, {before} -> {target}: {report.describe()}"
    assert tokens == live.refs[target].tokens, f"{what}, {before} -> {target}: greedy tokens differ from a fresh engine's"


@contextlib.contextmanager
def live_engine(name: str, config: dict[str, Any], tmp: Path, *, fp8: bool = False) -> Iterator[Live]:
    """The family's references and its live engine on X (the caller sets vLLM's environment)."""
    from weightsync.meta import client as meta

    canonical = write_pair(tmp, config, fp8=fp8)
    fresh_y = start_llm(tmp / "Y", config, backend=False)
    try:
        ref_y = reference(fresh_y)
    finally:
        shutdown(fresh_y)
        del fresh_y
    llm = start_llm(tmp / "X", config)
    try:
        ref_x = reference(llm)
        assert ref_x.tokens != ref_y.tokens, "X and Y must generate differently for the proofs to mean anything"
        with meta.EmbeddedMetaServer() as server:
            yield Live(name, config, tmp, canonical, {"X": ref_x, "Y": ref_y}, llm, server)
    finally:
        shutdown(llm)


# -- sources -----------------------------------------------------------------------------------------

def new_job(live: Live, what: str) -> str:
    return f"{live.name}-{what}-{uuid.uuid4().hex[:6]}"


@contextlib.contextmanager
def hf_writer(live: Live, job: str, targets: list[tuple[int, str]], sync: dict[str, Any]) -> Iterator[None]:
    """The trainer's transformers model in this process (``ModuleSource``), writing one version per
    target (its canonical values) from a thread; raises what the thread raised."""
    from weightsync.meta.client import MetaClient
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.config import SyncConfig
    from weightsync.sources.module import ModuleSource
    from weightsync.tools.torch_layout import fill_from_canonical

    source = ModuleSource(live.hf_model(), live.config)
    config = SyncConfig.from_wire({"num_writers": 1, "num_readers": 1, "job": job, "timeout": 240.0, **sync})
    errors: list[BaseException] = []

    def write() -> None:
        try:
            meta = MetaClient(live.server.address, job=job, token=live.server.token)
            with WeightWriter(source, rank=0, config=config, meta=meta) as writer:
                for version, target in targets:
                    with torch.no_grad():
                        fill_from_canonical(source.layout(), source.tensors(), live.canonical[target])
                    writer.write(version)
        except BaseException as exc:
            logging.getLogger(__name__).exception("the writer of %s failed", job)
            errors.append(exc)

    thread = threading.Thread(target=write, name=f"writer-{job}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(240)
    assert not thread.is_alive(), "the writer thread did not finish"
    if errors:
        raise errors[0]


@contextlib.contextmanager
def process_writers(live: Live, job: str, targets: list[tuple[int, str]], sync: dict[str, Any], *, source: str,
                    parallel: dict[str, int] | None = None) -> Iterator[None]:
    """Training ranks in child processes: two FSDP2 ranks of the transformers model
    (``tests/_frontier_trainer.py``), or TP x PP x DP megatron-core ranks (``tests/_megatron_trainer.py``)."""
    script, world, extra = (("_frontier_trainer.py", 2, ()) if source == "fsdp2" else
                            ("_megatron_trainer.py", num_writers(source, parallel), ("--parallel", json.dumps(parallel))))
    env = {**os.environ, "WEIGHTSYNC_META_ADDR": live.server.address, "WEIGHTSYNC_META_TOKEN": live.server.token,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    for name in [k for k in env if k.startswith("VLLM_")]:
        del env[name]
    seeds = ",".join(str(SEEDS[t]) for _, t in targets)
    procs = [launcher.launch([sys.executable, str(HERE / script), "--config", json.dumps(live.config), "--rank",
                              str(rank), "--world", str(world), "--seeds", seeds, "--job", job,
                              "--sync", json.dumps(sync), "--first-version", str(targets[0][0]), *extra], env=env)
             for rank in range(world)]
    try:
        yield
        for proc in procs:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def writers(live: Live, job: str, targets: list[tuple[int, str]], sync: dict[str, Any], source: str,
            parallel: dict[str, int] | None = None) -> Any:
    if source == "hf":
        return hf_writer(live, job, targets, sync)
    return process_writers(live, job, targets, sync, source=source, parallel=parallel)


def num_writers(source: str, parallel: dict[str, int] | None = None) -> int:
    """The training ranks of ``source``: Megatron's are TP x PP x DP of ``parallel``."""
    if source == "megatron":
        assert parallel is not None, "a megatron source needs its parallel sizes"
        return parallel["tp"] * parallel["pp"] * parallel["dp"]
    return {"hf": 1, "fsdp2": 2}[source]


# -- the APIs ---------------------------------------------------------------------------------------

def via_engine(live: Live, source: str, sync: dict[str, Any], versions: int = 1, *, prefetch: bool = False,
               parallel: dict[str, int] | None = None) -> None:
    """The in-process ``VLLMEngine`` behind a ``WeightReader`` (``prefetch``: ``prefetch.Prefetch``,
    on an engine that stages everything), ``versions`` versions of one job."""
    from weightsync.engines.vllm import VLLMEngine
    from weightsync.meta.client import MetaClient
    from weightsync.roles.prefetch import Prefetch
    from weightsync.roles.reader import WeightReader
    from weightsync.session.config import SyncConfig

    targets = _targets(live, versions)
    job = new_job(live, "engine")
    config = SyncConfig.from_wire({"num_writers": num_writers(source, parallel), "num_readers": 1, "job": job,
                                   "timeout": 240.0, **sync})
    engine = VLLMEngine(live.llm, in_place=False) if prefetch else live.engine
    meta = MetaClient(live.server.address, job=job, token=live.server.token)
    with writers(live, job, targets, sync, source, parallel), \
            WeightReader(engine, rank=0, config=config, meta=meta) as reader:
        staged = Prefetch(reader) if prefetch else None
        try:
            for version, target in targets:
                if staged is not None:
                    staged.start()
                    result = staged.apply(version, timeout=240)
                else:
                    result = reader.update(version, timeout=240)
                assert result.version == version
                live.version = version
                live.check(target, f"engine API, {source}, {sync or 'full'}{', prefetch' if prefetch else ''}")
        finally:
            if staged is not None:
                staged.close()


def via_peers(live: Live) -> None:
    """An engine that joins takes its first version from a peer, not from the trainer
    (``SyncConfig.peer_sources``): a transformers model of the family (reader seat 0, HF names,
    q/k/v apart: another layout than vLLM's) takes the version from the trainer; then the live vLLM
    engine joins as an engine that holds no version (a new ``VLLMEngine`` around it) and copies its
    whole share from that peer, re-planned against the peer's layout."""
    import transformers

    from weightsync.engines.buffers import ModuleEngine
    from weightsync.engines.vllm import VLLMEngine
    from weightsync.meta.client import MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.config import SyncConfig

    (version, target), = _targets(live, 1)
    job = new_job(live, "peers")
    sync = {"num_readers": None, "peer_sources": 1, "transport": "shm"}
    config = SyncConfig.from_wire({"num_writers": 1, "job": job, "timeout": 240.0, **sync})
    hf = transformers.AutoConfig.for_model(**{k: v for k, v in live.config.items() if k != "architectures"})
    peer = ModuleEngine(transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32), live.config)
    with writers(live, job, [(version, target)], sync, "hf"), \
            MetaClient(live.server.address, job=job, token=live.server.token) as first, \
            MetaClient(live.server.address, job=job, token=live.server.token) as second, \
            WeightReader(peer, rank=0, config=config, meta=first) as keeper, \
            WeightReader(VLLMEngine(live.llm, rank=1, replicas=2), rank=1, config=config, meta=second) as joiner:
        assert keeper.update(version, timeout=240).version == version
        result = joiner.update(version, timeout=240)
        assert result.version == version and result.peers == {0: result.nbytes}, result
        live.version = version
        live.check(target, "engine API, its first version from a peer of another layout")


def via_backend(live: Live, source: str, sync: dict[str, Any], versions: int = 1, *, prefetch: bool = False,
                parallel: dict[str, int] | None = None) -> None:
    """The ``"weightsync"`` worker backend, driven by ``update_llm``."""
    from weightsync.engines.vllm import update_llm
    from weightsync.session.config import SCOPES

    targets = _targets(live, versions)
    job = new_job(live, "backend")
    wire = {k: v for k, v in {"num_writers": num_writers(source, parallel), "num_readers": 1, "job": job, "timeout": 240.0,
                              **sync}.items() if SCOPES.get(k) != "rank"}
    live.llm.init_weight_transfer_engine({"init_info": {
        **wire, "meta_address": live.server.address, "meta_token": live.server.token, "rank": 0,
        "prefetch": prefetch}})
    try:
        with writers(live, job, targets, sync, source, parallel):
            for version, target in targets:
                update_llm(live.llm, version, timeout=240)
                assert live.llm.get_weight_version() == str(version)
                live.version = version
                live.check(target, f"worker backend, {source}, {sync or 'full'}{', prefetch' if prefetch else ''}")
    finally:
        live.llm.shutdown_weight_transfer_engine()


def via_trainer(live: Live, sync: dict[str, Any], versions: int = 1) -> None:
    """The trainer side of vLLM's weight-transfer API in this process (``WeightSyncTrainerEngine``
    over ``LLMClient``), the transformers model as its source (layer phases unless ``sync`` says)."""
    from weightsync.integrations.vllm_trainer import LLMClient, WeightSyncTrainerEngine, WeightSyncTrainerInitInfo
    from weightsync.sources.module import ModuleSource
    from weightsync.tools.torch_layout import fill_from_canonical

    targets = _targets(live, versions)
    job = new_job(live, "trainer")
    source = ModuleSource(live.hf_model(), live.config)
    info = WeightSyncTrainerInitInfo(rank=0, num_writers=1, num_readers=1, meta_address=live.server.address,
                                     meta_token=live.server.token, job=job, timeout=240.0, **sync)
    trainer = WeightSyncTrainerEngine.trainer_init(info, client=LLMClient(live.llm), source=source)
    try:
        for version, target in targets:
            with torch.no_grad():
                fill_from_canonical(source.layout(), source.tensors(), live.canonical[target])
            trainer.send_weights(version)
            live.version = version
            live.check(target, f"trainer side in process, hf, {sync or 'layer phases'}")
    finally:
        trainer.shutdown()


def _targets(live: Live, versions: int) -> list[tuple[int, str]]:
    """The next ``versions`` (version, checkpoint) of the family: each the checkpoint not held before."""
    out, held = [], live.held
    for i in range(1, versions + 1):
        held = "Y" if held == "X" else "X"
        out.append((live.version + i, held))
    return out


def _child_env(live: Live) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in a child process
    return env


def via_trainer_child(live: Live, versions: int = 2) -> None:
    """The trainer side of vLLM's API on an ``LLM`` whose engine core runs in a child process
    (``tests/_matrix_child.py``: a process of its own, started on X, the trainer's model beside it).
    Its state is read through the backend (digests); before any version it must be X's."""
    targets = ["Y", "X", "Y", "X"][:versions]
    cmd = [sys.executable, str(HERE / "_matrix_child.py"), "--checkpoint", str(live.tmp / "X"), "--config",
           json.dumps(live.config), "--seeds", ",".join(str(SEEDS[t]) for t in targets), "--job",
           new_job(live, "child")]
    proc = launcher.run(cmd, env=_child_env(live), timeout=600, warm="vllm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["version"] for r in results] == list(range(versions + 1)), proc.stdout[-2000:]
    from weightsync.tools.engine_state import state_from_wire

    held = "X"
    for result, target in zip(results, ["X", *targets], strict=True):
        what = f"{live.name}, trainer side, engine core in a child process, hf, layer phases"
        verify(live, held, target, what, result["tokens"], state_from_wire(result["state"]))
        if result["version"]:
            assert result["weight_version"] == str(result["version"]), result["weight_version"]
        held = target


def via_serve(live: Live, versions: int = 2) -> None:
    """``vllm serve`` (its own process, started on X, the weightsync backend) updated over HTTP by the
    trainer's model in this process on vLLM's trainer-side API (``HTTPVLLMWeightSyncClient``); its
    state is read through the dev route ``/collective_rpc``, its tokens through ``/v1/completions``;
    at the end ``weightsync verify --engine`` compares it with a fresh engine of its own."""
    import httpx
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from weightsync.apps.bench.vllm_prefetch_serve import vllm_serve
    from weightsync.cli import main
    from weightsync.engines.vllm_state import engine_state
    from weightsync.integrations.vllm_trainer import WeightSyncTrainerEngine, WeightSyncTrainerInitInfo
    from weightsync.sources.module import ModuleSource
    from weightsync.tools.torch_layout import fill_from_canonical

    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "2",
            "--skip-tokenizer-init", "--kv-cache-memory-bytes", str(32 << 20), "--seed", "0"]
    kwargs = engine_kwargs(live.config)
    if kwargs.get("speculative_config"):
        args += ["--speculative-config", json.dumps(kwargs["speculative_config"])]
    if kwargs.get("attention_config"):
        args += ["--attention-config", json.dumps(kwargs["attention_config"])]
    env = {**_child_env(live), "VLLM_SERVER_DEV_MODE": "1"}

    def served(url: str) -> tuple[list[int], Any]:
        body = {"model": str(live.tmp / "X"), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        tokens = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
        return tokens, engine_state(url)[1]

    with vllm_serve(live.tmp / "X", args, env=env, log=live.tmp / "server.log", timeout=600) as url:
        verify(live, "X", "X", f"{live.name}, vllm serve as started", *served(url))
        source = ModuleSource(live.hf_model(), live.config)
        info = WeightSyncTrainerInitInfo(rank=0, num_writers=1, num_readers=1, meta_address=live.server.address,
                                         meta_token=live.server.token, job=new_job(live, "serve"), timeout=240.0)
        trainer = WeightSyncTrainerEngine.trainer_init(info, client=HTTPVLLMWeightSyncClient(url), source=source)
        held = "X"
        try:
            for version, target in enumerate(["Y", "X", "Y", "X"][:versions], start=1):
                with torch.no_grad():
                    fill_from_canonical(source.layout(), source.tensors(), live.canonical[target])
                trainer.send_weights(version)
                what = f"{live.name}, vllm serve, trainer side over HTTP, hf, layer phases"
                verify(live, held, target, what, *served(url))
                held = target
        finally:
            trainer.shutdown()
        # the public tool on the same server: a fresh engine (a process of its own) on what it holds
        assert main(["verify", "--engine", url, "--checkpoint", str(live.tmp / held), "--timeout", "600"]) == 0


def _stderr(procs: list[Any]) -> str:
    out = []
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        out.append((proc.communicate()[1] or "")[-2000:])
    return " | ".join(out)


Cell = Callable[[Live], None]
