"""Peer copies (``SyncConfig.peer_sources``, issue 36's fan-out): engines that join take their first
version from the engines beside them, and the trainers' bytes per version do not grow with the
readers. The rules are in :mod:`weightsync.roles.peer_copies`."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import threading
import types
import uuid

import pytest
import torch

from test_quant import config
from weightsync import SyncConfig
from weightsync.engines.buffers import ShardedEngine
from weightsync.job.wire import PeerCopy, WireError
from weightsync.layout.wire import LayoutDecoder, encode_descriptor
from weightsync.plan import build_local_plan
from weightsync.roles.peer_copies import Found, PeerCopies, needed_bytes, serving_order
from weightsync.tools.tiny import canonical_weights
from weightsync.tools.torch_layout import fill_from_canonical
from weightsync.transport import TransportError, TransportOptions
from weightsync.transport.shm.peer_copy import HeldCopy, map_copy


def _versions(cfg, seeds: list[int]):
    """The writers' weights of each version (1-based, bf16), and whether an engine holds one."""

    def weights(version: int) -> dict[str, torch.Tensor]:
        return {n: t.to(torch.bfloat16) for n, t in canonical_weights(cfg, seeds[version - 1]).items()}

    def holds(engine: ShardedEngine, version: int) -> bool:
        return all(torch.equal(engine.tensors[n], w) for n, w in weights(version).items())

    return weights, holds


def _close(readers, metas) -> None:
    for reader in readers:
        reader.close()
    for meta in metas:
        meta.close()


def _ends_on(engines, holds, readers, keepers: int, integrity: bool, results, versions: list[int], share: int) -> None:
    """Every engine holds the last version; the keepers' copies carried the writers' digests (or
    none); the writer sent each version once, one reader's share, whatever the readers."""
    for seat, engine in enumerate(engines):
        assert holds(engine, versions[-1]), seat
    for seat in range(keepers):
        assert readers[seat]._peers._kind == ("xxh3" if integrity else ""), seat
    writes = [json.loads(line) for line in results.read_text().splitlines()]
    assert [w["version"] for w in writes] == versions
    assert {w["nbytes"] for w in writes} == {share}, writes


def _together(run, seats: range, until: int | None, errors: list[BaseException]) -> None:
    """``run(seat, until)`` for each seat at once, in threads; every one ends, and none failed."""
    threads = [threading.Thread(target=run, args=(seat, until)) for seat in seats]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors


def test_joiners_at_consecutive_seats_start_at_different_peers():
    assert serving_order([0, 1, 2, 3], 4) == [0, 1, 2, 3]
    assert serving_order([0, 1, 2, 3], 5) == [1, 2, 3, 0]
    assert serving_order([3, 1], 6) == [1, 3]
    assert serving_order([], 6) == []


def test_peer_sources_are_checked_where_they_are_written():
    with pytest.raises(ValueError, match=r"peer_sources must be in 0\.\.4 \(the job's reader seats"):
        SyncConfig(num_writers=1, num_readers=4, peer_sources=5)
    config = SyncConfig(num_writers=1, num_readers=None, transport="shm", peer_sources=3, integrity=True)
    assert SyncConfig.from_wire(config.to_wire()) == config


def test_a_peer_copy_record_round_trips_and_a_malformed_one_names_its_field():
    record = PeerCopy(7, "fp-ab", 3, "node-a", "/dev/shm/x", 1024, "xxh3")
    assert PeerCopy.from_wire(record.to_wire()) == record
    with pytest.raises(WireError, match="field 'path' must be a str"):
        PeerCopy.from_wire({**record.to_wire(), "path": 5})


def _plan_against(peers: dict[int, ShardedEngine], me: ShardedEngine, cfg: dict):
    decoder = LayoutDecoder(lambda digest: cfg)
    blob = encode_descriptor(me.layout_text, "m")
    src = decoder.roster([(seat, encode_descriptor(e.layout_text, "m")) for seat, e in peers.items()])
    return build_local_plan(src, decoder.roster([(me.rank, blob)]), role="reader", rank=me.rank)


