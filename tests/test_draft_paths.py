"""MTP draft weights on every path (issue 40): delta, FP8, the block formats, layer phases, prefetch,
the fleet-wide commit.

A tiny DeepSeek-V3 (latent attention, experts, one MTP layer: layer 2) trained by a writer thread
and read by engines that hold the MTP drafter (the ``vllm`` kind with ``mtp=1``, or the
checkpoint's tensors): after each version, every tensor of the MTP layer the engine holds is
bitwise the version's (quantized ones bitwise the reference quantization), whatever the path.
A LoRA job moves adapters only, which never target the MTP layer (``test_lora_leaves_the_drafter``).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from weightsync.engines.buffers import ShardedEngine
from weightsync.engines.staging import StagedWeights
from weightsync.layout import ModelSpec
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.roles.prefetch import Prefetch
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import WeightWriter
from weightsync.session.sync_session import SyncConfig
from weightsync.tools.tiny import CanonicalSource, canonical_weights, checkpoint_tensors, tiny_config
from weightsync.tools.torch_layout import fill_from_canonical, strided_view
from weightsync.transport import TransportOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIG = tiny_config(family="deepseek_v3")
SPEC = ModelSpec.from_hf_config(CONFIG)
MTP = f"model.layers.{SPEC.num_layers}."


def weights(version: int) -> dict[str, torch.Tensor]:
    """Version ``v``'s canonical weights; version 2 differs from version 1 in the MTP layer only
    (what a delta then carries)."""
    if version != 2:
        return canonical_weights(CONFIG, version)
    out = dict(canonical_weights(CONFIG, 1))
    out.update({n: t for n, t in canonical_weights(CONFIG, 2).items() if n.startswith(MTP)})
    return out


def run(engine, sync: SyncConfig, versions=(1, 2, 3), *, prefetch: bool = False, check=None) -> list:
    """One writer thread writing ``versions``; the reader updates to each and calls ``check(version)``."""
    errors: list[BaseException] = []
    results = []

    def write(server) -> None:
        try:
            source = CanonicalSource(CONFIG)
            with WeightWriter(source, rank=0, config=sync, meta=MetaClient(server.address, token=server.token)) as w:
                for version in versions:
                    fill_from_canonical(source.layout(), source.tensors(), weights(version))
                    w.write(version)
        except BaseException as exc:
            errors.append(exc)

    with EmbeddedMetaServer() as server:
        writer = threading.Thread(target=write, args=(server,))
        writer.start()
        try:
            with WeightReader(engine, rank=0, config=sync, meta=MetaClient(server.address, token=server.token)) as r:
                fetch = Prefetch(r) if prefetch else None
                for version in versions:
                    if fetch is not None:
                        fetch.start(version)
                        deadline = time.monotonic() + 60
                        while fetch.received is None and time.monotonic() < deadline:
                            time.sleep(0.01)
                        assert fetch.received == version
                        results.append(fetch.apply(version))
                    else:
                        results.append(r.update(version))
                    if check is not None:
                        check(version)
        finally:
            writer.join(60)
    assert not errors, errors
    return results


def held_mtp_bitwise(layout, tensors, version: int, quant: str | None = None) -> int:
    """Every MTP-layer region ``layout`` holds equals the version's weights (quantized: the
    reference); returns how many regions were checked."""
    from test_quant_block import bits
    from test_quant_block import reference as block_reference

    w = weights(version)
    want: dict[str, np.ndarray] = {}
    if quant in ("mxfp8", "mxfp4", "nvfp4"):
        from weightsync.layout.quant_block import BLOCK_SCHEMES, block_tensors

        for t in block_tensors(SPEC, BLOCK_SCHEMES[quant]):
            if t.base.startswith(MTP):
                want.update(block_reference(w[t.base], t))
    elif quant is not None:
        from test_quant import reference as fp8_reference
        from weightsync.layout.quant import SCHEMES, quantized_tensors

        for name in quantized_tensors(SPEC):
            if name.startswith(MTP):
                q, s = fp8_reference(w[name], quant)
                want[SCHEMES[quant].weight_name(name)] = q.view(torch.uint8).numpy()
                want[SCHEMES[quant].scale_name(name)] = s.view(torch.int32).numpy()
    checked = 0
    for shard in layout.shards:
        flat = tensors[shard.name].reshape(-1)
        for r in shard.regions:
            base = r.canonical.split("#")[0]
            if not (r.canonical.startswith(MTP) or base.startswith(MTP)):
                continue
            got = strided_view(flat, r.box.sizes, r.strides, r.offset)
            if r.canonical in want:
                expect = want[r.canonical][r.box.slices()]
                expect = expect.view(np.int32) if expect.dtype == np.float32 else expect
                assert np.array_equal(bits(got), expect), r.canonical
            else:
                assert torch.equal(got, w[r.canonical][r.box.slices()].to(got.dtype)), r.canonical
            checked += 1
    return checked


@pytest.mark.parametrize("quant", [None, "fp8_block", "mxfp8", "mxfp4", "nvfp4"])
def test_the_mtp_drafter_arrives_in_every_format(quant):
    kind = f"hf:quant={quant}" if quant == "fp8_block" else ("vllm:mtp=1" + (f",quant={quant}" if quant else ""))
    engine = ShardedEngine(kind, CONFIG, 0)
    sync = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=60)
    run(engine, sync, versions=(1, 2), check=lambda v: held_mtp_bitwise(engine.layout(), engine.tensors, v, quant))
    assert held_mtp_bitwise(engine.layout(), engine.tensors, 2, quant) > 0


def test_deltas_carry_the_mtp_drafters_changes():
    """Version 2 changes the MTP layer only: the delta moves its changes, bitwise, and little else."""
    engine = ShardedEngine("vllm:mtp=1", CONFIG, 0)
    sync = SyncConfig(num_writers=1, num_readers=1, transport="torch", timeout=60,
                      transport_options=TransportOptions(delta_anchor_every=4))
    results = run(engine, sync, versions=(1, 2), check=lambda v: held_mtp_bitwise(engine.layout(), engine.tensors, v))
    full, delta = results[0].nbytes, results[1].nbytes
    mtp_bytes = sum(t.nbytes for n, t in SPEC.canonical_tensors().items() if n.startswith(MTP))
    assert delta < full and delta <= mtp_bytes * 1.1 + 4096  # the MTP layer's changes and headers


class Loading(StagedWeights):
    """Stages like vLLM and "loads" by copying staging into its own tensors, phase by phase."""

    def __init__(self) -> None:
        super().__init__(SPEC, dtype=torch.float32, device="cpu", rank=0)
        self.model: dict[str, torch.Tensor] = {}
        self.phases_loaded: list[tuple[str, ...]] = []

    def _load_items(self, items):
        self.model.update({n: t.clone() for n, t in items})
        self.phases_loaded.append(tuple(n for n, _ in items))

    def check(self, version: int) -> None:
        want = checkpoint_tensors(weights(version))
        for name, tensor in want.items():
            if name.startswith(MTP):
                assert torch.equal(self.model[name], tensor), name


def test_layer_phases_load_the_mtp_drafter_phase_by_phase():
    engine = Loading()
    sync = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=60, layer_phases=True,
                      transport_options=TransportOptions(max_bucket_bytes=256 << 10))
    run(engine, sync, versions=(1, 2), check=engine.check)
    mtp_phases = [p for p in engine.phases_loaded if any(n.startswith(MTP) for n in p)]
    assert len(mtp_phases) >= 2 and len(engine.phases_loaded) > len(mtp_phases)  # loaded in several phases


def test_prefetch_brings_the_mtp_drafter():
    engine = Loading()
    engine.update(checkpoint_tensors(weights(3)), version=0)
    sync = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=60)
    run(engine, sync, versions=(1, 2), prefetch=True, check=engine.check)


def test_the_fleet_commit_brings_the_mtp_drafter():
    """``commit="fleet"``: the drafter is staged with the rest of the version and applied only on
    writer 0's commit, with prefetch as a serving engine runs it."""
    engine = Loading()
    engine.update(checkpoint_tensors(weights(3)), version=0)
    sync = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=60, commit="fleet")
    run(engine, sync, versions=(1, 2), prefetch=True, check=engine.check)


def test_lora_leaves_the_drafter():
    """A LoRA job moves adapters only, and they never target the MTP layer: the drafter's base
    weights are frozen with the rest of the base model (vLLM applies adapters to the target)."""
    from weightsync.layout.lora import LoraSpec

    names = LoraSpec(r=4, alpha=8).canonical(SPEC)
    assert names and not any(f".layers.{SPEC.num_layers}." in n for n in names)
