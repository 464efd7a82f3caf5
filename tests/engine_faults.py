"""Faults injected at the smallest interfaces, for the invalid-on-failure tests of every engine.

* :class:`PartialWrite` is the device port (every copy a shared-memory, file or NIXL reader
  makes into its destination goes through ``device_port.current().copy``) with one fault: the
  first copy into a chosen tensor writes its first half, then raises as a broken transfer
  would. The transport itself runs unchanged; only that copy is cut short.
* :func:`fail_in_phase` makes a reader's transport fail phase ``k`` of a version (the earlier
  phases arrived, and were loaded by an engine that loads phase by phase).
* :class:`Trainer` is one writer rank on a thread (``CanonicalSource``: the whole model), writing
  version ``v`` with the weights of a given seed while the test drives the reader.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from weightsync.clock.deadline import Deadline
from weightsync.meta import MetaClient
from weightsync.ports import device as device_port
from weightsync.session.sync_session import SyncConfig
from weightsync.tools.tiny import CanonicalSource, canonical_weights
from weightsync.tools.torch_layout import fill_from_canonical
from weightsync.transport import TransportError


class PartialWrite:
    """A device port whose first copy into ``target`` (after :meth:`arm`) writes half and raises."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.target: torch.Tensor | None = None
        self.written = 0  # bytes of the target written before the break

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arm(self, target: torch.Tensor) -> None:
        self.target, self.written = target, 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        target = self.target
        if target is None or dst.untyped_storage().data_ptr() != target.untyped_storage().data_ptr():
            self.inner.copy(dst, src)
            return
        self.target = None  # one fault
        half = max(1, dst.shape[0] // 2) if dst.dim() else 1
        if dst.dim():
            self.inner.copy(dst[:half], src[:half])
            self.written = dst[:half].numel() * dst.element_size()
        raise TransportError(f"injected: the connection broke after {self.written} bytes of {tuple(dst.shape)}")


@contextlib.contextmanager
def partial_writes() -> Iterator[PartialWrite]:
    """Install a :class:`PartialWrite` port (unarmed) for the block; transports made in it use it."""
    with device_port.use(PartialWrite(device_port.current())) as port:  # type: ignore[arg-type]
        yield port  # type: ignore[misc]


def fail_in_phase(reader: Any, version: int, phase: int) -> None:
    """From now on, ``reader``'s transport fails phase ``phase`` of ``version``: the phases before
    it arrive (and an engine that loads phase by phase loads them), that one breaks off."""
    planned = reader.session.planned
    assert planned is not None and planned.num_phases > phase, "plan the reader first, with enough phases"
    transport = planned.transport
    original = transport.receive

    def receive(v: int, *, deadline: Deadline, phase: int = 0, _k: int = phase) -> Any:
        if v == version and phase == _k:
            raise TransportError(f"injected: writer 0 went away in phase {_k} of version {v}")
        return original(v, deadline=deadline, phase=phase)

    transport.receive = receive


class Trainer:
    """One writer rank (the whole model, ``hf`` layout) on a thread of its own.

    ``write(version, seed)`` starts writing ``version`` with ``canonical_weights(config, seed)``
    (optionally changed by ``edit``) and returns a future: the test drives the reader meanwhile.
    """

    def __init__(self, config: dict[str, Any], sync: SyncConfig, address: str, token: str) -> None:
        self.config = config
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self._writer: Any = None
        self._pool.submit(self._open, sync, address, token).result(60)

    def _open(self, sync: SyncConfig, address: str, token: str) -> None:
        from weightsync.roles.writer import WeightWriter

        self.source = CanonicalSource(self.config)
        self._writer = WeightWriter(self.source, rank=0, config=sync, meta=MetaClient(address, job=sync.job,
                                                                                   token=token))

    def weights(self, seed: int, edit: Any = None) -> dict[str, torch.Tensor]:
        weights = canonical_weights(self.config, seed)
        if edit is not None:
            edit(weights)
        return weights

    def write(self, version: int, seed: int, edit: Any = None) -> concurrent.futures.Future[Any]:
        def run() -> Any:
            fill_from_canonical(self.source.layout(), self.source.tensors(), self.weights(seed, edit))
            return self._writer.write(version)
        return self._pool.submit(run)

    def close(self) -> None:
        def close() -> None:
            if self._writer is not None:
                self._writer.close()
                self._writer.meta.close()
        self._pool.submit(close).result(60)
        self._pool.shutdown()


def nudged(weights: dict[str, torch.Tensor]) -> None:
    """A next version that differs from ``weights`` in one element per tensor (a delta is small)."""
    for tensor in weights.values():
        tensor.view(-1)[0] += 1.0