def test_a_copy_rewritten_while_a_joiner_copies_is_torn_and_a_tensor_parallel_joiner_reads_a_replica():
    """The held copy's word is read before and after: a holder that rewrote its copy in between
    (it applied the next version) makes the joiner's copy torn, named, whatever bytes landed.
    A joiner of another layout (TP 2 of a replica) plans against the peer's and copies its slices."""
    cfg = config(hidden=128, inter=192)
    peer = ShardedEngine("hf:replicas=2", cfg, 0)
    fill_from_canonical(peer.layout(), peer.tensors, canonical_weights(cfg, 5))
    held = HeldCopy(0, peer.tensors)
    path = held.path
    try:
        held.hold(5, {n: t.view(-1) for n, t in peer.tensors.items()})
        mapped = map_copy(held.path, 0)
        assert mapped.holds() == 5 and held.version == 5
        joiner = ShardedEngine("vllm:tp=2", cfg, 1)
        plan = _plan_against({0: peer}, joiner, cfg)
        assert sum(op.nbytes for op in plan.ops) + sum(op.nbytes for op in plan.copy_ops) == \
            needed_bytes(joiner.layout())
        session = types.SimpleNamespace(channel=types.SimpleNamespace(who="reader 1"),
                                        config=types.SimpleNamespace(peer_sources=1, integrity=False), rank=1)
        copies = PeerCopies(session)  # type: ignore[arg-type]
        found = Found(PeerCopy(5, "fp", 0, "h", held.path, held.nbytes), plan, (mapped,))
        assert copies.take(found, joiner.tensors) == {0: needed_bytes(joiner.layout())}
        fresh = ShardedEngine("vllm:tp=2", cfg, 1)
        fill_from_canonical(fresh.layout(), fresh.tensors, canonical_weights(cfg, 5))
        for name, tensor in fresh.tensors.items():
            assert torch.equal(joiner.tensors[name], tensor), name
        held.hold(6, {n: t.view(-1) for n, t in peer.tensors.items()})  # the holder moved on
        with pytest.raises(TransportError, match=r"reader\(s\) \[0\] rewrote their peer copy of version 5 while "
                                                 r"reader 1 copied it"):
            copies.take(found, joiner.tensors)
    finally:
        held.close()
    with pytest.raises(TransportError, match=r"reader 0's peer copy .* is gone"):
        map_copy(path, 0)


def test_with_integrity_a_joiner_checks_every_box_it_copied_against_the_writers_digests():
    """The peer keeps the writers' digest of each box beside its copy; a joiner of its layout
    digests each box where it landed and compares: a byte flipped in the copy is named (shard,
    offset, box), before the engine may apply it."""
    from weightsync.transport.digests import op_digest
    from weightsync.transport.shm.peer_copy import digest_entries

    cfg = config(hidden=128, inter=192)
    peer, joiner = ShardedEngine("hf:replicas=2", cfg, 0), ShardedEngine("hf:replicas=2", cfg, 1)
    fill_from_canonical(peer.layout(), peer.tensors, canonical_weights(cfg, 5))
    flats = {n: t.view(-1) for n, t in peer.tensors.items()}
    plan = _plan_against({0: peer}, joiner, cfg)
    checked = [(op, op_digest(flats, op, "xxh3", side="writer")) for op in plan.ops]  # as the writers sent them
    held = HeldCopy(0, peer.tensors, entries=len(checked))
    try:
        held.hold(5, flats, digest_entries(list(flats), checked))
        session = types.SimpleNamespace(channel=types.SimpleNamespace(who="reader 1"), rank=1,
                                        config=types.SimpleNamespace(peer_sources=1, integrity=True),
                                        planned=types.SimpleNamespace(digests=types.SimpleNamespace(kind="xxh3")))
        copies = PeerCopies(session)  # type: ignore[arg-type]
        found = Found(PeerCopy(5, "fp", 0, "h", held.path, held.nbytes, "xxh3"), plan, (map_copy(held.path, 0),))
        assert copies.take(found, joiner.tensors) == {0: needed_bytes(joiner.layout())}
        for name, tensor in peer.tensors.items():
            assert torch.equal(joiner.tensors[name], tensor), name
        name = "model.layers.0.mlp.down_proj.weight"
        offset = held.table[name][0]
        held.segment.data[offset + 10] ^= 1  # one bit of the copy, after the peer checked it
        with pytest.raises(TransportError, match=r"1 of \d+ boxes copied from reader 0's peer copy of version 5 differ "
                                                 r"from the writers' digests: model\.layers\.0\.mlp\.down_proj\.weight at 0"):
            copies.take(found, joiner.tensors)
    finally:
        held.close()


