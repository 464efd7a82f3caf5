"""SGLang adapter: the proof on a GPU (B synced into an engine on A == a fresh engine on B),
and its contract with SGLang's API on a fake engine anywhere."""

from __future__ import annotations

import importlib.util
import random
import time

import pytest
import torch

from weightsync.engines.sglang import SGLangEngine, SGLangHTTP, _check
from weightsync.tools.tiny import canonical_weights, checkpoint_tensors, tiny_config, write_checkpoint

PROMPT = [random.Random(0).randrange(4, 512) for _ in range(300)]


class FakeEngine:
    """Records what ``sglang.Engine.update_weights_from_tensor`` would receive."""

    def __init__(self, answer=(True, "ok")):
        self.answer = answer
        self.calls = []
        self.versions = []

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(([(n, t.clone()) for n, t in named_tensors], flush_cache))
        return self.answer

    def update_weight_version(self, version):
        self.versions.append(version)


def test_tensor_mode_hands_over_every_checkpoint_tensor_once():
    config = tiny_config(moe=True)
    engine = FakeEngine()
    adapter = SGLangEngine(engine, config, dtype=torch.float32, device="cpu")
    weights = checkpoint_tensors(canonical_weights(config, seed=0))
    adapter.update(weights, version=3)
    [(items, flush)] = engine.calls
    assert [n for n, _ in items] == list(weights) and flush
    assert all(torch.equal(t, weights[n]) for n, t in items)
    assert engine.versions == ["3"] and adapter.weight_version == 3


def test_a_refused_update_marks_the_engine_invalid():
    config = tiny_config()
    engine = FakeEngine(answer=(False, "out of memory"))
    adapter = SGLangEngine(engine, config, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="SGLang update failed: out of memory"):
        adapter.apply(1)
    assert adapter.weight_version is None and engine.versions == []


def test_sglang_answers_which_version_it_serves_since_when_and_whether_valid():
    from weightsync.ports.engine import ServingVersion

    config = tiny_config()
    engine = FakeEngine()
    adapter = SGLangEngine(engine, config, dtype=torch.float32, device="cpu")
    assert adapter.serving() == ServingVersion(None, None, True)  # its start-up weights
    before = time.time()
    adapter.update(checkpoint_tensors(canonical_weights(config, seed=0)), version=3)
    answer = adapter.serving()
    assert (answer.version, answer.valid) == (3, True) and before <= answer.since <= time.time()
    assert ServingVersion.from_wire(answer.to_wire()) == answer
    engine.answer = (False, "out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        adapter.update(checkpoint_tensors(canonical_weights(config, seed=1)), version=4)
    answer = adapter.serving()
    assert (answer.version, answer.valid, answer.failed) == (None, False, 4)
    assert answer.reason == "version 4 failed: SGLang update failed: out of memory"
    assert engine.versions == ["3", "invalid:4"]


def test_answers_of_both_engine_kinds_are_checked():
    _check((True, "ok"), "update")
    _check({"success": True}, "update")
    _check(None, "update")
    with pytest.raises(RuntimeError, match="HTTP 500"):
        _check({"success": False, "message": "HTTP 500"}, "update")
    SGLangHTTP("http://127.0.0.1:1").close()


def _sglang_missing() -> str:
    if not torch.cuda.is_available():
        return "SGLang needs a CUDA GPU; this machine has none"
    return "" if importlib.util.find_spec("sglang") else "sglang is not installed (pip install sglang)"


@pytest.mark.gpu
@pytest.mark.skipif(bool(_sglang_missing()), reason=_sglang_missing())
@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_sync_into_sglang_matches_fresh_engine(tmp_path, mode):
    import sglang

    if mode == "distributed" and torch.cuda.device_count() < 2:
        pytest.skip("the distributed mode stages on a GPU outside the engine's (weightsync.tools.devices)")

    config = tiny_config(tie=True)
    a = write_checkpoint(tmp_path / "A", config, seed=1)
    b = write_checkpoint(tmp_path / "B", config, seed=2)
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}

    def greedy(engine):
        return engine.generate(input_ids=PROMPT, sampling_params=params)["output_ids"]

    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "mem_fraction_static": 0.3, "random_seed": 0}
    fresh = sglang.Engine(model_path=str(tmp_path / "B"), **kwargs)
    ref_b = greedy(fresh)
    fresh.shutdown()
    engine = sglang.Engine(model_path=str(tmp_path / "A"), **kwargs)
    try:
        ref_a = greedy(engine)
        assert ref_a != ref_b
        with SGLangEngine(engine, config, mode=mode, dtype=torch.float32) as adapter:
            adapter.update(checkpoint_tensors(b), version=1)
            assert greedy(engine) == ref_b
            adapter.update(checkpoint_tensors(a), version=2)
            assert greedy(engine) == ref_a
    finally:
        engine.shutdown()
