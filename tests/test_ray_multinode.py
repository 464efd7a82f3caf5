"""Two Ray nodes on one machine: placement-routed transports, and a node lost mid-sync.

Node a (the head) runs both trainers and reader 0, node b reader 1; each node is its own
raylet (``ray.cluster_utils.Cluster``). Same-node pairs must go over shared memory and the
cross-node pairs over torch (gloo), every version bitwise; killing node b while the writers
are sending leaves reader 0 on a complete version, and reader 1 restarted on a new node
rejoins. Both "nodes" share /dev/shm and the host name, so only Ray's node ids tell them
apart.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="needs ray (pip install 'weightsync[ray]')")

import sys  # noqa: E402

from ray import cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from weightsync.integrations.ray import SyncActor, attach_readers, attach_writers, meta_server, rejoin, stop_meta_server  # noqa: E402
from weightsync.integrations.ray.actors import NODE_LABEL  # noqa: E402
from weightsync.session.sync_session import SyncConfig  # noqa: E402
from weightsync.transport import TransportOptions  # noqa: E402

# one Ray cluster at a time on a 2-core CI machine: every Ray test runs in one xdist worker
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray"), pytest.mark.timeout(240)]

CONFIG_NAME = "tiny-qwen3-moe"
WAIT = 60.0  # bounds failures only


class Trainer(SyncActor):
    def __init__(self, rank):
        import torch

        from weightsync.configs import load_spec
        from weightsync.sources.module import ShardedSource

        torch.set_num_threads(1)
        self.config = load_spec(CONFIG_NAME).to_hf_config()
        self.source = ShardedSource("megatron:tp=2", self.config, rank)

    def weightsync_source(self):
        return self.source

    def step(self, version, timeout=WAIT):
        from weightsync.apps.demo import canonical_values
        from weightsync.session.sync_session import SyncError
        from weightsync.tools.torch_layout import fill_from_canonical

        fill_from_canonical(self.source.layout(), self.source.tensors(), canonical_values(self.config, version))
        try:
            return self.weightsync_write(version, timeout=timeout)
        except SyncError as exc:
            return {"error": str(exc)}


class Rollout(SyncActor):
    def __init__(self, rank):
        import torch

        from weightsync.configs import load_spec
        from weightsync.engines.buffers import ShardedEngine

        torch.set_num_threads(1)
        self.config = load_spec(CONFIG_NAME).to_hf_config()
        self.engine = ShardedEngine("vllm:tp=1,replicas=2", self.config, rank)

    def weightsync_engine(self):
        return self.engine

    def sync(self, version):
        """Apply ``version``; whether every tensor equals that version's weights, bitwise."""
        import torch

        from weightsync.apps.demo import canonical_values
        from weightsync.tools.torch_layout import allocate, fill_from_canonical

        result = self.weightsync_update(version, timeout=WAIT)
        want = allocate(self.engine.layout())
        fill_from_canonical(self.engine.layout(), want, canonical_values(self.config, result["version"]))
        exact = all(torch.equal(self.engine.tensors[n], want[n]) for n in want)
        return {**result, "exact": exact, "routes": self.weightsync_routes()}

    def weight_version(self):
        return self.engine.weight_version


@pytest.fixture(scope="module")  # started once (20-30 s here); the tests leave node a as they found it
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 8}, "include_dashboard": False})
    node_b = c.add_node(num_cpus=1, resources={"node_b": 8}, labels={NODE_LABEL: "b"})
    ray.init(address=c.address, namespace="weightsync-test", log_to_driver=False)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor classes live in this file
    try:
        yield c, node_b
    finally:
        stop_meta_server()
        ray.shutdown()
        c.shutdown()
        from weightsync.transport.shm.files import sweep_stale_segments

        sweep_stale_segments()


def test_a_state_dir_the_running_meta_server_does_not_use_is_refused(tmp_path):
    from weightsync.integrations.ray.meta import check_state_dir

    check_state_dir(str(tmp_path), str(tmp_path / "."), "weightsync/meta")  # the same directory
    check_state_dir(str(tmp_path), None, "weightsync/meta")  # found by name, whatever it keeps
    with pytest.raises(ValueError, match=r"the meta server weightsync/meta already runs with no state_dir \(its "
                                         r"state is lost when it stops\), not state_dir='/x': stop it first"):
        check_state_dir("", "/x", "weightsync/meta")
    with pytest.raises(ValueError, match=r"already runs with state_dir='/a', not state_dir='/b'"):
        check_state_dir("/a", "/b", "weightsync/meta")


def spawn(cls, node, rank):
    return ray.remote(cls).options(num_cpus=0, resources={node: 1}, max_restarts=0).remote(rank)


