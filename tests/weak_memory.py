"""A weakly ordered model of shared-memory control words (tests only): what an aarch64 CPU (GH200,
GB200) may show a reader of words another process stores without fences.

Each word keeps every value stored into it. A load returns any of them from the last one this
thread saw (or stored) on, never an older one: per-location coherence, which every CPU keeps, and
nothing else. Loads of two *different* words are unordered with each other, so a reader can see
one word's new value and another's old one, as x86-64 never shows but ARM may. Seeded; a load
returns the oldest value it may with probability ``stale``.

    weak = WeakMemory(seed=0)
    monkeypatch.setattr(shm, "read_segment", weak.wrap_reader(shm.read_segment))
    monkeypatch.setattr(shm_snapshot, "OwnSegment", weak.wrap_segment(shm_snapshot.OwnSegment))
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import torch


class WeakMemory:
    """Histories of shared words, keyed by (segment, index); what each thread has seen of them."""

    def __init__(self, *, seed: int = 0, stale: float = 0.5) -> None:
        self.rng = random.Random(seed)
        self.stale = stale
        self.lock = threading.Lock()
        self.history: dict[tuple[str, int], list[int]] = {}
        self.seen: dict[tuple[int, str, int], int] = {}  # (thread, segment, index) -> history position
        self.stale_loads = 0  # loads that returned a value older than the newest

    def _log(self, space: str, index: int, tensor: torch.Tensor) -> list[int]:
        return self.history.setdefault((space, index), [int(tensor[index])])

    def load(self, space: str, index: int, tensor: torch.Tensor) -> int:
        with self.lock:
            log = self._log(space, index, tensor)
            me = (threading.get_ident(), space, index)
            lo = self.seen.get(me, 0)
            at = lo if self.rng.random() < self.stale else len(log) - 1
            self.seen[me] = at
            self.stale_loads += at < len(log) - 1
            return log[at]

    def store(self, space: str, index: int, value: int, tensor: torch.Tensor) -> None:
        with self.lock:
            log = self._log(space, index, tensor)
            log.append(int(value))
            self.seen[(threading.get_ident(), space, index)] = len(log) - 1
            tensor[index] = int(value)

    def wrap_reader(self, read_segment: Callable[..., Any]) -> Callable[..., Any]:
        """``shm_segment.read_segment`` whose control words load and store through this model."""
        def read(path: str, writer: int) -> Any:
            mem, words, header = read_segment(path, writer)
            return mem, WeakWords(self, path, words), header
        return read

    def wrap_segment(self, own_segment: type) -> type:
        """``shm_segment.OwnSegment`` whose control words store and load through this model."""
        memory = self

        class WeakSegment(own_segment):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.words = WeakWords(memory, str(self.path), self.words)

        return WeakSegment


class WeakWords:
    """An int64 control-word tensor as a reader or writer sees it under :class:`WeakMemory`."""

    def __init__(self, memory: WeakMemory, space: str, tensor: torch.Tensor) -> None:
        self.memory, self.space, self.tensor = memory, space, tensor

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return _Words(self, range(*index.indices(self.tensor.numel())))
        return self.memory.load(self.space, int(index), self.tensor)

    def __setitem__(self, index: int, value: int) -> None:
        self.memory.store(self.space, int(index), int(value), self.tensor)


class _Words:
    def __init__(self, words: WeakWords, indices: range) -> None:
        self.words, self.indices = words, indices

    def fill_(self, value: int) -> None:
        for i in self.indices:
            self.words[i] = value
