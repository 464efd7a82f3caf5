"""What ``weightsync bench`` measures: models, layout pairs, methods, and the suites.

Models are the real shapes of public Llama / Qwen checkpoints from about 0.1B to about 2B
parameters (weights are random: :mod:`weightsync.apps.bench.weights`). Layout pairs are the
three that matter for co-located RL:

* ``tp2->tp1x2``: Megatron TP2 training -> two vLLM TP1 engines (resharding + fan-out);
* ``fsdp2->tp2``: FSDP2 over 2 ranks (row chunks) -> one vLLM TP2 engine (re-cut rows
  into column/row-parallel fused shards);
* ``same``: vLLM TP2 -> vLLM TP2 (no resharding: the pure-copy case).

``issue4`` is issue #4's figure: about 1 GB (Qwen3-0.6B, bf16), Megatron TP2 -> one vLLM
TP1 engine, weightsync over shared memory against one memcpy of the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.apps.bench.baselines import BASELINES, INTEGRITY_SUFFIX

#: name -> HF config (shape facts only; the dtype is set per case).
MODELS: Mapping[str, dict[str, Any]] = {
    # test-sized: seconds end to end
    "tiny": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 1000, "tie_word_embeddings": False},
    # a 125M Llama (GPT-2-small widths, Llama-2 vocabulary, GQA 3:1)
    "llama-0.1b": {"architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 2048,
                   "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
                   "vocab_size": 32000, "tie_word_embeddings": False},
    # the awex peer's "qwen3-mid" shape (Qwen3-0.6B widths, 12 layers, 32k vocab, untied)
    "qwen3-0.2b": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 32768, "tie_word_embeddings": False},
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
                     "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936, "tie_word_embeddings": True},
    "llama3.2-1b": {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
                    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                    "vocab_size": 128256, "tie_word_embeddings": True},
    "qwen3-1.7b": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936, "tie_word_embeddings": True},
}

LAYOUTS: Mapping[str, tuple[str, str]] = {
    "tp2->tp1x2": ("megatron:tp=2", "vllm:tp=1,replicas=2"),
    "fsdp2->tp2": ("fsdp:dp=2", "vllm:tp=2"),
    "same": ("vllm:tp=2", "vllm:tp=2"),
    "tp2->tp1": ("megatron:tp=2", "vllm:tp=1"),
}

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def model_config(model: str, dtype: str) -> dict[str, Any]:
    if model not in MODELS:
        raise ValueError(f"unknown benchmark model {model!r}; known: {sorted(MODELS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    return {**MODELS[model], "torch_dtype": DTYPES[dtype]}


def weightsync_methods(transports: Sequence[str]) -> tuple[str, ...]:
    """``weightsync-<transport>`` for each; shared memory also as ``weightsync-shm-zero-copy``
    (the trainer's weights allocated in /dev/shm, read by the engines without a snapshot)."""
    out: list[str] = []
    for t in transports:
        out.append(f"weightsync-{t}")
        if t == "shm":
            out.append("weightsync-shm-zero-copy")
    return tuple(out)


def with_integrity(methods: Sequence[str]) -> tuple[str, ...]:
    """Each weightsync method followed by itself with in-band digests (``+integrity``)."""
    return tuple(x for m in methods for x in (m, m + INTEGRITY_SUFFIX))


@dataclass(frozen=True, kw_only=True)
class Case:
    """One model x dtype x layout pair, and the methods run on it side by side."""

    model: str
    dtype: str
    layout: str
    methods: tuple[str, ...]
    reps: int = 3
    warmup: int = 1
    tag: str = ""
    peer: str = ""  # "awex": also run the awex peer on this case's shapes
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        model_config(self.model, self.dtype)
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout pair {self.layout!r}; known: {sorted(LAYOUTS)}")
        if self.reps < 1 or self.warmup < 0:
            raise ValueError(f"reps must be >= 1 and warmup >= 0, got {self.reps} and {self.warmup}")

    @property
    def name(self) -> str:
        return self.tag or f"{self.model}/{self.dtype}/{self.layout}"

    @property
    def source(self) -> str:
        return LAYOUTS[self.layout][0]

    @property
    def target(self) -> str:
        return LAYOUTS[self.layout][1]

    def config(self) -> dict[str, Any]:
        return model_config(self.model, self.dtype)


def suite(kind: str, transports: Sequence[str], *, models: Sequence[str] = (), dtypes: Sequence[str] = (),
          layouts: Sequence[str] = (), reps: int = 0, peer: bool = True, methods: Sequence[str] = ()) -> list[Case]:
    """The cases of ``quick``, ``full`` or ``test`` (optionally narrowed; ``methods`` replaces
    the methods of every case, e.g. to add one of your own, ``pkg.module:Class``)."""
    if methods:
        return [dataclasses.replace(c, methods=tuple(methods), peer="") for c in
                suite(kind, transports, models=models, dtypes=dtypes, layouts=layouts, reps=reps, peer=False)]
    ws = weightsync_methods(transports)
    every = ws + BASELINES
    cases: list[Case] = []
    if kind == "test":
        for layout in layouts or ("tp2->tp1x2",):
            cases.append(Case(model="tiny", dtype=(dtypes or ("bf16",))[0], layout=layout, methods=every,
                              reps=reps or 1, warmup=1))
        return cases
    if kind == "quick":
        model = (models or ("llama-0.1b",))[0]
        dtype = (dtypes or ("bf16",))[0]
        shm = tuple(m for m in ws if m.startswith("weightsync-shm"))
        cases.append(Case(model="qwen3-0.6b", dtype="bf16", layout="tp2->tp1", tag="issue4",
                          methods=with_integrity(shm), reps=reps or 3))
        for i, layout in enumerate(layouts or ("tp2->tp1x2", "fsdp2->tp2", "same")):
            # the first layout also runs every weightsync method with integrity checks, side by side
            methods = with_integrity(ws) + BASELINES if i == 0 else every
            cases.append(Case(model=model, dtype=dtype, layout=layout, methods=methods, reps=reps or 3))
        if peer:
            cases.append(Case(model="qwen3-0.2b", dtype="bf16", layout="tp2->tp1x2", tag="awex-peer",
                              methods=tuple(m for m in ws if m in ("weightsync-torch", "weightsync-shm",
                                                                    "weightsync-shm-zero-copy")),
                              reps=reps or 3, peer="awex"))
        return cases
    if kind == "full":
        cases.append(Case(model="qwen3-0.6b", dtype="bf16", layout="tp2->tp1", tag="issue4",
                          methods=tuple(m for m in ws if m.startswith("weightsync-shm")), reps=reps or 5))
        for model in models or ("llama-0.1b", "qwen2.5-0.5b", "llama3.2-1b", "qwen3-1.7b"):
            for dtype in dtypes or ("bf16", "fp32"):
                for layout in layouts or ("tp2->tp1x2", "fsdp2->tp2", "same"):
                    cases.append(Case(model=model, dtype=dtype, layout=layout, methods=every, reps=reps or 3))
        if peer:
            cases.append(Case(model="qwen3-0.2b", dtype="bf16", layout="tp2->tp1x2", tag="awex-peer",
                              methods=tuple(m for m in ws if m in ("weightsync-torch", "weightsync-shm",
                                                                    "weightsync-shm-zero-copy")),
                              reps=reps or 5, peer="awex"))
        return cases
    raise ValueError(f"unknown suite {kind!r}; choose quick, full or test")
