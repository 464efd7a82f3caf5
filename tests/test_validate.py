"""Validation against a checkpoint: matches, mismatches, missing/extra, read-only."""

from __future__ import annotations

import hashlib
import json
import os

import torch

from weightsync.apps.demo import canonical_values
from weightsync.cli import main
from weightsync.configs import load_spec
from weightsync.layout import parse_layout
from weightsync.tools.torch_layout import allocate, fill_from_canonical
from weightsync.tools.verify import dump_rank, merge_reports, save_canonical, union_volume, verify_rank


def _setup(tmp_path, kind="vllm:tp=2"):
    spec = load_spec("tiny-qwen3-moe")
    config = spec.to_hf_config()
    values = canonical_values(config, step=0)
    ckpt = tmp_path / "ckpt"
    save_canonical(values, ckpt)
    (ckpt / "config.json").write_text(json.dumps(config))
    layout = parse_layout(kind)
    ranks = []
    for r in range(layout.world_size):
        rl = layout.rank_layout(spec, r)
        tensors = allocate(rl)
        fill_from_canonical(rl, tensors, values)
        ranks.append((rl, tensors))
    return spec, values, ckpt, ranks


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_engine_matches_checkpoint_and_nothing_is_written(tmp_path):
    _, _, ckpt, ranks = _setup(tmp_path)
    before = {p: _digest(ckpt / p) for p in os.listdir(ckpt)}
    snapshot = [{n: t.clone() for n, t in tensors.items()} for _, tensors in ranks]
    reports = [verify_rank(rl, tensors, ckpt) for rl, tensors in ranks]
    assert all(r.matches for r in reports)
    assert not reports[0].ok  # one TP rank covers only half of the model
    merged = merge_reports(reports)
    assert merged.ok and merged.missing() == []
    assert {p: _digest(ckpt / p) for p in os.listdir(ckpt)} == before
    for (_, tensors), snap in zip(ranks, snapshot):
        assert all(torch.equal(tensors[n], snap[n]) for n in tensors)


def test_mismatch_is_located_with_max_difference(tmp_path):
    _, _, ckpt, ranks = _setup(tmp_path, "vllm:tp=1")
    rl, tensors = ranks[0]
    tensors["model.layers.1.mlp.experts.routed_experts.w2_weight"][3, 0, 0] += 0.5  # expert 3's down_proj
    report = verify_rank(rl, tensors, ckpt)
    bad = {n: t for n, t in report.tensors.items() if t.status != "ok"}
    assert list(bad) == ["model.layers.1.mlp.experts.3.down_proj.weight"]
    check = bad["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert check.differing_elements == 1 and abs(check.max_abs_diff - 0.5) < 1e-6
    assert json.loads(report.to_json())["summary"]["ok"] is False
    assert verify_rank(rl, tensors, ckpt, atol=0.6).matches


def test_missing_and_extra_tensors(tmp_path):
    spec, values, ckpt, ranks = _setup(tmp_path, "vllm:tp=1")
    rl, tensors = ranks[0]
    from weightsync.layout import RankLayout
    partial = RankLayout(0, tuple(s for s in rl.shards if s.name != "model.norm.weight"), rl.canonical)
    report = verify_rank(partial, tensors, ckpt)
    assert report.matches and report.missing() == ["model.norm.weight"]
    # a checkpoint lacking lm_head: the engine's lm_head is "extra"
    del values["lm_head.weight"]
    other = tmp_path / "other"
    save_canonical(values, other)
    report = verify_rank(rl, tensors, other)
    assert report.tensors["lm_head.weight"].status == "extra"


def test_union_volume_counts_replicas_once():
    from weightsync.layout import Box
    assert union_volume([Box((0,), (4,)), Box((2,), (4,)), Box((0,), (4,))]) == 6


def test_verify_cli_on_rank_dumps(tmp_path, capsys):
    _, _, ckpt, ranks = _setup(tmp_path, "megatron:tp=2")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for rl, tensors in ranks:
        dump_rank(tensors, dumps / f"rank-{rl.rank}.safetensors")
    assert main(["verify", "--checkpoint", str(ckpt), "--weights", str(dumps), "--layout", "megatron:tp=2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["ok"] is True
    rl, tensors = ranks[1]
    tensors["decoder.layers.0.self_attention.linear_qkv.weight"][0, 0] += 1
    dump_rank(tensors, dumps / "rank-1.safetensors")
    assert main(["verify", "--checkpoint", str(ckpt), "--weights", str(dumps), "--layout", "megatron:tp=2"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_verify_cli_two_checkpoints(tmp_path, capsys):
    _, _, ckpt, _ = _setup(tmp_path)
    assert main(["verify", "--checkpoint", str(ckpt), "--weights", str(ckpt)]) == 0
    assert capsys.readouterr().out.startswith("OK")


def test_nan_never_matches_a_number(tmp_path):
    """An engine full of NaN must not verify (``nan - x > atol`` is False: it used to)."""
    _, _, ckpt, ranks = _setup(tmp_path)
    layout, tensors = ranks[0]
    name = next(iter(tensors))
    tensors[name].fill_(float("nan"))
    report = verify_rank(layout, tensors, ckpt, atol=1.0)
    assert not report.ok
    bad = [c for c in report.tensors.values() if c.status == "mismatch"]
    assert bad and all(c.max_abs_diff == float("inf") for c in bad)


def test_nan_in_the_checkpoint_matches_only_the_same_nan(tmp_path):
    from weightsync.tools.verify import differences

    want = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")], dtype=torch.float32)
    same = want.clone()
    assert differences(same, want, 0.0).max() == 0  # NaN in the same place, inf == inf
    number = torch.tensor([1.0, 2.0, float("inf"), -float("inf")])
    assert differences(number, want, 0.0)[1] == float("inf")
    other_nan = same.clone()
    other_nan.view(torch.int32)[1] = other_nan.view(torch.int32)[1] ^ 1  # another NaN payload
    assert other_nan[1].isnan() and differences(other_nan, want, 0.0)[1] == float("inf")
    assert differences(torch.tensor([1.0, 2.0, -float("inf"), -float("inf")]), want, 10.0)[2] == float("inf")
    # end to end: a checkpoint holding a NaN verifies against an engine holding that NaN, and only it
    _, values, _, ranks = _setup(tmp_path, "vllm:tp=1")
    layout, tensors = ranks[0]
    values["model.norm.weight"][0] = float("nan")
    save_canonical(values, tmp_path / "nan-ckpt")
    fill_from_canonical(layout, tensors, values)
    assert verify_rank(layout, tensors, tmp_path / "nan-ckpt").tensors["model.norm.weight"].status == "ok"
    tensors["model.norm.weight"][0] = 0.0
    assert verify_rank(layout, tensors, tmp_path / "nan-ckpt").tensors["model.norm.weight"].status == "mismatch"
