"""What an in-process inference engine changes in its host process, and putting it back.

vLLM's CPU worker, hosted in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), binds
the process's threads to cores (``sched_setaffinity``) and replaces ``torch.set_num_threads``
with a no-op for the rest of the process. Training ranks the process starts afterwards inherit
the affinity: a DeepSpeed job launched after vLLM engines in one test process crawled until its
180 s timeout. Any program that hosts an engine in-process and later starts ranks (an RL driver,
a notebook, a test suite) needs its process back as it was::

    with preserved_process_state():
        llm = LLM(model=path, ...)
        ...                       # generate, sync weights
        shutdown(llm)
    # environment, CPU affinity, torch threads and torch.set_num_threads as before

:class:`ProcessState` also says what changed (:meth:`ProcessState.differences`), which the test
suite checks after every test so that a leak is caught where it happens.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


def _affinity() -> frozenset[int] | None:
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


@dataclass(frozen=True)
class ProcessState:
    """The process-wide settings an engine may change: environment, CPU affinity, torch's
    intra-op thread count and its ``set_num_threads`` function."""

    environ: dict[str, str]
    affinity: frozenset[int] | None
    num_threads: int
    set_num_threads: Callable[[int], Any] = field(compare=False)

    @classmethod
    def capture(cls) -> ProcessState:
        return cls(dict(os.environ), _affinity(), torch.get_num_threads(), torch.set_num_threads)

    def differences(self, now: ProcessState) -> list[str]:
        """What differs in ``now``, one line per setting (environment variables by name)."""
        out = []
        for key in sorted(set(self.environ) | set(now.environ)):
            before, after = self.environ.get(key), now.environ.get(key)
            if before != after:
                out.append(f"environment {key}: {before!r} -> {after!r}")
        if self.affinity != now.affinity:
            out.append(f"CPU affinity: {sorted(self.affinity or [])} -> {sorted(now.affinity or [])}")
        if self.num_threads != now.num_threads:
            out.append(f"torch threads: {self.num_threads} -> {now.num_threads}")
        if self.set_num_threads is not now.set_num_threads:
            out.append("torch.set_num_threads was replaced")
        return out

    def restore(self) -> None:
        """Put every setting back (the function first: vLLM's replacement ignores calls)."""
        torch.set_num_threads = self.set_num_threads  # type: ignore[assignment]
        if self.affinity is not None and _affinity() != self.affinity:
            os.sched_setaffinity(0, self.affinity)
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        os.environ.update(self.environ)


@contextlib.contextmanager
def preserved_process_state() -> Iterator[ProcessState]:
    """Run the block (an in-process engine's life), then restore this process's settings."""
    state = ProcessState.capture()
    try:
        yield state
    finally:
        state.restore()


__all__ = ["ProcessState", "preserved_process_state"]
