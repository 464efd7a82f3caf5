"""Layout metadata on the wire: descriptors and explicit shard lists round-trip, a roster's
descriptors are parsed once, and malformed blobs are refused with a message naming the rank."""

from __future__ import annotations

import msgpack
import pytest

from weightsync.job.channel import Member
from weightsync.layout import ModelSpec, parse_layout
from weightsync.layout.wire import LayoutDecoder, decode_layout, encode_descriptor, encode_explicit
from weightsync.session.sync_session import decode_roster

CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
          "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": 96, "torch_dtype": "bfloat16"}


def test_descriptors_and_explicit_layouts_round_trip():
    spec = ModelSpec.from_hf_config(CONFIG)
    kind = parse_layout("megatron:tp=2,pp=2,ep=2,etp=1")
    for rank, want in enumerate(kind.all_rank_layouts(spec)):
        by_descriptor = decode_layout(encode_descriptor(kind.describe(), "d"), rank=rank, load_model=lambda _: CONFIG)
        explicit = decode_layout(encode_explicit(want), rank=rank, load_model=lambda _: {})
        for got in (by_descriptor, explicit):
            assert got.rank == rank and got.shards == want.shards
            assert {n: want.canonical[n] for n in got.canonical} == dict(got.canonical)


def test_a_roster_parses_each_descriptor_and_model_once():
    calls: list[str] = []

    def load_model(digest: str) -> dict:
        calls.append(digest)
        return CONFIG

    spec = ModelSpec.from_hf_config(CONFIG)
    train, serve = parse_layout("megatron:tp=2,dp=2,ep=2,etp=1"), parse_layout("vllm:tp=2,replicas=2")
    people = [Member("writer", r, "host", encode_descriptor(train.describe(), "cfg")) for r in range(4)]
    people += [Member("reader", r, "host", encode_descriptor(serve.describe(), "cfg")) for r in range(4)]
    writers, readers = decode_roster(people, load_model)
    assert calls == ["cfg"]
    # One ModelSpec for the roster: its canonical tensors are one dict, which planning walks once.
    assert len(writers.canonical) == 1
    assert [w.shards for w in writers.layouts()] == [w.shards for w in train.all_rank_layouts(spec)]
    assert [r.shards for r in readers.layouts()] == [r.shards for r in serve.all_rank_layouts(spec)]
    assert writers.ranks.tolist() == [0, 1, 2, 3]


def test_a_roster_mixes_descriptors_and_explicit_layouts_in_rank_order():
    spec = ModelSpec.from_hf_config(CONFIG)
    serve = parse_layout("vllm:tp=2,replicas=2")
    want = serve.all_rank_layouts(spec)
    blob = encode_descriptor(serve.describe(), "cfg")
    members = [(3, blob), (0, encode_explicit(want[0])), (1, blob), (2, encode_explicit(want[2]))]
    side = LayoutDecoder(lambda _: CONFIG).roster(members)
    assert side.ranks.tolist() == [0, 1, 2, 3]
    assert [lay.shards for lay in side.layouts()] == [lay.shards for lay in want]


@pytest.mark.parametrize(("blob", "message"), [
    (b"\xc1", "layout metadata of rank 3 is not valid msgpack"),
    (msgpack.packb({"v": 99}), "rank 3 has unsupported wire version 99"),
    (msgpack.packb({"v": 1, "form": "carrier pigeon"}), "rank 3 has unknown form 'carrier pigeon'"),
    (msgpack.packb({"v": 1, "form": "explicit", "canonical": []}), r"rank 3 is malformed \(explicit form\)"),
    (msgpack.packb({"v": 1, "form": "descriptor", "layout": "vllm:tp=2"}), r"rank 3 is malformed \(descriptor"),
])
def test_malformed_blobs_name_the_rank(blob, message):
    decode = LayoutDecoder(lambda _: CONFIG)
    with pytest.raises(ValueError, match=message):
        decode(blob, rank=3)
    with pytest.raises(ValueError, match=message):
        decode.roster([(3, blob)])
