"""``weightsync plan``: plan a sync between two layouts of one model and print statistics.

    weightsync plan --config moe-1t --source megatron:tp=8,pp=16,dp=8,ep=64,etp=1 \\
        --target vllm:tp=16,replicas=16 --link-gbps 400 --json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from weightsync.configs import load_spec
from weightsync.layout import parse_layout
from weightsync.layout.kinds.megatron import MegatronLayout, derives
from weightsync.layout.quant import fp8_bytes_saved
from weightsync.layout.quant_offers import quantized_sources
from weightsync.plan import PlanOptions, build_local_plan, build_plan, plan_statistics


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True,
                   help="HF config.json (file or directory) or a bundled name, e.g. moe-1t, tiny-qwen3")
    p.add_argument("--source", required=True, help="training layout, e.g. megatron:tp=8,pp=4,ep=8,dp=2,etp=1")
    p.add_argument("--target", required=True, help="inference layout, e.g. vllm:tp=4,replicas=2")
    p.add_argument("--link-gbps", type=float, default=400.0,
                   help="per-rank link bandwidth in Gbit/s for simulated_seconds (default 400)")
    p.add_argument("--min-split-bytes", type=int, default=PlanOptions().min_split_bytes,
                   help="smallest part a replicated piece is cut into across holders")
    p.add_argument("--verify", action="store_true",
                   help="also run the plan in numpy on random weights and check every element "
                        "(small models only)")
    p.add_argument("--vllm-loaders", action="store_true",
                   help="take vllm layouts from a dry run of vLLM's own weight loaders (needs vllm installed); "
                        "default: weightsync's tables, which a test keeps equal to them")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.config)
    source = parse_layout(args.source)
    target = parse_layout(args.target)
    if args.link_gbps <= 0:
        raise ValueError("--link-gbps must be positive")
    options = PlanOptions(min_split_bytes=args.min_split_bytes)
    if any(isinstance(kind, MegatronLayout) and derives(spec) for kind in (source, target)):
        from weightsync.sources.megatron_names import install as install_megatron_names

        install_megatron_names()  # DeepSeek-V3/GLM-4.5/gpt-oss Megatron names come from mbridge (needs it installed)
    if args.vllm_loaders:
        from weightsync.engines.vllm_layout import install

        install()  # vllm kinds now come from vLLM's loaders; the time goes into expand_seconds
    started = time.perf_counter()
    writers = source.roster(spec)  # every rank's layout as columns (layout.roster)
    readers = target.roster(spec)
    writers, quant = quantized_sources(writers, readers)  # an FP8 target: writers quantize on send
    expand_seconds = time.perf_counter() - started
    stats = plan_statistics(writers, readers, options)
    t0 = time.perf_counter()
    build_local_plan(writers, readers, role="reader", rank=0, options=options)
    reader_local = time.perf_counter() - t0
    t0 = time.perf_counter()
    build_local_plan(writers, readers, role="writer", rank=0, options=options)
    writer_local = time.perf_counter() - t0
    out: dict[str, Any] = {
        "model": spec.family,
        "parameters": spec.num_parameters,
        "source": source.describe(),
        "target": target.describe(),
        "vllm_layouts": "vLLM's loaders" if args.vllm_loaders else "tables",
        "writers": source.world_size,
        "readers": target.world_size,
        **stats.to_dict(args.link_gbps),
        "expand_seconds": expand_seconds,
        "local_plan_seconds": {"reader0": reader_local, "writer0": writer_local},
    }
    if quant:
        out["fp8"] = {"tensors": len(quant.tensors),
                      "shared_tiles": int(sum(int(t.exchanged.sum()) for t in quant.tensors.values())),
                      "bytes_saved": fp8_bytes_saved(readers.canonical_tensors())}
    if args.verify:
        if quant:
            raise ValueError("--verify moves random values, not quantized ones; FP8 plans are checked bitwise "
                             "by tests/test_quant.py")
        out["verified"] = _verify(writers.layouts(), readers.layouts(), options, stats.needed_bytes)
    if args.json:
        print(json.dumps(out))
    else:
        _print_table(out)
    return 0


def _verify(writers: list, readers: list, options: PlanOptions, needed: int) -> bool:
    from weightsync.plan.reference import check_destinations, cut_shards, empty_shards, random_canonical, run_plan

    if needed > 1 << 30:
        raise ValueError(f"--verify runs in memory; {needed / 2**30:.1f} GiB is too large (use a small config)")
    plan = build_plan(writers, readers, options)
    values = random_canonical(writers[0].canonical, seed=0)
    src = {w.rank: cut_shards(w, values) for w in writers}
    dst = {r.rank: empty_shards(r) for r in readers}
    writes = run_plan(plan, src, dst)
    check_destinations(readers, dst, values)
    for r in readers:
        for shard in r.shards:
            covered = sum(reg.numel for reg in shard.regions)
            if int(writes[r.rank][shard.name].sum()) != covered or writes[r.rank][shard.name].max(initial=0) > 1:
                raise AssertionError(f"reader {r.rank} {shard.name}: elements written other than once")
    return True


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _print_table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"weightsync plan: {out['source']} -> {out['target']}", show_header=False)
    rows = [
        ("model", f"{out['model']}, {out['parameters'] / 1e9:.2f}B parameters"),
        ("ranks", f"{out['writers']} writers -> {out['readers']} readers"),
        ("total bytes (one model copy)", _fmt_bytes(out["total_bytes"])),
        ("needed bytes (all readers)", _fmt_bytes(out["needed_bytes"])),
        ("sent bytes", f"{_fmt_bytes(out['sent_bytes'])} (redundant: {out['sent_bytes'] - out['needed_bytes']})"),
        ("ops", f"{out['num_ops']:,}"),
        ("max send per writer", _fmt_bytes(out["max_send_bytes"])),
        ("max receive per reader", _fmt_bytes(out["max_recv_bytes"])),
        ("imbalance (max/mean send)", f"{out['imbalance']:.4f}"),
        ("max send / lower bound", f"{out['balance_ratio']:.4f}"),
        ("simulated time", f"{out['simulated_seconds']:.3f} s at {out['link_gbps']:g} Gbit/s per rank"),
        ("whole-plan statistics", f"{out['plan_seconds']:.2f} s"),
        ("one rank's local plan", f"reader 0: {out['local_plan_seconds']['reader0']:.3f} s, "
                                  f"writer 0: {out['local_plan_seconds']['writer0']:.3f} s"),
        ("metadata expansion", f"{out['expand_seconds']:.2f} s"),
    ]
    if "verified" in out:
        rows.append(("verified in numpy", "every destination element written once, bitwise equal"))
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
