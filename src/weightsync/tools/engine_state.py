"""What an engine holds: every tensor reachable from its modules, found by walking them, and a diff.

An engine that reloads weights in place can keep stale copies anywhere: a module attribute
that aliases a parameter (an attention backend's ``sinks``), a config object built from the
parameters at start-up (a fused-MoE quant config holding the biases), a packed copy captured
in a closure (a CPU GEMM's packed weight). A comparison with a checkpoint sees none of them,
and a list of names would miss the next one. So the state of an engine is what a walk finds:

* every parameter and buffer of every module;
* every other attribute of a module, followed through containers (dicts, lists, tuples),
  plain objects (their ``__dict__`` and ``__slots__``), ``functools.partial`` and the cells of
  function closures, down to the tensors they hold. Modules reached this way are skipped
  (the module tree names them), and so is anything already visited.

A tensor is named by the path that reached it first (``model.layers.0.attn.attn.impl.sinks``,
``...quant_method.moe_quant_config._w1.bias``, ``lm_head.cpu_linear.<packed_weight>``).
Integer scalars are *opaque*: native handles (a oneDNN matmul handle is a pointer kept in an
int64 scalar) and counters, whose values are addresses or counts, not weights; they are listed,
never compared.

    live = tensor_state({"": model, "drafter": drafter})
    report = compare_states(live, fresh, others={"X": old})   # names each tensor that differs
    assert report.ok, report.describe()
    wire = digest_state(live)          # name -> TensorDigest, JSON-able, for another process

Two states compare tensor by tensor, bitwise: two engines loaded on the same weights by the
same code on the same machine hold the same bytes.
"""

from __future__ import annotations

import enum
import functools
import math
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.tools.codecs.digest import tensor_digest
from weightsync.tools.torch_layout import dtype_name

__all__ = ["StateDiff", "StateReport", "TensorDigest", "compare_states", "digest_state", "state_from_wire",
           "state_to_wire", "tensor_state"]

#: Attribute values that hold no tensor: never walked.
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type, enum.Enum, torch.dtype, torch.device,
           torch.Size, types.ModuleType, types.BuiltinFunctionType, range, slice)
#: A walk this deep into objects from one module attribute finds nothing more in practice;
#: the bound keeps a pathological object graph from taking forever.
MAX_DEPTH = 12


@dataclass(frozen=True, slots=True)
class TensorDigest:
    """A tensor summarised for a comparison across processes: shape, dtype, and its bytes' digest
    (``sum64``: the same value on a CPU and a GPU, computed where the tensor lives)."""

    shape: tuple[int, ...]
    dtype: str
    digest: int

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorDigest:
        value = 0 if t.is_meta else tensor_digest(t.detach(), "sum64").value
        return cls(tuple(int(n) for n in t.shape), dtype_name(t.dtype), value)

    def to_wire(self) -> list[Any]:
        return [list(self.shape), self.dtype, f"{self.digest:016x}"]

    @classmethod
    def from_wire(cls, doc: Any) -> TensorDigest:
        try:
            shape, dtype, digest = doc
            return cls(tuple(int(n) for n in shape), str(dtype), int(str(digest), 16))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a tensor digest is [shape, dtype, hex digest], got {doc!r}") from exc


def is_opaque(t: torch.Tensor) -> bool:
    """Integer scalars hold handles and counters, not weights (see the module docstring)."""
    return t.dim() == 0 and not (t.is_floating_point() or t.is_complex())


