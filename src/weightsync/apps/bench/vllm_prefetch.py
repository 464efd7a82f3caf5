"""``weightsync bench --suite vllm-prefetch``: a vLLM engine's pause per update, with and without
prefetch, and its generation throughput during a sync against idle (issue 29).

For each in-process path (the in-process ``VLLMEngine``, and the ``"weightsync"`` worker backend
of an in-process ``LLM``, the code a ``vllm serve`` worker runs) a writer process writes versions
as fast as the engine process (:mod:`weightsync.integrations.vllm_prefetch`) applies them; the
engine process measures every figure side by side. The ``serve`` path runs a real ``vllm serve``
process, a trainer process and HTTP clients (:mod:`weightsync.apps.bench.vllm_prefetch_serve`).
Targets: the pause with prefetch within the engine's apply time + 10%, and throughput during a
sync >= 80% of idle.

    rows = run_vllm_prefetch(model="qwen3-30m", updates=3)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from weightsync.apps.bench.vllm_memory import MODELS, model_config

PATHS = ("engine", "backend", "serve")


def _writer(config: dict[str, Any], job: str, versions: int, transport: str, timeout: float) -> None:
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.tools.tiny import CanonicalSource, canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    source = CanonicalSource(config)
    sync = SyncConfig(num_writers=1, num_readers=1, job=job, timeout=timeout, transport=transport)
    weights = [canonical_weights(config, seed) for seed in (1, 2)]
    with WeightWriter(source, rank=0, config=sync) as writer:
        for version in range(1, versions + 1):  # each returns once the engine applied it
            fill_from_canonical(source.layout(), source.tensors(), weights[version % 2])
            writer.write(version)


def _case(name: str, path: str, *, updates: int, transport: str, timeout: float, tmp: Path,
          env: dict[str, str], pause_modes: tuple[str, ...] = ("abort",)) -> dict[str, Any]:
    from weightsync.tools.tiny import write_checkpoint

    config = model_config(name)
    checkpoint = tmp / name
    if not checkpoint.exists():
        write_checkpoint(checkpoint, config, seed=2)
    job = f"vllm-prefetch-{uuid.uuid4().hex[:8]}"
    row: dict[str, Any] = {"model": name, "path": path, "transport": transport,
                           "model_bytes": sum(t.nbytes for t in _canonical(config))}
    if path == "serve":
        from weightsync.apps.bench.vllm_prefetch_serve import serve_case

        return row | serve_case(name, checkpoint, job=job, updates=updates, transport=transport, timeout=timeout,
                                env=env, pause_modes=pause_modes)
    versions = 1 + 2 * updates
    common = ["--job", job, "--transport", transport, "--timeout", str(timeout)]
    engine = subprocess.Popen([sys.executable, "-m", "weightsync.integrations.vllm_prefetch", "--checkpoint",
                               str(checkpoint), "--path", path, "--updates", str(updates), *common],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writer = subprocess.Popen([sys.executable, "-m", "weightsync.apps.bench.vllm_prefetch", "writer", "--model", name,
                               "--versions", str(versions), *common], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        out, err = engine.communicate(timeout=timeout * 3)
        _, werr = writer.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        engine.kill()
        writer.kill()
        engine.communicate()
        writer.communicate()
        return row | {"error": "timed out"}
    lines = [line[len("WSPREFETCH "):] for line in out.splitlines() if line.startswith("WSPREFETCH ")]
    if engine.returncode or writer.returncode or not lines:
        tail = " | ".join((err or werr).strip().splitlines()[-3:])
        return row | {"error": f"engine exit {engine.returncode}, writer exit {writer.returncode}: {tail}"}
    return row | json.loads(lines[-1])


def _canonical(config: dict[str, Any]) -> list[Any]:
    from weightsync.layout import ModelSpec

    return list(ModelSpec.from_hf_config(config).canonical_tensors().values())


def run_vllm_prefetch(*, model: str = "qwen3-30m", updates: int = 3, transport: str = "auto",
                      paths: tuple[str, ...] = PATHS, timeout: float = 600.0,
                      pause_modes: tuple[str, ...] = ("abort",)) -> list[dict[str, Any]]:
    """One row per path (see module docstring); ``pause_modes``: how the ``serve`` path's driver
    pauses a prefetched update, each in turn (:data:`weightsync.apps.bench.vllm_prefetch_serve.PAUSE_MODES`)."""
    from weightsync.apps.bench.vllm_prefetch_serve import check_pause_modes
    from weightsync.meta.client import EmbeddedMetaServer

    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise ValueError(f"vLLM path(s) {unknown} are unknown; choose from {', '.join(PATHS)}")
    pause_modes = check_pause_modes(pause_modes)
    rows = []
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-prefetch-") as tmp, EmbeddedMetaServer() as server:
        env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
        for path in paths:
            rows.append(_case(model, path, updates=updates, transport=transport, timeout=timeout, tmp=Path(tmp),
                              env=env, pause_modes=pause_modes))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.apps.bench.vllm_prefetch")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer")
    w.add_argument("--model", required=True, choices=sorted(MODELS))
    w.add_argument("--job", required=True)
    w.add_argument("--versions", type=int, required=True)
    w.add_argument("--transport", default="auto")
    w.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    _writer(model_config(args.model), args.job, args.versions, args.transport, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