def test_a_plans_digest_table_refilled_with_the_next_versions_digests_is_the_table_built_for_them():
    """A keeping reader builds its digest table once per plan and refills only the digests each
    version: the same rows as a table built from scratch for that version's digests."""
    from weightsync.transport.digests import op_digest
    from weightsync.transport.shm.peer_copy import digest_entries, refill_digests

    cfg = config(hidden=128, inter=192)
    peer, joiner = ShardedEngine("hf:replicas=2", cfg, 0), ShardedEngine("hf:replicas=2", cfg, 1)
    plan = _plan_against({0: peer}, joiner, cfg)
    names = list(peer.tensors)
    digests = {}
    for seed in (5, 6):
        fill_from_canonical(peer.layout(), peer.tensors, canonical_weights(cfg, seed))
        flats = {n: t.view(-1) for n, t in peer.tensors.items()}
        digests[seed] = [(op, op_digest(flats, op, "xxh3", side="writer")) for op in plan.ops]
    table = digest_entries(names, digests[5])
    assert not torch.equal(table, digest_entries(names, digests[6]))
    assert torch.equal(refill_digests(table, digests[6]), digest_entries(names, digests[6]))


@pytest.mark.parametrize("integrity", [False, True], ids=["plain", "integrity"])
def test_late_readers_take_their_first_version_from_the_peers_and_the_writer_sends_each_version_once(tmp_path,
                                                                                                      integrity):
    """Issue 36's fan-out test: 1 writer, 8 readers. Readers 0-3 (peer sources) take version 1;
    readers 4-7 join late and take version 1 from them, each from another peer (seat mod 4), not
    from the writer; then all eight follow the writer to version 3. The writer's bytes per
    version are one reader's share whether 4 or 8 readers read it, and every engine ends bitwise
    on version 3, each tensor of which differs from version 1's. With ``integrity``, each joiner
    checks every box it copied against the writers' digests the peer kept. A ninth reader joining beside
    them finds its peer copy torn (the holder rewrote it under the copy): its engine is told, and
    it reads the writer instead, ending on a whole version, never a mix."""
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncError
    from writer_process import writer_processes

    cfg = config(hidden=256, inter=320)
    seeds = [2, 1, 3]
    job = f"peers-{uuid.uuid4().hex[:8]}"
    results = tmp_path / "writes.jsonl"
    engines = [ShardedEngine("hf:replicas=9", cfg, seat) for seat in range(9)]
    sync = SyncConfig(num_writers=1, num_readers=None, job=job, transport="shm", timeout=60, peer_sources=4,
                      integrity=integrity)

    weights, holds = _versions(cfg, seeds)

    assert all(not torch.equal(weights(1)[n], weights(3)[n]) for n in weights(1))
    with EmbeddedMetaServer() as server, writer_processes(server, cfg, "fsdp:dp=1", job=job, seeds=seeds,
                                                          extra=("--transport", "shm", "--elastic", "--peer-sources",
                                                                 "4", "--results", str(results),
                                                                 *(("--integrity",) if integrity else ()))):
        metas = [MetaClient(server.address, job=job, token=server.token) for _ in engines]
        readers = [WeightReader(engine, rank=seat, config=sync, meta=meta)
                   for seat, (engine, meta) in enumerate(zip(engines, metas, strict=True))]
        firsts: dict[int, object] = {}
        errors: list[BaseException] = []

        def run(seat: int, until: int | None) -> None:
            try:
                try:
                    firsts[seat] = readers[seat].update(timeout=60)
                except SyncError as exc:  # reader 8 reads the writer: with integrity, the version it adopts
                    if seat != 8 or not integrity:  # was planned with no digest for it, and fails untouched
                        raise
                    firsts[seat] = exc
                while until is not None and readers[seat].version != until:
                    readers[seat].update(timeout=60)
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)

        def together(seats: range, until: int | None) -> None:
            _together(run, seats, until, errors)

        aborted: list[int] = []

        def torn(found, buffers):
            engines[8].tensors[next(iter(engines[8].tensors))].view(-1)[0] = 7  # a byte landed, then it tore
            raise TransportError("reader(s) [0] rewrote their peer copy of version 1 while reader 8 copied it")

        readers[8]._peers.take = torn
        engines[8].abort = lambda version, error, abort=engines[8].abort: (aborted.append(version), abort(version, error))
        try:
            together(range(4), 1)  # the peer sources take version 1 (from the writer, or from each other)
            assert all(holds(engines[seat], 1) for seat in range(4))
            together(range(4, 9), None)  # the late readers' first update
            share = needed_bytes(engines[4].layout())
            for seat in range(4, 8):
                first = firsts[seat]
                assert first.version == 1 and holds(engines[seat], 1), seat
                assert first.peers == {seat % 4: share} and first.nbytes == share, (seat, first.peers)
            # the torn copy of version 1; then the writer's version: one planned with reader 8, or one it
            # adopted (with integrity that one has no digest for it, and fails untouched: it is told again)
            adopted_failed = isinstance(firsts[8], SyncError)
            assert aborted[0] == 1 and len(aborted) == (2 if adopted_failed else 1), aborted
            if adopted_failed:
                assert integrity and "planned before this reader joined the elastic set" in str(firsts[8]), firsts[8]
            else:
                assert firsts[8].peers == {} and holds(engines[8], firsts[8].version)
            together(range(9), 3)
        finally:
            _close(readers, metas)
    _ends_on(engines, holds, readers, 4, integrity, results, [1, 2, 3], share)  # once per version, 4 readers or 8


