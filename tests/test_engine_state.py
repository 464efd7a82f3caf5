"""The engine-state oracle's walk and comparison, on plain torch modules (no engine needed).

What an engine holds is found by walking it: parameters, buffers, and tensors behind module
attributes (an attention backend holding ``sinks``, a quant config holding the biases, a packed
copy captured in a closure or a ``functools.partial``). Integer scalars (native handles) are
listed, never compared. A comparison names every tensor that differs, says by how much, and
which other state it still equals; digests compare across processes.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from weightsync.tools.engine_state import (
    TensorDigest,
    compare_states,
    digest_state,
    state_from_wire,
    state_to_wire,
    tensor_state,
)


class _Impl:  # an attention backend: a plain object holding a parameter of its module
    def __init__(self, sinks: torch.Tensor) -> None:
        self.sinks = sinks
        self.scale = 0.5


class _QuantConfig:
    __slots__ = ("bias", "handle")

    def __init__(self, bias: torch.Tensor) -> None:
        self.bias = bias
        self.handle = torch.tensor(140234, dtype=torch.int64)  # a native pointer in an int64 scalar


class _Layer(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
        self.sinks = torch.nn.Parameter(torch.randn(2, generator=gen))
        self.register_buffer("cache", torch.randn(3, generator=gen))
        self.impl = _Impl(self.sinks)
        self.quant = {"config": _QuantConfig(torch.randn(4, generator=gen))}
        packed = self.weight.detach().t().contiguous()
        self.linear = lambda x: x @ packed  # a packed copy, reachable only through the closure
        self.partial = functools.partial(torch.add, torch.randn(2, generator=gen))
        self.child = torch.nn.Linear(3, 2)
        with torch.no_grad():
            self.child.weight.copy_(torch.randn(2, 3, generator=gen))
            self.child.bias.copy_(torch.randn(2, generator=gen))
        self.holder = {"module": self.child}  # a module reached through an object: named by the tree only


def test_the_walk_finds_tensors_behind_attributes_closures_and_partials():
    state = tensor_state({"": _Layer(1)})
    assert {"weight", "sinks", "cache", "impl.sinks", "quant.config.bias", "quant.config.handle", "linear.<packed>",
            "partial.<args>[0]", "child.weight", "child.bias"} <= set(state)
    assert state["impl.sinks"] is state["sinks"]  # by reference
    assert not any(name.startswith("holder.") for name in state)
    drafted = tensor_state({"": _Layer(1), "drafter": _Layer(2)})
    assert "drafter.impl.sinks" in drafted


def test_a_comparison_names_each_stale_tensor_and_what_it_still_equals():
    x, y = tensor_state({"": _Layer(1)}), tensor_state({"": _Layer(2)})
    assert compare_states(x, x).ok
    live = tensor_state({"": _Layer(2)})
    live["impl.sinks"] = x["impl.sinks"]  # a reload that left the backend's copy behind
    live["linear.<packed>"] = x["linear.<packed>"]
    report = compare_states(live, y, others={"X": x})
    assert report.names() == ["impl.sinks", "linear.<packed>"]
    diff = report.diffs[0]
    assert diff.status == "values" and diff.equals == ("X",) and diff.max_abs_diff > 0
    assert "impl.sinks: values (2 of 2 elements), max |live - reference|" in report.describe()
    assert "quant.config.handle" in report.opaque  # handles differ between engines: listed, not compared


def test_shapes_dtypes_and_missing_tensors_are_named():
    ref = {"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)}
    live = {"a": torch.zeros(3), "b": torch.zeros(3, dtype=torch.float64), "d": torch.zeros(1)}
    report = compare_states(live, ref)
    assert [(d.name, d.status) for d in report.diffs] == [("a", "shape"), ("b", "dtype"), ("c", "missing"),
                                                          ("d", "extra")]


def test_nan_is_compared_bitwise():
    a = torch.tensor([1.0, float("nan")])
    assert compare_states({"t": a}, {"t": a.clone()}).ok
    report = compare_states({"t": a}, {"t": torch.tensor([1.0, 2.0])})
    assert report.names() == ["t"] and report.diffs[0].max_abs_diff == float("inf")


def test_digests_cross_the_wire_and_compare_with_tensors():
    x, y = tensor_state({"": _Layer(1)}), tensor_state({"": _Layer(2)})
    wire = json.loads(json.dumps(state_to_wire(digest_state(x))))
    remote = state_from_wire(wire)
    assert all(isinstance(d, TensorDigest) for d in remote.values())
    assert compare_states(remote, x).ok  # digests against tensors
    report = compare_states(remote, y)
    assert set(report.names()) == {n for n in x if n != "quant.config.handle"}
    assert report.diffs[0].detail == "other bytes"
    with pytest.raises(ValueError, match="shape, dtype, hex digest"):
        state_from_wire({"t": [1, 2]})


def test_the_fresh_engine_is_asked_for_the_attention_backend_the_live_one_was_started_with():
    """A live engine started with an explicit attention backend (a float32 DeepSeek on an AMX
    CPU must ask for the reference CPU MLA: AMX MLA takes bf16 only) is compared with a fresh
    engine that asks for the same one, or the fresh engine would not start, or would pack its
    weights differently; a live engine that let vLLM choose lets the fresh one choose too."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from weightsync.engines.vllm_state import EngineSettings

    def config(backend, draft_backend=None):
        mtp = SimpleNamespace(method="mtp", num_speculative_tokens=1, attention_backend=draft_backend)
        return SimpleNamespace(model_config=SimpleNamespace(dtype="torch.float32", max_model_len=512),
                               scheduler_config=SimpleNamespace(max_num_seqs=2), speculative_config=mtp,
                               attention_config=SimpleNamespace(backend=backend))

    cpu_mla = SimpleNamespace(name="CPU_MLA")  # a member of vLLM's AttentionBackendEnum
    pinned = EngineSettings.of(config(cpu_mla, cpu_mla))
    assert pinned.llm_kwargs() == {
        "dtype": "float32", "max_model_len": 512, "max_num_seqs": 2, "attention_config": {"backend": "CPU_MLA"},
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "CPU_MLA"}}
    assert EngineSettings(**json.loads(json.dumps(asdict(pinned)))) == pinned  # as it crosses to the child
    chosen = EngineSettings.of(config(None)).llm_kwargs()
    assert "attention_config" not in chosen and "attention_backend" not in chosen["speculative_config"]
