"""Staging buffers for engines that must run their own loader (vLLM, SGLang).

An engine whose live weights a transport cannot write into (repacked, fused per TP rank,
quantised, or in another process) receives into *staging buffers* instead: the whole model
under its Hugging Face checkpoint names (the ``hf`` layout kind), allocated once. Once a
version has fully arrived, the adapter pushes every staged tensor through the engine's
own loader, which fuses, shards and repacks exactly as at start-up.

    class MyEngine(StagedWeights):
        def _load(self, version):
            engine.load_weights(self.staged_items())     # checkpoint order, full tensors

Memory: one copy of the model in the engine's dtype, on the device given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import torch

from weightsync.layout import ModelSpec, RankLayout
from weightsync.layout.kinds.hf import HFLayout
from weightsync.torch_layout import allocate, dtype_name

logger = logging.getLogger(__name__)


class StagedWeights:
    """Staging buffers holding a whole model under checkpoint names, and their bookkeeping.

    The part of an engine adapter that does not depend on where the model lives: the
    layout (``hf:dtype=...``), the buffers, validation, and the weight version. Subclasses
    implement :meth:`_load` (push every staged tensor through the engine's loader).
    """

    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype, device: str | torch.device, rank: int,
                 replicas: int | None = None) -> None:
        self.spec = spec
        # The hf kind's world must include this rank; pass the number of engines so that all
        # readers publish one descriptor (and share one layout template when planning).
        kind = HFLayout(replicas=replicas or rank + 1, dtype=dtype_name(dtype))
        kind.validate(spec)
        self.layout_text = kind.describe()
        self._layout = kind.rank_layout(spec, rank)
        self._buffers = allocate(self._layout, device=device)
        self._version: int | None = None
        self._complete = False  # every buffer holds one consistent version
        self._touched = False   # a load into the engine started and did not finish

    # -- InferenceEngine ----------------------------------------------------------------------
    def layout(self) -> RankLayout:
        return self._layout

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        return MappingProxyType(self._buffers)

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return self.layout_text, self.spec.to_hf_config()

    @property
    def weight_version(self) -> int | None:
        return self._version

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def apply(self, version: int) -> None:
        """Every buffer holds ``version`` (the reader's contract): load it into the engine."""
        self._complete = True
        self._version = None
        self._touched = True
        self._load(version)
        self._touched = False
        self._version = version

    def abort(self, version: int, error: BaseException) -> None:
        # The buffers may hold a mix of two versions; the next update must be a full one.
        self._complete = False
        self._version = None
        logger.warning("version %d was not applied (%s); the engine's weights are %s", version, error,
                       "invalid until the next full update" if self._touched else "unchanged")

    # -- direct loading -----------------------------------------------------------------------
    def update(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
               version: int) -> None:
        """Load tensors you hold (checkpoint names, full shapes) as ``version``.

        Everything is checked before the engine is touched; a rejected update leaves the
        engine as it was. The first update (and the first after a failure) must cover every
        tensor; later ones may cover a subset, the rest keeps its staged value.

        Raises:
            ValueError: unknown names, wrong shapes, non-floating dtypes, or missing tensors.
        """
        items = dict(weights.items() if isinstance(weights, Mapping) else weights)
        check_weights(self._layout, items, complete=not self._complete)
        for name, tensor in items.items():
            self._buffers[name].copy_(tensor)
        try:
            self.apply(version)
        except Exception as exc:
            self.abort(version, exc)
            raise

    def staged_items(self) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name, buffer) in checkpoint order: embeddings, layer by layer, head."""
        check_weights(self._layout, self._buffers, complete=True, exact_dtype=True)
        return [(shard.name, self._buffers[shard.name]) for shard in self._layout.shards]

    def _load(self, version: int) -> None:
        raise NotImplementedError


def check_weights(layout: RankLayout, weights: Mapping[str, torch.Tensor], *, complete: bool,
                  exact_dtype: bool = False) -> None:
    """Raise ValueError unless ``weights`` fit ``layout`` by name, shape and dtype."""
    expected = {s.name: s for s in layout.shards}
    unknown = [n for n in weights if n not in expected]
    wrong = [f"{n}: shape {tuple(t.shape)}, expected {expected[n].shape}"
             for n, t in weights.items() if n in expected and tuple(t.shape) != expected[n].shape]
    bad_dtype = [f"{n}: {t.dtype}" for n, t in weights.items() if n in expected and (
        dtype_name(t.dtype) != expected[n].dtype if exact_dtype else not t.is_floating_point())]
    missing = [n for n in expected if n not in weights] if complete else []
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} name(s) the model does not have: {unknown[:5]}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) with the wrong shape: {wrong[:5]}")
    if bad_dtype:
        problems.append(f"{len(bad_dtype)} tensor(s) with an unusable dtype: {bad_dtype[:5]}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing (the first update, and the first after a "
                        f"failed one, must cover the whole model): {missing[:5]}")
    if problems:
        raise ValueError("weights rejected before loading: " + "; ".join(problems))