def test_two_nodes_route_per_pair_and_survive_a_lost_node(cluster):
    c, node_b = cluster
    conn = meta_server()
    assert meta_server() == conn  # found by name: one server, one token
    with pytest.raises(ValueError, match=r"already runs with no state_dir .*, not state_dir='/never'"):
        meta_server(state_dir="/never")  # it would keep the job's state nowhere, silently
    config = SyncConfig(num_writers=2, num_readers=2, timeout=WAIT,
                        transport_options=TransportOptions(max_bucket_bytes=1 << 16, direct_min_bytes=1024))
    trainers = [spawn(Trainer, "node_a", r) for r in range(2)]
    rollouts = [spawn(Rollout, "node_a", 0), spawn(Rollout, "node_b", 1)]
    writers = attach_writers(trainers, config, conn)
    readers = attach_readers(rollouts, config, conn)
    head_id = writers[0]["node"]
    assert {w["node"] for w in writers} == {head_id} and readers[0]["node"] == head_id
    assert readers[1]["node"] == "label:b" != head_id  # a different Ray node on the same machine

    for v in (1, 2, 3):
        steps = [t.step.remote(v) for t in trainers]
        got = ray.get([r.sync.remote(v) for r in rollouts], timeout=WAIT)
        assert all("error" not in s for s in ray.get(steps, timeout=WAIT))
        assert [g["version"] for g in got] == [v, v] and all(g["exact"] for g in got)
    same, cross = got[0]["routes"], got[1]["routes"]
    assert same["transport"] == cross["transport"] == "routed"
    assert same["routes"] == {"shm": [(0, 0), (1, 0)], "torch": []}
    assert same["last_bytes"] == {"shm": same["plan_bytes"], "torch": 0}
    assert cross["routes"] == {"shm": [], "torch": [(0, 1), (1, 1)]}
    assert cross["last_bytes"] == {"shm": 0, "torch": cross["plan_bytes"]}

    # Version 4: reader 1 has not posted its receives when node b dies, so both writers are
    # mid-send over gloo; reader 0 (shared memory only) completes the version.
    steps = [t.step.remote(4, timeout=30.0) for t in trainers]
    got0 = ray.get(rollouts[0].sync.remote(4), timeout=WAIT)
    assert got0["version"] == 4 and got0["exact"]
    c.remove_node(node_b, allow_graceful=False)
    failed = ray.get(steps, timeout=WAIT)
    assert all("error" in s for s in failed), failed
    assert ray.get(rollouts[0].weight_version.remote(), timeout=WAIT) == 4

    # Reader 1 restarted on a replacement node (labelled as node b: it takes b's place) rejoins;
    # the job moves to a new epoch and goes on. The head node has no label: its Ray node id names it.
    c.add_node(num_cpus=1, resources={"node_c": 8}, labels={NODE_LABEL: "b"})  # a fresh resource: until
    rollouts[1] = spawn(Rollout, "node_c", 1)  # Ray's health check notices, dead node b still looks alive
    assert rejoin(rollouts[1], "reader", 1, config, conn)["node"] == readers[1]["node"] == "label:b"
    for v in (5, 6):
        steps = [t.step.remote(v) for t in trainers]
        got = ray.get([r.sync.remote(v) for r in rollouts], timeout=WAIT)
        assert all("error" not in s for s in ray.get(steps, timeout=WAIT))
        assert [g["version"] for g in got] == [v, v] and all(g["exact"] for g in got)
    ray.get([a.weightsync_leave.remote() for a in trainers + rollouts], timeout=WAIT)


def test_actors_attached_with_only_the_config_naming_an_etcd_cluster_sync_bitwise(cluster, tmp_path):
    """Issue 38's "the Ray integration can point the job at etcd": ``SyncConfig.meta_address``
    names a 3-member etcd cluster, ``attach_*`` get no ``meta=``, and no meta server actor runs."""
    from etcd_helpers import etcd_cluster, meta

    stop_meta_server()  # the other test's, if it ran first on this cluster
    etcd = etcd_cluster(tmp_path / "etcd")
    try:
        config = SyncConfig(num_writers=2, num_readers=2, timeout=WAIT, transport="shm", job="ray-etcd",
                            meta_address=etcd.address)
        trainers = [spawn(Trainer, "node_a", r) for r in range(2)]
        rollouts = [spawn(Rollout, "node_a", r) for r in range(2)]
        attach_writers(trainers, config)
        attach_readers(rollouts, config)
        for v in (1, 2):
            steps = [t.step.remote(v) for t in trainers]
            got = ray.get([r.sync.remote(v) for r in rollouts], timeout=WAIT)
            assert all("error" not in s for s in ray.get(steps, timeout=WAIT))
            assert [g["version"] for g in got] == [v, v] and all(g["exact"] for g in got)
        with meta(etcd.address, "ray-etcd") as c:
            assert c.latest_version().version == 2  # the job ran on etcd
        with pytest.raises(ValueError, match=r"Failed to look up actor"):  # the job started none
            ray.get_actor("weightsync-meta", namespace="weightsync")
        ray.get([a.weightsync_leave.remote() for a in trainers + rollouts], timeout=WAIT)
    finally:
        etcd.stop()
