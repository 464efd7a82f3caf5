"""In-band digests (SyncConfig(integrity=True)): one byte corrupted on its way in is caught.

Every transport: two writers (Megatron TP2) and two readers (vLLM TP1 replicas), each rank a
thread of this process with a real meta server. A fault hook in the test flips one byte of the
first piece reader 0 receives of version 1 (:func:`corrupt_in_transit`), before the reader digests it.
The reader refuses version 1 with an error naming the tensor, the writer and the bytes; its
engine (an InflightReader, which receives into staging) keeps serving version 0, bitwise;
the writers hear that reader 0 failed version 1; reader 1 applies every version; version 2
makes reader 0 current again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch

from weightsync.apps.demo import canonical_values
from weightsync.clock.deadline import Deadline
from weightsync.configs import load_spec
from weightsync.engines.buffers import ShardedEngine
from weightsync.layout import ModelSpec, RankLayout, parse_layout
from weightsync.layout.lora import LoraSpec
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.meta.client import open_meta
from weightsync.ports.engine import Invalid, Validity
from weightsync.roles.inflight import InflightReader
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import ReadersFailedError, WeightWriter
from weightsync.session.sync_session import SyncConfig, SyncError
from weightsync.sources.lora import LoraSource
from weightsync.sources.module import ShardedSource
from weightsync.tools.tiny import lora_weights, tiny_config
from weightsync.tools.torch_layout import allocate, fill_from_canonical
from weightsync.transport import TransportOptions, unavailable_reason
from weightsync.transport.shm.files import share_tensors

CONFIG = load_spec("tiny-qwen3-moe").to_hf_config()
SOURCE, TARGET = "megatron:tp=2", "vllm:tp=1,replicas=2"
VERSIONS = (0, 1, 2)
BAD_VERSION = 1


@dataclass(frozen=True)
class Case:
    """What the two writers hold and the two readers receive; by default Megatron TP2 -> vLLM TP1 x 2."""

    config: dict[str, Any] = field(default_factory=lambda: CONFIG)
    source: str = SOURCE
    targets: tuple[str, str] = (TARGET, TARGET)
    lora: LoraSpec | None = None

    def values(self, version: int) -> dict[str, torch.Tensor]:
        if self.lora is not None:
            return lora_weights(self.config, self.lora, seed=version + 1)
        return canonical_values(self.config, version)

    def make_source(self, rank: int) -> Any:
        if self.lora is None:
            return ShardedSource(self.source, self.config, rank)
        layout = self.lora.rank_layout(ModelSpec.from_hf_config(self.config), rank, tp=2, tp_rank=rank)
        return LoraSource(allocate(layout), self.config, self.lora, tp=2, tp_rank=rank, rank=rank)

    def make_engine(self, rank: int) -> Any:
        if self.lora is None:
            return ShardedEngine(self.targets[rank], self.config, rank)
        return AdapterEngine(self.lora.rank_layout(ModelSpec.from_hf_config(self.config), rank))

    def exact(self, engine: Any, version: int) -> bool:
        """The engine holds ``version`` bitwise (FP8 readers: their bytes were checked by digest)."""
        if "quant=" in self.targets[0] and engine is not None and "quant=" in getattr(engine, "layout_text", ""):
            return True
        want = allocate(engine.layout())
        fill_from_canonical(engine.layout(), want, self.values(version))
        return all(torch.equal(engine.tensors[n], want[n]) for n in want)


class AdapterEngine:
    """LoRA adapter tensors updated in place (a stand-in for an engine's adapter slots)."""

    stages_in_phases: ClassVar[bool] = False
    keeps_received_bytes: ClassVar[bool] = True

    def __init__(self, layout: RankLayout) -> None:
        self._layout, self.tensors, self.validity = layout, allocate(layout), Validity()

    def layout(self) -> RankLayout:
        return self._layout

    def descriptor(self) -> None:
        return None

    def receive_buffers(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def receiving(self, version: int) -> None:
        self.validity.touch(version)

    def apply(self, version: int) -> None:
        self.validity.applied(version)

    def abort(self, version: int, error: BaseException) -> None:
        self.validity.failed(version, error)

    @property
    def weight_version(self) -> int | None:
        return self.validity.version

    @property
    def invalid(self) -> Invalid | None:
        return self.validity.invalid


@dataclass
class Outcome:
    """What each rank saw, collected from its thread."""

    errors: list[BaseException] = field(default_factory=list)
    writes: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # writer -> (version, "ok" | error)
    reads: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # reader -> (version, "exact" | error)
    kept: dict[int, tuple[int | None, bool]] = field(default_factory=dict)  # reader -> (version served, bitwise)
    checked: dict[int, float] = field(default_factory=dict)
    corrupted: Any = None  # the op whose byte the fault hook flipped
    how: dict[str, Any] = field(default_factory=dict)  # the hook's state: where it flipped the byte


def corrupt_in_transit(reader: WeightReader, buffers: dict[str, torch.Tensor], version: int,
                       state: dict[str, Any]) -> Any:
    """The fault hook: one byte of the first piece of ``version`` that reader 0 receives arrives
    flipped. Where the transport digests as it lands the bytes (``VersionDigests.land`` /
    ``arrived``), the byte is flipped on its way in (in the copy's source, or where it arrived
    before it is digested); elsewhere (unfused transports, deltas applied in place) in the
    reader's memory after the transport delivered the phase, before the check."""
    planned = reader.session.planned
    assert planned is not None and planned.digests is not None
    transport, digests, last = planned.transport, planned.digests, planned.num_phases - 1
    receive, land, arrived = transport.receive, digests.land, digests.arrived
    op = planned.plan.ops[0]
    state.update(armed=False, done=False, where="")

    def target(o: Any) -> bool:
        hit = state["armed"] and not state["done"] and (o.dst_shard, o.dst_offset) == (op.dst_shard, op.dst_offset)
        if hit:
            state.update(done=True, where="in transit")
        return hit

    def flip(t: torch.Tensor) -> None:  # the first byte of its first element, in place
        row = t[(0,) * (t.dim() - 1)] if t.dim() > 1 else t
        row[:1].view(torch.uint8)[0] ^= 0x10

    def on_land(o: Any, dst: torch.Tensor, src: torch.Tensor, **kw: Any) -> None:
        if target(o):
            src = src.clone()
            flip(src)
        land(o, dst, src, **kw)

    def on_arrived(o: Any, view: torch.Tensor) -> None:
        if target(o):
            flip(view)
        arrived(o, view)

    def on_receive(v: int, *, deadline: Deadline, phase: int = 0) -> Any:
        state["armed"] = v == version
        stats = receive(v, deadline=deadline, phase=phase)
        if v == version and phase == last and not state["done"]:  # nothing digested it on its way in
            state.update(done=True, where="after landing")
            element = buffers[op.dst_shard].view(-1)[op.dst_offset: op.dst_offset + 1]
            element.view(torch.uint8)[0] ^= 0x10
        return stats

    transport.receive = on_receive  # type: ignore[method-assign]
    digests.land = on_land  # type: ignore[method-assign]
    digests.arrived = on_arrived  # type: ignore[method-assign]
    return op


def run_job(transport: str, options: dict[str, Any] | None = None, *, shared: bool = False,
            nodes: dict[tuple[str, int], str] | None = None, inflight: bool = True, case: Case | None = None,
            timeout: float = 60.0, coordinator: str | None = None) -> Outcome:
    """``coordinator``: an etcd cluster's address (else an embedded meta server)."""
    out = Outcome()
    case = case or Case()
    exact = case.exact
    opts = TransportOptions(max_bucket_bytes=1 << 16, direct_min_bytes=1024, **(options or {}))

    def config(role: str, rank: int) -> SyncConfig:
        return SyncConfig(num_writers=2, num_readers=2, transport=transport, timeout=timeout, integrity=True,
                          host=(nodes or {}).get((role, rank), ""), transport_options=opts)

    # Nobody leaves the job before everyone is done: a rank that leaves breaks the torch group of
    # the others (its lease is released), which would fail a writer still sending to a slower reader.
    done = threading.Barrier(4)

    def leave_together() -> None:
        try:
            done.wait(timeout * len(VERSIONS))
        except threading.BrokenBarrierError:
            pass  # another rank failed: its error is the one reported

    def guard(fn: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            try:
                fn(*args)
            except BaseException as exc:
                out.errors.append(exc)
                done.abort()
        return run

    @guard
    def writer(meta: MetaClient, rank: int) -> None:
        source = case.make_source(rank)
        shared_tensors = share_tensors(source.tensors()) if shared else None
        if shared_tensors is not None:  # the trainer's weights in /dev/shm: shm goes zero-copy
            source = ShardedSource(case.source, case.config, rank, tensors=shared_tensors.tensors)
        log = out.writes.setdefault(rank, [])
        try:
            with WeightWriter(source, rank=rank, config=config("writer", rank), meta=meta) as w:
                for v in VERSIONS:
                    fill_from_canonical(source.layout(), source.tensors(), case.values(v))
                    try:
                        w.write(v)
                        log.append((v, "ok"))
                    except ReadersFailedError as exc:
                        log.append((v, str(exc)))
                leave_together()
        finally:
            if shared_tensors is not None:
                shared_tensors.close()

    @guard
    def reader(meta: MetaClient, rank: int) -> None:
        engine = case.make_engine(rank)
        log = out.reads.setdefault(rank, [])
        if inflight:
            serve_inflight(meta, rank, engine, config("reader", rank), log)
            return
        with WeightReader(engine, rank=rank, config=config("reader", rank), meta=meta) as r:
            r.session.plan(Deadline.after(timeout))
            if rank == 0:
                out.corrupted = corrupt_in_transit(r, dict(engine.tensors), BAD_VERSION, out.how)
            for v in VERSIONS:
                try:
                    result = r.update(v, timeout=timeout)
                    log.append((result.version, "exact" if exact(engine, result.version) else "differs"))
                    out.checked[rank] = result.phases.get("check", -1.0)
                except SyncError as exc:
                    log.append((v, str(exc)))
                    out.kept[rank] = (engine.weight_version, False)
            leave_together()

    def serve_inflight(meta: MetaClient, rank: int, engine: Any, cfg: SyncConfig,
                       log: list[tuple[int, str]]) -> None:
        with InflightReader(engine, rank=rank, config=cfg, meta=meta, poll=0.05) as updater:
            inner = updater.reader
            inner.session.plan(Deadline.after(timeout))
            if rank == 0:
                out.corrupted = corrupt_in_transit(inner, updater._staging.buffers, BAD_VERSION, out.how)
            original = inner.update

            def update(*args: Any, **kwargs: Any) -> Any:
                try:
                    return original(*args, **kwargs)
                except SyncError as exc:  # refused: the live engine must still serve the last good version
                    log.append((inner.last_failed or -1, str(exc)))
                    out.kept[rank] = (engine.weight_version, exact(engine, BAD_VERSION - 1))
                    raise

            inner.update = update  # type: ignore[method-assign]
            updater.start()
            deadline = Deadline.after(timeout * len(VERSIONS))
            while engine.weight_version != VERSIONS[-1]:
                if deadline.expired:
                    raise TimeoutError(f"reader {rank} serves {engine.weight_version}")
                applied = updater.step_boundary()
                if applied is not None:
                    log.append((applied, "exact" if exact(engine, applied) else "differs"))
                else:
                    threading.Event().wait(0.005)
            leave_together()

    with contextlib.ExitStack() as stack:
        if coordinator is None:
            server = stack.enter_context(EmbeddedMetaServer())
            metas: list[Any] = [MetaClient(server.address, token=server.token) for _ in range(4)]
        else:
            metas = [open_meta(coordinator) for _ in range(4)]  # job "default", as the configs
        threads = [threading.Thread(target=writer, args=(metas[r], r)) for r in range(2)]
        threads += [threading.Thread(target=reader, args=(metas[2 + r], r)) for r in range(2)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout * (len(VERSIONS) + 2))
            assert not any(t.is_alive() for t in threads), "a rank did not finish"
        finally:
            for m in metas:
                m.close()
    if out.errors:
        raise out.errors[0]
    return out


def assert_refused_and_kept(out: Outcome, *, kept_version: int | None = BAD_VERSION - 1) -> None:
    bad = [(v, e) for v, e in out.reads[0] if e != "exact"]
    assert [v for v, _ in bad] == [BAD_VERSION], out.reads[0]
    error = bad[0][1]
    assert f"reader 0: version {BAD_VERSION} failed: integrity check: 1 of" in error, error
    op = out.corrupted
    assert f"{op.canonical}[" in error and f"from writer {op.src_rank} (" in error, error
    assert "bytes " in error and f" of {op.dst_shard!r}" in error and "): xxh3 " in error and "the writer sent" in error, error
    assert [v for v, e in out.reads[0] if e == "exact"] == [0, 2], out.reads[0]
    assert out.reads[1] == [(v, "exact") for v in VERSIONS], out.reads[1]
    served, bitwise = out.kept[0]
    assert served == kept_version
    if kept_version is not None:
        assert bitwise, "the engine no longer serves the last good version bitwise"
    for rank, log in out.writes.items():
        assert [v for v, _ in log] == list(VERSIONS), (rank, log)
        failed = dict(log)[BAD_VERSION]
        assert "failed version 1 (the next version brings them up to date): reader 0: integrity check: 1 of" in failed, (
            rank, failed)
        assert dict(log)[0] == dict(log)[2] == "ok"


def skip_unavailable(name: str) -> None:
    reason = unavailable_reason(name)
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize(("transport", "options", "shared"), [
    pytest.param("torch", {}, False, id="torch"),
    pytest.param("shm", {}, False, id="shm-snapshot"),
    pytest.param("shm", {}, True, id="shm-zero-copy"),
    pytest.param("file", {}, False, id="file"),
    pytest.param("nixl", {"nixl_mode": "pull"}, False, id="nixl-pull"),
    pytest.param("nixl", {"nixl_mode": "push"}, False, id="nixl-push"),
])
def test_one_corrupted_byte_is_refused_and_the_engine_keeps_its_version(transport, options, shared):
    skip_unavailable(transport)
    out = run_job(transport, options, shared=shared)
    assert_refused_and_kept(out)
    assert out.how["where"] == "in transit", "every CPU transport digests as the bytes land (one pass)"


def test_routed_one_corrupted_byte_is_refused():
    """Reader 0 is on another node (its pairs go over torch), reader 1 beside the writers (shm)."""
    nodes = {("writer", 0): "a", ("writer", 1): "a", ("reader", 0): "b", ("reader", 1): "a"}
    out = run_job("routed", nodes=nodes)
    assert_refused_and_kept(out)
    assert out.how["where"] == "in transit"


def test_in_place_engine_is_marked_invalid_and_recovers():
    """An engine that receives into its live weights cannot keep the last good version: as for a
    transfer that died part-way, it serves no valid version until the next one."""
    assert_refused_and_kept(run_job("shm", inflight=False), kept_version=None)


def test_inflight_staging_starts_as_a_copy_of_the_live_buffers():
    """Bytes no op writes (padding rows of a vocabulary) reach the live weights at every step
    boundary: staging must start equal to them, not as uninitialised memory."""
    from weightsync.roles.inflight import _StagingEngine

    engine = ShardedEngine(TARGET, CONFIG, 0)
    for t in engine.tensors.values():
        t.fill_(0.25)
    staging = _StagingEngine(engine, timeout=1.0)
    assert all(torch.equal(staging.buffers[n], t) and staging.buffers[n].data_ptr() != t.data_ptr()
               for n, t in engine.tensors.items())


# -- encodings: checked against the digests of the full new bytes --------------------------------

def fp8_config() -> dict[str, Any]:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
            "intermediate_size": 384, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 128, "vocab_size": 256, "torch_dtype": "bfloat16"}


def test_fp8_reader_refuses_a_corrupted_byte():
    """Writers quantize on send (rows cut inside 128x128 blocks: maxima exchanged); reader 0 stages
    FP8 values and scales, reader 1 bf16: digests are of the FP8 bytes the writers produced."""
    case = Case(config=fp8_config(), source="fsdp:dp=2", targets=("hf:quant=fp8_block,replicas=2",
                                                                 "hf:replicas=2"))
    assert_refused_and_kept(run_job("shm", case=case))


@pytest.mark.parametrize(("transport", "options"), [
    pytest.param("torch", {}, id="torch"),
    pytest.param("nixl", {}, id="nixl"),  # nixl_mode 'auto' picks pull with deltas
    pytest.param("nixl", {"nixl_mode": "push"}, id="nixl-push"),
    pytest.param("file", {}, id="file"),
])
def test_delta_reader_refuses_a_corrupted_byte(transport, options):
    """Delta sync: writers send what changed since the reader's version (nixl, file: readers read
    what writers published); the reader checks the full new bytes (its whole destination), not the
    delta, and the next version heals it."""
    skip_unavailable(transport)
    assert_refused_and_kept(run_job(transport, {"delta_anchor_every": 4, **options}))


def test_lora_adapter_refuses_a_corrupted_byte():
    case = Case(config=tiny_config(), lora=LoraSpec(r=8, alpha=16))
    assert_refused_and_kept(run_job("torch", case=case))


@pytest.mark.parametrize(("role", "device", "roles", "fused"), [
    pytest.param("writer", "cpu", {"writer", "reader"}, True, id="cpu-writer"),
    pytest.param("reader", "cpu", {"writer", "reader"}, True, id="cpu-reader"),
    pytest.param("reader", "cpu", {"writer"}, False, id="transport-fuses-for-writers-only"),
    pytest.param("reader", "cpu", (), False, id="transport-without-fusion"),
    pytest.param("reader", "cuda:1", {"writer", "reader"}, False, id="gpu-digests-after-each-phase"),
])
def test_a_transport_digests_as_it_copies_for_its_roles_on_host_memory(role, device, roles, fused):
    """The one device decision of fused digests (``VersionDigests.fuses``): host memory only; GPU
    ranks digest (sum64) once a phase arrived, as with a transport that does not fuse."""
    from weightsync.plan import build_local_plan
    from weightsync.tools.codecs.digest import kind_for
    from weightsync.transport.digests import VersionDigests

    spec = ModelSpec.from_hf_config(CONFIG)
    writers = [parse_layout(SOURCE).rank_layout(spec, r) for r in range(2)]
    readers = [parse_layout(TARGET).rank_layout(spec, r) for r in range(2)]
    plan = build_local_plan(writers, readers, role=role, rank=0)
    digests = VersionDigests(plan, None, role=role, rank=0, kind=kind_for([device]), device=device)
    assert digests.fuses(roles) is fused
    assert digests.kind == ("sum64" if device.startswith("cuda") else "xxh3")
