"""What the sharded training adapters (DTensor, ZeRO-3, Megatron) share.

Each adapter walks its framework's parameters once, maps every parameter name to
:class:`~weightsync.layout.params.ParamParts` and asks the framework which boxes of the
parameter the rank holds. This module holds the pieces around that walk: reading the
model config, cleaning wrapper prefixes off names, the error for names no canonical tensor
matches, and the compact descriptor a rank may publish when its layout equals a layout
kind's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from weightsync.layout import ModelSpec, RankLayout, parse_layout

logger = logging.getLogger(__name__)

#: Module-name segments wrappers insert (torch.compile, activation checkpointing, FSDP1).
WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def read_config(config: Mapping[str, Any] | ModelSpec) -> tuple[ModelSpec, dict[str, Any]]:
    """(spec, HF config dict) from either form."""
    if isinstance(config, ModelSpec):
        return config, config.to_hf_config()
    return ModelSpec.from_hf_config(config), dict(config)


def clean_name(name: str) -> str:
    """A parameter name without the segments wrappers insert."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def check_known(unknown: Sequence[str], spec: ModelSpec, what: str) -> None:
    """Raise a ValueError listing the parameters that map to no canonical tensor.

    Nothing is skipped silently: a parameter the inference engine would miss is a bug.
    """
    if unknown:
        raise ValueError(
            f"{len(unknown)} {what} parameter(s) match no canonical tensor of the {spec.family} model: "
            f"{list(unknown[:8])}{' ...' if len(unknown) > 8 else ''}. Check that the HF config matches the "
            "model, and that the names are the framework's own (no extra wrapper prefix)."
        )


def same_layout(a: RankLayout, b: RankLayout) -> bool:
    """Whether two layouts hold the same shards (regions compared as sets)."""
    def key(layout: RankLayout) -> dict[str, Any]:
        return {s.name: (s.shape, s.dtype, frozenset(s.regions)) for s in layout.shards}
    return len(a.shards) == len(b.shards) and key(a) == key(b)


def matching_descriptor(layout: RankLayout, spec: ModelSpec, config: Mapping[str, Any],
                        candidates: Iterable[str]) -> tuple[str, Mapping[str, object]] | None:
    """The first candidate layout kind whose shards on ``layout.rank`` equal ``layout``'s.

    A match lets the rank publish one short string instead of its shard list.
    """
    for text in candidates:
        try:
            kind = parse_layout(text)
            kind.validate(spec)
            if layout.rank < kind.world_size and same_layout(kind.rank_layout(spec, layout.rank), layout):
                return kind.describe(), config
        except ValueError:
            continue
    logger.debug("rank %d: layout matches none of the candidate kinds; publishing shards", layout.rank)
    return None


def uniform_dtype(layout: RankLayout, spec: ModelSpec) -> str:
    """``,dtype=X`` when every shard holds dtype X other than the model's, else ``""``."""
    dtypes = {s.dtype for s in layout.shards}
    if len(dtypes) == 1 and (dtype := dtypes.pop()) != spec.dtype:
        return f",dtype={dtype}"
    return ""
