"""A failed update never leaves a vLLM engine serving mixed weights under a version number.

One tiny Qwen3 engine (float32, eager, in this process), started on checkpoint A with the
``"weightsync"`` backend, is driven three ways: as the in-process :class:`VLLMEngine`, through
the worker backend (``update_llm``), and from the trainer side (``WeightSyncTrainerEngine`` over
``LLMClient``). For each, version V is broken by (a) a transfer that stops half-way through a
norm received in place, (b) a failure in phase k of ``layer_phases`` after phases 0..k-1 were
loaded, (c) the model's own ``load_weights`` raising half-way. The engine then is invalid: vLLM's
weight version, stamped on every output, is ``invalid:V`` (the worker stamps it before the error
reaches any driver), the reader's row on the meta server is ``invalid``. The next version arrives
in full, and the engine generates token for token what a fresh engine on that checkpoint does.
Each case starts from a valid checkpoint X, fails toward Y and recovers to Z, three checkpoints
that differ in every tensor (norms included), so no tensor of the recovered engine can pass by
having kept an old value. A failure before any byte reached the model keeps the engine at its
version. A ``vllm serve`` (its engine core in a child process) is stamped by the trainer side over
HTTP, and the meta server's status page and metrics show its reader invalid. Each driver also reads
back which version the engine serves (``serving_llm``, the trainer side's ``serving()``, ``vllm serve``'s
``GET /weightsync/version``), and ``vllm serve`` tags each completion with its version.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_faults import Trainer, fail_in_phase, partial_writes
from weightsync.engines.process_state import preserved_process_state
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.session.sync_session import SyncConfig, SyncError
from weightsync.tools.tiny import canonical_weights, tiny_config, write_checkpoint
from weightsync.transport import TransportError, TransportOptions

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm-invalid"),
    pytest.mark.timeout(600),
]

CONFIG = tiny_config()
SEEDS = {"A": 1, "B": 2, "C": 3}
PROMPT = [random.Random(0).randrange(4, 512) for _ in range(300)]
NEW_TOKENS = 16
BUCKET = 1 << 16  # phases of at most 64 KiB: 10 of them
NORM = "model.layers.1.input_layernorm.weight"  # received in place (vLLM's CPU build: the norms)


def start_llm(path: Path, **kwargs: Any) -> Any:
    from vllm import LLM

    from vllm_in_process import before_engine_start

    before_engine_start()
    return LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=2, seed=0,
               kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True, **kwargs)


def greedy(llm: Any) -> tuple[list[int], list[str]]:
    """Greedy tokens of the 300-token prompt (more than two KV blocks), and their version stamps."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [span.version for span in out.weight_versions or []]


