"""``weightsync bench``: weightsync against the ways users move weights today, side by side.

    result = run_bench(suite("quick", available_transports()), BenchOptions())
    result["rows"], result["ratios"]

Modules: :mod:`~weightsync.apps.bench.cases` (models, layout pairs, suites),
:mod:`~weightsync.apps.bench.weights` (deterministic random weights any process can compute),
:mod:`~weightsync.apps.bench.baselines` (safetensors reload, per-parameter and bucketed
broadcast, weightsync itself), :mod:`~weightsync.apps.bench.worker` (one benchmark process),
:mod:`~weightsync.apps.bench.runner` (the parent), :mod:`~weightsync.apps.bench.report` (table, JSON,
plot).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

from weightsync.apps.bench.cases import Case, suite
from weightsync.apps.bench.runner import BenchOptions, run_awex_peer, run_case


def machine() -> dict[str, Any]:
    """What the numbers were measured on (cores, CPU model, memory, load)."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal:"))) * 1024
    except (OSError, StopIteration):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    import torch

    return {"nproc": os.cpu_count(), "cpu": cpu, "memory_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "loadavg": list(load),
            "cuda": torch.cuda.is_available()}


def run_bench(cases: Sequence[Case], options: BenchOptions, *,
              on_method: Callable[[Case, str], None] | None = None) -> dict[str, Any]:
    """Run every case (and peer); returns ``{"rows", "ratios", "limits", ...}``."""
    from weightsync.apps.bench.report import summary_ratios
    from weightsync.meta.client import EmbeddedMetaServer

    rows: list[dict[str, Any]] = []
    limits: dict[str, dict[str, float]] = {}
    failures: list[str] = []
    skipped: list[str] = []
    started = time.perf_counter()
    load_before = machine()["loadavg"]
    with EmbeddedMetaServer() as server:
        meta_env = {"WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token}
        for case in cases:
            callback = (lambda m, case=case: on_method(case, m)) if on_method else None
            result = run_case(case, options, meta_env=meta_env, on_method=callback)
            if result.skipped:
                skipped.append(f"{case.name}: {result.skipped}")
                continue
            rows.extend(result.rows)
            limits[case.name] = result.limits
            if result.failure:
                failures.append(f"{case.name}: {result.failure}")
            if case.peer == "awex":
                peer = run_awex_peer(case, options)
                if peer is None:
                    skipped.append(f"{case.name}: awex peer not configured (--awex-python)")
                else:
                    from weightsync.apps.bench.runner import add_ratios

                    case_rows = [r for r in rows if r["case"] == case.name] + [peer]
                    add_ratios(case_rows, result.limits)
                    rows.append(peer)
                    if "error" in peer:
                        failures.append(f"{case.name}: {peer['error']}")
                if on_method:
                    on_method(case, "awex-p2p")
    failures += [f"{r['case']} {r['method']}: {r['error']}" for r in rows if "error" in r
                 and f"{r['case']}: {r['error']}" not in failures]
    failures += [f"{r['case']} {r['method']}: destination weights differ" for r in rows
                 if "seconds" in r and not r.get("verified") and r["method"] != "awex-p2p"]
    info = machine()
    info["loadavg_before"] = load_before
    return {"rows": rows, "ratios": summary_ratios(rows), "limits": limits, "failures": failures,
            "skipped": skipped, "machine": info, "seconds": time.perf_counter() - started,
            "options": {"max_bucket_bytes": options.max_bucket_bytes,
                        "baseline_bucket_bytes": options.baseline_bucket_bytes, "slots": options.slots}}


__all__ = ["BenchOptions", "Case", "machine", "run_bench", "suite"]
