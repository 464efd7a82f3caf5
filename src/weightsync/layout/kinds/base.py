"""The contract every parallel layout kind fulfils, and the ``kind:k=v,...`` parser.

A layout kind (``megatron``, ``vllm``, ``fsdp``, ...) is a small frozen dataclass of
integer options. Given a :class:`ModelSpec` it says how many ranks the layout has and
which shards each rank holds. Layouts are pure functions of (spec, options, rank), so a
participant can describe all its ranks with one short string, and every other rank can
expand that string into exactly the same shards (that is what keeps the meta server's
traffic small at a thousand ranks).

    layout = parse_layout("megatron:tp=2,pp=2")
    layout.validate(spec)            # ValueError naming what does not divide
    rank_layout = layout.rank_layout(spec, rank=3)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar

from weightsync.layout.columns import layout_columns
from weightsync.layout.kinds.pieces import Piece, assemble
from weightsync.layout.model import ModelSpec
from weightsync.layout.quant_block import check_quant, reader_canonical, reader_shards
from weightsync.layout.roster import Roster
from weightsync.layout.types import DTYPE_ITEMSIZE, CanonicalTensor, RankLayout, Shard


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutKind:
    """Base of all layout kinds. Subclasses declare integer fields with defaults."""

    kind: ClassVar[str] = ""
    #: Local dtype of every shard; ``None`` means the model's dtype.
    dtype: str | None = None
    #: FP8 weights (``fp8_block``, ``fp8_channel``: see ``layout.quant``); readers only.
    quant: str | None = None
    #: whether the kind describes an engine that can serve FP8 weights
    supports_quant: ClassVar[bool] = False

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def validate(self, spec: ModelSpec) -> None:
        """Raise ValueError (naming the option and the model dimension) if impossible."""

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        raise NotImplementedError

    def shard_key(self, rank: int) -> Hashable:
        """Ranks with equal keys hold identical shards (replicas); they share one template."""
        return rank

    def pieces(self, spec: ModelSpec, rank: int) -> list[Piece] | None:
        """The rank's shards as pieces (:mod:`weightsync.layout.kinds.pieces`), or None when the
        kind builds whole ranks only. A kind that returns pieces builds them in :meth:`build_piece`."""
        return None

    def build_piece(self, spec: ModelSpec, piece: Piece) -> list[Shard]:
        raise NotImplementedError(f"{self.kind}: pieces() without build_piece()")

    def piece_shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        """A rank's shards from its pieces (each piece built once per layout and model)."""
        built = memo(self, spec, "pieces")
        out: list[Shard] = []
        for piece in self.pieces(spec, rank) or ():
            shards = built.get(piece)
            if shards is None:
                shards = built[piece] = self.build_piece(spec, piece)
            out.extend(shards)
        return out

    def roster(self, spec: ModelSpec, ranks: Sequence[int] | None = None) -> Roster:
        """Every rank's layout (or ``ranks``'), as columns: what a job's planning reads.

        A kind that describes ranks as pieces builds each piece once and renames it for the
        other layers (:func:`~weightsync.layout.kinds.pieces.assemble`); any other is built from
        its rank layouts, one template per :meth:`shard_key`. The same for the same inputs
        (cached per layout and model).
        """
        self.validate(spec)
        cache = memo(self, spec, "roster")
        whole = cache.get("all")
        if whole is None:
            everyone = range(self.world_size)
            if self.pieces(spec, 0) is None:
                whole = Roster.from_layouts([self.rank_layout(spec, r) for r in everyone])
            elif self.quant:
                quant = self.quant
                whole = assemble(self, spec, everyone, reader_canonical(spec, quant),
                                 lambda shards: reader_shards(shards, spec, quant))
            else:
                whole = assemble(self, spec, everyone, spec.canonical_tensors())
            cache["all"] = whole
        if ranks is None:
            return whole  # type: ignore[no-any-return]
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"{self.describe()}: rank {bad[0]} is outside world size {self.world_size}")
        return whole.select(ranks)  # type: ignore[no-any-return]

    def rank_layout(self, spec: ModelSpec, rank: int) -> RankLayout:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.describe()}: rank {rank} is outside world size {self.world_size}")
        templates = memo(self, spec, "rank_layouts")
        key = self.shard_key(rank)
        template = templates.get(key)
        if template is None:
            if self.quant:
                template = RankLayout(rank, tuple(reader_shards(self.shards(spec, rank), spec, self.quant)),
                                      reader_canonical(spec, self.quant))
            else:
                template = RankLayout(rank, tuple(self.shards(spec, rank)), spec.canonical_tensors())
            layout_columns(template)  # validate once; ranks sharing the template share the result
            templates[key] = template
        return template if template.rank == rank else template.with_rank(rank)

    def attachments(self) -> tuple[str, ...]:
        """Names of the data a descriptor of this layout carries beside its text (the expert
        placements of ``weightsync.layout.eplb``)."""
        return ()

    def all_rank_layouts(self, spec: ModelSpec) -> list[RankLayout]:
        self.validate(spec)
        return [self.rank_layout(spec, r) for r in range(self.world_size)]

    def local_dtype(self, tensor: CanonicalTensor) -> str:
        return self.dtype or tensor.dtype

    def describe(self) -> str:
        """The canonical ``kind:k=v,...`` string (non-default options, sorted)."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default and f.init:
                parts.append(f"{f.name}={value}")
        return f"{self.kind}:{','.join(sorted(parts))}" if parts else self.kind

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.init:
                continue
            if f.name == "dtype":
                if value is not None and value not in DTYPE_ITEMSIZE:
                    raise ValueError(f"{self.kind}: dtype={value} is not one of {sorted(DTYPE_ITEMSIZE)}")
            elif f.name == "quant":
                if value is not None:
                    check_quant(value)
                    if not self.supports_quant:
                        raise ValueError(f"{self.kind}: quant= is for quantized readers (hf, vllm), "
                                         "not a training layout")
            elif isinstance(value, int) and value < 1 and not (value == 0 and f.default == 0):
                # A field defaulting to 0 means "derive it"; any other int must be >= 1.
                raise ValueError(f"{self.kind}: {f.name} must be >= 1, got {value}")


@functools.lru_cache(maxsize=32)
def _memo_tables(kind: LayoutKind, spec: ModelSpec) -> dict[str, dict[Hashable, Any]]:
    return {}


def memo(kind: LayoutKind, spec: ModelSpec, table: str) -> dict[Hashable, Any]:
    """A per-(layout, model) cache: layouts are pure, so equal inputs give equal shards."""
    return _memo_tables(kind, spec).setdefault(table, {})


_REGISTRY: dict[str, type[LayoutKind]] = {}


def register_kind(cls: type[LayoutKind]) -> type[LayoutKind]:
    """Class decorator adding a layout kind to :func:`parse_layout`."""
    _REGISTRY[cls.kind] = cls
    return cls


def known_kinds() -> Mapping[str, type[LayoutKind]]:
    return dict(_REGISTRY)


def parse_layout(text: str) -> LayoutKind:
    """Parse ``kind:k=v,k=v`` (e.g. ``megatron:tp=8,pp=4``) into a layout kind.

    Raises ValueError naming the unknown kind or option and listing the valid ones.
    """
    kind, _, rest = text.strip().partition(":")
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise ValueError(f"unknown layout kind {kind!r} in {text!r}; known: {sorted(_REGISTRY)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"layout option {item!r} in {text!r} is not of the form key=value")
        if key not in fields:
            raise ValueError(
                f"layout kind {kind!r} has no option {key!r}; options: {sorted(fields)}"
            )
        if not isinstance(fields[key].default, int):  # dtype, quant, a placement: text
            kwargs[key] = value
            continue
        try:
            kwargs[key] = int(value)
        except ValueError:
            raise ValueError(f"layout option {key}={value!r} in {text!r} is not an integer") from None
    return cls(**kwargs)
