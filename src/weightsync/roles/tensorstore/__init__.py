"""One-sided, versioned put / get of any named tensors, resharded on get (see ``store.py``).

    store = TensorStore(StoreConfig(job="rl", num_writers=W), rank=r)    # a writer
    store.put("value_head.weight", shard, where=TensorSlice.part(shape, index=r, count=W))
    store.complete(step)
    head = TensorStore(StoreConfig(job="rl")).get("value_head.weight")     # any reader

Modules: ``store`` (the :class:`TensorStore` handle and its config), ``arena`` (writers'
mapped arena files and the index readers map them by), ``slices`` (:class:`TensorSlice`).
"""

from weightsync.job.channel import STORE_FINGERPRINT
from weightsync.roles.tensorstore.slices import TensorSlice, slice_of
from weightsync.roles.tensorstore.store import StoreConfig, SupersededError, TensorStore

__all__ = ["STORE_FINGERPRINT", "StoreConfig", "SupersededError", "TensorSlice", "TensorStore", "slice_of"]
