"""FP8 and bf16 readers of one job, over every transport: three training processes (FSDP rows
cut inside FP8 blocks, their maxima exchanged through the meta server) write two versions, and
each reader gets its own format, bitwise (the reference quantization is tests/test_quant.py's)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import pytest
import torch

from test_quant import check_hf_reader, config
from weightsync.layout import ModelSpec
from weightsync.tools.tiny import canonical_weights
from weightsync.transport import TransportOptions


@contextlib.contextmanager
def _readers_first(errors: list[BaseException]) -> Iterator[None]:
    """A writer process that failed because a reader gave up names the reader, not itself: the
    readers' own errors come first in the failure."""
    try:
        yield
    except AssertionError as exc:
        if errors:
            raise AssertionError(f"readers failed: {errors!r}; then a writer: {str(exc)[-1500:]}") from exc
        raise


#: variants of a transport: (transport, writer flags, reader settings)
FP8_VARIANTS = {"shm-phases": ("shm", ("--layer-phases", "--bucket", "65536"),
                               {"layer_phases": True, "transport_options": TransportOptions(max_bucket_bytes=65536)}),
                "torch-delta": ("torch", ("--delta", "4"), {"transport_options": TransportOptions(delta_anchor_every=4)})}


@pytest.mark.parametrize("transport", ["shm", "torch", "file", "nixl", "routed", "shm-phases", "torch-delta"])
def test_fp8_and_bf16_readers_from_three_training_processes(transport):
    """Three FSDP ranks (rows cut inside blocks: maxima exchanged through the meta server) write two
    versions; an FP8 reader and a bf16 reader of the same job each get their own format, bitwise.
    Also in layer phases (into engines that hold the whole model) and with deltas."""
    import sys
    import uuid
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig
    from weightsync.transport import unavailable_reason
    from writer_process import writer_processes

    transport, flags, settings = FP8_VARIANTS.get(transport, (transport, (), {}))
    if unavailable_reason(transport):
        pytest.skip(unavailable_reason(transport))
    # routed: writers 0 and 2 with reader 0 on node a (shared memory), writer 1 and reader 1 on node b (torch)
    writer_hosts, reader_hosts = ("a,b,a", ["a", "b"]) if transport == "routed" else ("", ["", ""])
    cfg = config(hidden=256, inter=320)
    job = f"fp8-{uuid.uuid4().hex[:8]}"
    engines = [ShardedEngine("hf:quant=fp8_block", cfg, 0), ShardedEngine("hf:replicas=2", cfg, 1)]
    errors: list[BaseException] = []
    with _readers_first(errors), EmbeddedMetaServer() as server, writer_processes(server, cfg, "fsdp:dp=3", job=job, seeds=[2, 1],
                                                          extra=("--transport", transport, "--readers", "2",
                                                                 "--hosts", writer_hosts, *flags)):
        sync = SyncConfig(num_writers=3, num_readers=2, job=job, transport=transport, timeout=120, **settings)

        def read(rank: int) -> None:
            try:
                with MetaClient(server.address, job=job, token=server.token) as meta, \
                        WeightReader(engines[rank], rank=rank, config=dataclasses.replace(sync, host=reader_hosts[rank]),
                                     meta=meta) as reader:
                    for version in (1, 2):
                        assert reader.update(version).version == version
                        if version == 1:
                            snapshot[rank] = {n: t.clone() for n, t in engines[rank].tensors.items()}
                    # a reader done first stays until the other is done too: over gloo a reader that
                    # leaves (releases its lease) reads as dead to the one still receiving
                    done.wait(timeout=120)
            except BaseException as exc:  # re-raised below, in the test's thread
                errors.append(exc)
                done.abort()  # the other reader stops waiting for this one

        snapshot: dict[int, dict] = {}
        done = threading.Barrier(2)
        threads = [threading.Thread(target=read, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
    assert not errors, errors
    spec = ModelSpec.from_hf_config(cfg)
    for version, seed, tensors in ((1, 2, snapshot[0]), (2, 1, engines[0].tensors)):
        weights = {n: t.to(torch.bfloat16) for n, t in canonical_weights(cfg, seed).items()}
        check_hf_reader({"spec": spec, "weights": weights, "dst": {0: tensors}}, "fp8_block")
        plain = snapshot[1] if version == 1 else engines[1].tensors
        for name, weight in weights.items():
            assert torch.equal(plain[name], weight), (version, name)


def test_an_fp8_reader_that_joins_an_elastic_set_late_gets_its_own_format_bitwise():
    """``num_readers=None`` over shared memory (issue 36): a bf16 engine joins first and takes
    version 1; an FP8 engine joins after that. Writers quantize for it from the first version
    planned with it; a version it adopts that was planned without it has no FP8 piece in the
    writers' slots and fails on it before a byte lands (its engine keeps what it held). Both end
    on the last version, each in its own format, bitwise, and every version a reader reports
    is what its engine holds."""
    import sys
    import uuid
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import time

    from weightsync.clock.deadline import Deadline
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.job.keys import layouts_key
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig, SyncError
    from writer_process import writer_processes

    cfg = config(hidden=256, inter=320)
    spec = ModelSpec.from_hf_config(cfg)
    seeds = [2, 1, 3]
    job = f"fp8-elastic-{uuid.uuid4().hex[:8]}"
    plain, fp8 = ShardedEngine("hf:replicas=2", cfg, 0), ShardedEngine("hf:quant=fp8_block,replicas=2", cfg, 1)
    sync = SyncConfig(num_writers=3, num_readers=None, job=job, transport="shm", timeout=60)
    last = len(seeds)

    def weights(version: int) -> dict[str, torch.Tensor]:
        return {n: t.to(torch.bfloat16) for n, t in canonical_weights(cfg, seeds[version - 1]).items()}

    def holds_plain(version: int) -> bool:
        return all(torch.equal(plain.tensors[n], w) for n, w in weights(version).items())

    with EmbeddedMetaServer() as server, writer_processes(server, cfg, "fsdp:dp=3", job=job, seeds=seeds,
                                                          extra=("--transport", "shm", "--elastic")), \
            MetaClient(server.address, job=job, token=server.token) as meta, \
            WeightReader(plain, rank=0, config=sync, meta=meta) as first:
        assert first.update(1).version == 1 and holds_plain(1)
        failed: list[str] = []
        errors: list[BaseException] = []

        def late() -> None:
            try:
                with MetaClient(server.address, job=job, token=server.token) as meta2, \
                        WeightReader(fp8, rank=1, config=sync, meta=meta2) as reader:
                    for _ in range(2 * last):
                        try:
                            if reader.update(timeout=60).version == last:
                                return
                        except SyncError as exc:  # adopted a version planned without it
                            failed.append(str(exc))
                    raise AssertionError(f"the FP8 reader never reached version {last}: {failed}")
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)

        thread = threading.Thread(target=late)
        thread.start()
        # the bf16 engine takes version 2 (so the writers plan version 3) once the FP8 engine's join is
        # recorded: version 3 is planned with it, version 2 with or without it
        deadline = Deadline.after(60)
        while meta.counter(layouts_key()) < 2 and errors == [] and not deadline.expired:
            time.sleep(0.02)
        assert meta.counter(layouts_key()) >= 2, errors
        for version in range(2, last + 1):
            assert first.update(version, timeout=60).version == version and holds_plain(version), version
        thread.join(timeout=120)
        assert not thread.is_alive() and not errors, errors
    # at most the versions planned before it joined, each named as such: the one it adopted on
    # joining, and the next when the free-running writers planned it before the join was recorded
    # (seen once under a loaded suite: versions 1 and 2)
    assert len(failed) <= 2 and all("planned before this reader joined the elastic set" in f
                                    and "another process" not in f for f in failed), failed
    check_hf_reader({"spec": spec, "weights": weights(last), "dst": {0: fp8.tensors}}, "fp8_block")


def test_an_engine_of_another_model_joining_an_elastic_set_is_refused_and_the_writers_go_on():
    """``num_readers=None`` over shared memory: an engine whose model differs from the trainers'
    (another width) joins a running set. Its join used to make every writer plan for it and fail
    (tensors of shapes no writer holds): one misconfigured engine ended the training job. The
    joining reader now plans its share against the writers before it joins, and refuses itself
    naming the mismatch; the writers never see it, and the engine already in the set takes
    every version, bitwise."""
    import sys
    import uuid
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.job.keys import layouts_key
    from weightsync.meta.client import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig
    from writer_process import writer_processes

    cfg, other = config(hidden=256, inter=320), config(hidden=128, inter=320)
    seeds = [2, 1]
    job = f"elastic-other-{uuid.uuid4().hex[:8]}"
    engine = ShardedEngine("hf:replicas=2", cfg, 0)
    sync = SyncConfig(num_writers=3, num_readers=None, job=job, transport="shm", timeout=30)
    with EmbeddedMetaServer() as server, writer_processes(server, cfg, "fsdp:dp=3", job=job, seeds=seeds,
                                                          extra=("--transport", "shm", "--elastic")), \
            MetaClient(server.address, job=job, token=server.token) as meta, \
            WeightReader(engine, rank=0, config=sync, meta=meta) as first:
        assert first.update(1).version == 1
        with MetaClient(server.address, job=job, token=server.token) as meta2, \
                WeightReader(ShardedEngine("hf:replicas=2", other, 1), rank=1, config=sync, meta=meta2) as wrong, \
                pytest.raises(ValueError, match=r"reader 1 cannot join the job's elastic readers: .*shape"):
            wrong.update(timeout=30)
        assert meta.counter(layouts_key()) == 1  # only the first engine's join
        assert first.update(2, timeout=30).version == 2
    for name, weight in canonical_weights(cfg, seeds[-1]).items():
        assert torch.equal(engine.tensors[name], weight.to(torch.bfloat16)), name
