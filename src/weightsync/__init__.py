"""weightsync: planned, zero-redundancy, in-place weight sync from training into inference.

    from weightsync import SyncConfig, WeightReader, WeightWriter

The user-facing roles are imported lazily, so ``import weightsync`` stays cheap (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from weightsync.roles.inflight import InflightReader
    from weightsync.roles.reader import UpdateResult, WeightReader
    from weightsync.roles.tensorstore import StoreConfig, TensorSlice, TensorStore
    from weightsync.roles.writer import PolicyNotMetError, ReadersFailedError, WeightWriter, WriteResult
    from weightsync.session.sync_session import SyncConfig, SyncError, TransportOptions
    from weightsync.transport.shm.files import SharedTensors, share_tensors

_LAZY = {
    "SyncConfig": "weightsync.session.sync_session", "SyncError": "weightsync.session.sync_session",
    "TransportOptions": "weightsync.session.sync_session",
    "WeightWriter": "weightsync.roles.writer", "WriteResult": "weightsync.roles.writer",
    "ReadersFailedError": "weightsync.roles.writer", "PolicyNotMetError": "weightsync.roles.writer",
    "WeightReader": "weightsync.roles.reader", "UpdateResult": "weightsync.roles.reader",
    "InflightReader": "weightsync.roles.inflight",
    "TensorStore": "weightsync.roles.tensorstore", "StoreConfig": "weightsync.roles.tensorstore",
    "TensorSlice": "weightsync.roles.tensorstore",
    "share_tensors": "weightsync.transport.shm.files", "SharedTensors": "weightsync.transport.shm.files",
}

__all__ = ["InflightReader", "PolicyNotMetError", "ReadersFailedError", "SharedTensors", "StoreConfig", "SyncConfig",
           "SyncError", "TensorSlice", "TensorStore",
           "TransportOptions", "UpdateResult", "WeightReader", "WeightWriter", "WriteResult", "share_tensors"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
