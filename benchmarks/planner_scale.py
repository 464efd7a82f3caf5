"""Planner speed at trillion-parameter scale (a script, not a timed test).

A 1T-parameter MoE (bundled config ``moe-1t``: 61 layers, 384 experts, hidden 7168, expert
ffn 2048, vocab 163840) trained as ``megatron:tp=8,pp=16,dp=8,ep=64,etp=1`` (1024 ranks) and
served as ``vllm:tp=16,replicas=16`` (256 ranks). Measures, on one core:

* metadata expansion: building all 1280 ranks' layouts from their descriptors (once per job);
* one rank's local plan (reader 0, writer 0, and the slowest of a sample of ranks);
* the whole plan's statistics (every op of every rank, streamed).

    taskset -c 0 python benchmarks/planner_scale.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from weightsync.configs import load_spec
from weightsync.layout import parse_layout
from weightsync.plan import build_local_plan, plan_statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="moe-1t")
    parser.add_argument("--source", default="megatron:tp=8,pp=16,dp=8,ep=64,etp=1")
    parser.add_argument("--target", default="vllm:tp=16,replicas=16")
    parser.add_argument("--sample", type=int, default=4, help="extra ranks per role timed for local plans")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    spec = load_spec(args.config)
    src, dst = parse_layout(args.source), parse_layout(args.target)
    t0 = time.perf_counter()
    writers = src.all_rank_layouts(spec)
    readers = dst.all_rank_layouts(spec)
    expand = time.perf_counter() - t0

    local: dict[str, float] = {}
    ranks = {"reader": [0, *range(1, dst.world_size, max(dst.world_size // args.sample, 1))][: args.sample + 1],
             "writer": [0, *range(1, src.world_size, max(src.world_size // args.sample, 1))][: args.sample + 1]}
    ops: dict[str, int] = {}
    for role, rank_list in ranks.items():
        for rank in rank_list:
            t0 = time.perf_counter()
            plan = build_local_plan(writers, readers, role=role, rank=rank)  # type: ignore[arg-type]
            local[f"{role}{rank}"] = time.perf_counter() - t0
            ops[f"{role}{rank}"] = len(plan)

    t0 = time.perf_counter()
    stats = plan_statistics(writers, readers)
    whole = time.perf_counter() - t0
    out = {
        "config": args.config, "parameters": spec.num_parameters, "source": src.describe(),
        "target": dst.describe(), "writers": src.world_size, "readers": dst.world_size,
        "expand_seconds": expand, "local_plan_seconds": local, "local_plan_ops": ops,
        "max_local_plan_seconds": max(local.values()), "whole_plan_statistics_seconds": whole,
        "num_ops": stats.num_ops, "imbalance": stats.imbalance, "balance_ratio": stats.balance_ratio,
        "sent_equals_needed": stats.sent_bytes == stats.needed_bytes,
        "cpu_affinity": sorted(os.sched_getaffinity(0)), "load_average": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(out))
        return
    for key, value in out.items():
        print(f"{key:32s} {value}")


if __name__ == "__main__":
    main()
