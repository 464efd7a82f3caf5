"""The device model's memory (tests only): a budget per GPU as torch's caching allocator splits it,
and allocations that live as long as torch keeps them, CUDA IPC shares counted as torch counts
them (``tests/device_model.py`` describes the rules; :class:`DeviceModel` is built on this)."""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.ports.device import IpcHandle, allocatable_bytes


@dataclass
class Block:
    """One allocation: ``backing`` holds the memory as long as torch would keep it allocated."""

    key: int
    nbytes: int
    device: str
    what: str
    process: str
    backing: torch.Tensor | None
    tracked: bool = True  # allocated by the model (else: a test's tensor, shared as is)
    shareable: bool = False
    exporter_alive: bool = True
    shares: dict[int, int] = field(default_factory=dict)  # token -> torch's counter
    mapped: dict[int, str] = field(default_factory=dict)  # open mapping -> its process
    freed: bool = False


@dataclass
class Gpu:
    """One device's memory: live blocks, owners' reserves, and each process's allocator cache."""

    used: int = 0
    reserved: dict[str, int] = field(default_factory=dict)
    cache: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)  # process -> (bytes, whole segment)
    graphs: dict[str, int] = field(default_factory=dict)  # process -> graph pools' bytes


def _alias(backing: torch.Tensor) -> torch.Tensor:
    """A tensor over ``backing``'s bytes with a storage of its own (its lifetime is the holder's)."""
    buf = (ctypes.c_uint8 * backing.numel()).from_address(backing.data_ptr())
    return torch.frombuffer(buf, dtype=torch.uint8)




