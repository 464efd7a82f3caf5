"""Two things weightsync does to a gloo process group that torch has no public call for:
give it a device bound to the host this rank publishes (:func:`gloo_options`), and break it
so that every blocked send and receive fails now (:func:`break_group`).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync.clock.deadline import Deadline

logger = logging.getLogger(__name__)

#: The tag of :func:`break_group`'s receive, which no message ever uses (tags are message indices).
_BREAK_TAG = (1 << 31) - 1


def break_group(pg: Any, ranks: Sequence[int]) -> None:
    """Make every pending and future operation of a gloo group fail now.

    Neither ``abort()`` nor ``shutdown()`` of a gloo group wakes a thread blocked in a send or
    receive (torch 2.13), but a receive that times out makes gloo close every pair of the
    group with "Application timeout caused pair closure" (``UnboundBuffer::waitRecv``), which
    fails the blocked waits, here and at the peers, and keeps a late peer's bytes out.

    The receive must be posted on a pair that is still open: on the pair of a rank that died
    it fails at once, without the timeout that closes the others. So it is tried with each of
    ``ranks`` in turn; once one times out, the rest fail at once.
    One wait no break fails: a send whose bytes were partly written when its pair closed
    (see :meth:`GlooTransport._join_lanes`).
    """
    for rank in ranks:
        try:
            pg.recv([torch.empty(1)], rank, _BREAK_TAG).wait(datetime.timedelta(milliseconds=1))
        except Exception as exc:  # the timeout that breaks it, or a pair that is broken already
            logger.debug("gloo group broken through rank %d: %s", rank, exc)


def gloo_options(host: str, deadline: Deadline) -> Any:
    """gloo's options for a group: its device bound to ``host``, the address this rank publishes to
    its peers (``TransportOptions.host``). gloo's default device takes the address the machine's
    host name resolves to, which on a multi-homed host (a site behind its own link) may be one no
    peer can reach."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch 2.13 keeps it private
    options._timeout = datetime.timedelta(seconds=max(deadline.remaining(), 0.001))
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return options