def cached_tokens(llm: Any) -> int:
    """Prompt tokens of the 300-token prompt whose KV vLLM's prefix cache supplied (one greedy run)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    return int(llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].num_cached_tokens)


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


@dataclass
class Engine:
    """The engine under test and the references: greedy tokens of fresh engines on A, B and C."""

    llm: Any
    server: EmbeddedMetaServer
    refs: dict[str, list[int]]
    paths: dict[str, Path]
    holds: str = "A"  # the checkpoint the engine holds (valid)
    version: int = 0  # the last version the engine applied
    log: list[str] = field(default_factory=list)

    def model(self) -> Any:
        return self.llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0]

    def worker_engine(self) -> Any:
        """The ``WeightSyncTransferEngine`` of the worker (in this process: by reference)."""
        return self.llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]

    def next_steps(self) -> tuple[str, str]:
        """The checkpoint a failing version moves toward, and the one the engine recovers to."""
        y, z = (c for c in "ABC" if c != self.holds)
        return y, z

    def check(self, checkpoint: str, stamp: str) -> None:
        """The engine generates exactly as a fresh engine on ``checkpoint``, stamped ``stamp``, and
        its in-place norm holds the checkpoint's tensor bitwise."""
        tokens, stamps = greedy(self.llm)
        assert tokens == self.refs[checkpoint], f"the engine does not generate as a fresh engine on {checkpoint}"
        assert stamps == [stamp] and self.llm.get_weight_version() == stamp
        norm = dict(self.model().named_parameters())[NORM]
        assert torch.equal(norm, canonical_weights(CONFIG, SEEDS[checkpoint])[NORM])

    def check_invalid(self, version: int) -> None:
        """vLLM stamps every output ``invalid:<version>``; the norm is neither checkpoint's whole."""
        assert self.llm.get_weight_version() == f"invalid:{version}"
        _, stamps = greedy(self.llm)  # the engine still runs, on mixed weights, and says so
        assert stamps == [f"invalid:{version}"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One engine on A for every test here; fresh engines on B and C give the references."""
    tmp = tmp_path_factory.mktemp("invalid-vllm")
    paths = {name: tmp / name for name in SEEDS}
    for name, seed in SEEDS.items():
        write_checkpoint(paths[name], CONFIG, seed=seed)
    with preserved_process_state(), pytest.MonkeyPatch.context() as mp, EmbeddedMetaServer() as server:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_HOST_IP", "127.0.0.1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        refs = {}
        for name in ("B", "C"):
            fresh = start_llm(paths[name])
            refs[name] = greedy(fresh)[0]
            shutdown(fresh)
        llm = start_llm(paths["A"], weight_transfer_config={"backend": "weightsync"})
        # every check() reruns a prompt of more than two KV blocks that ran on the old weights: with the
        # prefix cache on, a version whose apply kept the old KV would not generate as a fresh engine
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        refs["A"] = greedy(llm)[0]
        assert len({tuple(r) for r in refs.values()}) == 3, "the checkpoints must generate differently"
        yield Engine(llm, server, refs, paths)
        shutdown(llm)


def sync_config(engine: Engine, fault: str, **kw: Any) -> SyncConfig:
    return SyncConfig(num_writers=1, num_readers=1, job=f"vinv-{uuid.uuid4().hex[:8]}", timeout=60,
                      layer_phases=fault == "phase",
                      transport_options=TransportOptions(max_bucket_bytes=BUCKET,
                                                         delta_anchor_every=0 if fault == "partial-write" else 8), **kw)


@contextlib.contextmanager
def trainer(engine: Engine, sync: SyncConfig) -> Iterator[Trainer]:
    t = Trainer(CONFIG, sync, engine.server.address, engine.server.token)
    try:
        yield t
    finally:
        t.close()


def row(engine: Engine, sync: SyncConfig) -> dict[str, Any]:
    with MetaClient(engine.server.address, job=sync.job, token=engine.server.token) as meta:
        return dict(meta.wait_reader_report(min_version=0, readers=0, timeout=1).rows[0])


@contextlib.contextmanager
def loader_breaks(engine: Engine) -> Iterator[None]:
    """Case (c): the model's own ``load_weights`` loads half of what it is given, then raises."""
    model = engine.model()
    original = model.load_weights

    def load_weights(weights: Any) -> Any:
        items = list(weights)
        original(iter(items[: len(items) // 2]))
        raise RuntimeError("injected: load_weights raised half-way")

    model.load_weights = load_weights
    try:
        yield
    finally:
        del model.load_weights  # the class's method again


def inject(engine: Engine, fault: str, reader: Any, version: int, port: Any = None,
           target: torch.Tensor | None = None) -> contextlib.AbstractContextManager[Any]:
    """Arm ``fault`` for ``version`` (partial write: into ``target``); returns the context the
    failing update runs in."""
    if fault == "partial-write":
        port.arm(target)
    elif fault == "phase":
        fail_in_phase(reader, version, 3)
    else:
        return loader_breaks(engine)
    return contextlib.nullcontext()


MESSAGES = {"partial-write": "connection broke", "phase": "phase 3", "loader": "load_weights raised half-way"}
FAULTS = list(MESSAGES)


# -- the in-process VLLMEngine, with its own WeightReader --------------------------------------------

@pytest.mark.parametrize("fault", FAULTS)
def test_an_in_process_vllm_engine_ends_invalid_and_a_full_version_recovers_it(engine, fault):
    from weightsync.engines.vllm import VLLMEngine
    from weightsync.roles.reader import WeightReader

    y, z = engine.next_steps()
    adapter = VLLMEngine(engine.llm)
    sync = sync_config(engine, fault)
    with partial_writes() as port, trainer(engine, sync) as t, \
            MetaClient(engine.server.address, job=sync.job, token=engine.server.token) as meta, \
            WeightReader(adapter, rank=0, config=sync, meta=meta) as reader:
        v = engine.version + 1
        done = t.write(v, SEEDS[engine.holds])  # the reader plans and arms on a version of what it holds
        reader.update(v)
        done.result(60)
        with inject(engine, fault, reader, v + 1, port, adapter.receive_buffers()[NORM]):
            done = t.write(v + 1, SEEDS[y])
            with pytest.raises(SyncError, match=MESSAGES[fault]):
                reader.update(v + 1)
        with contextlib.suppress(Exception):
            done.result(60)
        assert adapter.weight_version is None and adapter.invalid is not None and adapter.invalid.version == v + 1
        assert row(engine, sync)["state"] == "invalid"
        engine.check_invalid(v + 1)

        done = t.write(v + 2, SEEDS[z])
        result = reader.update(v + 2)
        done.result(60)
        assert result.nbytes == adapter.layout().nbytes  # in full, never a delta on mixed weights
        assert adapter.weight_version == v + 2 and adapter.invalid is None and row(engine, sync)["state"] == "valid"
    engine.check(z, str(v + 2))
    engine.holds, engine.version = z, v + 2


# -- the worker backend, driven by update_llm (vLLM's weight-transfer API) ----------------------------

@contextlib.contextmanager
def backend(engine: Engine, sync: SyncConfig, **extra: Any) -> Iterator[Any]:
    """The ``"weightsync"`` backend initialised for ``sync``'s job; yields the worker's transfer engine."""
    wire = {k: v for k, v in sync.to_wire().items() if k not in ("host", "transport_host")}
    engine.llm.init_weight_transfer_engine({"init_info": {
        **wire, "meta_address": engine.server.address, "meta_token": engine.server.token, "rank": 0, **extra}})
    try:
        yield engine.worker_engine()
    finally:
        engine.llm.shutdown_weight_transfer_engine()


@pytest.mark.parametrize("fault", FAULTS)
def test_the_worker_backend_stamps_vllm_invalid_when_a_failed_version_touched_the_model(engine, fault):
    """Before the fix the worker's reader knew, but vLLM's weight version stayed the old one: outputs
    of mixed weights were stamped with a valid version."""
    from weightsync.engines.vllm import stamp_if_invalid, update_llm
    from weightsync.engines.vllm_version import serving_llm

    y, z = engine.next_steps()
    sync = sync_config(engine, fault)
    with partial_writes() as port, trainer(engine, sync) as t, backend(engine, sync) as worker:
        v = engine.version + 1
        done = t.write(v, SEEDS[engine.holds])
        update_llm(engine.llm, v)
        done.result(60)
        reader = worker.reader
        with inject(engine, fault, reader, v + 1, port, reader.engine.receive_buffers()[NORM]):
            done = t.write(v + 1, SEEDS[y])
            with pytest.raises(Exception, match=MESSAGES[fault]):
                update_llm(engine.llm, v + 1)
        with contextlib.suppress(Exception):
            done.result(60)
        assert reader.version is None and reader.invalid is not None and row(engine, sync)["state"] == "invalid"
        engine.check_invalid(v + 1)
        # the driver's stamp, for a worker in a process of its own (vLLM's CPU build): it asks the worker
        engine.llm.update_weight_version(str(v))
        assert stamp_if_invalid(engine.llm) == f"invalid:{v + 1}" == engine.llm.get_weight_version()
        answer = serving_llm(engine.llm)  # the readback: no version, invalid since the failure, and why
        assert (answer.version, answer.valid, answer.failed, answer.since) == (None, False, v + 1, reader.invalid.since)
        assert MESSAGES[fault] in answer.reason

        done = t.write(v + 2, SEEDS[z])
        before = time.time()
        update_llm(engine.llm, v + 2)
        done.result(60)
        assert worker.last_result.nbytes == reader.engine.layout().nbytes and row(engine, sync)["state"] == "valid"
        answer = serving_llm(engine.llm)
        assert (answer.version, answer.valid) == (v + 2, True) and before <= answer.since <= time.time()
        # the prompt ran on the invalid weights just before: none of that KV is reused, the new version's is
        assert cached_tokens(engine.llm) == 0 and cached_tokens(engine.llm) >= 256
    engine.check(z, str(v + 2))
    engine.holds, engine.version = z, v + 2


@pytest.mark.parametrize("fault", ["partial-write", "loader"])
def test_a_prefetching_worker_keeps_its_version_until_vllms_loader_runs(engine, fault):
    """With ``prefetch`` the worker receives into staging while vLLM serves: a transfer cut short
    there leaves vLLM on version v (tokens and stamp); ``load_weights`` raising in the apply leaves
    it ``invalid:<v+1>``. ((b) does not arise: prefetch refuses ``layer_phases``.)"""
    from weightsync.engines.vllm import update_llm

    y, z = engine.next_steps()
    sync = sync_config(engine, fault)
    with partial_writes() as port, trainer(engine, sync) as t, backend(engine, sync, prefetch=True) as worker:
        v = engine.version + 1
        done = t.write(v, SEEDS[engine.holds])
        update_llm(engine.llm, v)
        done.result(60)
        reader = worker.reader
        staged = reader.engine.receive_buffers()["model.layers.1.self_attn.q_proj.weight"]
        with inject(engine, fault, reader, v + 1, port, staged):
            done = t.write(v + 1, SEEDS[y])
            with pytest.raises(Exception, match=MESSAGES[fault]):
                update_llm(engine.llm, v + 1)
        with contextlib.suppress(Exception):
            done.result(60)
        if fault == "loader":
            assert reader.invalid is not None and row(engine, sync)["state"] == "invalid"
            engine.check_invalid(v + 1)
        else:
            assert reader.version == v and row(engine, sync)["state"] == "valid"
            engine.check(engine.holds, str(v))
        done = t.write(v + 2, SEEDS[z])
        update_llm(engine.llm, v + 2)
        done.result(60)
    engine.check(z, str(v + 2))
    engine.holds, engine.version = z, v + 2


def test_a_failure_before_any_byte_reached_the_model_keeps_the_backends_version(engine):
    """The writer is gone before the worker's transport connects: the norms received in place were
    not written, nothing was loaded, so vLLM keeps serving version v under its own stamp."""
    from weightsync.engines.vllm import stamp_if_invalid, update_llm

    y, _ = engine.next_steps()
    sync = sync_config(engine, "loader")
    with trainer(engine, sync) as t, backend(engine, sync) as worker:
        v = engine.version + 1
        done = t.write(v, SEEDS[engine.holds])
        update_llm(engine.llm, v)
        done.result(60)
        session = worker.reader.session
        arm = session.arm

        def dead_writer(*args: Any, **kwargs: Any) -> Any:
            session.arm = arm
            raise TransportError("injected: writer 0 died before this worker connected")

        session.arm = dead_writer
        done = t.write(v + 1, SEEDS[y])
        with pytest.raises(Exception, match="died before this worker connected"):
            update_llm(engine.llm, v + 1)
        with contextlib.suppress(Exception):
            done.result(60)
        assert worker.reader.version == v and worker.reader.invalid is None
        assert (row(engine, sync)["state"], row(engine, sync)["version"]) == ("valid", v)
        assert stamp_if_invalid(engine.llm) is None  # nothing to stamp
    engine.check(engine.holds, str(v))
    engine.version = v


# -- the trainer side: WeightSyncTrainerEngine.send_weights over LLMClient ---------------------------

@pytest.mark.parametrize("fault", FAULTS)
def test_the_trainer_side_leaves_vllm_stamped_invalid_and_its_next_version_recovers_it(engine, fault):
    """``send_weights`` raises the worker's error; vLLM's version is ``invalid:V`` (never the old
    one), and the next ``send_weights`` restores the engine."""
    from weightsync.integrations.vllm_trainer import LLMClient, WeightSyncTrainerEngine, WeightSyncTrainerInitInfo
    from weightsync.tools.tiny import CanonicalSource
    from weightsync.tools.torch_layout import fill_from_canonical

    y, z = engine.next_steps()
    job = f"vinv-trainer-{uuid.uuid4().hex[:8]}"
    info = WeightSyncTrainerInitInfo(rank=0, num_writers=1, num_readers=1, job=job, meta_address=engine.server.address,
                                     meta_token=engine.server.token, timeout=60.0, layer_phases=fault == "phase",
                                     max_bucket_bytes=BUCKET, delta_anchor_every=8 if fault == "loader" else 0)
    source = CanonicalSource(CONFIG)
    with partial_writes() as port:
        sender = WeightSyncTrainerEngine.trainer_init(info, client=LLMClient(engine.llm), source=source)
        try:
            def send(version: int, checkpoint: str) -> None:
                fill_from_canonical(source.layout(), source.tensors(), canonical_weights(CONFIG, SEEDS[checkpoint]))
                sender.send_weights(version)

            v = engine.version + 1
            send(v, engine.holds)
            reader = engine.worker_engine().reader
            with inject(engine, fault, reader, v + 1, port, reader.engine.receive_buffers()[NORM]):
                with pytest.raises(Exception, match=MESSAGES[fault]):
                    send(v + 1, y)
            assert reader.invalid is not None
            engine.check_invalid(v + 1)
            assert [(a.version, a.valid, a.failed) for a in sender.serving()] == [(None, False, v + 1)]
            send(v + 2, z)
            assert reader.version == v + 2 and reader.invalid is None
            assert [(a.version, a.valid) for a in sender.serving()] == [(v + 2, True)]
        finally:
            sender.shutdown()
    engine.check(z, str(v + 2))
    engine.holds, engine.version = z, v + 2


# -- vllm serve: its engine core in a child process, driven over HTTP ----------------------------------

@pytest.mark.heavy  # 110 s in CI's conditions; by default the in-process cases above stamp invalid, and
# test_version_readback.py checks vllm serve's version route and header
def test_vllm_serve_is_stamped_invalid_over_http_and_the_meta_status_and_metrics_show_it(engine, monkeypatch):
    """``vllm serve`` runs its engine core in a child process (vLLM's CPU build: its worker in yet
    another), so the trainer side stamps it over HTTP. Version 2 breaks off on the trainer's side
    after phase 2 of 10 (the worker's receive of phase 3 times out after phases 0..2 were loaded):
    ``send_weights`` raises, and vLLM's weight version (``/weight_info``) is ``invalid:2``; the meta
    server's status page and metrics show the reader invalid. Version 3 recovers the server: the
    tokens of a fresh engine on C, under version ``3``."""
    import httpx
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from _vllm_native import vllm_server
    from weightsync.integrations.vllm_trainer import WeightSyncTrainerEngine, WeightSyncTrainerInitInfo
    from weightsync.tools.tiny import CanonicalSource
    from weightsync.tools.torch_layout import fill_from_canonical

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # as a user runs it (the module's engine: 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    job = f"vinv-serve-{uuid.uuid4().hex[:8]}"
    info = WeightSyncTrainerInitInfo(rank=0, num_writers=1, num_readers=1, job=job, meta_address=engine.server.address,
                                     meta_token=engine.server.token, timeout=20.0, layer_phases=True,
                                     max_bucket_bytes=BUCKET, delta_anchor_every=0)
    source = CanonicalSource(CONFIG)
    meta = httpx.Client(base_url=engine.server.address, trust_env=False, timeout=10,
                        headers={"Authorization": f"Bearer {engine.server.token}"})
    middleware = "weightsync.integrations.vllm_serve_version.WeightSyncVersionMiddleware"
    with meta, vllm_server(engine.paths["A"], extra=("--max-model-len", "512", "--middleware", middleware)) as url:
        sender = WeightSyncTrainerEngine.trainer_init(info, client=HTTPVLLMWeightSyncClient(url), source=source)
        try:
            def send(version: int, seed: int) -> None:
                fill_from_canonical(source.layout(), source.tensors(), canonical_weights(CONFIG, seed))
                sender.send_weights(version)

            def served() -> tuple[list[int], str]:
                body = {"model": str(engine.paths["A"]), "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                        "temperature": 0, "return_token_ids": True, "ignore_eos": True}
                response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                label = httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"]
                assert response.headers["x-weightsync-version"] == label  # the version it was generated under
                return response.json()["choices"][0]["token_ids"], label

            def version() -> tuple[int | None, bool, int | None, str]:
                answer = httpx.get(f"{url}/weightsync/version", timeout=30).json()
                return answer["version"], answer["valid"], answer["failed"], answer["label"]

            send(1, SEEDS["A"])
            transport = sender.writer.session.planned.transport
            original = transport.send

            def stops_after_phase_2(version: int, *, timeout: float, phase: int = 0) -> Any:
                if version == 2 and phase == 3:
                    raise TransportError("injected: the trainer stopped after phase 2")
                return original(version, timeout=timeout, phase=phase)

            transport.send = stops_after_phase_2
            with pytest.raises(Exception, match="stopped after phase 2"):
                send(2, SEEDS["B"])
            assert served()[1] == "invalid:2"
            assert version() == (None, False, 2, "invalid:2")
            status = meta.get("/status", auth=("anyone", engine.server.token)).text
            assert "INVALID since" in status[status.index(f"<h2>job {job}</h2>"):]
            assert f'weightsync_meta_reader_invalid{{job="{job}",rank="0"}} 1.0' in meta.get("/metrics").text

            send(3, SEEDS["C"])
            assert served() == (engine.refs["C"], "3")
            assert version() == (3, True, None, "3")
            assert [(a.version, a.valid) for a in sender.serving()] == [(3, True)]  # over /collective_rpc
            assert f'weightsync_meta_reader_invalid{{job="{job}",rank="0"}} 0.0' in meta.get("/metrics").text
        finally:
            sender.shutdown()


# -- which version generated an output (vLLM's spans; no engine needed) ---------------------------------

def test_an_output_is_tagged_with_one_version_only_when_every_token_came_from_it():
    from vllm.outputs import CompletionOutput, WeightVersionSpan

    from weightsync.engines.vllm_version import GeneratedUnder, generated_under

    def output(*spans: tuple[str, int, int], finished: bool = True) -> CompletionOutput:
        return CompletionOutput(0, "", [1] * 6, None, None, finish_reason="length" if finished else None,
                                weight_versions=[WeightVersionSpan(*s) for s in spans] if finished else None)

    assert generated_under(output(("7", 0, 6))) == GeneratedUnder(7, True, False, ("7",))
    assert generated_under(output(("7", 0, 2), ("8", 2, 6))) == GeneratedUnder(None, True, True, ("7", "8"))
    assert generated_under(output(("invalid:8", 0, 6))) == GeneratedUnder(None, False, False, ("invalid:8",))
    assert generated_under(output(("default", 0, 6))).version is None  # an engine weightsync never labelled
    with pytest.raises(ValueError, match="not finished"):
        generated_under(output(finished=False))


def test_the_worker_finds_its_engine_core_and_itself_on_its_stack():
    """Where the stamp goes (vLLM 0.32): the engine core is a caller of the worker's
    ``update_weights`` when the worker runs in its process (the ``uni`` executor), and the worker is
    the caller of ``init_transfer_engine`` whose ``weight_transfer_engine`` is the backend."""
    import sys

    from weightsync.integrations.vllm_backend import _calling_engine_core, _hosting_worker

    class Core:
        def set_weight_version(self, version: str) -> None: ...
        def get_weight_version(self) -> str: return ""
        def collective_rpc(self, method: str) -> None: return self.executor()
        def executor(self) -> Any: return Worker().update_weights()

    class Worker:
        def update_weights(self) -> Any: return _calling_engine_core(sys._getframe(0))

    core = Core()
    assert core.collective_rpc("update_weights") is core
    assert _calling_engine_core(sys._getframe(0)) is None  # a worker in a process of its own

    backend = object()

    class Host:
        weight_transfer_engine = backend

        def init(self) -> Any: return _hosting_worker(sys._getframe(0), backend)

    host = Host()
    assert host.init() is host and _hosting_worker(sys._getframe(0), backend) is None
