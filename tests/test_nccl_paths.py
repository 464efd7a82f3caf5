"""The NCCL transport's control flow without a GPU: a process group that behaves as torch 2.13's
``ProcessGroupNCCL`` does where it matters (``endCoalescing`` returns no work when nothing was
posted), so that each issue-23 defect of this transport has a test that runs in CI."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fake_meta import DirectoryMeta
from weightsync.deadline import Deadline
from weightsync.device_port import TorchDevices
from weightsync.job import JobChannel
from weightsync.transport import TransportContext, TransportError, TransportOptions
from weightsync.transport.torch_dist import Pair
from weightsync.transport.torch_nccl import NcclTransport


class FakeWork:
    def block_current_stream(self) -> None:
        pass


class FakeGroup:
    """Posts nothing anywhere; ``_end_coalescing`` as ``ProcessGroupNCCL::endCoalescing``: no
    coalesced operation, no work (``nullptr``, None in Python)."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, int, int]] = []
        self.aborted = False

    def _start_coalescing(self, device: Any) -> None:
        self.posted = []

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        self.posted.append(("send", peer, tag))

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        self.posted.append(("recv", peer, tag))

    def _end_coalescing(self, device: Any) -> FakeWork | None:
        return FakeWork() if self.posted else None

    def abort(self) -> None:
        self.aborted = True


def nccl(tmp_path: Any, role: str, **options: Any) -> NcclTransport:
    ctx = TransportContext(channel=JobChannel(DirectoryMeta(str(tmp_path)), role=role, rank=0),  # type: ignore[arg-type]
                           num_writers=1, num_readers=1, options=TransportOptions(**options))
    return NcclTransport(ctx)


@pytest.mark.parametrize("role", ["writer", "reader"])
def test_checksums_with_nothing_to_send_this_phase_complete(tmp_path, role):
    """Defect 6: a phase in which this rank exchanges no message with its peer, with
    ``checksum=True``: the checksum round posts nothing and NCCL returns no work."""
    t = nccl(tmp_path, role, checksum=True)
    group = FakeGroup()
    t._pg = group
    stats = t._move(3, Deadline.after(5), [Pair(0, 1 if role == "reader" else 0, [])], sending=role == "writer")
    assert (stats.version, stats.nbytes, stats.messages) == (3, 0, 0)
    assert t._pg is group and not group.aborted


def test_an_unexpected_failure_tears_the_group_down_and_raises_a_transport_error(tmp_path):
    """Defect 6's second half: whatever fails inside a sync (here an AttributeError, as
    ``None.block_current_stream()`` raised), the caller sees a TransportError and the
    communicator is aborted: the next epoch forms a new one."""
    t = nccl(tmp_path, "reader")
    group = FakeGroup()
    t._pg = group

    class Broken(TorchDevices):
        def record(self, device: Any) -> Any:
            raise AttributeError("'NoneType' object has no attribute 'block_current_stream'")

    t.dev = Broken()
    with pytest.raises(TransportError, match=r"reader 0: version 4 failed with writer 0: 'NoneType' object has no "
                                             "attribute 'block_current_stream'"):
        t._move(4, Deadline.after(5), [Pair(0, 1, [])], sending=False)
    assert group.aborted and t._pg is None
