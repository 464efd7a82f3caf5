"""vLLM's own layout of a model, recorded by a dry run of its weight loaders.

Where does each checkpoint slice land in a vLLM worker at TP rank ``t`` of ``tp``, DP rank
``d``, with or without expert parallelism? vLLM knows: its ``load_weights`` cuts, fuses and
copies every checkpoint tensor into the worker's parameters. This module asks it, as vLLM's
``sharded_rdt`` backend does: it builds the model for the wanted parallelism on the meta
device (no memory, no process group: the parallel groups are stand-ins that only answer
their size and rank) and runs the model's own ``load_weights`` on *recording tensors*. A
recording tensor follows every view the loaders take of it (``narrow``, ``chunk``,
``permute``, indexing, ...) and, when a loader copies it into a parameter, records which box
of which canonical tensor went to which strided region of which parameter. The result is a
list of :class:`~weightsync.layout.Shard` per rank, plain data for the pure core
(``layout/kinds/vllm.py`` consumes it), exact for any architecture vLLM supports.

    shards = record_rank(hf_config, tp=2, rank=1)                 # list[Shard]
    install()             # the ``vllm`` layout kind now asks vLLM instead of its hand tables

Recordings are cached per (architecture, config digest, parallelism, rank). With ``mtp``
the MTP drafter (``speculative_config`` method ``mtp``) is recorded too; vLLM's proposer
shares the target's embedding and output head with it, so only its own layers are shards.

A loader that does anything but views and copies with a checkpoint tensor (arithmetic, a
dtype cast) fails the recording with the op named: its result is not a slice of the
checkpoint. ``zero_`` is the one exception (gpt-oss's ``w2_bias`` on TP ranks but the
first): the parameter then holds zeros, which map to no canonical tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import tempfile
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.engines.process_state import preserved_process_state
from weightsync.layout import ModelSpec, Region, Shard
from weightsync.layout.box import Box, contiguous_strides
from weightsync.layout.kinds.hf import HFLayout
from weightsync.tools.torch_layout import dtype_name

#: Tensor methods that return a view of their input: the recording follows them.
_VIEW_OPS = frozenset({"narrow", "view", "reshape", "__getitem__", "unsqueeze", "squeeze", "transpose", "t",
                       "permute", "flatten", "contiguous", "chunk", "split", "unbind", "select", "detach",
                       "view_as", "reshape_as", "movedim"})
#: Tensor attributes and methods that only read metadata.
_META_OPS = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "storage_offset", "__len__", "nelement",
                       "element_size", "__get__", "data_ptr", "__format__", "__repr__", "__bool__"})


class _Recorder:
    """Collects the copies the loaders make: (parameter, destination view) <- (canonical box)."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._by_storage = {p.untyped_storage()._cdata: (name, p) for name, p in params.items()}
        self.regions: dict[str, list[Region]] = {name: [] for name in params}
        self.zeroed: set[str] = set()

    def copy(self, dest: torch.Tensor, src: RecordingTensor) -> torch.Tensor:
        found = self._by_storage.get(dest.untyped_storage()._cdata)
        if found is None:
            raise NotImplementedError(f"a loader copied {src.source} into a tensor that is no parameter of the model")
        name, param = found
        if src.zeroed:
            self.zeroed.add(name)
            return dest
        view = src.window
        dest_shape = [s for s in dest.shape if s != 1]
        if [s for s in view.shape if s != 1] != dest_shape:
            raise NotImplementedError(f"{name}: a broadcasting copy of {src.source} {tuple(view.shape)} into "
                                      f"{tuple(dest.shape)} is not a slice")
        keep_src = [k for k, s in enumerate(view.shape) if s != 1]
        keep_dst = [k for k, s in enumerate(dest.shape) if s != 1]
        src_dims = [(int(view.shape[k]), int(view.stride()[k])) for k in keep_src]
        dst_strides = [int(dest.stride()[k]) for k in keep_dst]
        offset = dest.storage_offset() - param.storage_offset()
        self.regions[name].append(src.region(src_dims, int(view.storage_offset()), dst_strides, int(offset)))
        return dest


