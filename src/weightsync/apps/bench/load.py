"""``weightsync bench --suite load``: many readers, many back-to-back versions, nothing grows.

One writer process and ``readers`` reader processes (a tiny Qwen3 over shared memory, the
``auto`` transport on one host) against a real ``weightsync meta-server`` process; the writer
writes ``versions`` versions back to back with ``staleness=0`` (each ``write()`` returns when
every reader applied it), and every reader checks every version bitwise. Sampled every
``every`` versions: each process's resident memory, the bytes of weightsync files in
``/dev/shm``, the meta server's memory and its ``/healthz``. The claim it checks: memory,
``/dev/shm`` and the server stay flat however many versions go by.

    rows = run_load(readers=16, versions=200)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

#: small enough that 17 processes share 2 cores; every weight changes every version
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "vocab_size": 512, "torch_dtype": "float32"}


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set of a process (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def shm_bytes() -> int:
    """Bytes of weightsync's files in /dev/shm (segments and zero-copy tensors)."""
    total = 0
    for entry in Path("/dev/shm").glob("weightsync*"):
        with contextlib.suppress(OSError):  # removed while we looked
            total += entry.stat().st_size
    return total


def _weights(version: int) -> dict[str, torch.Tensor]:
    from weightsync.tools.tiny import canonical_weights

    return canonical_weights(CONFIG, seed=version % 7)


def _writer(job: str, *, readers: int, versions: int, every: int, timeout: float) -> None:
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.torch_layout import fill_from_canonical

    torch.set_num_threads(1)
    source = ShardedSource("hf", CONFIG, 0)
    sync = SyncConfig(num_writers=1, num_readers=readers, job=job, timeout=timeout)
    pool = {seed: _weights(seed) for seed in range(7)}
    with WeightWriter(source, rank=0, config=sync) as writer:
        for version in range(1, versions + 1):
            fill_from_canonical(source.layout(), source.tensors(), pool[version % 7])
            t0 = time.perf_counter()
            writer.write(version)
            seconds = time.perf_counter() - t0
            record: dict[str, Any] = {"version": version, "seconds": seconds}
            if version % every == 0 or version == 1:
                record.update(rss=rss_bytes(), shm=shm_bytes())
            print("WSLOAD " + json.dumps(record), flush=True)


def _reader(job: str, rank: int, *, readers: int, versions: int, every: int, timeout: float) -> None:
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig

    torch.set_num_threads(1)
    engine = ShardedEngine(f"hf:replicas={readers}", CONFIG, rank)
    sync = SyncConfig(num_writers=1, num_readers=readers, job=job, timeout=timeout)
    pool = {seed: _weights(seed) for seed in range(7)}
    wrong = 0
    with WeightReader(engine, rank=rank, config=sync) as reader:
        for version in range(1, versions + 1):
            reader.update(version, timeout=timeout)
            want = pool[version % 7]
            wrong += sum(not torch.equal(engine.tensors[n], want[n]) for n in want)
            if version % every == 0 or version == 1:
                print("WSLOAD " + json.dumps({"version": version, "rss": rss_bytes(), "wrong": wrong}), flush=True)
    print("WSLOAD " + json.dumps({"done": True, "wrong": wrong}), flush=True)


def _records(out: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("WSLOAD "):]) for line in out.splitlines() if line.startswith("WSLOAD ")]


def run_load(*, readers: int = 16, versions: int = 200, every: int = 50, timeout: float = 120.0) -> dict[str, Any]:
    """One run; a dict of samples per version checkpoint and the verdicts (see module docstring)."""
    import httpx

    from weightsync.meta.config import ensure_token_file

    shm_before = shm_bytes()
    with tempfile.TemporaryDirectory(prefix="weightsync-load-") as tmp:
        token_file = Path(tmp) / "token"
        token = ensure_token_file(token_file)
        server = subprocess.Popen([sys.executable, "-m", "weightsync.cli", "meta-server", "--port", "0",
                                   "--token-file", str(token_file)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        procs: list[subprocess.Popen[str]] = []
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"meta server did not start: {line!r}")
            address = line.rsplit(" ", 1)[1].strip()
            env = {**os.environ, "WEIGHTSYNC_META_ADDR": address, "WEIGHTSYNC_META_TOKEN": token,
                   "OMP_NUM_THREADS": "1"}
            job = f"load-{uuid.uuid4().hex[:8]}"
            common = ["--job", job, "--readers", str(readers), "--versions", str(versions), "--every", str(every),
                      "--timeout", str(timeout)]
            procs = [subprocess.Popen([sys.executable, "-m", "weightsync.apps.bench.load", "reader", "--rank", str(r),
                                       *common], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for r in range(readers)]
            writer = subprocess.Popen([sys.executable, "-m", "weightsync.apps.bench.load", "writer", *common], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(writer)
            started = time.perf_counter()
            server_samples = []
            while writer.poll() is None and time.perf_counter() - started < timeout * versions:
                health = httpx.get(f"{address}/healthz", timeout=10).status_code
                server_samples.append({"t": time.perf_counter() - started, "rss": rss_bytes(server.pid),
                                       "healthz": health})
                time.sleep(2.0)
            outs = [p.communicate(timeout=timeout) for p in procs]
            wall = time.perf_counter() - started
            health = httpx.get(f"{address}/healthz", timeout=10).status_code
            server_samples.append({"t": wall, "rss": rss_bytes(server.pid), "healthz": health})
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
            server.terminate()
            server.wait(timeout=30)
    failed = [(i, p.returncode, err.strip().splitlines()[-1:]) for i, (p, (_, err)) in
              enumerate(zip(procs, outs, strict=True)) if p.returncode]
    writer_records = _records(outs[-1][0])
    reader_records = [_records(out) for out, _ in outs[:-1]]
    seconds = [r["seconds"] for r in writer_records if r["version"] > 1]
    samples = [r for r in writer_records if "rss" in r]
    result: dict[str, Any] = {
        "readers": readers, "versions": versions, "wall_seconds": wall, "failed": failed,
        "versions_per_second": len(writer_records) / wall if wall else 0.0,
        "write_seconds_p50": statistics.median(seconds) if seconds else None,
        "write_seconds_p99": sorted(seconds)[int(0.99 * (len(seconds) - 1))] if seconds else None,
        "writer": [{"version": r["version"], "rss": r["rss"], "shm": r["shm"]} for r in samples],
        "readers_rss": {r["version"]: sum(rec.get("rss", 0) for recs in reader_records for rec in recs
                                          if rec.get("version") == r["version"]) for r in samples},
        "wrong": sum(recs[-1].get("wrong", 1) for recs in reader_records if recs),
        "server": server_samples,
        "shm_before": shm_before, "shm_after": shm_bytes(),
    }
    result["ok"] = (not failed and result["wrong"] == 0 and result["shm_after"] <= shm_before
                    and all(s["healthz"] == 200 for s in server_samples))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.apps.bench.load")
    parser.add_argument("role", choices=["writer", "reader"])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--job", required=True)
    parser.add_argument("--readers", type=int, required=True)
    parser.add_argument("--versions", type=int, required=True)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.role == "writer":
        _writer(args.job, readers=args.readers, versions=args.versions, every=args.every, timeout=args.timeout)
    else:
        _reader(args.job, args.rank, readers=args.readers, versions=args.versions, every=args.every,
                timeout=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
