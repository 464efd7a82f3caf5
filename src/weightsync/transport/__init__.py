"""Transports: one package each, behind the :class:`Transport` Protocol, chosen in one place.

| name    | modules                              | moves bytes by                                   | one-sided |
|---------|--------------------------------------|--------------------------------------------------|-----------|
| torch   | torch/gloo.py, torch/nccl.py         | p2p: torch's gloo on CPU, NCCL (nccl4py) on GPU  | no        |
| shm     | shm/transport.py, shm/zero_copy.py   | POSIX shared memory / CUDA IPC, co-located ranks | yes       |
| file    | file/transport.py                    | safetensors files on (shared) storage            | yes       |
| nixl    | nixl/pull.py, nixl/push.py           | NIXL/UCX RDMA reads (pull) or writes (push)      | pull only |
| routed  | routed/transport.py                  | shm within a node, torch across nodes, per pair  | no        |

Adding a transport is one package, one entry in ``_FACTORIES`` and one availability probe.
A transport with several modes (torch: gloo or NCCL by device; nixl: pull or push) has one
class per mode; :func:`transport_class_path` picks the class, here and nowhere else. Which
transport a job uses is decided from every rank's placement by
:func:`weightsync.tools.devices.choose_transport`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

from weightsync.tools.devices import torch_backend
from weightsync.transport.base import (
    TransferStats,
    Transport,
    TransportContext,
    TransportError,
    TransportOptions,
)

logger = logging.getLogger(__name__)

#: name -> "module:Class", or, for transports with modes, mode -> "module:Class"
_FACTORIES: dict[str, str | dict[str, str]] = {
    "torch": {"gloo": "weightsync.transport.torch.gloo:GlooTransport",
              "nccl": "weightsync.transport.torch.nccl:NcclTransport"},
    "shm": "weightsync.transport.shm.transport:SharedMemoryTransport",
    "file": "weightsync.transport.file.transport:FileTransport",
    "nixl": {"pull": "weightsync.transport.nixl.pull:NixlPullTransport",
             "push": "weightsync.transport.nixl.push:NixlPushTransport"},
    "routed": "weightsync.transport.routed.transport:RoutedTransport",
}


def transport_class_path(name: str, ctx: TransportContext) -> str:
    """``module:Class`` implementing transport ``name`` for this job (resolving its mode)."""
    entry = _FACTORIES[name]
    if isinstance(entry, str):
        return entry
    if name == "torch":
        mode = torch_backend(ctx.device)
    else:
        from weightsync.transport.nixl.common import resolve_mode

        mode = resolve_mode(ctx.options.nixl_mode, num_writers=ctx.num_writers, num_readers=ctx.num_readers,
                            delta=bool(ctx.options.delta_anchor_every))
    logger.debug("transport %s -> mode %s", name, mode)
    return entry[mode]


def _nixl_missing() -> str | None:
    if importlib.util.find_spec("nixl_cu12") or importlib.util.find_spec("nixl"):
        return None
    return "NIXL is not installed (pip install 'weightsync[nixl]')"


def _shm_missing() -> str | None:
    import os

    return None if os.path.isdir("/dev/shm") else "/dev/shm is not available on this system"


_PROBES: dict[str, Callable[[], str | None]] = {"nixl": _nixl_missing, "shm": _shm_missing, "routed": _shm_missing}


def unavailable_reason(name: str) -> str | None:
    """None when transport ``name`` can be used here, else why not."""
    if name not in _FACTORIES:
        return f"unknown transport {name!r}; known: {sorted(_FACTORIES)}"
    probe = _PROBES.get(name)
    return probe() if probe else None


def available_transports() -> list[str]:
    return [name for name in _FACTORIES if unavailable_reason(name) is None]


def create_transport(name: str, ctx: TransportContext) -> Transport:
    reason = unavailable_reason(name) or _nccl_missing(name, ctx)
    if reason:
        raise ValueError(f"transport {name!r} cannot be used: {reason}")
    check_delta_carried(name, ctx)
    return _class_of(name, ctx)(ctx)  # type: ignore[no-any-return]


def _nccl_missing(name: str, ctx: TransportContext) -> str | None:
    """Why ``name`` cannot move this job's GPU memory here: its NCCL mode (torch between GPUs,
    and routed's torch route) drives NCCL through nccl4py (transport/torch/nccl_comm.py)."""
    if name not in ("torch", "routed") or torch_backend(ctx.device) != "nccl":
        return None
    from weightsync.transport.torch.nccl_comm import nccl4py_missing

    return nccl4py_missing()


def check_delta_carried(name: str, ctx: TransportContext) -> None:
    """Refuse ``delta_anchor_every`` where transport ``name`` (in this job's mode, and for
    ``routed`` both its routes) would send full versions anyway: a setting is never ignored.
    (routed's shm route carries deltas in host memory only: refused here on GPU memory, at
    creation, rather than when its shm part is set up in ``prepare``.)"""
    anchor = ctx.options.delta_anchor_every
    if not anchor:
        return
    for route in ("shm", "torch") if name == "routed" else (name,):
        cls = _class_of(route, ctx)
        if not getattr(cls, "carries_deltas", False):
            where = f"the {name} transport" if route == name else f"the {name} transport's {route} route"
            raise ValueError(f"{ctx.who}: delta_anchor_every={anchor} is not supported by {where} "
                             f"({cls.__name__}, on {ctx.device}): it would send every version in full. Deltas "
                             "run over torch (gloo between CPU ranks, NCCL between GPUs), and over shm, nixl, "
                             "file and routed between CPU ranks; use one of those, or delta_anchor_every=0")
        if name == "routed" and route == "shm":
            from weightsync.transport.delta.published import check_delta

            check_delta("routed", ctx)  # its same-node pairs go through CUDA IPC


def _class_of(name: str, ctx: TransportContext) -> Any:
    module, cls = transport_class_path(name, ctx).split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = [
    "TransferStats",
    "Transport",
    "TransportContext",
    "TransportError",
    "TransportOptions",
    "available_transports",
    "check_delta_carried",
    "create_transport",
    "transport_class_path",
    "unavailable_reason",
]
