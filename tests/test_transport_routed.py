"""The routed transport: shm between same-node pairs, torch between nodes, per pair.

Two "nodes" in one process (ranks publish node names through ``SyncConfig.host``): writers
on node a, reader 0 on node a, reader 1 on node b. Each rank runs in its own thread.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fake_meta import FakeChannel
from weightsync.apps.demo import canonical_values
from weightsync.configs import load_spec
from weightsync.engines.buffers import ShardedEngine
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import WeightWriter
from weightsync.session.sync_session import SyncConfig
from weightsync.sources.module import ShardedSource
from weightsync.tools.devices import RankPlacement, choose_transport, same_node
from weightsync.tools.torch_layout import allocate, fill_from_canonical
from weightsync.transport import TransportOptions


def place(role, rank, node):
    return RankPlacement(role, rank, node)


def test_auto_routes_per_pair_when_some_writer_shares_a_node_with_a_reader():
    mixed = [place("writer", 0, "a"), place("reader", 0, "a"), place("reader", 1, "b")]
    choice = choose_transport("auto", mixed)
    assert choice.name == "routed" and "shm between same-node pairs" in choice.reason
    assert same_node(mixed) == {(0, 0): True, (0, 1): False}
    apart = [place("writer", 0, "a"), place("reader", 0, "b")]
    assert choose_transport("auto", apart).name == "torch"
    assert choose_transport("auto", mixed, unavailable={"shm": "no /dev/shm"}).name == "torch"


def test_routed_job_moves_same_node_pairs_over_shm_and_the_rest_over_torch():
    config = load_spec("tiny-qwen3-moe").to_hf_config()
    nodes = {("writer", 0): "a", ("writer", 1): "a", ("reader", 0): "a", ("reader", 1): "b"}
    versions = [1, 2, 3]
    errors: list[BaseException] = []
    readers: dict[int, tuple[WeightReader, ShardedEngine]] = {}

    def sync_config(node):
        return SyncConfig(num_writers=2, num_readers=2, host=node, timeout=60,
                          transport_options=TransportOptions(max_bucket_bytes=1 << 16, direct_min_bytes=1024))

    def run_writer(server, rank):
        try:
            source = ShardedSource("megatron:tp=2", config, rank)
            with WeightWriter(source, rank=rank, config=sync_config(nodes[("writer", rank)]),
                              meta=MetaClient(server.address, token=server.token)) as writer:
                for v in versions:
                    fill_from_canonical(source.layout(), source.tensors(), canonical_values(config, v))
                    writer.write(v)
        except BaseException as exc:
            errors.append(exc)

    def run_reader(server, rank):
        try:
            engine = ShardedEngine("vllm:tp=1,replicas=2", config, rank)
            reader = WeightReader(engine, rank=rank, config=sync_config(nodes[("reader", rank)]),
                                  meta=MetaClient(server.address, token=server.token))
            readers[rank] = (reader, engine)
            for v in versions:
                assert reader.update(v, timeout=60).version == v
                want = allocate(engine.layout())
                fill_from_canonical(engine.layout(), want, canonical_values(config, v))
                assert all(torch.equal(engine.tensors[n], want[n]) for n in want), f"reader {rank} version {v}"
        except BaseException as exc:
            errors.append(exc)

    with EmbeddedMetaServer() as server:
        threads = [threading.Thread(target=run_writer, args=(server, r)) for r in range(2)]
        threads += [threading.Thread(target=run_reader, args=(server, r)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        try:
            assert not any(t.is_alive() for t in threads), "a rank did not finish"
            if errors:
                raise errors[0]
            for rank, (reader, _) in readers.items():
                planned = reader.session.planned
                assert planned is not None and planned.transport_name == "routed"
                transport = planned.transport
                need = planned.plan.total_bytes
                if rank == 0:  # same node as both writers
                    assert transport.routes == {"shm": [(0, 0), (1, 0)], "torch": []}
                    assert transport.last_bytes == {"shm": need, "torch": 0}
                else:
                    assert transport.routes == {"shm": [], "torch": [(0, 1), (1, 1)]}
                    assert transport.last_bytes == {"shm": 0, "torch": need}
        finally:
            for reader, _ in readers.values():
                reader.close()


@pytest.mark.parametrize("bad", [()])
def test_routed_refuses_a_context_without_placements(bad):
    from weightsync.transport import TransportContext, create_transport

    ctx = TransportContext(channel=FakeChannel("reader", 0), num_writers=1, num_readers=1,
                           placements=bad)
    with pytest.raises(ValueError, match="routed transport needs every rank's node"):
        create_transport("routed", ctx)