def test_a_phased_engine_under_layer_phases_is_refused_peer_copies_naming_both_settings():
    """An engine that stages phase by phase under ``layer_phases`` never holds a whole version in
    its receive buffers, so it could neither keep a copy nor take one; without layer phases it
    stages the whole model and takes part (the engine matrix's vLLM ``engine-hf-peers`` cell)."""
    from weightsync.engines.staging import StagedWeights
    from weightsync.layout import ModelSpec
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader

    spec = ModelSpec.from_hf_config(config(hidden=128, inter=192))
    with EmbeddedMetaServer() as server, MetaClient(server.address, job="phased", token=server.token) as meta:
        engine = StagedWeights(spec, dtype=torch.float32, device="cpu", rank=0)
        with pytest.raises(ValueError, match=r"peer_sources=1 with layer_phases=True and StagedWeights, which then "
                                             r"stages phase by phase"):
            WeightReader(engine, rank=0, meta=meta, config=SyncConfig(num_writers=1, num_readers=1, job="phased",
                                                                      peer_sources=1, layer_phases=True))
        WeightReader(engine, rank=0, meta=meta, config=SyncConfig(num_writers=1, num_readers=1, job="phased",
                                                                  peer_sources=1)).close()


def test_under_the_device_model_a_copy_is_whole_before_its_word_and_landed_before_the_checks():
    """GPU rules on CPU (tests/device_model.py): copies are queued and complete only at a
    synchronise (or at random), and memory with pending work read by another process is a hazard.
    The keeper's copies into its file complete before the word names the version, and the
    joiner's land before its local copies, its checks and its seqlock read: bitwise, no hazard."""
    from device_model import DeviceModel
    from weightsync.ports import device as device_port

    cfg = config(hidden=128, inter=192)
    peer, joiner = ShardedEngine("hf:replicas=2", cfg, 0), ShardedEngine("vllm:tp=1,replicas=2", cfg, 1)
    fill_from_canonical(peer.layout(), peer.tensors, canonical_weights(cfg, 5))
    held = HeldCopy(0, peer.tensors)
    model = DeviceModel(seed=11)
    try:
        with device_port.use(model):
            with model.as_process("keeper"):
                held.hold(5, {n: t.view(-1) for n, t in peer.tensors.items()})
            session = types.SimpleNamespace(channel=types.SimpleNamespace(who="reader 1"), rank=1,
                                            config=types.SimpleNamespace(peer_sources=1, integrity=False))
            found = Found(PeerCopy(5, "fp", 0, "h", held.path, held.nbytes), _plan_against({0: peer}, joiner, cfg),
                          (map_copy(held.path, 0),))
            with model.as_process("joiner"):
                assert PeerCopies(session).take(found, joiner.tensors) == {0: needed_bytes(joiner.layout())}  # type: ignore[arg-type]
    finally:
        held.close()
    assert model.violations == []
    fresh = ShardedEngine("vllm:tp=1,replicas=2", cfg, 1)
    fill_from_canonical(fresh.layout(), fresh.tensors, canonical_weights(cfg, 5))
    for name, tensor in fresh.tensors.items():
        assert torch.equal(joiner.tensors[name], tensor), name