class RecordingTensor(torch.Tensor):
    """A storage-less checkpoint tensor that follows views and records copies out of it.

    ``window`` is a meta tensor over the checkpoint tensor's (contiguous) storage: the elements
    this recording refers to. ``contiguous()`` keeps the view (the copy it would make holds the
    same elements in the same logical order), and ``reshape`` must be a view. ``base`` is the
    checkpoint tensor's region in the ``hf`` layout: which box of which canonical tensor it is.
    """

    source: str
    shape0: tuple[int, ...]
    window: torch.Tensor
    base: Region
    zeroed: bool
    _recorder: _Recorder

    @staticmethod
    def __new__(cls, source: str, view: torch.Tensor, base: Region, recorder: _Recorder) -> RecordingTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, view.shape, dtype=view.dtype, device=torch.device("meta"))
        t.source, t.window, t.base, t.zeroed, t._recorder = source, view, base, False, recorder
        t.shape0 = tuple(int(n) for n in view.shape)
        return t

    def _child(self, view: torch.Tensor) -> RecordingTensor:
        child = RecordingTensor(self.source, view, self.base, self._recorder)
        child.shape0, child.zeroed = self.shape0, self.zeroed
        return child

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "copy_" and isinstance(args[1], RecordingTensor):
            return args[1]._recorder.copy(args[0], args[1])
        if name == "__setitem__" and isinstance(args[2], RecordingTensor):
            with torch._C.DisableTorchFunctionSubclass():
                dest = args[0][args[1]]
            args[2]._recorder.copy(dest, args[2])
            return None
        this = args[0] if args else None
        if isinstance(this, RecordingTensor):
            if name == "zero_":
                this.zeroed = True
                return this
            if name in ("contiguous", "detach"):
                return this
            if name in _VIEW_OPS:
                op = {"reshape": "view", "reshape_as": "view_as"}.get(name, name)
                rest = [a.window if isinstance(a, RecordingTensor) else a for a in args[1:]]
                with torch._C.DisableTorchFunctionSubclass():
                    result = getattr(torch.Tensor, op)(this.window, *rest, **kwargs)
                if isinstance(result, torch.Tensor):
                    return this._child(result)
                return type(result)(this._child(r) for r in result)
            if name in _META_OPS or name in ("shape", "dtype", "device", "ndim", "is_meta", "requires_grad"):
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
        raise NotImplementedError(f"vLLM's loader applies {name or func} to checkpoint tensor "
                                  f"{getattr(this, 'source', '?')}: that is not a slice, so it cannot be recorded")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise NotImplementedError(f"vLLM's loader applies {func} to a checkpoint tensor: not a slice")

    def region(self, src_dims: list[tuple[int, int]], src_offset: int, dst_strides: list[int],
               dst_offset: int) -> Region:
        """The canonical region of one copy: the recorded view composed with the checkpoint's region.

        ``src_dims`` are the (size, stride) of the copied view's non-unit dims over the
        checkpoint tensor's storage, ``dst_strides`` the destination's for the same dims.
        Each must run along one checkpoint dim (a reshape that merged dims is split again).
        """
        shape = self.shape0
        cstrides = contiguous_strides(shape)
        offs = [src_offset // c % n if n else 0 for c, n in zip(cstrides, shape, strict=True)]
        if sum(o * c for o, c in zip(offs, cstrides, strict=True)) != src_offset:
            raise NotImplementedError(f"{self.source}: a view at offset {src_offset} is not a box")
        sizes, strides = [1] * len(shape), [0] * len(shape)
        work = list(zip(src_dims, dst_strides, strict=True))
        while work:
            (size, stride), dst = work.pop()
            dim = next((d for d in range(len(shape)) if cstrides[d] == stride and shape[d] > 1), None)
            if dim is None or sizes[dim] != 1:
                raise NotImplementedError(f"{self.source}: a view with stride {stride} is not a box")
            if size > shape[dim] and offs[dim] == 0 and size % shape[dim] == 0:
                work += [((size // shape[dim], stride * shape[dim]), dst * shape[dim]), ((shape[dim], stride), dst)]
                continue
            if offs[dim] + size > shape[dim]:
                raise NotImplementedError(f"{self.source}: a view past the end of its dim {dim}")
            sizes[dim], strides[dim] = size, dst
        lead = self.base.box.ndim - len(shape)
        box = Box(self.base.box.offsets[:lead] + tuple(o + b for o, b in zip(offs, self.base.box.offsets[lead:],
                                                                              strict=True)),
                  self.base.box.sizes[:lead] + tuple(sizes))
        return Region(self.base.canonical, box, dst_offset, (0,) * lead + tuple(strides))


# -- the model for one rank, on the meta device, under stand-in parallel groups -----------------

class _Group:
    """A stand-in for vLLM's ``GroupCoordinator``: its size and this rank's place, no communication."""

    def __init__(self, size: int, rank: int) -> None:
        self.world_size, self.rank_in_group, self.rank, self.local_rank = size, rank, rank, rank
        self.ranks = list(range(size))
        self.is_first_rank = self.is_last_rank = True
        self.device_group = self.cpu_group = types.SimpleNamespace(size=lambda: size, rank=lambda: rank)


@contextlib.contextmanager
def _parallel_groups(tp: int, dp: int, t: int, d: int) -> Iterator[None]:
    """vLLM's parallel groups for TP rank ``t`` of DP rank ``d``, restored afterwards."""
    import vllm.distributed.parallel_state as ps

    groups = {"_TP": _Group(tp, t), "_DP": _Group(dp, d), "_EP": _Group(tp * dp, d * tp + t), "_PP": _Group(1, 0),
              "_PCP": _Group(1, 0), "_DCP": _Group(1, 0), "_ETP": _Group(1, 0), "_EPLB": _Group(1, 0),
              "_WORLD": _Group(tp * dp, d * tp + t)}
    saved = {name: getattr(ps, name) for name in groups}
    try:
        for name, group in groups.items():
            setattr(ps, name, group)
        yield
    finally:
        for name, group in saved.items():
            setattr(ps, name, group)


def _digest(config: Mapping[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=12).hexdigest()


@functools.lru_cache(maxsize=8)
def _engine_config(config_json: str, dtype: str, mtp: bool) -> Any:
    """vLLM's own ``VllmConfig`` for the model (built once per config: it inspects the model)."""
    from vllm.engine.arg_utils import EngineArgs

    # vLLM's platform sets process-wide variables while it builds a config: a planner keeps none
    with tempfile.TemporaryDirectory() as tmp, preserved_process_state():
        (Path(tmp) / "config.json").write_text(config_json)
        args = EngineArgs(model=tmp, skip_tokenizer_init=True, dtype=dtype,  # type: ignore[arg-type]
                          enforce_eager=True, load_format="dummy",
                          max_model_len=256, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
                          if mtp else None)
        return args.create_engine_config()


@contextlib.contextmanager
def _expert_maps_on_cpu() -> Iterator[None]:
    """Build vLLM 0.32's ``ExpertMapManager`` on the CPU while the model is built on meta.

    Its expert maps are small index tensors that the expert weight loaders read back
    (``.item()``) to tell whether an expert is local: they must hold data.
    """
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    original = ExpertMapManager.__init__

    @functools.wraps(original)
    def on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        with torch.device("cpu"):
            original(self, *args, **kwargs)

    ExpertMapManager.__init__ = on_cpu  # type: ignore[method-assign]
    try:
        yield
    finally:
        ExpertMapManager.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _rope_cache_untouched() -> Iterator[None]:
    """Keep the rotary embeddings built on meta out of vLLM's process-wide cache.

    ``get_rope`` memoises every ``RotaryEmbedding`` it builds in ``_ROPE_DICT``: a recording
    would leave one whose ``cos_sin_cache`` is a meta tensor, and the next real engine of
    the same shape in this process would pick it up and fail at its first forward
    ("Cannot copy out of meta tensor").
    """
    from vllm.model_executor.layers import rotary_embedding

    saved = dict(rotary_embedding._ROPE_DICT)
    rotary_embedding._ROPE_DICT.clear()
    try:
        yield
    finally:
        rotary_embedding._ROPE_DICT.clear()
        rotary_embedding._ROPE_DICT.update(saved)


def _build(vllm_config: Any, model_config: Any, ep: bool) -> torch.nn.Module:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config.compilation_config.static_forward_context.clear()  # the attention layers of the last build
    vllm_config.parallel_config.enable_expert_parallel = ep
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), \
            _expert_maps_on_cpu(), _rope_cache_untouched(), torch.device("meta"):
        return initialize_model(vllm_config=vllm_config, model_config=model_config)


def _record(model: torch.nn.Module, checkpoint: list[Shard], skip: tuple[str, ...] = ()) -> list[Shard]:
    """Run ``model.load_weights`` on recording tensors of ``checkpoint``; the parameters as shards."""
    params = {n: p for n, p in model.named_parameters() if not n.startswith(skip)}
    recorder = _Recorder(params)
    weights = [(s.name, RecordingTensor(s.name, torch.empty(s.shape, dtype=_torch_dtype(s.dtype), device="meta"),
                                        s.regions[0], recorder)) for s in checkpoint]
    model.load_weights(iter(weights))  # type: ignore[operator]
    out = []
    for name, param in params.items():
        regions = recorder.regions[name]
        if sum(r.numel for r in regions) > param.numel():
            raise NotImplementedError(f"vLLM's loaders write some elements of {name} more than once (two checkpoint "
                                      "tensors land on them): not a layout")
        if regions:
            out.append(Shard(name, tuple(param.shape), dtype_name(param.dtype),
                             tuple(sorted(regions, key=lambda r: (r.offset, r.canonical)))))
    return out


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


def record_rank(config: Mapping[str, Any], *, tp: int = 1, dp: int = 1, ep: bool = False, rank: int = 0,
                mtp: bool = False, dtype: str | None = None, every_layer: bool = False) -> tuple[Shard, ...]:
    """The shards of vLLM worker ``rank`` (``d * tp + t``) of a model, as vLLM's loaders fill them.

    vLLM lays out a decoder layer by its kind (which roles it has: dense or MoE), not by its
    index, so by default the model is recorded with only as many layers as it takes to meet
    each kind once (DeepSeek-V3: its 3 dense layers and one MoE layer), and every other layer
    is its kind's recording renamed; ``every_layer`` records the whole model (a test checks
    both agree).

    Args:
        config: the Hugging Face ``config.json`` of the model.
        tp, dp, ep: tensor and data parallel sizes; ``ep`` is ``enable_expert_parallel``.
        rank: the worker's rank within one engine (``d * tp + t``).
        mtp: record the MTP drafter too (the engine runs MTP speculative decoding).
        dtype: the engine's dtype (default: the config's).
        every_layer: build and record every layer.

    Raises:
        NotImplementedError: a loader does more than view and copy a checkpoint tensor.
    """
    spec = ModelSpec.from_hf_config(config)
    dtype = dtype or spec.dtype
    key = (_digest(config), tp, dp, ep, rank, mtp, dtype, every_layer)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    kind_of = _layer_kinds(spec)
    kept = spec.num_layers if every_layer else max(kind_of) + 1
    small = dict(config) if kept == spec.num_layers else _truncated(config, kept)
    shards = _record_model(small, tp=tp, dp=dp, ep=ep, rank=rank, mtp=mtp, dtype=dtype)
    out = tuple(shards) if kept == spec.num_layers else tuple(_expand(shards, spec, kind_of, kept))
    _CACHE[key] = out
    return out


def _record_model(config: Mapping[str, Any], *, tp: int, dp: int, ep: bool, rank: int, mtp: bool,
                  dtype: str) -> list[Shard]:
    spec = ModelSpec.from_hf_config(config)
    vllm_config = _engine_config(json.dumps(dict(config), sort_keys=True), dtype, mtp)
    checkpoint = list(HFLayout(dtype=None).rank_layout(spec, 0).shards)
    main = [s for s in checkpoint if _layer(s.name) < spec.num_layers]
    with _parallel_groups(tp, dp, rank % tp, rank // tp):
        shards = _record(_build(vllm_config, vllm_config.model_config, ep), main)
        if mtp and spec.mtp_layers:
            draft = _build(vllm_config, vllm_config.speculative_config.draft_model_config, ep)
            # vLLM's proposer gives the drafter the target's embedding and output head
            shards += _record(draft, [s for s in checkpoint if _layer(s.name) >= spec.num_layers],
                              skip=("model.embed_tokens.", "lm_head."))
            shards = [s for s in shards if ".shared_head.head." not in s.name]
    return shards


def _layer_kinds(spec: ModelSpec) -> list[int]:
    """For each decoder layer, the first layer of its kind (the same roles)."""
    first: dict[tuple[str, ...], int] = {}
    return [first.setdefault(spec.layer_roles(layer), layer) for layer in range(spec.num_layers)]


def _truncated(config: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """``config`` with its first ``layers`` decoder layers (per-layer lists cut to match)."""
    out = {**config, "num_hidden_layers": layers}
    if isinstance(config.get("layer_types"), list):
        out["layer_types"] = config["layer_types"][:layers]
    if isinstance(config.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    return out


def _expand(shards: list[Shard], spec: ModelSpec, kind_of: list[int], kept: int) -> list[Shard]:
    """A truncated model's shards for the whole model: each layer is its kind's, renamed;
    the MTP layers (numbered from ``kept`` in the truncated model) move after the last layer."""
    by_layer: dict[int, list[Shard]] = {}
    outside: list[Shard] = []
    for shard in shards:
        layer = _layer(shard.name)
        (outside if layer < 0 else by_layer.setdefault(layer, [])).append(shard)
    out = outside[:1]  # the embedding
    for layer in range(spec.num_layers):
        out += [_renamed(s, kind_of[layer], layer) for s in by_layer[kind_of[layer]]]
    out += outside[1:]
    for j in range(spec.mtp_layers):
        out += [_renamed(s, kept + j, spec.num_layers + j) for s in by_layer.get(kept + j, [])]
    return out


def _renamed(shard: Shard, old: int, new: int) -> Shard:
    if old == new:
        return shard
    a, b = f"model.layers.{old}.", f"model.layers.{new}."
    regions = tuple(dataclasses.replace(r, canonical=b + r.canonical.removeprefix(a)) for r in shard.regions)
    return Shard(b + shard.name.removeprefix(a), shard.shape, shard.dtype, regions)


_CACHE: dict[tuple[Any, ...], tuple[Shard, ...]] = {}


def _layer(name: str) -> int:
    """The layer number of a checkpoint name (-1 outside the layers)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else -1


def buildable_config(spec: ModelSpec) -> dict[str, Any]:
    """``spec``'s config with the routing settings vLLM needs to build the model, which no weight depends on."""
    config = spec.to_hf_config()
    if spec.is_moe:
        top_k = min(2, spec.num_experts)
        config.update(num_experts_per_tok=top_k, experts_per_token=top_k, n_group=1, topk_group=1,
                      norm_topk_prob=True, hidden_act="silu")
        if spec.score_correction:
            config["scoring_func"] = "sigmoid"
    return config


def install() -> None:
    """Make the ``vllm`` layout kind ask vLLM's loaders (:func:`record_rank`) instead of its hand tables."""
    from weightsync.layout.kinds import vllm as kind

    def recorded(spec: ModelSpec, layout: Any, rank: int) -> list[Shard]:
        config = buildable_config(spec)
        local = rank % (layout.tp * layout.dp)
        return list(record_rank(config, tp=layout.tp, dp=layout.dp, ep=layout.ep > 1, rank=local,
                                mtp=bool(layout.mtp), dtype=layout.dtype))

    kind.use_recorder(recorded)


def digest(shards: tuple[Shard, ...] | list[Shard]) -> str:
    """A short hash of shards (names, shapes, dtypes, regions), to compare recordings."""
    h = hashlib.blake2b(digest_size=12)
    for s in shards:
        h.update(f"{s.name}{s.shape}{s.dtype}".encode())
        for r in s.regions:
            h.update(f"{r.canonical}{r.box}{r.offset}{r.strides}".encode())
    return h.hexdigest()

