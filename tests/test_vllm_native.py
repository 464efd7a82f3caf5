"""vLLM's native weight-transfer API with ``backend="weightsync"`` on both sides (issue 14).

A real ``vllm serve`` process (CPU build, started as a user starts it) is updated by two
FSDP2 trainer processes through ``WeightTransferTrainerFactory.trainer_init`` and vLLM's own
``HTTPVLLMWeightSyncClient``; after each version, the server's greedy completion equals a
fresh engine's on the same weights, and its weight version is the version sent. The same
API drives an ``LLM`` whose engine core runs in a child process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import launcher
from _vllm_native import free_port, run_to_end
from weightsync.tools.tiny import tiny_config, write_checkpoint

HERE = Path(__file__).resolve().parent
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm-native"),
    pytest.mark.timeout(600),
]


def _results(out: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]


def _run(args: list[str], *, timeout: float = 300, env: dict[str, str] | None = None) -> list[dict]:
    """``tests/_vllm_native.py args``, its engines in its own process unless ``env`` says otherwise:
    a fresh reference engine computes the same tokens there, without the two processes (engine
    core, worker) that vLLM's CPU build starts per engine otherwise (measured: 79 s against 22 s
    for two references)."""
    proc = launcher.run([sys.executable, str(HERE / "_vllm_native.py"), *args], timeout=timeout, warm="vllm",
                        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                             **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _results(proc.stdout)


@pytest.mark.heavy  # 130 s; in the default run: two trainer ranks over HTTP (the LoRA case below), FSDP2
# trainers (test_engine_matrix deepseek_v3 engine-fsdp2-full), vllm serve updated over HTTP (the pause case)
def test_vllm_serve_is_updated_by_two_fsdp2_trainers_over_http(tmp_path):
    sys.path.insert(0, str(HERE))
    from _vllm_native import vllm_server
    from weightsync.meta.client import EmbeddedMetaServer

    config = tiny_config(tie=True)
    write_checkpoint(tmp_path / "A", config, seed=1)  # the server starts here
    write_checkpoint(tmp_path / "B", config, seed=2)  # the trainers start here
    out = tmp_path / "versions"
    with EmbeddedMetaServer() as meta, vllm_server(tmp_path / "A") as url:
        cmd = [sys.executable, str(HERE / "_vllm_native.py"), "trainer", "--world", "2", "--checkpoint",
               str(tmp_path / "B"), "--url", url, "--out", str(out), "--meta", meta.address, f"--token={meta.token}",
               "--job", "serve", "--model", str(tmp_path / "A"), "--versions", "2"]
        outputs = _trainers(cmd, world=2)
    served = _results(outputs[0])
    assert [r["version"] for r in served] == [1, 2]
    refs = {Path(r["path"]).name: r["tokens"] for r in _run(["reference", str(out / "v1"), str(out / "v2")])}
    for r in served:
        assert r["weight_version"] == str(r["version"])
        assert r["tokens"] == refs[f"v{r['version']}"], r  # the same weights as a fresh engine, token for token
    assert refs["v1"] != refs["v2"]  # the training step changed the weights, and the server followed


def _trainers(cmd: list[str], *, world: int) -> list[str]:
    """Run trainer ranks ``0..world-1`` of ``cmd`` (one process each, ``--rank R`` appended) to
    the end; their stdouts."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    procs = [launcher.launch([*cmd, "--rank", str(r)], env=env, warm="vllm") for r in range(world)]
    return run_to_end(procs, timeout=300)