needs_nixl = pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None,
                                reason="NIXL is not installed")


@needs_nixl
def test_a_copy_served_over_nixl_is_read_from_another_host_bitwise_and_a_rewritten_one_reads_as_torn():
    """A keeping reader's copy, served by its NIXL agent, read as a reader on another host reads
    it: only the shards asked for, bitwise, holding the version the keeper held. The keeper
    rewriting the copy between the two reads of its version word makes the read copy say it
    holds none (torn), as a local mapping would."""
    from weightsync.clock.deadline import Deadline
    from weightsync.job.wire import RemoteCopy
    from weightsync.transport.nixl import peer_read

    flats = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.randn(257).to(torch.bfloat16)}
    held = HeldCopy(0, flats)
    server = peer_read.CopyServer(0, "reader 0")
    try:
        held.hold(7, flats)
        remote = server.serve(held)
        assert RemoteCopy.from_wire(PeerCopy.from_wire(PeerCopy(7, "fp", 0, "node-a", held.path, held.nbytes, "",
                                                                remote).to_wire()).remote.to_wire()) == remote
        copy = peer_read.fetch_copy(remote, 0, {"b"}, table=False, who="reader 5", deadline=Deadline.after(20))
        assert copy.holds() == 7 and torch.equal(copy.flats["b"], flats["b"])
        assert not torch.equal(copy.flats["a"], flats["a"])  # not asked for: not read

        real = peer_read.NixlAgent.run_once
        reads = []

        def rewritten_between(agent, op, peer, descs, mem, deadline, **kw):  # the keeper applies version 8
            reads.append(kw["what"])
            if len(reads) == 3:
                held.segment.words[3] = 8
            return real(agent, op, peer, descs, mem, deadline, **kw)

        peer_read.NixlAgent.run_once = rewritten_between  # type: ignore[method-assign]
        try:
            torn = peer_read.fetch_copy(remote, 0, {"a", "b"}, table=False, who="reader 5",
                                        deadline=Deadline.after(20))
        finally:
            peer_read.NixlAgent.run_once = real  # type: ignore[method-assign]
        assert torn.holds() == -1 and len(reads) == 3, reads
        with pytest.raises(TransportError, match="reader 0's peer copy holds no shard 'c'"):
            peer_read.fetch_copy(remote, 0, {"c"}, table=False, who="reader 5", deadline=Deadline.after(5))
    finally:
        server.close()
        held.close()


def test_peers_across_hosts_is_refused_without_peer_sources_naming_both():
    with pytest.raises(ValueError, match=r"peers_across_hosts=True with peer_sources=0: no reader keeps a copy"):
        SyncConfig(num_writers=1, num_readers=2, peers_across_hosts=True)
    with pytest.raises(WireError, match=r"field 'remote': field 'address' must be >= 0"):
        PeerCopy.from_wire({"version": 1, "fingerprint": "f", "epoch": 0, "host": "h", "path": "/p", "nbytes": 1,
                            "digests": "", "remote": {"agent": b"x", "address": -1, "size": 1, "shards": {},
                                                      "entries_at": 0, "capacity": 0}})


