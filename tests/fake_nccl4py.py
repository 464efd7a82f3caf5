"""nccl4py's ``nccl.core``, as far as weightsync calls it, for CPU tests: every call is recorded.

Installed with :func:`install` in place of the real module, so that weightsync's own code path
(``nccl_comm.connect`` and ``NcclComm``) runs unchanged. Names and signatures follow nccl4py
0.6.0 (``tests/test_nccl_comm.py::test_the_nccl4py_names_weightsync_calls_exist`` checks them
against the real module where it is installed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch

SUCCESS, REMOTE_ERROR, IN_PROGRESS = 0, 6, 7


class UniqueId:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    @property
    def as_bytes(self) -> bytes:
        return self.raw

    @staticmethod
    def from_bytes(b: bytes | bytearray | memoryview) -> UniqueId:
        return UniqueId(bytes(b))


@dataclass
class NCCLConfig:
    blocking: bool | None = None


class FakeNccl(ModuleType):
    """The module: ``calls`` holds ``(name, ...)`` tuples in call order, from every thread.

    Args:
        connect_polls: how many ``get_async_error`` polls of a new communicator answer
            ``ncclInProgress`` before ``ncclSuccess`` (None: forever, a peer that never comes).
        post_polls: the same after each ``group_end``.
    """

    def __init__(self, *, connect_polls: int | None = 2, post_polls: int | None = 1) -> None:
        super().__init__("nccl.core")
        self.connect_polls, self.post_polls = connect_polls, post_polls
        self.calls: list[tuple[Any, ...]] = []
        self.comms: list[Communicator] = []
        self.lock = threading.Lock()
        self.UniqueId = UniqueId
        self.NCCLConfig = NCCLConfig
        module = self

        class Bound(Communicator):
            nccl = module

        self.Communicator = Bound

    def record(self, *call: Any) -> None:
        with self.lock:
            self.calls.append(call)

    def get_unique_id(self, empty: bool = False) -> UniqueId:
        self.record("get_unique_id")
        return UniqueId(bytes(range(128)))

    def group_start(self) -> None:
        self.record("group_start")

    def group_end(self) -> None:
        self.record("group_end")
        for comm in self.comms:
            comm.pending = self.post_polls

    def get_error_string(self, result: int) -> str:
        return {REMOTE_ERROR: "remote process exited or there was a network error"}.get(result, "unknown")


class Communicator:
    nccl: FakeNccl

    def __init__(self, nranks: int, rank: int) -> None:
        self.nranks, self.rank = nranks, rank
        self.pending: int | None = self.nccl.connect_polls
        self.state = SUCCESS  # what get_async_error answers once nothing is pending
        self.valid = True

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: UniqueId, config: NCCLConfig | None = None) -> Communicator:
        cls.nccl.record("init", nranks, rank, unique_id.as_bytes, None if config is None else config.blocking)
        comm = cls(nranks, rank)
        cls.nccl.comms.append(comm)
        return comm

    def _check(self, what: str) -> None:
        if not self.valid:  # nccl4py's NcclInvalid: the handle was freed by abort or destroy
            raise RuntimeError(f"Cannot {what}: Communicator not initialized")

    def send(self, sendbuf: torch.Tensor, peer: int, *, stream: Any = None) -> None:
        self._check("send")
        self.nccl.record("send", peer, sendbuf.dtype, sendbuf.numel(), sendbuf.data_ptr(), stream)

    def recv(self, recvbuf: torch.Tensor, peer: int, *, stream: Any = None) -> None:
        self._check("recv")
        self.nccl.record("recv", peer, recvbuf.dtype, recvbuf.numel(), recvbuf.data_ptr(), stream)

    def get_async_error(self) -> int:
        self._check("get async error")
        if self.pending is None:
            return IN_PROGRESS
        if self.pending > 0:
            self.pending -= 1
            return IN_PROGRESS
        return self.state

    def get_last_error(self) -> str:
        return ""

    def abort(self) -> None:
        self.nccl.record("abort", self.rank, threading.current_thread().name)
        self.valid = False

    def destroy(self) -> None:
        self.nccl.record("destroy", self.rank)
        self.valid = False


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeNccl | None = None) -> FakeNccl:
    """Put ``fake`` (a new :class:`FakeNccl` by default) where ``import nccl.core`` finds it."""
    fake = fake or FakeNccl()
    package = ModuleType("nccl")
    package.core = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "nccl", package)
    monkeypatch.setitem(__import__("sys").modules, "nccl.core", fake)
    return fake