@pytest.mark.heavy  # 106 s; LoRA versions into vLLM run by default in test_lora, vllm serve over HTTP below
def test_vllm_serve_takes_lora_adapter_versions_from_two_tp_trainers_over_http(tmp_path):
    """``vllm serve --enable-lora --lora-modules policy=...`` with the "weightsync" backend: two
    tensor-parallel trainer ranks of a LoRA adapter send adapter-only versions through vLLM's
    HTTP routes into the adapter ``policy`` (id 1). After each version, requests naming
    ``policy`` generate exactly what the server generates with that adapter loaded from disk
    by vLLM itself (``disk2``, ``disk3``), the weight version is the version sent, only the
    adapter's bytes moved, and the base model never changed."""
    sys.path.insert(0, str(HERE))
    from _vllm_native import vllm_server
    from weightsync.layout import ModelSpec
    from weightsync.layout.lora import LoraSpec
    from weightsync.meta.client import EmbeddedMetaServer
    from weightsync.tools.tiny import write_adapter

    config, lora = tiny_config(), LoraSpec(r=8, alpha=16)
    write_checkpoint(tmp_path / "base", config, seed=1)
    for seed in (4, 2, 3):  # policy starts from seed 4's adapter; the trainers send seeds 2 and 3
        write_adapter(tmp_path / f"adapter{seed}", config, lora, seed)
    modules = [f"policy={tmp_path / 'adapter4'}", f"disk2={tmp_path / 'adapter2'}", f"disk3={tmp_path / 'adapter3'}"]
    extra = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "3", "--max-cpu-loras", "4",
             "--lora-modules", *modules)
    with EmbeddedMetaServer() as meta, vllm_server(tmp_path / "base", extra=extra) as url:
        cmd = [sys.executable, str(HERE / "_vllm_native.py"), "lora-trainer", "--world", "2", "--url", url,
               "--meta", meta.address, f"--token={meta.token}", "--job", "serve-lora", "--model",
               str(tmp_path / "base"), "--served", "policy", "--compare", "disk2,disk3", "--seeds", "2,3"]
        outputs = _trainers(cmd, world=2)
    start, *served = _results(outputs[0])
    assert [(r["version"], r["weight_version"]) for r in served] == [(1, "1"), (2, "2")]
    base = str(tmp_path / "base")
    zero, one, two = (r["tokens"] for r in (start, *served))
    assert len({tuple(zero["policy"]), tuple(zero["disk2"]), tuple(zero["disk3"]), tuple(zero[base])}) == 4
    assert one["policy"] == zero["disk2"] and two["policy"] == zero["disk3"]  # token for token, as loaded from disk
    assert zero[base] == one[base] == two[base]  # the base model never moved
    sent = [sum(r["nbytes"] for r in rank) for rank in zip(_results(outputs[0])[1:], _results(outputs[1]), strict=True)]
    assert sent == [lora.nbytes(ModelSpec.from_hf_config(config))] * 2  # the adapter's bytes, each once


