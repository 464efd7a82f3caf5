"""Peer copies across hosts: a keeping reader serves its copy's memory over NIXL, and a reader on
another host reads what its plan needs of it (``SyncConfig.peers_across_hosts``).

A peer copy (:mod:`weightsync.transport.shm.peer_copy`) is one ``/dev/shm`` segment: a control
page whose word says which version the copy holds, the keeper's shards, its digest table. On
its own host a joining reader maps the file. A reader on another host cannot, so the keeper
registers the whole segment with a NIXL agent of its own (:class:`CopyServer`) and puts the
agent's metadata, the segment's address and its layout in its
:class:`~weightsync.job.wire.PeerCopy` record (:class:`~weightsync.job.wire.RemoteCopy`). A
fresh engine on a new node, which has no peer on its host, then reads its first version from
engines on other nodes, not from the trainers.

The joiner READs, one after the other, the control page, what its plan takes from that peer,
then the control page again: the seqlock of the local case, across hosts. If the word changed
between the two reads, the keeper rewrote its copy meanwhile and what was read may be torn: the
joiner reads the writers instead. :func:`read_into` READs each op's runs straight into the
joiner's receive buffers (host memory, no conversion: one pass, no staging); :func:`fetch_copy`
READs the shards (and the digest table, with ``integrity``) into a staging buffer laid out as the
segment, which the copy logic then reads as it reads a mapped file
(:func:`~weightsync.transport.shm.peer_copy.copy_in`). Either closes its agent once the reads
are done. A keeper that died, or does not answer, fails the read (named), within the caller's
deadline.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from weightsync.clock.deadline import Deadline
from weightsync.job.wire import RemoteCopy
from weightsync.tools.torch_layout import torch_dtype
from weightsync.transport.base import TransportError
from weightsync.transport.nixl.agent import Descriptors, NixlAgent
from weightsync.transport.nixl.common import contiguous_runs
from weightsync.transport.shm.peer_copy import ENTRY_WORDS, HELD_WORD, HeldCopy, MappedCopy, copy_in
from weightsync.transport.shm.segment import CONTROL_BYTES, EMPTY

if TYPE_CHECKING:
    from weightsync.plan import TransferOp

__all__ = ["CopyServer", "fetch_copy", "read_into"]


class CopyServer:
    """A keeping reader's NIXL agent, serving its held copy's segment to readers on other hosts."""

    def __init__(self, seat: int, who: str) -> None:
        self.seat, self.who = seat, who
        self._agent: NixlAgent | None = None
        self._address = 0  # the segment registered (a new held copy, after a layout change, is a new one)

    def serve(self, held: HeldCopy) -> RemoteCopy:
        """What readers on other hosts need to read ``held`` (registered first, on a new agent if
        the held copy is another segment than the one registered).

        Raises:
            TransportError: NIXL could not create its agent or register the memory.
        """
        mem = held.segment.mem
        if self._agent is None or mem.data_ptr() != self._address:
            self.close()
            self._agent = NixlAgent(f"weightsync-peercopy{self.seat}-{secrets.token_hex(4)}", who=self.who,
                                    loopback=False)
            self._agent.register([(mem.data_ptr(), mem.numel())], "DRAM")
            self._address = mem.data_ptr()
        shards = {name: (int(offset), int(numel), str(dtype)) for name, (offset, numel, dtype) in held.table.items()}
        return RemoteCopy(self._agent.metadata(), mem.data_ptr(), mem.numel(), shards, held.nbytes, held.capacity)

    def close(self) -> None:
        agent, self._agent, self._address = self._agent, None, 0
        if agent is not None:
            agent.close()


def fetch_copy(remote: RemoteCopy, seat: int, shards: Collection[str], *, table: bool, who: str,
               deadline: Deadline) -> MappedCopy:
    """Read reader ``seat``'s copy (``shards`` of it, and its digest table with ``table``) from
    its host into a staging buffer laid out as its segment (module docstring). The copy's
    :meth:`~weightsync.transport.shm.peer_copy.MappedCopy.holds` is the version it held while it
    was read, or -1 if the keeper rewrote it meanwhile.

    Raises:
        TransportError: NIXL failed (the keeper is gone, or unreachable), the deadline passed,
            or the record names a shard it does not hold.
    """
    missing = sorted(set(shards) - set(remote.shards))
    if missing:
        raise TransportError(f"reader {seat}'s peer copy holds no shard {missing[0]!r}")
    wanted = []  # (local offset, segment offset, bytes): the shards land where they lie in the segment
    try:
        for name in sorted(shards):
            offset, numel, dtype = remote.shards[name]
            wanted.append((CONTROL_BYTES + offset, CONTROL_BYTES + offset, numel * torch_dtype(dtype).itemsize))
    except ValueError as exc:
        raise TransportError(f"reader {seat}'s peer copy record: {exc}") from None
    if table:
        wanted.append((CONTROL_BYTES + remote.entries_at, CONTROL_BYTES + remote.entries_at,
                       8 * ENTRY_WORDS * remote.capacity))
    if any(at + n > remote.size for _, at, n in wanted):
        raise TransportError(f"reader {seat}'s peer copy record places a shard past its {remote.size}-byte segment")
    staged = torch.empty(remote.size, dtype=torch.uint8)  # laid out as the segment; only what is read is looked at
    wanted = [r for r in wanted if r[2] > 0]
    body = ([staged.data_ptr() + x for x, _, _ in wanted], [remote.address + x for _, x, _ in wanted],
            [n for _, _, n in wanted])
    words = staged[:CONTROL_BYTES].view(torch.int64)
    before, after = _between_words(remote, seat, [(staged.data_ptr(), staged.numel())], body, who=who,
                                   deadline=deadline, what="shards", control=words)
    if before != after:
        words[HELD_WORD] = EMPTY  # rewritten while it was read: torn
    try:
        return copy_in(staged, seat, remote.shards, remote.entries_at, remote.capacity)
    except ValueError as exc:
        raise TransportError(f"reader {seat}'s peer copy record does not fit its segment: {exc}") from None


def _between_words(remote: RemoteCopy, seat: int, memory: Sequence[tuple[int, int]],
                   body: tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray, Sequence[int] | np.ndarray], *,
                   who: str, deadline: Deadline, what: str, control: torch.Tensor | None = None,
                   starts: Sequence[int] = ()) -> tuple[int, int]:
    """The seqlock across hosts: on an agent of its own, with ``memory`` registered, READ reader
    ``seat``'s control page (into ``control`` when given, a page-sized int64 view inside
    ``memory``), then ``body`` (local addresses, segment addresses, lengths; ``starts``: where the
    local registrations begin), then the version word again; returns the version word before and
    after. The agent is closed once the reads are done.

    Raises:
        TransportError: NIXL failed (the keeper is gone, or unreachable) or the deadline passed.
    """
    again = torch.empty(CONTROL_BYTES // 8, dtype=torch.int64)  # the page read again
    first = control if control is not None else torch.empty(CONTROL_BYTES // 8, dtype=torch.int64)
    own = [again] if control is not None else [again, first]
    agent = NixlAgent(f"weightsync-peerread-{secrets.token_hex(4)}", who=who, loopback=False)
    try:
        agent.register([*((t.data_ptr(), CONTROL_BYTES) for t in own), *memory], "DRAM")
        label = f"reader {seat}'s peer copy"
        peer = agent.connect(remote.agent, label=label, deadline=deadline)

        def page(into: torch.Tensor, which: str) -> None:
            descs = Descriptors.of([into.data_ptr()], [remote.address], [CONTROL_BYTES])
            agent.run_once("READ", peer, descs, "DRAM", deadline, what=f"{label}'s control page{which}")

        page(first, "")
        if len(body[2]):
            local_starts = [*starts, *(t.data_ptr() for t in own)]
            agent.run_once("READ", peer, Descriptors.of(*body, local_starts=local_starts), "DRAM", deadline,
                           what=f"{label}'s {what}")
        page(again, ", again")
    finally:
        agent.close()
    return int(first[HELD_WORD]), int(again[HELD_WORD])


def read_into(remote: RemoteCopy, seat: int, ops: Sequence[TransferOp], flats: Mapping[str, torch.Tensor], *,
              version: int, who: str, deadline: Deadline) -> int:
    """READ ``ops`` (whose source is reader ``seat``'s copy, ``version`` of it) straight into the
    joiner's host-memory ``flats``, between two reads of the copy's version word; returns the bytes.

    Raises:
        TransportError: NIXL failed, the deadline passed, an op's source lies outside the copy,
            or the copy did not hold ``version`` throughout (torn: the keeper applied another).
    """
    local, at, lengths = [], [], []
    try:
        for op in ops:
            offset, numel, dtype = remote.shards[op.src_shard]
            size = torch_dtype(dtype).itemsize
            if size != flats[op.dst_shard].element_size():
                raise ValueError(f"{op.src_shard} is {dtype} in the copy, {flats[op.dst_shard].dtype} here")
            src, dst, run = contiguous_runs(op.box.sizes, op.src_strides, op.dst_strides)
            if op.src_offset + int(src.max(initial=0)) + run > numel:
                raise ValueError(f"an op reads past {op.src_shard}'s {numel} elements")
            local.append(flats[op.dst_shard].data_ptr() + (op.dst_offset + dst) * size)
            at.append(remote.address + CONTROL_BYTES + offset + (op.src_offset + src) * size)
            lengths.append(np.full(len(src), run * size, dtype=np.int64))
    except (KeyError, ValueError) as exc:
        raise TransportError(f"reader {seat}'s peer copy cannot serve this plan: {exc}") from None
    regions = [(flat.data_ptr(), flat.numel() * flat.element_size()) for flat in flats.values() if flat.numel()]
    none = np.empty(0, dtype=np.int64)
    body = (np.concatenate(local), np.concatenate(at), np.concatenate(lengths)) if local else (none, none, none)
    before, after = _between_words(remote, seat, regions, body, who=who, deadline=deadline,
                                   what=f"version {version}", starts=sorted({a for a, _ in regions}))
    if before != version or after != version:
        raise TransportError(f"reader {seat} rewrote its peer copy of version {version} while {who} read it from its "
                             f"host (it held version {before}, then {after})")
    return int(sum(int(n.sum()) for n in lengths))
