"""The bench machinery: a tiny end-to-end run (JSON schema, bitwise destinations) and its parts."""

from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from launcher import run as run_process
from weightsync.apps.bench.baselines import RankContext, WeightsyncMethod, make_method, plan_buckets
from weightsync.apps.bench.cases import Case, model_config, suite
from weightsync.apps.bench.report import summary_ratios
from weightsync.apps.bench.runner import add_ratios, parse_awex_output
from weightsync.apps.bench.weights import CanonicalLoader, WeightPool, fill, gather_contributions, mismatches
from weightsync.cli import main
from weightsync.layout import ModelSpec, parse_layout
from weightsync.tools.torch_layout import allocate

ROW_KEYS = {"method", "transport", "layout", "bytes", "seconds", "gbps", "peak_extra_bytes"}


@pytest.mark.xdist_group("bench")
def test_tiny_bench_run_json_schema_and_bitwise_destinations(capsys, tmp_path):
    """Every method (weightsync transports and the baselines) lands bitwise-equal weights."""
    png = tmp_path / "bench.png"
    code = main(["bench", "--suite", "test", "--no-peer", "--json", "--no-progress", "--plot", str(png),
                 "--timeout", "120"])
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert code == 0, result["failures"]
    methods = {r["method"] for r in result["rows"]}
    assert {"safetensors-disk", "safetensors-shm", "per-param-broadcast", "bucketed-broadcast",
            "weightsync-shm", "weightsync-shm-zero-copy", "weightsync-torch", "weightsync-file"} <= methods
    spec = ModelSpec.from_hf_config(model_config("tiny", "bf16"))
    for row in result["rows"]:
        assert ROW_KEYS <= set(row), row
        assert row["verified"] is True, row  # each reader compared every byte it holds
        # bytes that really arrived: two TP1 replicas of a bf16 model each receive all of it
        assert row["bytes"] == row["needed_bytes"] == 2 * spec.num_parameters * 2
        assert row["seconds"] > 0 and row["gbps"] > 0
    for key in ("shm_over_memcpy", "shm_zero_copy_over_memcpy", "safetensors_over_weightsync",
                "per_param_broadcast_over_weightsync"):
        assert result["ratios"][key] > 0
    assert png.stat().st_size > 10_000
    assert not glob.glob("/dev/shm/weightsync-bench-*")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("weightsync-") and n.endswith("-params")]


