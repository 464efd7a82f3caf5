"""weightsync on Ray: the meta server as a named actor, and trainer/rollout actors as ranks.

    from weightsync.integrations.ray import SyncActor, attach_readers, attach_writers, meta_server

    @ray.remote
    class Trainer(SyncActor):
        def weightsync_source(self): return ModuleSource(self.model, hf_config)
        def step(self, v): ...; return self.weightsync_write(v)

    @ray.remote
    class Rollout(SyncActor):
        def weightsync_engine(self): return HFEngine(self.model)

    meta = meta_server()                                   # named, detached; found by name
    attach_writers(trainers, SyncConfig(num_writers=2, num_readers=4), meta)   # ranks = list order
    attach_readers(rollouts, SyncConfig(num_writers=2, num_readers=4), meta)

Every rank publishes its Ray node id as its node, so ``transport="auto"`` moves bytes over
shared memory between actors on one Ray node and over torch (gloo/NCCL) between nodes, per
pair (:mod:`weightsync.transport.routed.transport`). ``ray`` is imported only inside this package
(extra ``weightsync[ray]``); see docs/distributed.md.
"""

from __future__ import annotations

from weightsync.integrations.ray.actors import SyncActor, attach_readers, attach_writers, node_identity, rejoin
from weightsync.integrations.ray.meta import MetaConnection, meta_server, stop_meta_server

__all__ = ["MetaConnection", "SyncActor", "attach_readers", "attach_writers", "meta_server", "node_identity",
           "rejoin", "stop_meta_server"]
