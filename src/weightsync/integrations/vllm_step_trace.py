"""Timestamps of a vLLM worker's forwards and weight-update calls, for the engine's pause.

``weightsync bench --suite vllm-prefetch`` (path ``serve``) sets :data:`ENV` to a file for the
``vllm serve`` it starts; the ``"weightsync"`` backend then appends one line per event to it:
``<time.monotonic()> <event>``, where the event is ``forward+`` / ``forward-`` (the model's
forward began / ended: one engine step) or ``<call>+`` / ``<call>-`` for the backend's
``start_weight_update``, ``update_weights`` and ``finish_weight_update``. ``time.monotonic`` is
the system's CLOCK_MONOTONIC, so these times compare with the trainer's and the clients'. From
them the bench tells how long the engine did not step around each update, against the apply
(:func:`engine_pauses`). Unset (everywhere but that bench), nothing is installed.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

#: the trace file's path; unset: no trace
ENV = "WEIGHTSYNC_VLLM_STEP_TRACE"


class StepTrace:
    """Appends ``<monotonic time> <event>`` lines to a file, one write per event (line-buffered)."""

    def __init__(self, path: str) -> None:
        self.file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 - open for the worker's lifetime

    def mark(self, event: str) -> None:
        self.file.write(f"{time.monotonic():.6f} {event}\n")

    @contextlib.contextmanager
    def span(self, call: str) -> Iterator[None]:
        self.mark(call + "+")
        try:
            yield
        finally:
            self.mark(call + "-")


def install(model: Any) -> StepTrace | None:
    """A :class:`StepTrace` marking ``model``'s forwards, if :data:`ENV` names a file; else None."""
    path = os.environ.get(ENV)
    if not path:
        return None
    trace = StepTrace(path)
    model.register_forward_pre_hook(lambda *_: trace.mark("forward+"))
    model.register_forward_hook(lambda *_: trace.mark("forward-"))
    return trace


def read(path: str) -> list[tuple[float, str]]:
    """The events of a trace file, in time order."""
    with open(path) as f:
        events = [(float(t), event) for t, event in (line.split() for line in f if line.strip())]
    return sorted(events)


def engine_pauses(events: Sequence[tuple[float, str]]) -> list[dict[str, float]]:
    """Around each ``update_weights`` call: ``stopped`` (the last forward's end before it),
    ``apply_start``/``apply_end`` (the call), ``restarted`` (the next forward's start), and the
    durations of the step before (``step_before_s``) and of the first one after (``step_after_s``)."""
    forwards: list[tuple[float, float]] = []
    begun = None
    for t, event in events:
        if event == "forward+":
            begun = t
        elif event == "forward-" and begun is not None:
            forwards.append((begun, t))
            begun = None
    starts = [b for b, _ in forwards]
    out = []
    calls = [t for t, event in events if event == "update_weights+"]
    ends = [t for t, event in events if event == "update_weights-"]
    for start, end in zip(calls, ends, strict=False):
        i = bisect.bisect_right(starts, start)  # forwards[i - 1] is the last begun before the call
        if i == 0 or i == len(forwards):
            continue
        before, after = forwards[i - 1], forwards[i]
        out.append({"stopped": before[1], "apply_start": start, "apply_end": end, "restarted": after[0],
                    "step_before_s": before[1] - before[0], "step_after_s": after[1] - after[0],
                    "step_after_end": after[1]})
    return out


def step_seconds(events: Sequence[tuple[float, str]], windows: Sequence[tuple[float, float]]) -> list[float]:
    """Durations of the forwards wholly inside ``windows`` ((start, end) pairs): steady steps."""
    out, begun = [], None
    for t, event in events:
        if event == "forward+":
            begun = t
        elif event == "forward-" and begun is not None:
            if any(start <= begun and t <= end for start, end in windows):
                out.append(t - begun)
            begun = None
    return out