@needs_nixl
@pytest.mark.parametrize("integrity", [False, True], ids=["plain", "integrity"])
def test_a_reader_on_a_new_host_takes_its_first_version_from_peers_on_another_host_over_nixl(tmp_path, integrity):
    """A replacement engine on a new node has no peer beside it: without ``peers_across_hosts``
    it read its first version from the trainers. Readers 0-1 keep copies on node-a; readers 2-3
    join late on node-b and take version 1 from them over NIXL, each from another peer, not from
    the writer (whose bytes per version stay one reader's share); then all four follow the writer
    to version 3, bitwise. With ``integrity`` the peer's digest table comes over NIXL too, and
    each joiner checks every box it read against it."""
    import dataclasses

    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from writer_process import writer_processes

    cfg = config(hidden=256, inter=320)
    seeds = [2, 1, 3]
    job = f"peers-afar-{uuid.uuid4().hex[:8]}"
    results = tmp_path / "writes.jsonl"
    engines = [ShardedEngine("hf:replicas=4", cfg, seat) for seat in range(4)]
    sync = SyncConfig(num_writers=1, num_readers=None, job=job, transport="nixl", timeout=60, peer_sources=2,
                      peers_across_hosts=True, transport_options=TransportOptions(nixl_mode="pull"), integrity=integrity)

    weights, holds = _versions(cfg, seeds)

    with EmbeddedMetaServer() as server, writer_processes(server, cfg, "fsdp:dp=1", job=job, seeds=seeds,
                                                          extra=("--transport", "nixl", "--nixl-mode", "pull",
                                                                 "--elastic", "--peer-sources", "2",
                                                                 "--peers-across-hosts", "--results", str(results),
                                                                 *(("--integrity",) if integrity else ()))):
        metas = [MetaClient(server.address, job=job, token=server.token) for _ in engines]
        readers = [WeightReader(engine, rank=seat, config=dataclasses.replace(sync, host="node-a" if seat < 2
                                                                              else "node-b"), meta=meta)
                   for seat, (engine, meta) in enumerate(zip(engines, metas, strict=True))]
        firsts: dict[int, object] = {}
        errors: list[BaseException] = []

        def run(seat: int, until: int | None) -> None:
            try:
                firsts[seat] = readers[seat].update(timeout=60)
                while until is not None and readers[seat].version != until:
                    readers[seat].update(timeout=60)
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)

        def together(seats: range, until: int | None) -> None:
            _together(run, seats, until, errors)

        try:
            together(range(2), 1)
            together(range(2, 4), None)  # the late readers, on another host
            share = needed_bytes(engines[2].layout())
            for seat in (2, 3):
                first = firsts[seat]
                assert first.version == 1 and holds(engines[seat], 1), seat
                assert first.peers == {seat % 2: share} and first.nbytes == share, (seat, first.peers)
            together(range(4), 3)
        finally:
            _close(readers, metas)
    _ends_on(engines, holds, readers, 2, integrity, results, [1, 2, 3], share)  # once per version, 2 readers or 4


