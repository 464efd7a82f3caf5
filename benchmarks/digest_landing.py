"""One reader landing a version with and without fused digests, in one process (issue 42).

The reader's side of ``integrity=True`` alone, with no transport around it: qwen3-0.6b's plan
from ``megatron:tp=2`` to ``vllm:tp=1`` (1,011 ops, 1.19 GB), copied op by op from the two
writers' shards (in this process's memory) into the reader's three ways: ``torch``'s copy
(``Tensor.copy_``), the plain copies the transports make (the device port's, which takes the
copy kernels' non-temporal stores once they are loaded), and
:meth:`weightsync.transport.digests.VersionDigests.land` (copy and XXH3 in one pass). They
alternate ``--reps`` times; the best and the median of each are printed, and the fused copies'
ratio to the plain ones.

    python benchmarks/digest_landing.py [--reps 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from weightsync.apps.bench.cases import MODELS
    from weightsync.layout import ModelSpec, parse_layout
    from weightsync.layout.roster import Roster
    from weightsync.plan import PlanOptions, build_local_plan
    from weightsync.ports import device
    from weightsync.tools.codecs import digest_jit
    from weightsync.tools.torch_layout import allocate
    from weightsync.transport.digests import VersionDigests
    from weightsync.transport.tensors import flat_views, op_dst_view, op_src_view

    torch.set_num_threads(1)
    spec = ModelSpec.from_hf_config(MODELS["qwen3-0.6b"])
    writers = [parse_layout("megatron:tp=2").rank_layout(spec, r) for r in range(2)]
    reader = parse_layout("vllm:tp=1").rank_layout(spec, 0)
    plan = build_local_plan(Roster.from_layouts(writers), Roster.from_layouts([reader]), role="reader", rank=0,
                            options=PlanOptions())
    sources = [flat_views(allocate(layout)) for layout in writers]
    for flats in sources:
        for flat in flats.values():
            flat.random_(0, 100)
    landed = flat_views(allocate(reader))
    if digest_jit.load() is None:
        print("numba is not installed: no fused kernels to measure", file=sys.stderr)
        return 1
    digests = VersionDigests(plan, None, role="reader", rank=0, kind="xxh3", device="cpu")

    def torch_copy() -> None:
        for op in plan.ops:
            op_dst_view(landed, op).copy_(op_src_view(sources[op.src_rank], op))

    port = device.current()

    def plain() -> None:
        for op in plan.ops:
            port.copy(op_dst_view(landed, op), op_src_view(sources[op.src_rank], op))

    def fused() -> None:
        digests.begin(0)
        for op in plan.ops:
            digests.land(op, op_dst_view(landed, op), op_src_view(sources[op.src_rank], op))

    seconds: dict[str, list[float]] = {"torch": [], "plain": [], "fused": []}
    for _ in range(args.reps + 1):  # the first round warms caches up and is dropped
        for name, run in (("torch", torch_copy), ("plain", plain), ("fused", fused)):
            t0 = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - t0)
    row = {"ops": len(plan.ops), "bytes": plan.total_bytes, "reps": args.reps}
    for name, values in seconds.items():
        row[f"{name}_best_ms"] = 1e3 * min(values[1:])
        row[f"{name}_median_ms"] = 1e3 * statistics.median(values[1:])
    row["fused_over_plain_median"] = row["fused_median_ms"] / row["plain_median_ms"]
    row["plain_over_torch_median"] = row["plain_median_ms"] / row["torch_median_ms"]
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print(f"{row['ops']} ops, {row['bytes'] / 1e9:.2f} GB: torch best {row['torch_best_ms']:.1f} ms, median "
              f"{row['torch_median_ms']:.1f} ms; plain best {row['plain_best_ms']:.1f} ms, median "
              f"{row['plain_median_ms']:.1f} ms; fused best {row['fused_best_ms']:.1f} ms, median "
              f"{row['fused_median_ms']:.1f} ms ({row['fused_over_plain_median']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
