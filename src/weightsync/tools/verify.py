"""Validation: compare an engine's weights, through its canonical view, with a checkpoint.

Tensor by tensor, for every region an engine rank holds, the local view is compared with
the same box of the checkpoint tensor (read with ``safe_open(...).get_slice``, so only the
needed bytes are loaded). Reports list missing tensors (in the checkpoint, covered by no
rank), extra tensors (held by the engine, absent from the checkpoint), shape and dtype
mismatches, and the maximum absolute difference. Nothing is ever written: validation is
safe on a live engine.

    report = verify_rank(engine.layout(), engine.receive_buffers(), "/ckpt")
    report = merge_reports([report_rank0, report_rank1])     # coverage across ranks
    assert report.ok, report.to_json()

Canonical expert stacks (``...experts.*.gate_proj.weight``) are checked against the
per-expert checkpoint tensors (``...experts.7.gate_proj.weight``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weightsync.layout import Box, RankLayout, expert_name, is_expert_stack

#: safetensors dtype codes -> our dtype names.
_ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    file: str
    shape: tuple[int, ...]
    dtype: str


def checkpoint_index(directory: str | os.PathLike[str]) -> dict[str, CheckpointEntry]:
    """Every tensor of the ``*.safetensors`` files in ``directory`` (headers only)."""
    directory = os.fspath(directory)
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {directory!r}")
    out: dict[str, CheckpointEntry] = {}
    for name in files:
        path = os.path.join(directory, name)
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = f.get_slice(key)
                out[key] = CheckpointEntry(path, tuple(sl.get_shape()), _ST_NAMES.get(sl.get_dtype(), sl.get_dtype()))
    return out


@dataclass(slots=True)
class TensorCheck:
    """The comparison of one canonical tensor (over the boxes checked)."""

    name: str
    status: str  # ok | mismatch | shape_mismatch | extra | missing
    checked_elements: int = 0
    differing_elements: int = 0
    max_abs_diff: float = 0.0
    engine_dtype: str = ""
    checkpoint_dtype: str = ""
    detail: str = ""


@dataclass(slots=True)
class VerifyReport:
    """The result of a verification; ``ok`` only if every tensor matched and none is missing."""

    tensors: dict[str, TensorCheck] = field(default_factory=dict)
    #: checkpoint name -> boxes (in checkpoint coordinates) the engine's regions cover
    covered: dict[str, list[Box]] = field(default_factory=dict)
    checkpoint: dict[str, CheckpointEntry] = field(default_factory=dict)
    atol: float = 0.0

    @property
    def matches(self) -> bool:
        """Every region checked equals the checkpoint (one rank's view; coverage not required)."""
        return all(t.status == "ok" for t in self.tensors.values())

    @property
    def ok(self) -> bool:
        """Matches, and the regions cover every checkpoint tensor (a whole engine's view)."""
        return self.matches and not self.missing()

    def missing(self) -> list[str]:
        """Checkpoint tensors not fully covered by the engine's regions."""
        out = []
        for name, entry in self.checkpoint.items():
            if union_volume(self.covered.get(name, [])) < math.prod(entry.shape):
                out.append(name)
        return sorted(out)

    def summary(self) -> dict[str, Any]:
        statuses: dict[str, int] = {}
        for t in self.tensors.values():
            statuses[t.status] = statuses.get(t.status, 0) + 1
        worst = max((t.max_abs_diff for t in self.tensors.values()), default=0.0)
        return {"ok": self.ok, "tensors": len(self.tensors), "statuses": statuses,
                "missing": len(self.missing()), "max_abs_diff": worst, "atol": self.atol}

    def to_json(self) -> str:
        return json.dumps({
            "summary": self.summary(),
            "missing": self.missing(),
            "problems": [vars_of(t) for t in self.tensors.values() if t.status != "ok"],
            "tensors": [vars_of(t) for t in self.tensors.values()],
        }, indent=2)


def vars_of(check: TensorCheck) -> dict[str, Any]:
    return {f: getattr(check, f) for f in TensorCheck.__slots__}  # type: ignore[attr-defined]


def _checkpoint_boxes(name: str, box: Box) -> Iterable[tuple[str, tuple[slice, ...], tuple[slice, ...]]]:
    """(checkpoint key, slices into that tensor, slices into the region) for a canonical box."""
    if not is_expert_stack(name):
        yield name, box.slices(), tuple(slice(None) for _ in box.sizes)
        return
    inner = Box(box.offsets[1:], box.sizes[1:]).slices()
    for i in range(box.sizes[0]):
        yield expert_name(name, box.offsets[0] + i), inner, (slice(i, i + 1),) + tuple(slice(None) for _ in inner)


def verify_rank(layout: RankLayout, tensors: Mapping[str, torch.Tensor], checkpoint_dir: str | os.PathLike[str], *,
                atol: float = 0.0, index: Mapping[str, CheckpointEntry] | None = None) -> VerifyReport:
    """Compare every region of one rank with the checkpoint (read-only on both sides)."""
    index = dict(index) if index is not None else checkpoint_index(checkpoint_dir)
    comparer = _Comparer(VerifyReport(checkpoint=dict(index), atol=atol), index)
    try:
        for shard in layout.shards:
            local = tensors.get(shard.name)
            if local is None:
                raise ValueError(f"rank {layout.rank}: no tensor given for shard {shard.name!r}")
            flat = local.detach().reshape(-1)
            for region in shard.regions:
                view = flat.as_strided(region.box.sizes, region.strides, flat.storage_offset() + region.offset)
                for key, ck_slices, region_slices in _checkpoint_boxes(region.canonical, region.box):
                    comparer.compare(key, view[region_slices], ck_slices, shard.dtype)
    finally:
        comparer.close()
    return comparer.report


class _Comparer:
    """Compares views with checkpoint slices, keeping one open handle per file."""

    def __init__(self, report: VerifyReport, index: Mapping[str, CheckpointEntry]) -> None:
        self.report = report
        self.index = index
        self.handles: dict[str, Any] = {}

    def compare(self, key: str, got: torch.Tensor, slices: tuple[slice, ...], engine_dtype: str) -> None:
        entry = self.index.get(key)
        check = self.report.tensors.setdefault(key, TensorCheck(key, "ok", engine_dtype=engine_dtype,
                                                                checkpoint_dtype=entry.dtype if entry else ""))
        if entry is None:
            check.status, check.detail = "extra", "held by the engine but absent from the checkpoint"
            return
        bounds = [(s.start or 0, s.stop if s.stop is not None else dim)
                  for s, dim in zip(slices, entry.shape, strict=False)]
        if len(slices) != len(entry.shape) or any(hi > dim for (_, hi), dim in zip(bounds, entry.shape, strict=False)):
            check.status = "shape_mismatch"
            check.detail = f"engine maps slices {bounds} onto a checkpoint tensor of shape {entry.shape}"
            return
        handle = self.handles.get(entry.file)
        if handle is None:
            handle = safe_open(entry.file, framework="pt")
            handle.__enter__()
            self.handles[entry.file] = handle
        want = handle.get_slice(key)[slices]
        got = got.detach().cpu()  # an engine's weights may live on a GPU; the checkpoint is read to host memory
        diff = differences(got.reshape(want.shape), want, self.report.atol)
        differing = int((diff > self.report.atol).sum())
        check.checked_elements += got.numel()
        check.differing_elements += differing
        check.max_abs_diff = max(check.max_abs_diff, float(diff.max()) if diff.numel() else 0.0)
        if differing and check.status == "ok":
            check.status = "mismatch"
        self.report.covered.setdefault(key, []).append(
            Box(tuple(lo for lo, _ in bounds), tuple(hi - lo for lo, hi in bounds)))

    def close(self) -> None:
        for h in self.handles.values():
            h.__exit__(None, None, None)
        self.handles.clear()


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def differences(got: torch.Tensor, want: torch.Tensor, atol: float) -> torch.Tensor:
    """``|got - want|`` element by element, where a NaN never passes for a number.

    ``(got - want).abs() > atol`` is False for NaN, so an engine full of NaN would verify.
    Here a NaN on either side is ``inf`` (a mismatch), unless both sides hold a NaN in the
    same place, bitwise when the dtypes agree; equal infinities are 0 (``inf - inf`` is NaN).
    """
    g, w = got.double(), want.double()
    diff = (g - w).abs()
    g_nan, w_nan = g.isnan(), w.isnan()
    same_nan = g_nan & w_nan
    if got.dtype == want.dtype and got.element_size() in _BITS and same_nan.any():
        bits = _BITS[got.element_size()]
        same_nan &= got.contiguous().view(bits) == want.contiguous().view(bits)
    diff = torch.where(g_nan | w_nan, torch.where(same_nan, 0.0, math.inf), diff)
    return torch.where(g.isinf() & (g == w), 0.0, diff)


def union_volume(boxes: list[Box]) -> int:
    """Elements covered by the union of boxes (coordinate compression; replicas count once)."""
    if not boxes:
        return 0
    ndim = boxes[0].ndim
    if ndim == 0:
        return 1
    cuts = [sorted({b.offsets[d] for b in boxes} | {b.ends[d] for b in boxes}) for d in range(ndim)]
    grid = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.bool)
    for b in boxes:
        idx = tuple(slice(cuts[d].index(b.offsets[d]), cuts[d].index(b.ends[d])) for d in range(ndim))
        grid[idx] = True
    widths = [torch.tensor([hi - lo for lo, hi in zip(c[:-1], c[1:], strict=True)], dtype=torch.float64)
              for c in cuts]
    cell = widths[0]
    for w in widths[1:]:
        cell = torch.outer(cell.reshape(-1), w).reshape(*cell.shape, len(w))
    return int((cell * grid).sum().item())


