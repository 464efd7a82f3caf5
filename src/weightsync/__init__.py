"""weightsync: planned, zero-redundancy, in-place weight sync from training into inference.

    from weightsync import SyncConfig, WeightReader, WeightWriter

The user-facing roles are imported lazily, so ``import weightsync`` stays cheap (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from weightsync.inflight import InflightReader
    from weightsync.reader import UpdateResult, WeightReader
    from weightsync.session import SyncConfig, SyncError, TransportOptions
    from weightsync.tensorstore import StoreConfig, TensorSlice, TensorStore
    from weightsync.transport.shm_files import SharedTensors, share_tensors
    from weightsync.writer import ReadersFailedError, WeightWriter, WriteResult

_LAZY = {
    "SyncConfig": "weightsync.session", "SyncError": "weightsync.session", "TransportOptions": "weightsync.session",
    "WeightWriter": "weightsync.writer", "WriteResult": "weightsync.writer", "ReadersFailedError": "weightsync.writer",
    "WeightReader": "weightsync.reader", "UpdateResult": "weightsync.reader",
    "InflightReader": "weightsync.inflight",
    "TensorStore": "weightsync.tensorstore", "StoreConfig": "weightsync.tensorstore",
    "TensorSlice": "weightsync.tensorstore",
    "share_tensors": "weightsync.transport.shm_files", "SharedTensors": "weightsync.transport.shm_files",
}

__all__ = ["InflightReader", "ReadersFailedError", "SharedTensors", "StoreConfig", "SyncConfig", "SyncError",
           "TensorSlice", "TensorStore",
           "TransportOptions", "UpdateResult", "WeightReader", "WeightWriter", "WriteResult", "share_tensors"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