@contextlib.contextmanager
def _three_readers_under_a_quorum(tmp_path, seeds: list[int], job: str):
    """One writer process writing versions 1.. with ``seeds`` over shm under ``quorum=2`` of an
    elastic set; readers 0-1 keep peer copies, reader 2 does not. Yields (engines, readers,
    ``together(seats, until)``: those readers update until they hold ``until``, at once, and
    ``holds(engine, version)``); the writer's results file is checked by :func:`_ends_on`."""
    import dataclasses

    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from writer_process import writer_processes

    cfg = config(hidden=256, inter=320)
    engines = [ShardedEngine("hf:replicas=3", cfg, seat) for seat in range(3)]
    sync = SyncConfig(num_writers=1, num_readers=None, job=job, transport="shm", timeout=60, peer_sources=2,
                      completion="quorum=2")
    _, holds = _versions(cfg, seeds)
    with EmbeddedMetaServer() as server, writer_processes(server, cfg, "fsdp:dp=1", job=job, seeds=seeds,
                                                          extra=("--transport", "shm", "--elastic", "--peer-sources",
                                                                 "2", "--completion", "quorum=2", "--results",
                                                                 str(tmp_path / "writes.jsonl"))):
        metas = [MetaClient(server.address, job=job, token=server.token) for _ in engines]
        readers = [WeightReader(engine, rank=seat, config=dataclasses.replace(sync), meta=meta)
                   for seat, (engine, meta) in enumerate(zip(engines, metas, strict=True))]
        errors: list[BaseException] = []
        got: dict[int, list] = {0: [], 1: [], 2: []}

        def run(seat: int, until: int | None) -> None:
            try:
                got[seat].append(readers[seat].update(timeout=60))
                while until is not None and readers[seat].version != until:
                    got[seat].append(readers[seat].update(timeout=60))
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)

        try:
            yield engines, readers, lambda seats, until: (_together(run, seats, until, errors), got)[1], holds
        finally:
            _close(readers, metas)
    _ends_on(engines, holds, readers, 2, False, tmp_path / "writes.jsonl", list(range(1, len(seeds) + 1)),
             needed_bytes(engines[2].layout()))


def test_a_reader_that_missed_versions_catches_up_from_peers_and_one_that_follows_reads_the_writer(tmp_path):
    """Under a quorum a slow reader misses versions; it caught up by reading the newest from the
    writer, though the peers beside it held that version. Readers 0-1 keep copies, reader 2
    takes version 1, then misses versions 2 and 3 (the writer's quorum of 2 is met by 0 and 1):
    its next update takes version 3 from a peer, whole and bitwise, and the writer's bytes per
    version stay one reader's share. A reader that missed nothing (it follows) still reads the
    writer: version 4 comes to reader 2 from the writer."""
    job = f"peers-lag-{uuid.uuid4().hex[:8]}"
    with _three_readers_under_a_quorum(tmp_path, [2, 1, 3, 5], job) as (engines, readers, together, holds):
        together(range(3), 1)
        together(range(2), 3)  # reader 2 misses versions 2 and 3
        share = needed_bytes(engines[2].layout())
        caught = readers[2].update(timeout=60)
        assert caught.version == 3 and holds(engines[2], 3)
        assert sum(caught.peers.values()) == share and set(caught.peers) <= {0, 1}, caught.peers
        follows = together(range(3), 4)[2][-1]
        assert follows.version == 4 and follows.peers == {} and holds(engines[2], 4), follows


def test_a_reader_that_failed_the_last_version_from_the_writers_takes_it_from_the_peers_that_hold_it(
        tmp_path, monkeypatch):
    """A reader that failed version V from the writers waited for a newer one, though the peers
    beside it held V: when V was the trainers' last version (or their steps are long) it stayed
    behind (a NIXL push reader that comes to V after the writer sent it fails V at once). Here
    reader 2 lags: it took version 1, and readers 0 and 1 met the quorum of versions 2 and 3, the
    last. As it asks for version 3, its peers do not hold it yet and the writers' transport
    fails it. Its next update takes version 3 from a peer, bitwise."""
    from weightsync.roles.reader import SyncError

    def fails(version, **kwargs):
        raise TransportError(f"reader 2: writer 0 sent version {version} without this reader")

    job = f"peers-failed-{uuid.uuid4().hex[:8]}"
    with _three_readers_under_a_quorum(tmp_path, [2, 1, 3], job) as (engines, readers, together, holds):
        together(range(3), 1)
        together(range(2), 3)  # reader 2 misses versions 2 and 3, the last
        lagging = readers[2]
        with monkeypatch.context() as patch:
            patch.setattr(lagging._peers, "find", lambda **kwargs: None)  # the peers do not hold it yet
            patch.setattr(lagging.session.planned.transport, "receive", fails)
            with pytest.raises(SyncError, match="version 3 failed: reader 2: writer 0 sent version 3 without"):
                lagging.update(timeout=10)
        caught = lagging.update(timeout=10)
        assert caught.version == 3 and holds(engines[2], 3)
        assert set(caught.peers) <= {0, 1} and sum(caught.peers.values()) == needed_bytes(engines[2].layout())