@pytest.mark.xdist_group("bench")
def test_a_method_that_skips_the_copy_fails_verification(capsys, monkeypatch):
    """New weights every version, each version checked: skipping a copy cannot pass as fast."""
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH", "")])))
    code = main(["bench", "--suite", "test", "--no-peer", "--json", "--no-progress", "--timeout", "120",
                 "--reps", "2", "--methods", "weightsync-shm,_bench_methods:SkipsCopyAfterFirst"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["weightsync-shm"]["verified"] is True
    cheat = rows["_bench_methods:SkipsCopyAfterFirst"]
    assert cheat["verified"] is False and cheat["mismatches"], cheat
    assert code == 1 and any("destination weights differ" in f for f in result["failures"])


def test_versions_differ_in_every_row():
    spec = ModelSpec.from_hf_config(model_config("tiny", "bf16"))
    layout = parse_layout("hf").rank_layout(spec, 0)
    pool = WeightPool.for_layout(layout, seed=0)
    tensors = allocate(layout)
    fill(layout, tensors, pool.at(1))
    assert mismatches(layout, tensors, pool.at(1)) == []
    stale = set(mismatches(layout, tensors, pool.at(2)))
    assert stale == set(layout.canonical)  # every tensor changed between versions
    for name, t in layout.canonical.items():
        a, b = pool.at(1).full(name, t.shape), pool.at(2).full(name, t.shape)
        rows = a.reshape(a.shape[0], -1) if a.dim() > 1 else a.reshape(1, -1)
        other = b.reshape(rows.shape)
        assert bool((rows != other).any(dim=1).all()), f"{name}: some row did not change"


def test_weight_pool_boxes_agree_across_layouts():
    spec = ModelSpec.from_hf_config(model_config("tiny", "fp32"))
    src = parse_layout("megatron:tp=2").rank_layout(spec, 1)
    pool = WeightPool.for_layout(src, seed=3)
    tensors = allocate(src)
    fill(src, tensors, pool)
    assert mismatches(src, tensors, pool) == []
    # the same elements, computed as whole tensors, load into another layout identically
    dst = parse_layout("vllm:tp=2").rank_layout(spec, 1)
    engine = allocate(dst)
    loader = CanonicalLoader(dst, engine)
    for name, tensor in spec.canonical_tensors().items():
        loader.load(name, pool.full(name, tensor.shape))
    assert mismatches(dst, engine, pool) == []
    # a single flipped element is caught
    qkv = engine["model.layers.0.self_attn.qkv_proj.weight"]
    qkv.view(-1)[5] = torch.nextafter(qkv.view(-1)[5], torch.tensor(float("inf")))
    assert mismatches(dst, engine, pool) == ["model.layers.0.self_attn.q_proj.weight"]
    # different tensors get different values
    assert not torch.equal(pool.full("model.layers.0.mlp.up_proj.weight", (128, 64)),
                           pool.full("model.layers.0.mlp.gate_proj.weight", (128, 64)))


@pytest.mark.parametrize(("layout", "norm_ranks"), [("megatron:tp=2", [0]), ("fsdp:dp=2", [0, 1]),
                                                   ("vllm:tp=2", [0])])
def test_gather_contributions_cover_each_tensor_once(layout, norm_ranks):
    spec = ModelSpec.from_hf_config(model_config("tiny", "bf16"))
    kind = parse_layout(layout)
    contributions = gather_contributions([kind.rank_layout(spec, r) for r in range(kind.world_size)])
    assert set(contributions) == set(spec.canonical_tensors())
    norm = contributions["model.norm.weight"]
    assert [c.rank for c in norm] == norm_ranks  # replicated: only the lowest rank sends it; FSDP: row chunks


def test_plan_buckets_respects_the_bound_and_keeps_order():
    spec = ModelSpec.from_hf_config(model_config("tiny", "bf16"))
    canon = spec.canonical_tensors()
    buckets = plan_buckets(spec, 40_000)
    assert [n for b in buckets for n in b] == list(canon)
    for b in buckets:
        assert len(b) == 1 or sum(canon[n].nbytes for n in b) <= 40_000


def test_ratios_and_awex_parsing():
    case = Case(model="qwen3-0.2b", dtype="bf16", layout="tp2->tp1x2", tag="awex-peer",
                methods=("weightsync-torch",), peer="awex")
    stdout = "\n".join([
        json.dumps({"shape": "qwen3-mid", "dtype": "bf16", "model_bytes": 1000, "bytes_moved_total": 2000}),
        "iter 0: transfer_phase_s=9.0 GB/s(total moved)=0.1",
        "iter 1: transfer_phase_s=2.0 GB/s(total moved)=0.1",
        "iter 2: transfer_phase_s=4.0 GB/s(total moved)=0.1",
        "ALL_BITWISE_EQUAL",
    ])
    peer = parse_awex_output(case, stdout)
    assert peer["seconds"] == 3.0 and peer["verified"] and peer["bytes"] == 2000  # warm-up dropped
    ours = {"case": "awex-peer", "method": "weightsync-torch", "layout": "tp2->tp1x2", "bytes": 2000,
            "per_reader_bytes": 1000, "seconds": 1.0}
    rows = [ours, peer]
    add_ratios(rows, {"memcpy_gbps": 1e-6, "loopback_gbps": 1e-6})
    assert ours["over_memcpy"] == pytest.approx(1.0)
    assert summary_ratios(rows)["awex_over_weightsync_torch"] == pytest.approx(3.0)
    assert "error" in parse_awex_output(case, "Traceback ...", 1)


def test_integrity_methods_and_their_cost_ratio():
    ctx = cast(RankContext, SimpleNamespace(tensors={}))
    method, plain = make_method("weightsync-shm-zero-copy+integrity", ctx), make_method("weightsync-torch", ctx)
    assert isinstance(method, WeightsyncMethod) and isinstance(plain, WeightsyncMethod)
    assert (method.name, method.transport, method.zero_copy, method.integrity) == (
        "weightsync-shm-zero-copy+integrity", "shm", True, True)
    assert (plain.name, plain.integrity) == ("weightsync-torch", False)
    rows = [{"case": "c", "method": "weightsync-shm-zero-copy", "seconds": 2.0},
            {"case": "c", "method": "weightsync-shm-zero-copy+integrity", "seconds": 2.5}]
    assert summary_ratios(rows) == {"integrity_cost_shm_zero_copy": pytest.approx(0.25)}


def test_suites_and_bad_input():
    quick = suite("quick", ["torch", "shm", "file"])
    assert quick[0].name == "issue4" and quick[0].methods == (
        "weightsync-shm", "weightsync-shm+integrity", "weightsync-shm-zero-copy", "weightsync-shm-zero-copy+integrity")
    assert "weightsync-file+integrity" in quick[1].methods and "weightsync-file+integrity" not in quick[2].methods
    assert any(c.layout == "fsdp2->tp2" for c in quick) and any(c.layout == "same" for c in quick)
    with pytest.raises(ValueError, match="unknown benchmark model"):
        model_config("gpt-17", "bf16")
    with pytest.raises(ValueError, match="unknown layout pair"):
        Case(model="tiny", dtype="bf16", layout="tp3", methods=())
    assert main(["bench", "--suite", "test", "--transports", "warp-drive"]) == 2


def test_vllm_serve_prefetch_rows_from_token_arrivals_and_the_trainer_trace():
    """The serve row's figures from token arrivals and the trainer's trace (no server needed):
    the pause is the clients' gap around the moment the engine was paused, tokens/s count
    the tokens inside each window."""
    from weightsync.apps.bench.vllm_prefetch import run_vllm_prefetch
    from weightsync.apps.bench.vllm_prefetch_serve import client_pause, summarize, window_rate
    from weightsync.cli.commands.bench import _prefetch_cells

    # one chunk of 4 tokens every 0.25 s, but none in (10, 13) (a blocking sync from 10.2 to 12.8)
    # and none in (20, 21) (a prefetched update paused from 20.2 to 20.8)
    arrivals = [(t / 4, 4) for t in range(160) if not (40 < t < 52 or 80 < t < 84)]
    times = [t for t, _ in arrivals]
    assert client_pause(times, 10.2, 12.8) == 3.0
    assert client_pause(times, 20.2, 20.8) == 1.0
    # a token generated before the pause that reached its client after /pause returned
    assert client_pause(sorted([*times, 10.3]), 10.2, 12.8) == pytest.approx(2.7)
    assert window_rate(times, [n for _, n in arrivals], [(14.0, 15.0), (30.0, 31.0)]) == 20.0  # 5 chunks a second
    with pytest.raises(ValueError, match="no token arrived on both sides"):
        client_pause(times, 100.0, 101.0)
    trace = {"blocking": [{"start": 10.2, "paused": 10.5, "updated": 12.5, "end": 12.8}],
             "prefetch": [{"start": 16.0, "received": 20.2, "paused": 20.5, "update": 20.5, "updated": 20.75,
                           "end": 20.8}],
             "idle": [[23.0, 27.2]]}
    row = summarize(arrivals, trace)
    assert row["blocking_pause_s"] == 3.0 and row["prefetch_pause_s"] == 1.0
    assert row["prefetch_update_s"] == 0.25 and row["pause_over_update"] == 4.0
    assert row["blocking_sync_s"] == pytest.approx(2.6) and row["prefetch_sync_s"] == pytest.approx(4.8)
    assert row["prefetch_driver_pause_s"] == pytest.approx(0.6)
    # 17 chunks in [16, 20.2] and 17 in [23, 27.2]: 68 tokens over 4.2 s each
    assert row["during_tokens_per_s"] == pytest.approx(68 / 4.2) and row["during_over_idle"] == pytest.approx(1.0)
    cells = _prefetch_cells({"path": "serve", **row})
    assert cells[2:5] == ["1.000", "0.250", "4.00"]  # pause, /update_weights, pause over it
    assert row["pause_modes"] == {"abort": {"updates": 1, "pause_s": 1.0, "update_s": 0.25,
                                            "driver_pause_s": pytest.approx(0.6), "pause_over_update": 4.0,
                                            "pauses_s": [1.0]}}
    # the driver's pause modes take turns; the row's own prefetch figures are the first mode's
    keep = {"start": 28.0, "received": 30.0, "paused": 30.1, "update": 30.1, "updated": 30.3, "end": 30.4,
            "mode": "keep"}
    arrivals = [(t, n) for t, n in arrivals if not 30.0 < t < 30.5]  # the keep pause: a 0.5 s gap
    row = summarize(arrivals, {**trace, "prefetch": [*trace["prefetch"], keep], "pause_modes": ["abort", "keep"]})
    assert row["prefetch_pause_s"] == 1.0 and row["updates"] == 1
    assert row["pause_modes"]["keep"] == {"updates": 1, "pause_s": 0.5, "update_s": pytest.approx(0.2),
                                          "driver_pause_s": pytest.approx(0.4), "pause_over_update": pytest.approx(2.5),
                                          "pauses_s": [0.5]}
    with pytest.raises(ValueError, match=r"serve pause mode\(s\) \['wait'\] are unknown; choose from abort, keep, "
                                         "keep-stale, abort-reset, keep-reset"):
        run_vllm_prefetch(paths=("serve",), pause_modes=("abort", "wait"))
    with pytest.raises(ValueError, match=r"vLLM path\(s\) \['gpu'\] are unknown; choose from engine, backend, serve"):
        run_vllm_prefetch(paths=("serve", "gpu"))


def test_vllm_serve_engine_figures_from_the_workers_step_trace(tmp_path):
    """Where the clients' gap went, from the worker's trace (forwards and update_weights): the
    engine's pause is the last forward's end before the apply to the next forward's start."""
    from weightsync.apps.bench.vllm_prefetch_serve import summarize
    from weightsync.integrations.vllm_step_trace import StepTrace, read

    trace_file = tmp_path / "steps.trace"
    steps = StepTrace(str(trace_file))
    steps.file.close()
    # decode steps of 0.1 s every 0.125 s; the apply in [20.3, 20.5]; a 0.3 s prefill at 20.6
    events = [(t / 8 + d, e) for t in range(240) if not 161 < t < 168 for d, e in ((0.0, "forward+"),
                                                                                  (0.1, "forward-"))]
    events += [(20.3, "update_weights+"), (20.5, "update_weights-"), (20.6, "forward+"), (20.9, "forward-")]
    trace_file.write_text("".join(f"{t:.6f} {e}\n" for t, e in events))
    arrivals = [(t / 8 + 0.11, 4) for t in range(240) if not 161 < t < 168] + [(20.92, 4)]
    trace = {"blocking": [{"start": 10.2, "paused": 10.5, "updated": 12.5, "end": 12.8}],
             "prefetch": [{"start": 16.0, "received": 20.2, "paused": 20.25, "update": 20.25, "updated": 20.52,
                           "end": 20.58}],
             "idle": [[23.0, 27.2]]}
    arrivals = [(t, n) for t, n in arrivals if not 10.2 < t < 12.8]
    row = summarize(arrivals, trace, read(str(trace_file)))
    abort = row["pause_modes"]["abort"]
    assert abort["pause_s"] == pytest.approx(20.92 - (20.125 + 0.11))  # the clients' gap
    assert abort["engine_pause_s"] == pytest.approx(20.6 - 20.225) and abort["apply_s"] == pytest.approx(0.2)
    assert abort["before_apply_s"] == pytest.approx(20.3 - 20.225)
    assert abort["after_apply_s"] == pytest.approx(0.1) and abort["step_after_s"] == pytest.approx(0.3)
    assert abort["gap_before_s"] == pytest.approx(-0.01) and abort["gap_after_s"] == pytest.approx(0.02)
    assert abort["engine_pause_over_apply"] == pytest.approx(0.375 / 0.2)
    assert row["decode_step_s"] == pytest.approx(0.1) and row["longest_idle_step_s"] == pytest.approx(0.1)


def test_gpu_script_fails_clearly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu.py")
    proc = run_process([sys.executable, script, "--sizes", "1b"], timeout=60)
    assert proc.returncode == 2
    assert "CUDA" in proc.stderr


def test_link_shaping_commands_pace_rather_than_drop():
    from weightsync.apps.bench.link import tbf_arguments

    ten = tbf_arguments(10)
    assert ten[:6] == ["qdisc", "add", "dev", "lo", "root", "tbf"]
    assert ten[ten.index("rate") + 1] == "10gbit"
    assert int(ten[ten.index("burst") + 1]) == 1_250_000  # 1 ms at 10 Gbit/s
    assert int(tbf_arguments(0.1)[ten.index("burst") + 1]) == 4 * 65536  # never below four loopback packets
    with pytest.raises(ValueError, match="positive"):
        tbf_arguments(0)


def test_link_shaping_never_replaces_someone_elses_qdisc():
    from weightsync.apps.bench.link import root_qdisc_is_default

    assert root_qdisc_is_default("qdisc noqueue 0: root refcnt 2 \n")
    assert root_qdisc_is_default("")
    assert not root_qdisc_is_default("qdisc tbf 8001: root refcnt 2 rate 10Gbit burst 4Mb lat 50ms \n")
    assert not root_qdisc_is_default("qdisc netem 8002: root refcnt 2 limit 1000 delay 5ms\n")


def test_link_rates_are_parsed_or_refused_by_name():
    import argparse

    from weightsync.cli.commands.bench import _link_rates

    assert _link_rates("lo,10,2.5") == [None, 10.0, 2.5]
    with pytest.raises(argparse.ArgumentTypeError, match="'ten' is neither 'lo' nor a rate"):
        _link_rates("lo,ten")
    with pytest.raises(argparse.ArgumentTypeError, match="positive, got 0"):
        _link_rates("0")


def test_delta_bench_runs_the_transports_that_carry_deltas_and_says_why_not_the_others(monkeypatch):
    """The bench's transports come from the refusals' own rules (SyncConfig's combination check
    and the transport class's ``check_delta_carried``): a transport or mode appears the day it
    carries deltas, and is left out with the refusal's message until then."""
    import importlib.util

    from weightsync.apps.bench.delta_sync import VARIANTS, delta_variants
    from weightsync.transport.file.transport import FileTransport

    carried, left_out = delta_variants()
    names = {v.name for v in carried}
    assert {"torch", "shm", "shm-zero-copy", "routed", "file"} <= names
    nixl = bool(importlib.util.find_spec("nixl_cu12") or importlib.util.find_spec("nixl"))
    assert ("nixl-pull" in names) == ("nixl-push" in names) == nixl  # push joined once it carried deltas
    assert set(left_out) | names == {v.name for vs in VARIANTS.values() for v in vs}
    # a transport class that stops carrying deltas leaves the bench with check_delta_carried's message
    monkeypatch.setattr(FileTransport, "carries_deltas", False)
    carried, left_out = delta_variants()
    assert "file" not in {v.name for v in carried}
    assert "is not supported by the file transport" in left_out["file"]


@pytest.mark.xdist_group("bench")
@pytest.mark.parametrize("transport", [
    "routed",
    # CI's budget: `make test-heavy`; deltas over file land bitwise by default in
    # test_faults.py::test_delta_on_every_transport_survives_every_poke_bitwise[file]
    pytest.param("file", marks=pytest.mark.heavy),
])
def test_delta_bench_rows_send_fewer_bytes_bitwise(transport):
    """routed splits the two writers between its shm and gloo routes, file writes change files;
    every version lands bitwise in both modes and the delta moves fewer bytes than the full sync."""
    from weightsync.apps.bench.delta_sync import TEST_MODEL, run_delta

    rows, changed = run_delta(models=[TEST_MODEL], steps=3, timeout=120, transports=[transport])
    assert [(r["transport"], r["mode"]) for r in rows] == [(transport, "full"), (transport, "delta")], rows
    assert all(r.get("verified") for r in rows), rows
    full, delta = rows
    assert full["nbytes_per_version"][0] == delta["nbytes_per_version"][0] == full["nbytes"]  # version 1: full
    assert delta["nbytes"] < full["nbytes"] and delta["bytes_vs_full"] < 1.0
    assert len(changed[TEST_MODEL]) == 2


def test_the_vllm_prefetch_suite_runs_every_model_named_and_refuses_two_transports(monkeypatch, capsys):
    """``--models a,b`` ran only ``a`` (the rest silently dropped), and ``--transports`` took its
    first entry: each model now gets its rows, and a second transport is refused by name."""
    import weightsync.apps.bench.vllm_prefetch as vllm_prefetch
    from weightsync.cli import main

    ran = []

    def fake_run(*, model, updates, transport, paths, timeout, pause_modes):
        ran.append((model, transport))
        return []

    monkeypatch.setattr(vllm_prefetch, "run_vllm_prefetch", fake_run)
    assert main(["bench", "--suite", "vllm-prefetch", "--models", "qwen3-30m,qwen3-0.2b"]) == 0
    assert ran == [("qwen3-30m", "auto"), ("qwen3-0.2b", "auto")]
    assert main(["bench", "--suite", "vllm-prefetch", "--transports", "shm,torch"]) == 2
    assert ("--suite vllm-prefetch runs one transport per run; got --transports ['shm', 'torch']"
            in capsys.readouterr().err)


def test_the_vllm_suites_name_an_unknown_model_and_the_known_ones():
    from weightsync.apps.bench.vllm_memory import model_config

    with pytest.raises(ValueError, match=r"unknown model 'qwen3-0.6b' for the vLLM suites; known: qwen3-30m, "
                                         r"qwen3-0.2b, qwen3-0.4b"):
        model_config("qwen3-0.6b")
