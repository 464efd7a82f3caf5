"""``weightsync plan``: its JSON contract and its one-line errors."""

from __future__ import annotations

import json
import sys

import pytest

from launcher import run as run_process
from weightsync.cli import main


def run_cli(*args):
    return run_process([sys.executable, "-m", "weightsync.cli", *args], timeout=120)


def test_plan_json_has_the_documented_fields(capsys):
    assert main(["plan", "--config", "tiny-qwen3-moe", "--source", "megatron:tp=2,pp=2,ep=2,dp=2,etp=1",
                 "--target", "vllm:tp=2,replicas=2", "--link-gbps", "100", "--json", "--verify",
                 "--min-split-bytes", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("total_bytes", "needed_bytes", "num_ops", "max_send_bytes", "max_recv_bytes",
                "imbalance", "plan_seconds", "simulated_seconds"):
        assert key in out
    assert out["sent_bytes"] == out["needed_bytes"]
    assert out["verified"] is True
    assert out["simulated_seconds"] == pytest.approx(
        max(out["max_send_bytes"], out["max_recv_bytes"]) / (100e9 / 8))


def test_plan_table_output(capsys):
    assert main(["plan", "--config", "tiny-qwen3", "--source", "fsdp:dp=2", "--target", "vllm:tp=2"]) == 0
    assert "max send / lower bound" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--config", "tiny-qwen3", "--source", "megatron:tp=3", "--target", "hf"],
     "num_key_value_heads=4 (query groups) is not divisible by tp=3"),
    (["--config", "tiny-qwen3-moe", "--source", "megatron:ep=3", "--target", "hf"],
     "num_experts=8 is not divisible by ep=3"),
    (["--config", "no-such-model", "--source", "hf", "--target", "hf"], "neither a file nor a bundled config"),
    (["--config", "tiny-qwen3", "--source", "tpu:x=1", "--target", "hf"], "unknown layout kind 'tpu'"),
])
def test_impossible_layouts_give_one_line_and_exit_2(args, message):
    proc = run_cli("plan", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_unknown_architecture(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 8}))
    proc = run_cli("plan", "--config", str(cfg), "--source", "hf", "--target", "hf")
    assert proc.returncode == 2 and "unknown architecture 'BertModel'" in proc.stderr


def test_fp8_block_target_reports_fp8_bytes_and_their_scales(capsys):
    """``--target ...,quant=fp8_block``: every linear weight of the layers moves one byte per element
    plus a float32 scale per 128x128 block; embeddings, lm_head, norms and biases stay bf16."""
    import math
    from importlib import resources

    def needed(target: str) -> int:
        assert main(["plan", "--config", "qwen2.5-7b", "--source", "megatron:tp=4", "--target", target,
                     "--json"]) == 0
        return int(json.loads(capsys.readouterr().out)["needed_bytes"])

    cfg = json.loads((resources.files("weightsync.configs") / "qwen2.5-7b.json").read_text())
    h, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
    head = h // cfg["num_attention_heads"]
    linears = [(h, h), (kv * head, h), (kv * head, h), (h, h), (inter, h), (inter, h), (h, inter)]
    saved = cfg["num_hidden_layers"] * sum(
        2 * o * i - (o * i + 4 * math.ceil(o / 128) * math.ceil(i / 128)) for o, i in linears)
    bf16, fp8 = needed("vllm:tp=2"), needed("vllm:tp=2,quant=fp8_block")
    assert bf16 - fp8 == saved
    assert 0.55 < fp8 / bf16 < 0.65  # 7.6B parameters, 1.1B of them in bf16 embeddings and lm_head
