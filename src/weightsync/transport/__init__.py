"""Transports: one package each, behind the :class:`Transport` Protocol, chosen in one place.

| name    | modules                              | moves bytes by                                   | one-sided |
|---------|--------------------------------------|--------------------------------------------------|-----------|
| torch   | torch/gloo.py, torch/nccl.py         | p2p: torch's gloo on CPU, NCCL (nccl4py) on GPU  | no        |
| shm     | shm/transport.py, shm/zero_copy.py   | POSIX shared memory / CUDA IPC, co-located ranks | yes       |
| file    | file/transport.py                    | safetensors files on (shared) storage            | yes       |
| nixl    | nixl/pull.py, nixl/push.py           | NIXL/UCX RDMA reads (pull) or writes (push)      | pull only |
| routed  | routed/transport.py                  | shm within a node, torch across nodes, per pair  | no        |

Every transport is an entry of the open registry (:mod:`weightsync.transport.registry`): the
built-in ones are registered below, a third party registers its own in code or through the
``weightsync.transports`` entry-point group. A transport with several modes (torch: gloo or
NCCL by device; nixl: pull or push) has one class per mode and says which mode a job uses. Which
transport a job uses is decided from every rank's placement by
:func:`weightsync.tools.devices.choose_transport`.
"""

from __future__ import annotations

import importlib.util
import logging

from weightsync.tools.devices import torch_backend
from weightsync.transport.base import (
    TransferStats,
    Transport,
    TransportContext,
    TransportError,
    TransportOptions,
)
from weightsync.transport.registry import register_transport, registered_transports, transport_entry

logger = logging.getLogger(__name__)

def _torch_mode(ctx: TransportContext) -> str:
    return torch_backend(ctx.device)


def _nixl_mode(ctx: TransportContext) -> str:
    from weightsync.transport.nixl.common import resolve_mode

    return resolve_mode(ctx.options.nixl_mode, num_writers=ctx.num_writers,
                        num_readers=None if ctx.elastic else ctx.num_readers,
                        delta=bool(ctx.options.delta_anchor_every))


def _nixl_missing() -> str | None:
    if importlib.util.find_spec("nixl_cu12") or importlib.util.find_spec("nixl"):
        return None
    return "NIXL is not installed (pip install 'weightsync[nixl]')"


def _shm_missing() -> str | None:
    import os

    return None if os.path.isdir("/dev/shm") else "/dev/shm is not available on this system"


def _nccl_missing(ctx: TransportContext) -> str | None:
    """Why this job's GPU memory cannot move over NCCL here: weightsync drives NCCL through
    nccl4py (transport/torch/nccl_comm.py)."""
    if torch_backend(ctx.device) != "nccl":
        return None
    from weightsync.transport.torch.nccl_comm import nccl4py_missing

    return nccl4py_missing()


def _routed_delta_check(ctx: TransportContext) -> None:
    """routed's shm route carries deltas in host memory only (its same-node GPU pairs go through
    CUDA IPC): refused when the transport is created, not when its shm part is set up."""
    from weightsync.transport.delta.published import check_delta

    check_delta("routed", ctx)


register_transport("torch", {"gloo": "weightsync.transport.torch.gloo:GlooTransport",
                             "nccl": "weightsync.transport.torch.nccl:NcclTransport"},
                   mode=_torch_mode, refuses=_nccl_missing)
register_transport("shm", "weightsync.transport.shm.transport:SharedMemoryTransport", missing=_shm_missing)
register_transport("file", "weightsync.transport.file.transport:FileTransport")
register_transport("nixl", {"pull": "weightsync.transport.nixl.pull:NixlPullTransport",
                            "push": "weightsync.transport.nixl.push:NixlPushTransport"},
                   mode=_nixl_mode, missing=_nixl_missing)
register_transport("routed", "weightsync.transport.routed.transport:RoutedTransport", missing=_shm_missing,
                   refuses=_nccl_missing, routes=("shm", "torch"), check_delta=_routed_delta_check)


def transport_class_path(name: str, ctx: TransportContext) -> str:
    """``module:Class`` implementing transport ``name`` for this job (resolving its mode)."""
    return transport_entry(name).path(ctx)


def unavailable_reason(name: str) -> str | None:
    """None when transport ``name`` can be used on this machine, else why not."""
    try:
        entry = transport_entry(name)
    except ValueError as exc:
        return str(exc)
    return entry.missing()


def available_transports() -> list[str]:
    return [name for name in registered_transports() if unavailable_reason(name) is None]


def create_transport(name: str, ctx: TransportContext) -> Transport:
    """The transport ``name`` for this rank of this job.

    Raises:
        ValueError: the transport is unknown, cannot run here or for this job (naming why), or
            a setting in ``ctx.options`` would be ignored by it.
    """
    entry = transport_entry(name)
    reason = entry.missing() or entry.refuses(ctx)
    if reason:
        raise ValueError(f"transport {name!r} cannot be used: {reason}")
    check_delta_carried(name, ctx)
    transport: Transport = entry.cls(ctx)(ctx)
    return transport


def check_delta_carried(name: str, ctx: TransportContext) -> None:
    """Refuse ``delta_anchor_every`` where transport ``name`` (in this job's mode), or one of the
    transports its bytes also travel over, would send full versions anyway: a setting is never
    ignored."""
    anchor = ctx.options.delta_anchor_every
    if not anchor:
        return
    entry = transport_entry(name)
    for route in entry.routes or (name,):
        cls = transport_entry(route).cls(ctx)
        if not cls.carries_deltas:
            where = f"the {name} transport" if route == name else f"the {name} transport's {route} route"
            raise ValueError(f"{ctx.who}: delta_anchor_every={anchor} is not supported by {where} "
                             f"({cls.__name__}, on {ctx.device}): it would send every version in full. Deltas "
                             "run over torch (gloo between CPU ranks, NCCL between GPUs), and over shm, nixl, "
                             "file and routed between CPU ranks; use one of those, or delta_anchor_every=0")
    entry.check_delta(ctx)


__all__ = [
    "TransferStats",
    "Transport",
    "TransportContext",
    "TransportError",
    "TransportOptions",
    "available_transports",
    "check_delta_carried",
    "create_transport",
    "register_transport",
    "registered_transports",
    "transport_class_path",
    "unavailable_reason",
]