def merge_reports(reports: Iterable[VerifyReport]) -> VerifyReport:
    """Combine per-rank reports; coverage adds up across ranks (replicas count once per box)."""
    merged = VerifyReport()
    for r in reports:
        merged.checkpoint.update(r.checkpoint)
        merged.atol = max(merged.atol, r.atol)
        for name, check in r.tensors.items():
            m = merged.tensors.setdefault(name, TensorCheck(name, "ok", engine_dtype=check.engine_dtype,
                                                           checkpoint_dtype=check.checkpoint_dtype))
            m.checked_elements += check.checked_elements
            m.differing_elements += check.differing_elements
            m.max_abs_diff = max(m.max_abs_diff, check.max_abs_diff)
            if check.status != "ok" and m.status == "ok":
                m.status, m.detail = check.status, check.detail
        for name, boxes in r.covered.items():
            merged.covered.setdefault(name, []).extend(boxes)
    return merged


def save_canonical(values: Mapping[str, torch.Tensor], directory: str | os.PathLike[str],
                   *, filename: str = "model.safetensors") -> str:
    """Write canonical tensors as a Hugging Face checkpoint (expert stacks split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in values.items():
        if is_expert_stack(name):
            for e in range(tensor.shape[0]):
                out[expert_name(name, e)] = tensor[e].contiguous()
        else:
            out[name] = tensor.contiguous()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(os.fspath(directory), filename)
    save_file(out, path)
    return path


def dump_rank(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Save one rank's local tensors (by local name) for offline ``weightsync verify``."""
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, os.fspath(path))
