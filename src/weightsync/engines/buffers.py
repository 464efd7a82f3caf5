"""In-place engines without an engine library: tensors laid out per a layout kind, or any
``nn.Module`` with Hugging Face names.

These are what tests, the demo and custom inference code use: the transport writes
straight into the tensors (parameters), and ``apply`` only records the version. So the
engine's weights are touched from the transport's first receive of a version on: a failure
after it leaves the engine invalid (``weight_version`` None, ``invalid`` set) until a later
version arrives in full; a failure before it (a refused plan, a writer dead before the
receive) leaves it at its version.

    engine = ShardedEngine("vllm:tp=2", config, rank)   # allocates vLLM-style shards
    engine = ModuleEngine(hf_model, config)             # an HF model, updated in place
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from weightsync.layout import ModelSpec, RankLayout, parse_layout
from weightsync.ports.engine import Invalid, Validity
from weightsync.tools.torch_layout import allocate, module_layout, named_tensors


class _InPlace:
    """Shared bookkeeping: version and validity of in-place buffers (the weights themselves)."""

    stages_in_phases: ClassVar[bool] = False
    keeps_received_bytes: ClassVar[bool] = True  # the parameters themselves

    def __init__(self) -> None:
        self.validity = Validity()

    def receiving(self, version: int) -> None:
        self.validity.touch(version)  # the receive buffers are the live weights

    def apply(self, version: int) -> None:
        self.validity.applied(version)

    def abort(self, version: int, error: BaseException) -> None:
        self.validity.failed(version, error)

    @property
    def weight_version(self) -> int | None:
        return self.validity.version

    @property
    def invalid(self) -> Invalid | None:
        return self.validity.invalid


class ShardedEngine(_InPlace):
    """Engine buffers laid out per a registered layout kind, updated in place."""

    def __init__(self, layout: str, config: Mapping[str, Any], rank: int,
                 tensors: Mapping[str, torch.Tensor] | None = None, *, device: str = "cpu") -> None:
        super().__init__()
        kind = parse_layout(layout)
        self.layout_text = kind.describe()
        self.config = dict(config)
        spec = ModelSpec.from_hf_config(config)
        kind.validate(spec)
        self._layout = kind.rank_layout(spec, rank)
        self.tensors = dict(tensors) if tensors is not None else allocate(self._layout, device=device)

    def layout(self) -> RankLayout:
        return self._layout

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        return self.tensors

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return self.layout_text, self.config


class ModuleEngine(_InPlace):
    """Any module with HF parameter names (e.g. a transformers model), updated in place."""

    def __init__(self, module: torch.nn.Module, config: Mapping[str, Any] | ModelSpec, *, rank: int = 0) -> None:
        super().__init__()
        self.module = module
        spec = config if isinstance(config, ModelSpec) else ModelSpec.from_hf_config(config)
        self.spec = spec
        self._layout = module_layout(named_tensors(module, spec).items(), spec, rank)

    def layout(self) -> RankLayout:
        return self._layout

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        names = {s.name for s in self._layout.shards}
        return {n: p.detach() for n, p in named_tensors(self.module, self.spec).items() if n in names}

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return None
