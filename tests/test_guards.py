"""Inconsistent input is a clear error before any byte moves; ``write()`` tells the truth.

One writer and one reader in two threads of this process (an embedded meta server), on the
transports that need no extra: each test gives the job something wrong (source tensors in
the wrong dtype or shape, a transposed view, settings that differ between ranks, a reader
whose engine refuses the weights) and checks the error the user sees and that no reader
applied anything it should not have.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from weightsync import SyncConfig, WeightReader, WeightWriter
from weightsync.clock.deadline import Deadline
from weightsync.engines.buffers import ShardedEngine
from weightsync.layout import ModelSpec
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.session.sync_session import SyncError
from weightsync.sources.module import ShardedSource
from weightsync.tools.torch_layout import allocate, fill_from_canonical

pytestmark = pytest.mark.timeout(120)
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "vocab_size": 128, "torch_dtype": "float32"}
TRANSPORTS = ["torch", "shm", "file"]


def values(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(t.shape, generator=g) for n, t in ModelSpec.from_hf_config(CONFIG).canonical_tensors().items()}


def good_source(step: int = 0) -> ShardedSource:
    source = ShardedSource("hf", CONFIG, 0)
    fill_from_canonical(source.layout(), source.tensors(), values(step))
    return source


@pytest.fixture
def server():
    with EmbeddedMetaServer() as s:
        yield s


def client(server, job: str = "default") -> MetaClient:
    return MetaClient(server.address, token=server.token, job=job)


class ReaderThread:
    """A reader updating in a thread: its results or the exception that stopped it."""

    def __init__(self, reader: WeightReader, updates: int, timeout: float) -> None:
        self.reader, self.results, self.error = reader, [], None
        self.thread = threading.Thread(target=self._run, args=(updates, timeout), daemon=True)
        self.thread.start()

    def _run(self, updates: int, timeout: float) -> None:
        try:
            for _ in range(updates):
                self.results.append(self.reader.update(timeout=timeout))
        except BaseException as exc:
            self.error = exc

    def join(self) -> ReaderThread:
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self


# -- source tensors that disagree with the layout ------------------------------------------------

def _fp16(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.float16) for n, t in tensors.items()}


def _one_larger(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = "model.layers.0.mlp.down_proj.weight"
    t = tensors[name]
    return {**tensors, name: torch.zeros(t.shape[0] + 2, t.shape[1])}


def _one_smaller(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = "model.layers.0.mlp.down_proj.weight"
    t = tensors[name]
    return {**tensors, name: t[:-1].clone()}


def _transposed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = "model.layers.0.self_attn.o_proj.weight"  # square: a legal shape, but strided
    return {**tensors, name: tensors[name].t().contiguous().t()}


BAD_SOURCES: dict[str, tuple[Callable, str]] = {
    "fp16-under-fp32": (_fp16, r"float16\[.*\], the layout says float32"),
    "larger": (_one_larger, r"down_proj.weight: float32\[34, 64\], the layout says float32\[32, 64\]"),
    "smaller": (_one_smaller, r"down_proj.weight: float32\[31, 64\], the layout says float32\[32, 64\]"),
    "transposed-view": (_transposed, r"o_proj.weight: not contiguous .* t\.contiguous\(\)"),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("bad", list(BAD_SOURCES))
def test_source_tensors_that_disagree_with_the_layout_are_refused_before_any_byte_moves(server, transport, bad):
    """fp16 tensors under an fp32 config used to arrive as garbage over torch (reinterpreted bytes),
    a larger tensor sent its first rows, a smaller one or a transposed view failed inside torch."""
    make_bad, message = BAD_SOURCES[bad]
    layout = good_source().layout()
    source = ShardedSource("hf", CONFIG, 0, make_bad(dict(allocate(layout))))
    config = SyncConfig(num_writers=1, num_readers=1, transport=transport, timeout=20)
    engine = ShardedEngine("hf", CONFIG, 0)
    with WeightWriter(source, rank=0, config=config, meta=client(server)) as writer, \
            WeightReader(engine, rank=0, config=config, meta=client(server)) as reader:
        waiting = ReaderThread(reader, 1, timeout=0.2)  # nothing is published: it times out
        with pytest.raises(ValueError, match=message):
            writer.write(0)
        assert writer.meta.latest_version() is None  # nothing was published
        waiting.join()
        assert isinstance(waiting.error, TimeoutError) and engine.weight_version is None


# -- write() tells the truth ----------------------------------------------------------------------

class RefusingEngine(ShardedEngine):
    """An engine that refuses the versions it is told to (its loader raises)."""

    def __init__(self, refuse: set[int]) -> None:
        super().__init__("hf", CONFIG, 0)
        self.refuse = refuse

    def apply(self, version: int) -> None:
        if version in self.refuse:
            raise RuntimeError(f"engine refuses version {version}: NaN in the weights")
        super().apply(version)


@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_write_raises_naming_the_readers_that_failed_the_version(server, transport):
    """The only reader failed version 0, yet write(0) used to return a normal WriteResult."""
    from weightsync import ReadersFailedError

    config = SyncConfig(num_writers=1, num_readers=1, transport=transport, timeout=30)
    engine = RefusingEngine(refuse={0})
    source = good_source()
    with WeightWriter(source, rank=0, config=config, meta=client(server)) as writer, \
            WeightReader(engine, rank=0, config=config, meta=client(server)) as reader:
        serving = ReaderThread(reader, 1, timeout=30)
        with pytest.raises(ReadersFailedError, match=r"reader 0: .*engine refuses version 0") as caught:
            writer.write(0)
        assert caught.value.version == 0 and list(caught.value.failed) == [0]
        serving.join()
        assert isinstance(serving.error, SyncError) and engine.weight_version is None
        fill_from_canonical(source.layout(), source.tensors(), values(1))
        serving = ReaderThread(reader, 1, timeout=30)
        assert writer.write(1).version == 1  # the next version goes through as usual
        serving.join()
        assert serving.error is None and engine.weight_version == 1
        assert all(torch.equal(engine.tensors[n], t) for n, t in source.tensors().items())


# -- settings that differ between ranks -----------------------------------------------------------

def test_readers_count_only_when_registered(server):
    with client(server, "barrier") as meta:
        with pytest.raises(ValueError, match="reader rank 0 is not registered in job 'barrier'"):
            meta.report_applied(0, 3)
        from weightsync.meta import Participant

        meta.register(Participant("reader", 0))
        meta.register(Participant("reader", 5))  # a stale process of an older, larger job
        meta.report_applied(5, 3)
        with pytest.raises(TimeoutError, match="laggards: rank 0 at no valid version"):
            meta.wait_readers(min_version=3, readers=1, timeout=0.2)
        meta.report_applied(0, 3)
        assert meta.wait_readers(min_version=3, readers=1, timeout=5)[0] == 3


@pytest.mark.parametrize(("writer_config", "reader_config", "message"), [
    ({"num_writers": 1}, {"num_writers": 2}, r"other settings than writer 0 \(num_writers: 2 here, 1 there\)|"
                                              r"other settings than reader 0 \(num_writers: 1 here, 2 there\)"),
    ({"staleness": 1}, {"staleness": 0}, r"\(staleness: (0|1) here, (0|1) there\)"),
    ({"layer_phases": True}, {}, r"\(layer_phases: (true|false) here, (true|false) there\)"),
])
def test_settings_that_differ_between_ranks_are_an_error_before_planning(server, writer_config, reader_config,
                                                                         message):
    base = {"num_writers": 1, "num_readers": 1, "transport": "shm", "timeout": 10}
    with WeightWriter(good_source(), rank=0, config=SyncConfig(**{**base, **writer_config}),
                      meta=client(server)) as writer:
        writer.session.register()
        reader = WeightReader(ShardedEngine("hf", CONFIG, 0), rank=0, config=SyncConfig(**{**base, **reader_config}),
                              meta=client(server))
        with reader, pytest.raises(ValueError, match=message):
            reader.update(timeout=5)
        with pytest.raises(ValueError, match=message):  # and the writer sees it as well
            writer.write(0)


def test_two_threads_planning_one_reader_get_one_plan(server, monkeypatch):
    """An InflightReader's thread plans on its first version while its owner may be planning
    too (tests/test_integrity.py does): both must get one PlannedSync. Two would each make a
    transport and digests, the later replacing the one a version is being received with (its
    check then finds digests never attached)."""
    import weightsync.session.sync_session as session_module

    made: list[str] = []
    create = session_module.create_transport

    def slow_create(name: str, ctx: Any) -> Any:
        made.append(ctx.role)
        if ctx.role == "reader":
            time.sleep(0.5)  # the second thread asks meanwhile
        return create(name, ctx)

    monkeypatch.setattr(session_module, "create_transport", slow_create)
    config = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=10, integrity=True)
    with WeightWriter(good_source(), rank=0, config=config, meta=client(server)) as writer, \
            WeightReader(ShardedEngine("hf", CONFIG, 0), rank=0, config=config, meta=client(server)) as reader:
        writer.session.register()
        got: list[Any] = []
        threads = [threading.Thread(target=lambda: got.append(reader.session.plan(Deadline.after(10))))
                   for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(30)
        assert len(got) == 2 and got[0] is got[1] is reader.session.planned
        assert made == ["reader"]


def test_a_second_writer_of_one_rank_in_one_process_is_refused_until_the_first_closes(server):
    config = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=10)
    with WeightWriter(good_source(), rank=0, config=config, meta=client(server)):
        with pytest.raises(ValueError, match=r"a WeightWriter for writer rank 0 of job 'default' \(meta server "
                                             r"http://127\.0\.0\.1:\d+\) is already open in this process: close it"):
            WeightWriter(good_source(), rank=0, config=config, meta=client(server))
        WeightWriter(good_source(), rank=0, config=SyncConfig(num_writers=1, num_readers=1, job="other"),
                     meta=client(server, "other")).close()  # another job's rank 0 is another rank
    WeightWriter(good_source(), rank=0, config=config, meta=client(server)).close()


def test_a_meta_client_of_another_job_is_refused():
    with EmbeddedMetaServer() as server, client(server, "other-job") as meta:
        with pytest.raises(ValueError, match=r"SyncConfig\(job='default'\) but the MetaClient passed in speaks for "
                                             r"job 'other-job'"):
            WeightWriter(good_source(), rank=0, config=SyncConfig(num_writers=1, num_readers=1), meta=meta)


# -- the transport epoch moves forward only --------------------------------------------------------

def test_epoch_advances_are_atomic_and_never_move_it_back(server):
    """advance_epoch used to read, then write, in two calls: a rank that read an old epoch could
    write it back after others had moved on (one failure is noticed by many ranks at once)."""
    from weightsync.job.channel import JobChannel

    meta = client(server, "epochs")
    read_first, moved_on = threading.Event(), threading.Event()

    class SlowReads:  # a rank that stalls between its read and its write, if it reads at all
        job = meta.job

        def __getattr__(self, name):
            return getattr(meta, name)

        def get_document(self, key, *, wait=0.0):
            value = meta.get_document(key, wait=wait)
            if key == "epoch" and not read_first.is_set():
                read_first.set()
                assert moved_on.wait(10)
            return value

    slow = JobChannel(SlowReads(), role="reader", rank=0)
    fast = JobChannel(meta, role="reader", rank=1)
    stalled = threading.Thread(target=slow.advance_epoch, args=(0,))
    stalled.start()
    read_first.wait(2)  # the old implementation is now between its read (epoch 0) and its write
    assert fast.advance_epoch(0) == 1 and fast.advance_epoch(1) == 2
    moved_on.set()
    stalled.join(10)
    assert fast.current_epoch() == 2  # never back to 1
    # many ranks noticing the same failure move it by exactly one
    seen = fast.current_epoch()
    threads = [threading.Thread(target=JobChannel(meta, role="writer", rank=r).advance_epoch, args=(seen,))
               for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert fast.current_epoch() == seen + 1
