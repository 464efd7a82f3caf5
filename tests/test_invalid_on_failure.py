"""A failed update never leaves an engine serving mixed weights under a version number.

For each engine adapter that runs without vLLM, three faults break version 2 of a job (a
trainer thread writes the whole model over shared memory, deltas on): (a) the transport breaks
off half-way through a tensor it writes (a live weight for in-place engines, staging for the
others); (b) phase k of a ``layer_phases`` version fails after the phases before it arrived;
(c) the engine's own loader (or apply) raises half-way. Afterwards the engine is *invalid*
(``weight_version`` None, ``invalid`` naming version 2, the meta server's reader row ``invalid``
since then) or, where the fault never reached what it serves, still fully on version 1 and
saying so. Then version 3 arrives in full (never as a delta against bytes an invalid engine
holds) and the engine is valid, holding version 3 bitwise, compared with a fresh copy built on
version 3's weights.

The vLLM adapters (in-process engine, worker backend, trainer side) have the same cases in
``tests/test_invalid_vllm.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine_faults import Trainer, fail_in_phase, nudged, partial_writes
from weightsync.engines.buffers import ModuleEngine
from weightsync.engines.sglang import SGLangEngine
from weightsync.engines.staging import StagedWeights
from weightsync.layout import ModelSpec
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.roles.inflight import InflightReader
from weightsync.roles.prefetch import Prefetch
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import ReadersFailedError
from weightsync.session.sync_session import SyncConfig, SyncError
from weightsync.tools.tiny import canonical_weights, checkpoint_tensors, tiny_config
from weightsync.transport import TransportError, TransportOptions

# transformers is imported where a model is built, not at collection: every xdist worker collects
# this file, and importing transformers (with accelerate) costs each about a second
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")

CONFIG = {**tiny_config(), "torch_dtype": "float32"}
FAULTS = ["partial-write", "phase", "loader"]
#: phases of at most 64 KiB: the tiny model's version moves in 10 of them
BUCKET = 1 << 16
PHASE = 3  # the phase that fails in case (b)
SEEDS = {1: 1, 2: 2, 3: 2}  # version -> seed of its weights; version 3 is version 2 nudged (a small delta)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedMetaServer]:
    with EmbeddedMetaServer() as s:
        yield s


@contextlib.contextmanager
def job(server: EmbeddedMetaServer, fault: str, transport: str = "shm"
        ) -> Iterator[tuple[SyncConfig, MetaClient, Trainer]]:
    """A job of one trainer and one reader, with phases for (b) and deltas on but for (a) (the
    transport's copy into the destination is the one cut short; deltas are applied by their codec).
    Shared memory by default: its readers start every epoch afresh; torch (gloo) readers keep what
    they vouch for across the epoch a failure starts, unless told their engine is invalid."""
    sync = SyncConfig(num_writers=1, num_readers=1, job=f"inv-{uuid.uuid4().hex[:8]}", timeout=60,
                      transport=transport, layer_phases=fault == "phase",
                      transport_options=TransportOptions(max_bucket_bytes=BUCKET,
                                                         delta_anchor_every=0 if fault == "partial-write" else 8))
    trainer = Trainer(CONFIG, sync, server.address, server.token)
    try:
        with MetaClient(server.address, job=sync.job, token=server.token) as meta:
            yield sync, meta, trainer
    finally:
        trainer.close()


def weights_of(version: int) -> dict[str, torch.Tensor]:
    """The canonical weights the trainer writes as ``version``."""
    weights = canonical_weights(CONFIG, SEEDS[version])
    if version == 3:
        nudged(weights)
    return weights


def write(trainer: Trainer, version: int) -> Any:
    return trainer.write(version, SEEDS[version], nudged if version == 3 else None)


def row(meta: MetaClient) -> dict[str, Any]:
    """The meta server's view of reader 0 (what the status page and metrics show)."""
    return dict(meta.wait_reader_report(min_version=0, readers=0, timeout=1).rows[0])


def assert_invalid(engine: Any, meta: MetaClient, message: str) -> None:
    assert engine.weight_version is None
    assert engine.invalid is not None and engine.invalid.version == 2 and message in engine.invalid.error
    r = row(meta)
    assert (r["state"], r["version"], r["failed_version"]) == ("invalid", None, 2), r
    assert r["invalid_since"] == pytest.approx(engine.invalid.since, abs=1.0) and message in r["error"]


def assert_kept(engine: Any, meta: MetaClient, message: str) -> None:
    assert engine.weight_version == 1 and engine.invalid is None
    r = row(meta)
    assert (r["state"], r["version"], r["failed_version"]) == ("valid", 1, 2), r
    assert message in r["error"]


def recover(reader: Any, trainer: Trainer, engine: Any, meta: MetaClient, *, full: bool, update: Any = None) -> None:
    """Version 3 (version 2 nudged: a delta would be tiny) is applied whole; after an invalid
    engine (``full``) it comes in full, whatever bytes of version 2 the engine holds."""
    done = write(trainer, 3)
    result = (update or reader.update)(3)
    done.result(60)
    if full:
        assert result.nbytes == engine.layout().nbytes, "an invalid engine took the next version as a delta"
    assert engine.weight_version == 3 and engine.invalid is None
    assert (row(meta)["state"], row(meta)["version"]) == ("valid", 3)


# -- HF transformers modules, updated in place: ModuleEngine --------------------------------------

def hf_model(weights: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """A transformers model holding ``weights`` (canonical; None: seed 0's)."""
    import transformers

    from weightsync.sources.module import ModuleSource
    from weightsync.tools.torch_layout import fill_from_canonical

    config = transformers.AutoConfig.for_model(**CONFIG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    source = ModuleSource(model, CONFIG)
    fill_from_canonical(source.layout(), source.tensors(), weights if weights is not None else
                        canonical_weights(CONFIG, 0))
    return model


def same_parameters(model: torch.nn.Module, version: int) -> bool:
    fresh = dict(hf_model(weights_of(version)).named_parameters())
    return all(torch.equal(p, fresh[name]) for name, p in model.named_parameters())


def refuse_apply(engine: Any, version: int) -> None:
    """Case (c) for an in-place engine: its apply step raises once every byte landed."""
    original = engine.apply

    def apply(v: int) -> None:
        if v == version:
            raise RuntimeError(f"injected: the engine's post-load step failed on version {v}")
        original(v)

    engine.apply = apply


@pytest.mark.parametrize("fault", FAULTS)
def test_an_in_place_module_engine_ends_invalid_and_the_next_version_recovers_it(server, fault):
    model = hf_model()
    engine = ModuleEngine(model, CONFIG)
    target = model.model.layers[1].self_attn.q_proj.weight
    with partial_writes() as port, job(server, fault, "torch" if fault == "loader" else "shm") as (sync, meta, trainer), \
            WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
        done = write(trainer, 1)
        reader.update(1)
        done.result(60)
        assert same_parameters(model, 1) and engine.weight_version == 1

        message = {"partial-write": "connection broke", "phase": f"phase {PHASE}", "loader": "post-load"}[fault]
        if fault == "partial-write":
            port.arm(target.detach())
        elif fault == "phase":
            fail_in_phase(reader, 2, PHASE)
        else:
            refuse_apply(engine, 2)
        done = write(trainer, 2)
        with pytest.raises(SyncError, match=message):
            reader.update(2)
        with pytest.raises(ReadersFailedError):
            done.result(60)
        assert_invalid(engine, meta, message)
        assert reader.version is None and reader.invalid == engine.invalid
        if fault != "loader":  # a mix of two versions, as a broken transfer leaves it
            assert not same_parameters(model, 1) and not same_parameters(model, 2)
        if fault == "partial-write":
            assert port.written == target.numel() * 2 and torch.equal(target[:64], hf_model(weights_of(2)).model.layers[
                1].self_attn.q_proj.weight[:64])

        recover(reader, trainer, engine, meta, full=True)
        assert same_parameters(model, 3)


def test_a_failure_before_the_first_byte_keeps_an_in_place_engine_at_its_version(server):
    """A writer gone before the receive (the transport's set-up fails): nothing touched the
    weights, so the engine still serves version 1 and says so; version 2 then arrives as usual."""
    model = hf_model()
    engine = ModuleEngine(model, CONFIG)
    with job(server, "partial-write") as (sync, meta, trainer), \
            WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
        done = write(trainer, 1)
        reader.update(1)
        done.result(60)
        arm = reader.session.arm

        def dead_writer(*args: Any, **kwargs: Any) -> Any:
            reader.session.arm = arm
            raise TransportError("injected: writer 0 died before this reader connected")

        reader.session.arm = dead_writer
        done = write(trainer, 2)
        with pytest.raises(SyncError, match="died before this reader connected"):
            reader.update(2)
        with pytest.raises(ReadersFailedError):
            done.result(60)
        assert_kept(engine, meta, "died before this reader connected")
        assert same_parameters(model, 1)
        recover(reader, trainer, engine, meta, full=False)
        assert same_parameters(model, 3)


# -- an engine that stages the whole model and loads it itself: SGLang's adapter ------------------

class SGLangModel:
    """A stand-in ``sglang.Engine`` that holds its weights: ``update_weights_from_tensor`` copies
    each tensor into them in order (as SGLang's loader does), and can break off after ``n``."""

    def __init__(self) -> None:
        self.weights = {n: t.clone() for n, t in checkpoint_tensors(canonical_weights(CONFIG, 0)).items()}
        self.versions: list[str] = []
        self.break_after: int | None = None

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]], load_format: Any = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        for i, (name, tensor) in enumerate(named_tensors):
            if i == self.break_after:
                self.break_after = None
                raise RuntimeError(f"injected: SGLang's scheduler died loading {name}")
            self.weights[name].copy_(tensor)
        return True, "ok"

    def update_weight_version(self, version: str) -> None:
        self.versions.append(version)

    def holds(self, version: int) -> bool:
        want = checkpoint_tensors(weights_of(version))
        return all(torch.equal(self.weights[n], t) for n, t in want.items())


@pytest.mark.parametrize("fault", FAULTS)
def test_sglang_keeps_its_version_unless_its_loader_ran_and_then_recovers(server, fault):
    """SGLang takes a version in one update call from whole-model staging: a transfer that breaks
    off (half a staged tensor, or phase k) never reaches it, so it stays on version 1 (its version
    stamp too); a loader that dies half-way leaves it invalid, stamped ``invalid:2``."""
    sglang = SGLangModel()
    engine = SGLangEngine(sglang, CONFIG, dtype=torch.float32, device="cpu")
    with partial_writes() as port, job(server, fault) as (sync, meta, trainer), \
            WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
        done = write(trainer, 1)
        reader.update(1)
        done.result(60)
        assert sglang.holds(1) and sglang.versions == ["1"]

        message = {"partial-write": "connection broke", "phase": f"phase {PHASE}", "loader": "scheduler died"}[fault]
        if fault == "partial-write":
            port.arm(engine.receive_buffers()["model.layers.1.self_attn.q_proj.weight"])
        elif fault == "phase":
            fail_in_phase(reader, 2, PHASE)
        else:
            sglang.break_after = len(engine.layout().shards) // 2
        done = write(trainer, 2)
        with pytest.raises(SyncError, match=message):
            reader.update(2)
        with pytest.raises(ReadersFailedError):
            done.result(60)
        if fault == "loader":
            assert_invalid(engine, meta, message)
            assert sglang.versions[-1] == "invalid:2" and not sglang.holds(1) and not sglang.holds(2)
        else:
            assert_kept(engine, meta, message)
            assert sglang.versions == ["1"] and sglang.holds(1)

        recover(reader, trainer, engine, meta, full=fault == "loader")
        assert sglang.holds(3) and sglang.versions[-1] == "3"


# -- InflightReader: staging in the background, the live engine touched at a step boundary ---------

@pytest.mark.parametrize("fault", FAULTS)
def test_an_inflight_engine_is_touched_only_at_a_step_boundary(server, fault):
    """The transfer lands in the reader's staging: (a) and (b) leave the live engine serving
    version 1 (and the meta server says so); (c) the live engine's apply fails at the step
    boundary after the copy, and the engine is invalid, never version 1 with version 2's bytes."""
    model = hf_model()
    engine = ModuleEngine(model, CONFIG)
    with partial_writes() as port, job(server, fault) as (sync, meta, trainer), \
            InflightReader(engine, rank=0, config=sync, meta=meta, poll=0.05) as updater:
        def serve(version: int) -> Any:
            done = write(trainer, version)
            updater.wait_version(version, timeout=60)
            return done.result(60)

        serve(1)
        assert same_parameters(model, 1) and engine.weight_version == 1
        inner = updater.reader
        message = {"partial-write": "connection broke", "phase": f"phase {PHASE}", "loader": "post-load"}[fault]
        if fault == "partial-write":
            port.arm(updater._staging.buffers["model.layers.1.self_attn.q_proj.weight"])
        elif fault == "phase":
            fail_in_phase(inner, 2, PHASE)
        else:
            refuse_apply(engine, 2)
        done = write(trainer, 2)
        if fault == "loader":
            with pytest.raises(SyncError, match=r"could not take version 2 at a step boundary \(.*post-load.*\); it is invalid"):
                updater.wait_version(2, timeout=60)
        with pytest.raises(ReadersFailedError):
            done.result(60)
        if fault == "loader":
            assert_invalid(engine, meta, message)
        else:
            assert_kept(engine, meta, message)
            assert same_parameters(model, 1)

        done = write(trainer, 3)
        updater.wait_version(3, timeout=60)
        done.result(60)  # once the reader reported version 3 applied
        r = row(meta)
        assert (r["state"], r["version"]) == ("valid", 3) and engine.weight_version == 3 and engine.invalid is None
        if fault == "loader":  # the live engine was invalid: version 3 came in full
            assert r["nbytes"] == engine.layout().nbytes
        assert same_parameters(model, 3)


# -- Prefetch: receive into staging while the engine serves, its own loader at apply ----------------

class LoadingEngine(StagedWeights):
    """Stages like vLLM and serves ``model``, which only its loader writes, a tensor at a time;
    the loader can break off after ``n`` tensors."""

    def __init__(self) -> None:
        super().__init__(ModelSpec.from_hf_config(CONFIG), dtype=torch.float32, device="cpu", rank=0)
        self.model = {n: t.clone() for n, t in checkpoint_tensors(canonical_weights(CONFIG, 0)).items()}
        self.break_after: int | None = None

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for i, (name, tensor) in enumerate(items):
            if i == self.break_after:
                self.break_after = None
                raise RuntimeError(f"injected: the loader raised at {name}")
            self.model[name].copy_(tensor)

    def holds(self, version: int) -> bool:
        return all(torch.equal(self.model[n], t) for n, t in checkpoint_tensors(weights_of(version)).items())


@pytest.mark.parametrize("fault", ["partial-write", "loader"])
def test_a_prefetching_engine_keeps_its_version_until_its_loader_runs(server, fault):
    """(a) the background receive breaks off in staging: the engine serves version 1 throughout;
    (c) its loader raises half-way in apply: invalid. ((b) does not arise: a prefetch refuses
    ``layer_phases``, tests/test_prefetch.py.)"""
    engine = LoadingEngine()
    with partial_writes() as port, job(server, fault) as (sync, meta, trainer), \
            WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
        prefetch = Prefetch(reader)
        done = write(trainer, 1)
        prefetch.start()
        prefetch.apply(1)
        done.result(60)
        assert engine.holds(1)

        message = {"partial-write": "connection broke", "loader": "loader raised"}[fault]
        if fault == "partial-write":
            port.arm(engine.receive_buffers()["model.layers.1.self_attn.q_proj.weight"])
        else:
            engine.break_after = len(engine.layout().shards) // 2
        done = write(trainer, 2)
        prefetch.start()
        if fault == "partial-write":  # the engine serves version 1 while the receive breaks off
            with pytest.raises(ReadersFailedError):
                done.result(60)
            assert engine.holds(1) and engine.weight_version == 1
        with pytest.raises(SyncError, match=message):
            prefetch.apply(2)
        if fault == "loader":
            with pytest.raises(ReadersFailedError):
                done.result(60)
            assert_invalid(engine, meta, message)
            assert not engine.holds(1) and not engine.holds(2)
        else:
            assert_kept(engine, meta, message)
            assert engine.holds(1)

        prefetch.start()
        recover(reader, trainer, engine, meta, full=fault == "loader", update=prefetch.apply)
        assert engine.holds(3)


# -- vLLM's control planes: how the trainer side stamps an engine invalid (no engine needed) --------

class _Answer:
    def __init__(self, body: Any) -> None:
        self.body = body

    def json(self) -> Any:
        return self.body

    def raise_for_status(self) -> None:
        pass


def test_the_trainer_side_stamps_through_each_control_plane(monkeypatch):
    """After a failed version, ``send_weights`` asks the workers (``weightsync_invalid``) and, if one
    is invalid, sets ``invalid:<version>``: over HTTP with vLLM's dev-mode routes, on Ray actors,
    through ``LLMClient``; a client that can do neither gets None (and a warning when it matters)."""
    import sys
    from types import SimpleNamespace

    import httpx

    from weightsync.integrations.vllm_trainer_stamp import invalid_stamper

    states: list[Any] = [None]
    posts: list[tuple[str, Any]] = []

    def post(url: str, *, json: Any = None, timeout: float = 0.0) -> _Answer:
        posts.append((url, json))
        return _Answer({"results": states} if url.endswith("/collective_rpc") else {"success": True})

    monkeypatch.setattr(httpx, "post", post)
    over_http = invalid_stamper(SimpleNamespace(base_url="http://rollout:8000/"), 5.0)
    assert over_http is not None and over_http() is None
    assert posts == [("http://rollout:8000/collective_rpc", {"method": "weightsync_invalid"})]
    states[:] = [{"version": 7, "error": "injected", "since": 1.0}]
    assert over_http() == "invalid:7"
    assert posts[-1] == ("http://rollout:8000/update_weight_version", {"new_version": "invalid:7"})

    class Actor:
        def __init__(self, answer: Any) -> None:
            self.answer, self.stamps = answer, []
            self.collective_rpc = SimpleNamespace(remote=lambda method: [self.answer] if method else [])
            self.update_weight_version = SimpleNamespace(remote=self.stamps.append)

    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(get=lambda ref, timeout=None: ref))
    valid, invalid = Actor(None), Actor({"version": 4, "error": "x", "since": 0.0})
    over_ray = invalid_stamper(SimpleNamespace(handles=[valid, invalid]), 5.0)
    assert over_ray is not None and over_ray() == "invalid:4"
    assert (valid.stamps, invalid.stamps) == ([], ["invalid:4"])  # each actor is an engine of its own

    ours = SimpleNamespace(stamp_if_invalid=lambda: "invalid:3")
    assert invalid_stamper(ours, 5.0) is ours.stamp_if_invalid
    assert invalid_stamper(object(), 5.0) is None
