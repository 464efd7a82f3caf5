"""One rank's share of a job: everyone's layouts decoded from the roster, and this rank's part of
the plan from them (:class:`~weightsync.session.sync_session.SyncSession` plans with these; a
reader joining an elastic set plans with them against the writers before it joins)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from weightsync.job.wire import Member
from weightsync.layout.quant_block_offers import block_sources
from weightsync.layout.quant_offers import quantized_sources
from weightsync.layout.roster import Roster
from weightsync.layout.wire import LayoutDecoder
from weightsync.plan import PlanOptions, build_local_plan
from weightsync.plan.ops import Role

if TYPE_CHECKING:
    import torch

    from weightsync.plan import Plan
    from weightsync.tools.codecs.fp8 import Exchange


class Quantizer(Protocol):
    """A writer's quantize-on-send (FP8: ``codecs.fp8.WriterQuantizer``; MXFP8/MXFP4/NVFP4:
    ``codecs.mx.BlockQuantizer``): this version's derived tensors from the source's."""

    def derive(self, tensors: Mapping[str, torch.Tensor], exchange: Exchange) -> dict[str, torch.Tensor]: ...


def decode_roster(people: Sequence[Member], load_model: Callable[[str], Mapping[str, Any]]
                  ) -> tuple[Roster, Roster]:
    """Every writer's and reader's layout from the roster, as columns (``load_model``: model config by digest).

    Ranks publishing one descriptor are built together by their layout kind, with no object per
    rank (:class:`~weightsync.layout.roster.Roster`).
    """
    models: dict[str, Mapping[str, Any]] = {}

    def model(digest: str) -> Mapping[str, Any]:
        if digest not in models:
            models[digest] = load_model(digest)
        return models[digest]

    decode = LayoutDecoder(model)
    sides = []
    for role in ("writer", "reader"):
        members = [(p.rank, p.layout) for p in people if p.role == role]
        sides.append(decode.roster(members) if members else Roster.from_layouts([]))
    return sides[0], sides[1]


def plan_share(writers: Roster, readers: Roster, *, role: Role, rank: int, options: PlanOptions,
               timings: dict[str, float] | None = None, previous: Plan | None = None
               ) -> tuple[Plan, Roster, Quantizer | None]:
    """One rank's share of the job from everyone's layouts, as :meth:`SyncSession.plan` computes it.

    Returns this rank's plan, the writers as planned (with FP8 twins and scale shards when
    readers ask for FP8) and, for a writer that sends FP8, its quantizer. ``timings``
    receives the seconds of each step: ``fp8_offers``, ``local_plan``, ``quantizer``.
    ``previous``: this rank's plan before readers' layouts changed, with the same ``writers``
    roster (see :func:`~weightsync.plan.build_local_plan`).
    """
    times = timings if timings is not None else {}
    t0 = time.perf_counter()
    planned, quant = quantized_sources(writers, readers)  # FP8 readers: writers quantize on send
    planned, blocks = block_sources(planned, readers)  # MXFP8, MXFP4, NVFP4 readers likewise
    if quant and blocks:
        raise ValueError(f"readers ask for FP8 ({', '.join(sorted({t.scheme.name for t in quant.tensors.values()}))}) "
                         f"and {', '.join(sorted({o.tensor.scheme.name for o in blocks.offers.values()}))} in one "
                         "job: one quantized format per job (run a job per format)")
    t1 = time.perf_counter()
    plan = build_local_plan(planned, readers, role=role, rank=rank, options=options, previous=previous)
    t2 = time.perf_counter()
    quantizer: Quantizer | None = None
    if quant and role == "writer":
        from weightsync.tools.codecs.fp8 import WriterQuantizer

        fp8 = WriterQuantizer(quant, planned.layout(rank), plan)  # objects for this rank only
        quantizer = fp8 if fp8.active else None
    elif blocks and role == "writer":
        from weightsync.tools.codecs.mx import BlockQuantizer

        block = BlockQuantizer(blocks, rank=rank)
        quantizer = block if block.active else None
    times.update(fp8_offers=t1 - t0, local_plan=t2 - t1, quantizer=time.perf_counter() - t2)
    return plan, planned, quantizer


__all__ = ["Quantizer", "decode_roster", "plan_share"]