@pytest.mark.heavy  # 80 s; the matrix's trainer-child cell updates an LLM with a child engine core by default
def test_llm_with_a_child_engine_core_is_updated_through_the_same_api(tmp_path):
    config = tiny_config()
    write_checkpoint(tmp_path / "B", config, seed=2)
    results = _run(["mp-engine", "--checkpoint", str(tmp_path / "B"), "--seeds", "1,2"],
                   env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    start, one, first_closed, two, closed = results
    assert one["tokens"] != start["tokens"]  # version 1 (other weights) took effect
    # version 2 (the checkpoint's weights), sent by a second trainer, restored them exactly
    assert two["tokens"] == start["tokens"]
    assert (one["weight_version"], two["weight_version"]) == ("1", "2")
    # shutdown in either order, weightsync's part in under 2 s (issue 28 §5): the first trainer
    # before the engine (it releases the workers before its meta server stops: they stalled 30 s
    # retrying it, and the second trainer needed no shutdown_weight_transfer_engine call); the
    # engine (its workers) before the second trainer. vLLM's CPU engine core itself takes its
    # 5 s SIGTERM grace to stop, with or without weightsync (measured on this machine: 5.0 s)
    assert first_closed["trainer_first_seconds"] < 2, first_closed
    assert closed["trainer_seconds"] < 2 and closed["engine_seconds"] < 5 + 2, closed


@pytest.mark.heavy  # 50 s; deltas through the worker backend run by default in test_engine_matrix (mixtral)
def test_deltas_through_the_weightsync_backend_restore_the_engine_exactly(tmp_path):
    """``delta_anchor_every`` on both sides: the second version moves only the elements that
    changed, and the engine ends on exactly the checkpoint's weights (its tokens at start)."""
    config = tiny_config()
    write_checkpoint(tmp_path / "B", config, seed=2)
    start, moved, restored = _run(["mp-engine-delta", "--checkpoint", str(tmp_path / "B"), "--seed", "2"],
                                  env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert moved["tokens"] != start["tokens"]  # 2% of the elements moved: a different model
    assert restored["tokens"] == start["tokens"]  # the delta put exactly those elements back
    assert restored["nbytes"] < 0.1 * moved["nbytes"]  # and only they crossed the wire
    assert (moved["weight_version"], restored["weight_version"]) == ("1", "2")


def test_the_prefix_cache_reset_is_decided_at_init_and_a_client_without_one_is_refused():
    from types import SimpleNamespace

    from weightsync.integrations.vllm_trainer import prefix_cache_resetter

    calls = []
    own = SimpleNamespace(reset_prefix_cache=lambda: calls.append("own"))
    prefix_cache_resetter(own, 5)()
    assert calls == ["own"]

    class Wrapped:  # a user's wrapper around vLLM's HTTP client: found by its base_url, not its class name
        base_url = "http://127.0.0.1:1"

    assert callable(prefix_cache_resetter(Wrapped(), 5))
    with pytest.raises(ValueError, match="Opaque cannot reset vLLM's prefix cache"):
        prefix_cache_resetter(type("Opaque", (), {})(), 5)


def test_a_prefix_cache_reset_that_vllm_answers_success_false_fails_naming_the_route():
    """vLLM 0.32's ``/reset_prefix_cache`` answers 200 with ``{"success": false}`` while requests
    run; checking the status alone let the update end with old-weight KV blocks cached (issue 29)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from weightsync.integrations.vllm_trainer import prefix_cache_resetter

    answers = [b'{"success": false}', b'{"success": true}', b""]
    paths = []

    class Route(BaseHTTPRequestHandler):
        def do_POST(self):
            paths.append(self.path)
            body = answers.pop(0)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Route)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reset = prefix_cache_resetter(SimpleNamespace(base_url=url + "/"), 5)
        with pytest.raises(RuntimeError, match=rf'POST {url}/reset_prefix_cache answered {{"success": false}}: '
                                               r"vLLM did not reset its prefix cache .* pause generation \(POST /pause\) "
                                               r"before send_weights"):
            reset()
        reset()  # {"success": true}
        reset()  # an empty 200, as vLLM before 0.32 answered
        assert paths == ["/reset_prefix_cache"] * 3
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_workers_that_never_answer_update_weights_fail_send_weights_naming_the_meta_server():
    """It was a bare ``TimeoutError()`` (issue 28): say which version, how long, and where the
    workers receive from."""
    import threading
    from types import SimpleNamespace

    from weightsync.integrations.vllm_trainer import WeightSyncTrainerEngine, WeightSyncTrainerInitInfo
    from weightsync.session.sync_session import SyncError

    stuck = threading.Event()
    client = SimpleNamespace(start_weight_update=lambda: None, update_weights=lambda info: stuck.wait(30),
                             finish_weight_update=lambda weight_version=None: None)
    writer = SimpleNamespace(write=lambda v: "sent", meta=SimpleNamespace(address="http://10.9.9.9:7000"))
    engine = WeightSyncTrainerEngine(client=client, source=None, is_sender=True, writer=writer,
                                     info=WeightSyncTrainerInitInfo(rank=0, timeout=0.5), closers=[])
    try:
        with pytest.raises(SyncError, match=r"trainer rank 0: vLLM's workers did not finish update_weights of version "
                                            r"1 within 0\.5 s .* through the meta server at http://10\.9\.9\.9:7000"):
            engine.send_weights()
    finally:
        stuck.set()


def test_vllm_serve_applies_a_prefetched_version_inside_vllms_pause_alone(tmp_path):
    """The driver's lean sequence (issue 29): /pause, /update_weights, /finish_weight_update,
    /resume, and no /reset_prefix_cache of its own: vLLM's /pause resets the prefix cache once the
    engine stopped (mode abort, and keep, whose frozen requests it preempts), so after the update
    the prompt, cached under the old weights, is computed again (no cached token) and the greedy
    tokens equal a fresh engine's on the new weights, the version stamp the version sent.
    ``keep-stale`` (/pause?mode=keep&clear_cache=false) really keeps the old weights' cache: the
    same prompt then takes its cached blocks (what the mode documents, and the proof that the
    prompt's blocks were cached, so that the other modes' zero is the reset's doing)."""
    sys.path.insert(0, str(HERE))
    from _vllm_native import vllm_server
    from weightsync.meta.client import EmbeddedMetaServer

    config = tiny_config(tie=True)
    write_checkpoint(tmp_path / "A", config, seed=1)  # the server starts here
    write_checkpoint(tmp_path / "B", config, seed=2)
    refs = {Path(r["path"]).name: r["tokens"] for r in _run(["reference", str(tmp_path / "A"), str(tmp_path / "B")])}
    assert refs["A"] != refs["B"]
    with (EmbeddedMetaServer() as meta,
          vllm_server(tmp_path / "A", extra=("--enable-prompt-tokens-details", "--block-size", "32")) as url):
        out = run_to_end([launcher.launch(
            [sys.executable, str(HERE / "_vllm_native.py"), "pause-driver", "--url", url, "--meta", meta.address,
             f"--token={meta.token}", "--job", "pause", "--model", str(tmp_path / "A"),
             "--plan", "2:abort,1:keep-stale,2:keep,1:abort-reset"])], timeout=300)
    served = _results(out[0])
    assert [(r["version"], r.get("mode")) for r in served] == [
        (0, None), (1, "abort"), (2, "keep-stale"), (3, "keep"), (4, "abort-reset")]
    assert served[0]["tokens"] == refs["A"]
    for r, ref in ((served[1], "B"), (served[3], "B"), (served[4], "A")):
        assert (r["tokens"], r["cached_tokens"], r["weight_version"]) == (refs[ref], 0, str(r["version"])), r
    stale = served[2]
    assert stale["weight_version"] == "2" and stale["cached_tokens"] > 0, stale  # version 1's blocks, reused
