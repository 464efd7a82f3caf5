"""The exact-bytes delta sequence that every one-sided transport carrying deltas passes, in one process.

One writer and one reader of tiny-qwen3 (HF layout, fp32) over a transport built by the test,
``delta_anchor_every=4``: the first version in full; 3 changed fp32 elements as one sparse
encoding (3 int32 indices + 3 values = 24 bytes); an unchanged version 0 bytes; a reader that
forgot its base, or missed a version, takes the version in full. Every version bitwise::

    with delta_pair(make_transport, tmp_path) as pair:   # make_transport(role, options) -> Transport
        run_exact_sequence(pair)

The transports differ only in how they are built, so the sequence is written once here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.clock.deadline import Deadline

#: Anchors: full versions at 1 and 5.
ANCHOR_EVERY = 4
#: 3 int32 indices + 3 fp32 values.
THREE_CHANGES_BYTES = 24


@dataclass
class DeltaPair:
    """A prepared writer and reader of one tiny plan, and the tensors they move."""

    writer: Any
    reader: Any
    src: dict[str, torch.Tensor]
    dst: dict[str, torch.Tensor]
    full: int  # the plan's bytes: what a full version moves

    def step(self, version: int, change: int = 0, *, receive: bool = True) -> int | None:
        """Change the first ``change`` elements, send ``version``; the bytes the reader took, or None."""
        next(iter(self.src.values()))[:change] += 1.0
        self.writer.send(version, deadline=Deadline.after(5))
        if not receive:
            return None
        moved = self.reader.receive(version, deadline=Deadline.after(5)).nbytes
        assert all(torch.equal(self.dst[n], self.src[n]) for n in self.src), version
        return moved


@contextlib.contextmanager
def delta_pair(make_transport: Callable[[str, dict[str, Any]], Any], **options: Any) -> Iterator[DeltaPair]:
    """A writer and a reader built by ``make_transport(role, options)`` with ``slots=2`` and
    ``delta_anchor_every=4`` added to ``options``, prepared on tiny-qwen3; closed on exit."""
    from weightsync.configs import load_spec
    from weightsync.layout import parse_layout
    from weightsync.plan import build_plan

    layouts = parse_layout("hf").all_rank_layouts(load_spec("tiny-qwen3"))
    plan = build_plan(layouts, layouts)
    options = {"slots": 2, "delta_anchor_every": ANCHOR_EVERY, **options}
    src = {s.name: torch.randn(s.numel, generator=torch.Generator().manual_seed(i))
           for i, s in enumerate(layouts[0].shards)}
    dst = {s.name: torch.zeros(s.numel) for s in layouts[0].shards}
    writer = make_transport("writer", options)
    reader = None
    try:
        reader = make_transport("reader", options)
        writer.prepare(plan, src, epoch=0, deadline=Deadline.after(10))
        reader.prepare(plan, dst, epoch=0, deadline=Deadline.after(10))
        yield DeltaPair(writer, reader, src, dst, plan.total_bytes)
    finally:
        writer.close()
        if reader is not None:
            reader.close()


def run_exact_sequence(pair: DeltaPair) -> None:
    """Seven versions: full, 24 bytes, 0 bytes, full after ``forget_received``, a missed version,
    full after it, 24 bytes again."""
    assert pair.step(1) == pair.full
    assert pair.step(2, change=3) == THREE_CHANGES_BYTES
    assert pair.step(3) == 0
    pair.reader.forget_received()  # the engine's version changed outside the reader
    assert pair.step(4, change=3) == pair.full
    pair.step(5, change=3, receive=False)  # missed: version 6's base is 5, the reader holds 4
    assert pair.step(6, change=3) == pair.full
    assert pair.step(7, change=3) == THREE_CHANGES_BYTES