class MemoryRules:
    """Memory and CUDA IPC rules of :class:`device_model.DeviceModel` (its state is set there)."""

    budget: int | dict[str, int] | None
    context: int
    expandable_segments: bool
    contexts: set[tuple[str, str]]
    violations: list[str]
    peak: int
    allocations: dict[int, tuple[int, str]]
    pinned: list[tuple[int, str]]
    _lock: threading.RLock
    _gpus: dict[str, Any]
    _blocks: dict[int, Any]
    _by_ptr: dict[int, int]
    _exports: dict[int, tuple[int, str]]
    _graveyard: list[torch.Tensor]
    _tokens: int
    _keys: int
    _mappings: int

    def process(self) -> str:
        raise NotImplementedError

    def is_gpu(self, device: str | torch.device) -> bool:
        raise NotImplementedError

    def _progress(self) -> None:
        raise NotImplementedError

    def _hazard(self, message: str) -> AssertionError:
        raise NotImplementedError

    # -- memory -------------------------------------------------------------------------------
    def _key(self, device: str | torch.device) -> str:
        d = torch.device(device)
        return f"cuda:{d.index or 0}" if d.type == "cuda" else str(d)

    def _gpu(self, device: str) -> Gpu:
        return self._gpus.setdefault(device, Gpu())

    def _budget(self, device: str) -> int | None:
        return self.budget.get(device) if isinstance(self.budget, dict) else self.budget

    def driver_free(self, device: str | torch.device) -> int | None:
        """What the driver has free on ``device`` (as ``cudaMemGetInfo``): the budget less live
        blocks, reserves, and every allocator's cached and graph-pool memory."""
        key = self._key(device)
        budget = self._budget(key)
        if budget is None:
            return None
        gpu = self._gpu(key)
        cached = sum(n for blocks in gpu.cache.values() for n, _ in blocks)
        return budget - gpu.used - sum(gpu.reserved.values()) - cached - sum(gpu.graphs.values())

    def free_bytes(self, device: str | torch.device) -> int | None:
        if not self.is_gpu(device):
            return None
        free = self.driver_free(device)
        if free is None:
            return None
        return allocatable_bytes(free, self._gpu(self._key(device)).cache.get(self.process(), []))

    @property
    def used(self) -> int:
        return sum(g.used for g in self._gpus.values())

    @property
    def reserved(self) -> dict[str, int]:
        return {owner: n for g in self._gpus.values() for owner, n in g.reserved.items()}

    def _take(self, device: str, nbytes: int, what: str) -> None:
        """Account ``nbytes`` as torch's allocator gets them: a cached block that fits, else the
        driver, else the driver after giving back the process's wholly free cached segments."""
        gpu = self._gpu(device)
        cache = gpu.cache.setdefault(self.process(), [])
        fits = sorted(b for b in cache if b[0] >= nbytes)
        free = self.driver_free(device)
        if fits:
            cache.remove(fits[0])
            if fits[0][0] > nbytes:
                cache.append((fits[0][0] - nbytes, False))  # the rest of a split block
        elif free is not None and free < nbytes:
            if free + sum(n for n, whole in cache if whole) < nbytes:
                raise torch.OutOfMemoryError(f"device model: {what} needs {nbytes} bytes, "
                                             f"{self.free_bytes(device)} free (reserved: {gpu.reserved})")
            cache[:] = [b for b in cache if not b[1]]
        gpu.used += nbytes
        self.peak = max(self.peak, self.used)

    def empty(self, nbytes: int, device: str | torch.device, *, what: str, pinned: bool = False,
              shareable: bool = False) -> torch.Tensor:
        if pinned:  # page-locked host memory: outside the device budget, and recorded
            self.pinned.append((nbytes, what))
            return torch.empty(nbytes, dtype=torch.uint8)
        if not self.is_gpu(device):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        with self._lock:
            self._progress()
            key = self._key(device)
            self._take(key, nbytes, what)
            self.contexts.add((self.process(), key))
            self._keys += 1
            backing = torch.empty(nbytes, dtype=torch.uint8)
            block = Block(self._keys, nbytes, key, what, self.process(), backing, shareable=shareable)
            self._blocks[block.key] = block
            self.allocations[block.key] = (nbytes, what)
            if nbytes == 0:
                block.tracked = False
                return backing
            t = _alias(backing)
            self._by_ptr[t.data_ptr()] = block.key
            # the exporter's reference: its storage (views of other dtypes included)
            weakref.finalize(t.untyped_storage(), self._exporter_freed, block.key)
            return t

    def reserve(self, nbytes: int, owner: str, device: str = "cpu") -> None:
        """``owner`` (an engine) takes ``nbytes`` of ``device``'s budget for itself."""
        with self._lock:
            free = self.driver_free(device)
            if free is not None and nbytes > free:
                raise torch.OutOfMemoryError(f"device model: {owner} cannot reserve {nbytes} bytes, {free} free")
            reserved = self._gpu(self._key(device)).reserved
            reserved[owner] = reserved.get(owner, 0) + nbytes

    def reserve_rest(self, owner: str, device: str = "cpu") -> int:
        """``owner`` takes everything still free (vLLM sizing its KV cache); returns how much."""
        with self._lock:
            rest = self.driver_free(device) or 0
            self.reserve(rest, owner, device)
            return rest

    def cache(self, nbytes: int, *, blocks: int = 1, whole: bool = False, device: str = "cpu",
              process: str | None = None) -> None:
        """The allocator of ``process`` (default: this one) holds ``nbytes`` reserved but free, as
        ``blocks`` equal free blocks: inside partly used segments, or ``whole`` free segments
        (which it gives back to the driver when an allocation needs them)."""
        with self._lock:
            free = self.driver_free(device)
            if free is not None and nbytes > free:
                raise torch.OutOfMemoryError(f"device model: cannot cache {nbytes} bytes, {free} free")
            cache = self._gpu(self._key(device)).cache.setdefault(process or self.process(), [])
            cache += [(nbytes // blocks, whole)] * blocks

    def graph_pool(self, nbytes: int, *, device: str = "cpu", process: str | None = None) -> None:
        """CUDA graphs of ``process`` keep ``nbytes`` in their private pool (reserved, serving only them)."""
        with self._lock:
            graphs = self._gpu(self._key(device)).graphs
            who = process or self.process()
            graphs[who] = graphs.get(who, 0) + nbytes

    def context_bytes(self, device: str | torch.device) -> int:
        if not self.is_gpu(device) or (self.process(), self._key(device)) in self.contexts:
            return 0
        return self.context

    # -- CUDA IPC -------------------------------------------------------------------------------
    def share(self, tensor: torch.Tensor) -> IpcHandle:
        with self._lock:
            key = self._by_ptr.get(tensor.untyped_storage().data_ptr())
            if key is None:  # a test's own tensor: shared as is, no lifetime kept
                self._keys += 1
                key = self._keys
                self._blocks[key] = Block(key, 0, "cpu", "a test tensor", self.process(), tensor, tracked=False,
                                          shareable=True)
            block = self._blocks[key]
            if self.expandable_segments and not block.shareable:
                self.violations.append(f"{block.what} was shared from an expandable segment")
                raise RuntimeError(f"device model: {block.what} lies in an expandable segment "
                                   "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which cudaIpcGetMemHandle "
                                   "cannot share")
            self._tokens += 1
            block.shares[self._tokens] = 1  # torch: GetNewRefCountedSentData sets the counter to 1
            self._exports[self._tokens] = (key, self.process())
            return IpcHandle((self._tokens,), str(tensor.device), "model-gpu", self.process())

    def open(self, handle: IpcHandle, device: str) -> torch.Tensor:
        with self._lock:
            token = int(handle.fields[0])
            key, exporter = self._exports[token]
            if exporter == self.process() or handle.process == self.process():
                self.violations.append(f"{self.process()} opened an IPC handle it exported itself")
                raise RuntimeError("CUDA error: invalid device context (device model: cudaIpcOpenMemHandle of a "
                                   f"handle exported by this process, {self.process()})")
            need = self.context_bytes(device)
            if need:  # the open creates this process's context on the device, out of its budget
                free = self.free_bytes(device)
                if free is not None and need > free:
                    raise torch.OutOfMemoryError(f"CUDA error: out of memory (device model: {self.process()}'s "
                                                 f"context on {device} needs {need} bytes, {free} free)")
                self.reserve(need, f"{self.process()}'s context on {device}", device)
                self.contexts.add((self.process(), self._key(device)))
            block = self._blocks[key]
            if not block.tracked:
                assert block.backing is not None
                return block.backing
            if block.freed:
                raise self._hazard(f"{self.process()} opened {block.what} after it was freed")
            assert block.backing is not None
            t = _alias(block.backing)
            self._mappings += 1
            block.mapped[self._mappings] = self.process()
            weakref.finalize(t.untyped_storage(), self._consumer_freed, key, token, self._mappings)
            return t

    def release(self, handle: IpcHandle) -> None:
        with self._lock:
            token = int(handle.fields[0])
            self._consume(self._blocks[self._exports[token][0]], token)

    def _consumer_freed(self, key: int, token: int, mapping: int) -> None:
        with self._lock:
            block = self._blocks[key]
            block.mapped.pop(mapping, None)
            self._consume(block, token)

    def _consume(self, block: Block, token: int) -> None:
        if not block.tracked:
            return
        block.shares[token] -= 1
        if block.shares[token] < 0:
            self.violations.append(f"{block.what} leaks: a share of it was consumed {1 - block.shares[token]} times "
                                   "(its counter went below 0, which torch reads as unsigned: never freed)")
        self._collect(block)

    def _exporter_freed(self, key: int) -> None:
        with self._lock:
            block = self._blocks[key]
            block.exporter_alive = False
            self._collect(block)

    def _collect(self, block: Block) -> None:
        """Free the block once torch would: the exporter let go and every counter is 0."""
        if block.freed or block.exporter_alive or any(c != 0 for c in block.shares.values()):
            return
        block.freed = True
        if block.mapped:
            self.violations.append(f"{block.what} was freed while {sorted(set(block.mapped.values()))} still "
                                   "mapped it (a share's counter reached 0 early)")
            assert block.backing is not None
            self._graveyard.append(block.backing)
        block.backing = None
        self._gpu(block.device).used -= block.nbytes
        self.allocations.pop(block.key, None)
        self._by_ptr = {p: k for p, k in self._by_ptr.items() if k != block.key}

    def leaks(self) -> list[str]:
        """Blocks their exporter freed that torch would still hold (after a garbage collection)."""
        gc.collect()
        with self._lock:
            return [f"{b.what} ({b.nbytes} bytes, counters {sorted(b.shares.values())})"
                    for b in self._blocks.values() if b.tracked and not b.exporter_alive and not b.freed]
