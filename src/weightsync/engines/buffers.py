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
    engine = ModelsEngine({"": ModuleEngine(model, config), "draft.": NamedEngine(eagle_head)})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from weightsync.layout import ModelSpec, RankLayout, parse_layout
from weightsync.layout.models import merge, named_layout, prefixed
from weightsync.ports.engine import Invalid, Validity
from weightsync.tools.torch_layout import allocate, dtype_name, module_layout, named_tensors


class _InPlace:
    """Shared bookkeeping: version and validity of in-place buffers (the weights themselves)."""

    stages_in_phases: ClassVar[bool] = False
    keeps_received_bytes: ClassVar[bool] = True  # the parameters themselves
    in_place_names: tuple[str, ...] | None = None  # see InferenceEngine.in_place_names

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
        self.rank = rank
        self._layout = kind.rank_layout(spec, rank)
        self.tensors = dict(tensors) if tensors is not None else allocate(self._layout, device=device)

    def layout(self) -> RankLayout:
        return self._layout

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        return self.tensors

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return self.layout_text, self.config

    def relayout(self, layout: str) -> None:
        """The same tensors now hold ``layout``'s boxes: an engine whose expert placement moved
        (vLLM's EPLB moves each expert's weights with it). Its reader re-plans before the next
        version (:meth:`weightsync.session.sync_session.SyncSession.relayout`).

        Raises:
            ValueError: ``layout`` has other shards (names, shapes or dtypes) than these tensors.
        """
        kind = parse_layout(layout)
        spec = ModelSpec.from_hf_config(self.config)
        kind.validate(spec)
        new = kind.rank_layout(spec, self.rank)
        shards = {s.name: (s.shape, s.dtype) for s in self._layout.shards}
        if {s.name: (s.shape, s.dtype) for s in new.shards} != shards:
            raise ValueError(f"ShardedEngine.relayout: {kind.describe()} has other shards than {self.layout_text} "
                             "(a placement moves experts between slots, it keeps every tensor)")
        self.layout_text, self._layout = kind.describe(), new


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


class NamedEngine(_InPlace):
    """Any module's parameters and buffers, each a whole tensor under its own name, updated in
    place: a model no family describes, such as an EAGLE draft head (``fc`` and a decoder layer)."""

    def __init__(self, module: torch.nn.Module, *, rank: int = 0) -> None:
        super().__init__()
        self.module = module
        self._layout = named_layout({n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in _named(module).items()},
                                    rank)

    def layout(self) -> RankLayout:
        return self._layout

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        return _named(self.module)

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return None


class ModelsEngine:
    """The engines of one reader's models, each under a prefix: a target model and the draft model
    it speculates with (``{"": target, "draft.": draft}``), synced as one job, applied together.

    Raises:
        ValueError: an engine stages in phases (each model would need its own), or the engines
            disagree on keeping received bytes.
    """

    stages_in_phases: ClassVar[bool] = False
    keeps_received_bytes: ClassVar[bool] = True
    in_place_names: tuple[str, ...] | None = None  # see InferenceEngine.in_place_names

    def __init__(self, engines: Mapping[str, Any], *, rank: int = 0) -> None:
        staged = [p for p, e in engines.items() if e.stages_in_phases or not e.keeps_received_bytes]
        if staged:
            raise ValueError(f"ModelsEngine: the engines under {staged} stage their weights; combine engines that "
                             "receive in place (ModuleEngine, ShardedEngine, NamedEngine)")
        self.engines = dict(engines)
        self.rank = rank
        self._cache: tuple[tuple[int, ...], RankLayout] | None = None

    def layout(self) -> RankLayout:
        """The models' layouts under their prefixes (the same object while none of them changes)."""
        parts = [e.layout() for e in self.engines.values()]
        key = tuple(id(p) for p in parts)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, merge([prefixed(p, prefix) for p, prefix in zip(parts, self.engines, strict=True)],
                                      self.rank))
        return self._cache[1]

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        return {prefix + n: t for prefix, e in self.engines.items() for n, t in e.receive_buffers().items()}

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return None

    def receiving(self, version: int) -> None:
        for engine in self.engines.values():
            engine.receiving(version)

    def apply(self, version: int) -> None:
        for engine in self.engines.values():
            engine.apply(version)

    def abort(self, version: int, error: BaseException) -> None:
        for engine in self.engines.values():
            engine.abort(version, error)

    @property
    def weight_version(self) -> int | None:
        versions = {e.weight_version for e in self.engines.values()}
        return versions.pop() if len(versions) == 1 else None

    @property
    def invalid(self) -> Invalid | None:
        """The first model left invalid by a failed version: the models serve together, so one
        invalid model makes the reader's next version come in full."""
        return next((e.invalid for e in self.engines.values() if e.invalid is not None), None)


def _named(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**{n: p.detach() for n, p in module.named_parameters()}, **dict(module.named_buffers())}