def tensor_state(roots: Mapping[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every tensor reachable from the modules of ``roots`` (prefix -> root module), by path.

    Prefixes are prepended to module paths (``""``: none; ``"drafter"``: ``drafter.model...``).
    Tensors are returned by reference: read them, do not keep them past the engine's next update.
    """
    walker = _Walker()
    for prefix, root in roots.items():
        for path, module in root.named_modules(remove_duplicate=False):
            walker.module(_join(prefix, path), module)
    return walker.found


class _Walker:
    def __init__(self) -> None:
        self.found: dict[str, torch.Tensor] = {}
        self._seen: set[int] = set()

    def module(self, path: str, module: torch.nn.Module) -> None:
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None:
                self.found.setdefault(_join(path, name), t)
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules") or "hook" in key:
                continue
            self.value(_join(path, key), value, 0)

    def value(self, path: str, value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            self.found.setdefault(path, value)
            return
        if value is None or isinstance(value, (*_LEAVES, torch.nn.Module)) or depth > MAX_DEPTH:
            return
        if id(value) in self._seen:
            return
        self._seen.add(id(value))
        for sub, item in _children(value):
            self.value(path + sub, item, depth + 1)


def _children(value: Any) -> Iterable[tuple[str, Any]]:
    """(path suffix, child) of one object: what a walk follows."""
    if isinstance(value, Mapping):
        return [(f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return []  # unordered: no stable names (weights are not kept in sets)
    if isinstance(value, functools.partial):
        return [(".<func>", value.func), (".<args>", value.args), (".<keywords>", value.keywords)]
    if isinstance(value, types.FunctionType):
        cells = zip(value.__code__.co_freevars, value.__closure__ or (), strict=True)
        return [(f".<{name}>", _cell(cell)) for name, cell in cells]
    if isinstance(value, (types.MethodType, types.BuiltinMethodType)):
        return []  # its __self__ is walked where it is held
    out: list[tuple[str, Any]] = []
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        out += [(f".{k}", v) for k, v in attrs.items()]
    for cls in type(value).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                out.append((f".{slot}", getattr(value, slot)))
    return out


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


# -- comparison --------------------------------------------------------------------------------------

State = Mapping[str, "torch.Tensor | TensorDigest"]


@dataclass(frozen=True, slots=True)
class StateDiff:
    """One tensor that differs between a live engine and its reference.

    ``status``: ``values`` (same shape and dtype, other bytes), ``shape``, ``dtype``, ``missing``
    (the reference holds it, the live engine does not) or ``extra`` (the other way round).
    ``max_abs_diff`` when both tensors were at hand (NaN otherwise); ``equals``: the names of
    ``others`` states the live tensor is bitwise equal to (e.g. the checkpoint it held before).
    """

    name: str
    status: str
    detail: str = ""
    max_abs_diff: float = math.nan
    equals: tuple[str, ...] = ()

    def describe(self) -> str:
        said = f"{self.name}: {self.status}"
        if self.detail:
            said += f" ({self.detail})"
        if not math.isnan(self.max_abs_diff):
            said += f", max |live - reference| {self.max_abs_diff:.4g}"
        if self.equals:
            said += f", equal to {', '.join(self.equals)}"
        return said


@dataclass(slots=True)
class StateReport:
    """A live engine's state against a reference (a fresh engine on the same weights)."""

    compared: int = 0
    diffs: list[StateDiff] = field(default_factory=list)
    #: integer scalars (handles, counters) on either side: listed, not compared
    opaque: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.diffs

    def names(self) -> list[str]:
        return [d.name for d in self.diffs]

    def describe(self, limit: int = 40) -> str:
        if self.ok:
            return f"all {self.compared} tensors equal the reference's ({len(self.opaque)} opaque handles skipped)"
        lines = [f"{len(self.diffs)} of {self.compared} tensors differ from the reference:"]
        lines += [f"  {d.describe()}" for d in self.diffs[:limit]]
        if len(self.diffs) > limit:
            lines.append(f"  ... and {len(self.diffs) - limit} more")
        return "\n".join(lines)

    def to_wire(self) -> dict[str, Any]:
        return {"ok": self.ok, "compared": self.compared, "opaque": len(self.opaque),
                "diffs": [{"name": d.name, "status": d.status, "detail": d.detail,
                           "max_abs_diff": None if math.isnan(d.max_abs_diff) else d.max_abs_diff,
                           "equals": list(d.equals)} for d in self.diffs]}


def compare_states(live: State, reference: State, *, others: Mapping[str, State] | None = None) -> StateReport:
    """Every tensor of ``live`` against ``reference``'s of the same name, bitwise.

    Either side may hold tensors or :class:`TensorDigest` values (a state read in another
    process); with tensors on both sides a difference also says its largest magnitude.
    """
    report = StateReport()
    others = others or {}
    for name in sorted(live.keys() | reference.keys()):
        a, b = live.get(name), reference.get(name)
        if _opaque(a) or _opaque(b):
            report.opaque.append(name)
            continue
        report.compared += 1
        if a is None or b is None:
            report.diffs.append(StateDiff(name, "extra" if b is None else "missing",
                                          "only the live engine holds it" if b is None
                                          else "only the reference holds it"))
            continue
        diff = _compare(name, a, b)
        if diff is not None:
            equals = tuple(label for label, state in others.items()
                           if name in state and _compare(name, a, state[name]) is None)
            report.diffs.append(StateDiff(diff.name, diff.status, diff.detail, diff.max_abs_diff, equals))
    return report


def _opaque(v: torch.Tensor | TensorDigest | None) -> bool:
    if isinstance(v, torch.Tensor):
        return is_opaque(v)
    return v is not None and v.shape == () and not v.dtype.startswith(("float", "bfloat", "complex"))


def _compare(name: str, a: torch.Tensor | TensorDigest, b: torch.Tensor | TensorDigest) -> StateDiff | None:
    da = a if isinstance(a, TensorDigest) else TensorDigest(tuple(a.shape), dtype_name(a.dtype), 0)
    db = b if isinstance(b, TensorDigest) else TensorDigest(tuple(b.shape), dtype_name(b.dtype), 0)
    if da.shape != db.shape:
        return StateDiff(name, "shape", f"{da.shape} against {db.shape}")
    if da.dtype != db.dtype:
        return StateDiff(name, "dtype", f"{da.dtype} against {db.dtype}")
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.is_meta or b.is_meta:
            return None if a.is_meta and b.is_meta else StateDiff(name, "values", "one side is on the meta device")
        x, y = a.detach(), b.detach().to(a.device)
        if _same_bytes(x, y):
            return None
        from weightsync.tools.verify import differences

        delta = differences(x.cpu(), y.cpu(), 0.0) if x.numel() else torch.zeros(0)
        differing = int((delta > 0).sum())
        return StateDiff(name, "values", f"{differing} of {x.numel()} elements",
                         float(delta.max()) if delta.numel() else 0.0)
    ga = TensorDigest.of(a).digest if isinstance(a, torch.Tensor) else da.digest
    gb = TensorDigest.of(b).digest if isinstance(b, torch.Tensor) else db.digest
    return None if ga == gb else StateDiff(name, "values", "other bytes")


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.numel() == 0:
        return True
    bx = x.contiguous().reshape(-1).view(torch.uint8)
    by = y.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(bx, by))


def digest_state(state: Mapping[str, torch.Tensor]) -> dict[str, TensorDigest]:
    """Each tensor's :class:`TensorDigest` (no tensor leaves the process)."""
    return {name: TensorDigest.of(t) for name, t in state.items()}


def state_to_wire(state: Mapping[str, TensorDigest]) -> dict[str, list[Any]]:
    return {name: d.to_wire() for name, d in state.items()}


def wire_digests(state: State) -> dict[str, list[Any]]:
    """A state read by reference or as digests (:data:`State`), as the wire form of its digests."""
    return state_to_wire({name: v if isinstance(v, TensorDigest) else TensorDigest.of(v) for name, v in state.items()})


def state_from_wire(doc: Any) -> dict[str, TensorDigest]:
    if not isinstance(doc, Mapping):
        raise ValueError(f"an engine state on the wire is a mapping of tensor name to digest, got {type(doc).__name__}")
    return {str(name): TensorDigest.from_wire(d) for name, d in doc.items()}
