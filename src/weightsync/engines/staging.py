"""Staging buffers for engines that must run their own loader (vLLM, SGLang).

An engine whose live weights a transport cannot write into (repacked, fused per TP rank,
quantised, or in another process) receives into *staging buffers* instead: the whole model
under its Hugging Face checkpoint names (the ``hf`` layout kind), allocated once. Once a
version has fully arrived, the adapter pushes every staged tensor through the engine's
own loader, which fuses, shards and repacks exactly as at start-up.

    class MyEngine(StagedWeights):
        def _load_items(self, items):
            engine.load_weights(items)     # checkpoint order, full tensors

Memory: one copy of the model in the engine's dtype, on the device given; with phases
(``SyncConfig(layer_phases=True)``), one phase of whole layers.

**Where a version first touches the engine**, and so what a failure leaves: the engine's own
weights are touched by the first byte received into a tensor taken in place
(:meth:`StagedWeights.receive_in_place`), else by the opening of its load (:meth:`_begin`:
with phases, of the first phase). A failure after that makes the engine invalid
(``weight_version`` None, ``invalid`` set, :meth:`_invalidate` stamps the engine itself) until a
later version is loaded in full; a failure before it (a refused plan, a dead writer, a transfer
that broke off in staging, staged tensors refused by the checks) leaves the engine serving the
version it had, untouched: whole-model staging is what lets such an engine keep its version.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import ClassVar

import torch

from weightsync.layout import ModelSpec, RankLayout, Shard
from weightsync.layout.box import Box
from weightsync.layout.kinds.hf import HFLayout
from weightsync.layout.models import merge
from weightsync.layout.restrict import restrict
from weightsync.ports import device as device_port
from weightsync.ports.engine import Invalid, ServingVersion
from weightsync.tools.torch_layout import TORCH_DTYPES, dtype_name

logger = logging.getLogger(__name__)


class StagedWeights:
    """Staging buffers holding a whole model under checkpoint names, and their bookkeeping.

    The part of an engine adapter that does not depend on where the model lives: the
    layout (``hf:dtype=...``), the buffers, validation, and the weight version. Subclasses
    push staged tensors through the engine's loader: :meth:`_begin` opens a load,
    :meth:`_load_items` loads some tensors, :meth:`_end` completes the version.

    **Phases** (``SyncConfig(layer_phases=True)``; a :class:`~weightsync.ports.engine.PhasedEngine`):
    the reader calls :meth:`use_phases` with the job's phases of whole layers; an engine that
    ``loads_in_phases`` then lays its buffers out in one *arena* the size of the largest
    phase, every phase's tensors on the same memory, and loads each phase as it arrives
    (:meth:`phase_arrived`). Staging is then one phase, not the model.
    """

    stages_in_phases: ClassVar[bool] = True
    #: Staging is allocated once and only the transport writes it (phases that share the
    #: arena excepted, see :class:`~weightsync.ports.engine.InferenceEngine`).
    keeps_received_bytes: ClassVar[bool] = True
    #: Whether the engine's loader takes a version in several calls (vLLM's layerwise reload
    #: does); an engine that does not stages the whole model whatever the phases.
    loads_in_phases: bool = True

    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype, device: str | torch.device, rank: int,
                 replicas: int | None = None, quant: str | None = None,
                 reads: Mapping[str, Iterable[Box]] | None = None, extra: RankLayout | None = None) -> None:
        self.spec = spec
        # The hf kind's world must include this rank; pass the number of engines so that all
        # readers publish one descriptor (and share one layout template when planning).
        kind = HFLayout(replicas=replicas or rank + 1, dtype=dtype_name(dtype), quant=quant)  # quant: FP8 engines
        kind.validate(spec)
        self.layout_text = kind.describe()
        self._layout = kind.rank_layout(spec, rank)
        #: ``reads``: the boxes of each canonical tensor the engine's loader reads (a TP worker's
        #: slices): only they arrive, into whole checkpoint-shaped buffers (an explicit layout)
        self._explicit = reads is not None or extra is not None  # published as shards, not as the hf kind
        if reads is not None:
            self._layout = restrict(self._layout, reads)
        #: ``extra``: another model of the job the engine stages too (a separate drafter, under its
        #: prefix: :mod:`weightsync.layout.models`); the layout is then the explicit union
        if extra is not None:
            self._layout = merge([self._layout, extra], rank)
        self._device = torch.device(device)
        self.dev = device_port.current()
        self._phases: tuple[tuple[str, ...], ...] | None = None  # laid out for these; None: not yet
        self._arena: torch.Tensor | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._version: int | None = None
        self._complete = False  # every buffer holds one consistent version
        self._touched = False   # bytes of a version that did not complete reached the engine's weights
        self._loading: int | None = None  # the version whose load is open (between phases)
        #: why the engine serves no valid version (None: it serves ``_version``, or what it started with)
        self.invalid: Invalid | None = None
        #: ``time.time()`` when the version the engine serves went live (None: its start-up weights)
        self.applied_at: float | None = None
        #: checkpoint tensors received straight into the engine's own parameters (no staging)
        self._direct: dict[str, torch.Tensor] = {}
        #: device memory reserved for the arena before the engine sized its cache (adopt_reserve)
        self._reserve: torch.Tensor | None = None

    # -- InferenceEngine ----------------------------------------------------------------------
    def layout(self) -> RankLayout:
        return self._layout

    @property
    def device(self) -> str:
        return str(self._device) if self._device.type == "cpu" else str(torch.empty(0, device=self._device).device)

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        if self._phases is None:
            self.use_phases(None)
        return MappingProxyType(self._buffers)

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        if self._explicit:
            return None  # not the hf kind's whole model: the shards themselves are published
        return self.layout_text, self.spec.to_hf_config()

    @property
    def weight_version(self) -> int | None:
        return None if self._touched or self.invalid is not None else self._version

    def receiving(self, version: int) -> None:
        """Bytes of ``version`` land in staging, and in the tensors taken in place, which are the
        engine's own: with any, the engine is touched from here on."""
        if self._direct:
            self._touched = True

    @property
    def staging_bytes(self) -> int:
        """Memory the staging buffers take (the arena: the largest phase)."""
        return 0 if self._arena is None else self._arena.numel()

    def receive_in_place(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Receive these checkpoint tensors straight into the engine's parameters: no staging,
        and the engine's loader never sees them (each must need no post-processing)."""
        for name, tensor in targets.items():
            shard = self._layout.shard(name)
            if tuple(tensor.shape) != shard.shape or TORCH_DTYPES[shard.dtype] != tensor.dtype \
                    or not tensor.is_contiguous():
                raise ValueError(f"{name}: the engine's tensor ({tuple(tensor.shape)}, {tensor.dtype}) is not the "
                                 f"checkpoint's ({shard.shape}, {shard.dtype}); it cannot be received in place")
        self._direct = dict(targets)
        self._phases = None  # lay the buffers out again

    @property
    def in_place_names(self) -> tuple[str, ...]:
        return tuple(self._direct)

    # -- phases -------------------------------------------------------------------------------
    def lay_out(self, *, layer_phases: bool = False, budget_bytes: int = 0) -> None:
        """Allocate staging now, for the job's settings, rather than at the first update.

        Called at init (vLLM's ``init_weight_transfer_engine``, SGLang's adapter), so that
        staging that does not fit is refused there, with its figure and the setting to change,
        never inside a sync. The phases are those every rank computes from the canonical
        tensors (:func:`weightsync.plan.phases.layer_phases` with ``max_bucket_bytes``); the
        reader lays out again at the first update only if the job's phases differ.
        """
        from weightsync.plan.phases import layer_phases as phases_of

        self.use_phases(phases_of(self._layout.canonical, budget_bytes=budget_bytes) if layer_phases else None)

    def arena_bytes(self, phases: tuple[tuple[str, ...], ...] | None) -> int:
        """The staging arena :meth:`use_phases` lays out for ``phases``, in bytes (nothing allocated)."""
        return self._arrange(phases)[3]

    def adopt_reserve(self, reserve: torch.Tensor | None) -> None:
        """Lay the arena out in ``reserve`` (device memory taken before the engine sized its KV
        cache), if it is large enough; else it is freed and the arena allocated anew."""
        self._reserve = reserve

    def _arrange(self, phases: tuple[tuple[str, ...], ...] | None) -> tuple[
            tuple[tuple[str, ...], ...], list[list[Shard]], dict[str, int], int]:
        """(the phases laid out, each phase's staged shards, each shard's offset, the arena's bytes)."""
        everything = (tuple(self._layout.canonical),)
        wanted = phases if phases and self.loads_in_phases else everything
        phase_of = {name: i for i, names in enumerate(wanted) for name in names}
        by_phase: list[list[Shard]] = [[] for _ in wanted]
        for shard in self._layout.shards:
            if shard.name in self._direct:
                continue
            owners = {phase_of.get(r.canonical) for r in shard.regions}
            if len(owners) != 1 or None in owners:
                raise ValueError(f"shard {shard.name} spans phases {sorted(o for o in owners if o is not None)}")
            by_phase[owners.pop()].append(shard)  # type: ignore[index]
        offsets: dict[str, int] = {}
        size = 0
        for shards in by_phase:
            at = 0
            for shard in shards:
                offsets[shard.name] = at
                at += -(-shard.nbytes // _ALIGN) * _ALIGN
            size = max(size, at)
        return wanted, by_phase, offsets, max(size, _ALIGN)

    def use_phases(self, phases: tuple[tuple[str, ...], ...] | None) -> None:
        """Lay the buffers out for ``phases`` of canonical tensors (None: the whole model at once)."""
        wanted, by_phase, offsets, size = self._arrange(phases)
        if wanted == self._phases:
            return
        self._arena = None
        self._buffers = {}
        reserve, self._reserve = self._reserve, None
        if reserve is not None and reserve.numel() >= size:
            arena = reserve[:size].zero_()
        else:
            del reserve  # freed first: its memory serves the allocation below
            arena = device_port.allocate(
                self.dev, size, self._device, what="the engine's staging arena",
                fix="leave the engine room for it (vLLM: a lower gpu_memory_utilization, or kv_cache_memory_bytes, or "
                    "the job's layer_phases and max_bucket_bytes in additional_config={'weightsync': {...}}, which "
                    "reserves staging before the KV cache is sized; SGLang: a lower mem_fraction_static)"
                    + (", or stage one phase of layers at a time (SyncConfig(layer_phases=True))"
                       if self.loads_in_phases and len(wanted) == 1 else ""),
            ).zero_()
        for shard in self._layout.shards:
            if shard.name in self._direct:
                self._buffers[shard.name] = self._direct[shard.name]
                continue
            at = offsets[shard.name]
            self._buffers[shard.name] = arena[at: at + shard.nbytes].view(TORCH_DTYPES[shard.dtype]).view(shard.shape)
        self._arena, self._phases = arena, wanted
        self._phase_shards = by_phase
        self._complete = False  # whatever was staged before is gone
        logger.info("staging: %d phase(s), arena of %.1f MB on %s", len(wanted), size / 1e6, self._device)

    def phase_arrived(self, version: int, phase: int, names: tuple[str, ...]) -> None:
        """Phase ``phase`` of ``version`` is staged: load it now (the next phase reuses the memory)."""
        if self._phases is None or len(self._phases) == 1:
            return  # everything is loaded by apply()
        if self._phases[phase] != names:
            raise ValueError(f"phase {phase} of the job holds other tensors than this engine laid out: the engine "
                             "and the job disagree on phases (same max_bucket_bytes everywhere?)")
        items = [(s.name, self._buffers[s.name]) for s in self._phase_shards[phase]]
        check_weights(_only(self._layout, items), dict(items), complete=True, exact_dtype=True)
        if phase == 0:
            self._open(version)
        self._load_items(items)
        if self._device.type == "cpu":
            trim_host_heap()

    # -- the version's lifecycle ----------------------------------------------------------------
    def _open(self, version: int) -> None:
        self._touched = True  # from the first call into the engine's loader on
        self._loading = version
        self._begin(version)

    def apply(self, version: int) -> None:
        """Every buffer (or phase) holds ``version`` (the reader's contract): complete the load."""
        if self._loading != version:  # the whole model at once: load it all now
            items = self.staged_items()  # checked before the engine is touched
            self._open(version)
            self._load_items(items)
        self._loading = None
        self._end(version)
        self._loaded(version, staged=True)

    def _loaded(self, version: int, *, staged: bool) -> None:
        """The engine serves ``version`` in full; ``staged``: staging holds it too (a later update
        may then cover a subset)."""
        self._complete = staged
        self._touched = False
        self.invalid = None
        self._version = version
        self.applied_at = time.time()

    def serving(self) -> ServingVersion:
        """Which version the engine serves, since when, valid or not (SGLang's readback, and
        vLLM's in-process engine's)."""
        return ServingVersion.of(self, since=self.applied_at)

    def abort(self, version: int, error: BaseException) -> None:
        """The update of ``version`` failed: invalid if it touched the engine (see module docstring)."""
        # Staging may hold a mix of two versions either way: the next update must be a full one.
        if self._loading is not None:
            self._loading = None
            try:
                self._end(version, failed=True)  # never leave the engine inside an open load
            except Exception as exc:  # the original error is what the caller sees
                logger.warning("closing the failed load of version %d: %s", version, exc)
        self._complete = False
        if self._touched:
            self._touched = False
            self._version = None
            since = self.invalid.since if self.invalid is not None else time.time()
            self.invalid = Invalid(version, str(error) or type(error).__name__, since)
            try:
                self._invalidate(version)
            except Exception as exc:  # the original error is what the caller sees
                logger.warning("marking the engine invalid after version %d failed: %s", version, exc)
        logger.warning("version %d was not applied (%s); the engine %s", version, error,
                       "is invalid until a later version is loaded in full" if self.invalid is not None
                       else f"still serves {'its start-up weights' if self._version is None else self._version}")

    # -- direct loading -----------------------------------------------------------------------
    def update(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
               version: int) -> None:
        """Load tensors you hold (checkpoint names, full shapes) as ``version``.

        Everything is checked before the engine is touched; a rejected update leaves the
        engine as it was. The first update (and the first after a failure, or after phased
        syncs) must cover every tensor; later ones may cover a subset, the rest keeps its
        staged value.

        Raises:
            ValueError: unknown names, wrong shapes, non-floating dtypes, or missing tensors.
        """
        self.use_phases(None)
        items = dict(weights.items() if isinstance(weights, Mapping) else weights)
        check_weights(self._layout, items, complete=not self._complete)
        self.receiving(version)
        for name, tensor in items.items():
            self.dev.copy(self._buffers[name], tensor)
        try:
            self.apply(version)
        except Exception as exc:
            self.abort(version, exc)
            raise

    def load_local(self, weights: Mapping[str, torch.Tensor], *, version: int) -> None:
        """Load a whole model this process holds (a co-located trainer's replica: checkpoint names,
        full shapes, any floating dtype) straight through the engine's loader, with no staging: the
        local copy, for a trainer rank and its engine in one process with nothing to move between
        processes. Everything is checked before the engine is touched; a failure once the load
        began leaves the engine invalid until a later version is loaded in full.

        Raises:
            ValueError: unknown names, wrong shapes, non-floating dtypes, or missing tensors.
        """
        check_weights(self._layout, weights, complete=True)
        items = [(shard.name, weights[shard.name]) for shard in self._layout.shards]  # checkpoint order
        try:
            self._open(version)
            self._load_items(items)
            self._loading = None
            self._end(version)
        except Exception as exc:
            self.abort(version, exc)
            raise
        self._loaded(version, staged=False)  # staging does not hold it: a staged update comes in full

    def staged_items(self) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name, buffer) in checkpoint order: embeddings, layer by layer, head."""
        if self._phases is None:
            self.use_phases(None)
        check_weights(self._layout, self._buffers, complete=True, exact_dtype=True)
        return [(shard.name, self._buffers[shard.name]) for shard in self._layout.shards
                if shard.name not in self._direct]

    # -- the engine's loader (subclasses) ------------------------------------------------------
    def _begin(self, version: int) -> None:
        """Open a load of ``version`` into the engine (vLLM: a layerwise-reload session)."""

    def _load_items(self, items: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def _end(self, version: int, *, failed: bool = False) -> None:
        """Complete (or, ``failed``, close) the load: after it the engine serves the new weights."""

    def _invalidate(self, version: int) -> None:
        """The engine's weights are a mix since ``version`` failed: say so where its outputs are
        labelled (vLLM, SGLang: their own weight version), until a later version is loaded."""


_ALIGN = 64


def invalid_stamp(version: int) -> str:
    """The weight version an engine (vLLM, SGLang) is given when the update to ``version`` failed
    after touching its weights: every output it generates until a later full update carries it,
    so rollouts of mixed weights can be told apart and dropped."""
    return f"invalid:{version}"


def trim_host_heap() -> None:
    """Give host memory the loader freed back to the operating system.

    A CPU engine's loader allocates and frees a module's worth of tensors per module
    (vLLM materializes and repacks each); glibc keeps freed heap pages mapped, so without
    this the resident set grows by the loader's high-water mark over the whole model instead
    of one phase. ``malloc_trim`` is glibc-only; elsewhere this does nothing.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _only(layout: RankLayout, items: list[tuple[str, torch.Tensor]]) -> RankLayout:
    names = {name for name, _ in items}
    return RankLayout(layout.rank, tuple(s for s in layout.shards if s.name in names), layout.canonical)


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
