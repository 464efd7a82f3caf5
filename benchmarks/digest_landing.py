"""One reader landing a version with and without fused digests, in one process (issue 42).

The reader's side of ``integrity=True`` alone, with no transport around it: qwen3-0.6b's plan
from ``megatron:tp=2`` to ``vllm:tp=1`` (1,011 ops, 1.19 GB), copied op by op from the two
writers' shards (in this process's memory) into the reader's three ways: ``torch``'s copy
(``Tensor.copy_``), the plain copies the transports make (the device port's, which takes the
copy kernels' non-temporal stores once they are loaded), and
:meth:`weightsync.transport.digests.VersionDigests.land` (copy and XXH3 in one pass). They
alternate ``--reps`` times; the best and the median of each are printed, and the fused copies'
ratio to the plain ones.

``--kernels`` measures the kernels alone instead, one 64 MiB buffer (from memory) and one of
256 KiB (from L2), GB/s of the best of three rounds: XXH3 alone in these kernels and in
``xxhash``, the fused copy + XXH3 with ordinary and with non-temporal stores, the plain
non-temporal copy, and ``np.copyto`` (docs/integrity.md).

    python benchmarks/digest_landing.py [--reps 7] [--json] [--kernels]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="the kernels alone, GB/s (see above)")
    args = parser.parse_args(argv)
    if args.kernels:
        return kernels(as_json=args.json)

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


def kernels(*, as_json: bool) -> int:
    """GB/s of each kernel on one buffer, from memory (64 MiB) and from L2 (256 KiB)."""
    import numpy as np

    from weightsync.tools.codecs import digest_jit

    k = digest_jit.load()
    if k is None:
        print("numba is not installed: no kernels to measure", file=sys.stderr)
        return 1
    rows: dict[str, dict[str, float]] = {}
    for size in (64 << 20, 256 << 10):
        src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        dst = np.empty_like(src)
        runs = _kernel_runs(k, src, dst)
        reps = max(1, (512 << 20) // size)
        row = rows[f"{size >> 10} KiB"] = {}
        for name, run in runs.items():
            run()
            best = min(_timed(run, reps) for _ in range(3))
            row[name] = reps * size / best / 1e9
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        for size_name, row in rows.items():
            print(size_name + ": " + "; ".join(f"{name} {gbps:.2f} GB/s" for name, gbps in row.items()))
    return 0


def _kernel_runs(k: Any, src: Any, dst: Any) -> dict[str, Callable[[], object]]:
    """Each measured kernel on one buffer, as a call."""
    import numpy as np
    import xxhash

    n = src.size
    return {
        "xxh3 (kernels)": lambda: k.once(src, 0, n, dst, 0, n, 1, n, copy=False),
        "xxh3 (xxhash)": lambda: xxhash.xxh3_64_intdigest(src),
        "fused, ordinary stores": lambda: k.once(src, 0, n, dst, 0, n, 1, n, copy=True),
        "fused, non-temporal": lambda: k.once(src, 0, n, dst, 0, n, 1, n, copy=True, nontemporal=True),
        "plain copy, non-temporal": lambda: k.copy(src, 0, n, dst, 0, n, 1, n),
        "np.copyto": lambda: np.copyto(dst, src),
    }


def _timed(run: Callable[[], object], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
