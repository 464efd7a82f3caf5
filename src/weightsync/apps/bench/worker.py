"""One benchmark process: holds one rank's shards and runs every method of a case on them.

``weightsync bench`` starts ``W + R`` of these per case (plain subprocesses, JSON spec on
the command line, one JSON line per result on stdout; nothing is pickled). They share one
gloo group for barriers, the baselines' gather (writers) and broadcast (writer 0 +
readers); weightsync's transports make their own connections through the meta server.

Per case, in order:

1. writers fill their shards with the benchmark weights (:mod:`weightsync.apps.bench.weights`);
   readers allocate zeroed engine buffers;
2. the physical limits, measured here and now: gloo loopback bandwidth (writer 0 ->
   reader 0, one large message) and one single-threaded memcpy (on reader 0) of the bytes
   one reader must receive;
3. for each method: readers zero their buffers, every rank resets its peak-RSS counter,
   ``warmup + reps`` syncs run, each of a *new* version: writers first fill the method's
   source tensors with that version's weights (``WeightPool.at``), untimed; the sync is
   started by a barrier and timed on every rank until that rank's part is done (the parent
   takes the slowest rank); then, untimed, every reader checks every byte it holds against
   that version's weights and records the bytes that really arrived. A method that skips
   a copy or resends an older version fails the check of that version.

    python -m weightsync.apps.bench.worker --spec '<json>' --rank <global rank>
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Any

from weightsync.tools.rss import reset_peak_rss, status_bytes

PREFIX = "WSBENCH "


def emit(record: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(record), flush=True)


def measure_limits(ctx: Any, nbytes: int, *, reps: int = 5) -> dict[str, float]:
    """gloo loopback bandwidth and single-thread memcpy bandwidth, measured in this run."""
    import torch
    import torch.distributed as dist

    out: dict[str, float] = {}
    me = ctx.global_rank
    first_reader = ctx.num_writers
    loop_bytes = max(min(nbytes, 256 << 20), 1 << 20)
    buf = torch.ones(loop_bytes if me in (0, first_reader) else 1, dtype=torch.uint8)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        if me == 0:
            dist.send(buf, dst=first_reader)
        elif me == first_reader:
            dist.recv(buf, src=0)
        times.append(time.perf_counter() - t0)
    if me == first_reader:
        out["loopback_gbps"] = loop_bytes / statistics.median(times) / 1e9
    del buf
    dist.barrier()
    if me == first_reader:
        copy_bytes = max(min(nbytes, 1 << 30), 1 << 20)
        src = torch.ones(copy_bytes, dtype=torch.uint8)
        dst = torch.zeros(copy_bytes, dtype=torch.uint8)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        out["memcpy_gbps"] = copy_bytes / statistics.median(times) / 1e9
        out["memcpy_bytes_measured"] = copy_bytes
        del src, dst
    dist.barrier()
    return out


def run_case(spec: dict[str, Any], global_rank: int) -> None:
    import torch
    import torch.distributed as dist

    from weightsync.apps.bench.baselines import RankContext, make_method, reader_bytes
    from weightsync.apps.bench.weights import WeightPool, fill, mismatches
    from weightsync.layout import ModelSpec, parse_layout
    from weightsync.tools.torch_layout import allocate

    torch.set_num_threads(1)
    config = spec["config"]
    src, dst = parse_layout(spec["source"]), parse_layout(spec["target"])
    num_writers, num_readers = src.world_size, dst.world_size
    world = num_writers + num_readers
    timeout = float(spec["timeout"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=global_rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    train_group = dist.new_group(list(range(num_writers)))
    update_group = dist.new_group([0, *range(num_writers, world)])
    role = "writer" if global_rank < num_writers else "reader"
    rank = global_rank if role == "writer" else global_rank - num_writers
    model = ModelSpec.from_hf_config(config)
    writer_layouts = [src.rank_layout(model, r) for r in range(num_writers)]
    layout = writer_layouts[rank] if role == "writer" else dst.rank_layout(model, rank)
    tensors = allocate(layout)
    pool = WeightPool.for_layout(layout, seed=int(spec.get("seed", 0)))
    t0 = time.perf_counter()
    if role == "writer":
        fill(layout, tensors, pool.at(0))
    ctx = RankContext(role=role, rank=rank, num_writers=num_writers, num_readers=num_readers, config=config,
                      source=spec["source"], target=spec["target"], spec=model, layout=layout, tensors=tensors,
                      writer_layouts=writer_layouts, train_group=train_group, update_group=update_group,
                      scratch=spec["scratch"], timeout=timeout, options=spec["options"])
    fill_seconds = time.perf_counter() - t0
    per_reader = reader_bytes(dst.rank_layout(model, 0))
    limits = measure_limits(ctx, per_reader)
    if global_rank == num_writers:
        emit({"event": "limits", **limits, "fill_seconds": fill_seconds})
    reps, warmup = int(spec["reps"]), int(spec["warmup"])
    for method_name in spec["methods"]:
        record: dict[str, Any] = {"event": "method", "method": method_name, "role": role, "rank": rank,
                                  "bytes": reader_bytes(layout) if role == "reader" else 0}
        try:
            record.update(_run_method(ctx, method_name, reps=reps, warmup=warmup, make=make_method,
                                      pool=pool, check=lambda p: mismatches(layout, tensors, p)))
        except Exception as exc:  # report and stop: the peers are now out of step
            record["error"] = f"{type(exc).__name__}: {exc}"
            emit(record)
            raise
        emit(record)
    dist.barrier()
    dist.destroy_process_group()


def _run_method(ctx: Any, name: str, *, reps: int, warmup: int, make: Any, pool: Any,
                check: Any) -> dict[str, Any]:
    """Set up ``name``, run ``warmup + reps`` versions (new weights each), verify each one."""
    import torch.distributed as dist

    from weightsync.apps.bench.weights import fill

    if ctx.role == "reader":
        for t in ctx.tensors.values():
            t.zero_()
    dist.barrier()
    rss_before = status_bytes("VmRSS")
    shmem_before = status_bytes("RssShmem")
    hwm_ok = reset_peak_rss()
    peak = 0  # the highest resident memory *during a sync* above rss_before (not the checks between)
    method = make(name, ctx)
    times: list[float] = []
    phases: list[dict[str, float]] = []
    received: list[int] = []
    bad: set[str] = set()
    verified: list[bool] = []
    t_setup = time.perf_counter()
    try:
        method.setup()
        setup_seconds = time.perf_counter() - t_setup
        for i in range(warmup + reps):
            version = pool.at(i)
            if ctx.role == "writer":
                fill(ctx.layout, method.source_tensors(), version)  # untimed: "training" made version i
            if hwm_ok:
                reset_peak_rss()  # the peak counts the sync only
            dist.barrier()
            t0 = time.perf_counter()
            report = method.sync(i)
            dt = time.perf_counter() - t0
            if hwm_ok:
                peak = max(peak, status_bytes("VmHWM") - rss_before)
            if ctx.role == "reader":  # untimed: every byte of version i, bitwise
                wrong = check(version)
                verified.append(not wrong)
                bad.update(wrong)
            if i >= warmup:
                times.append(dt)
                phases.append(report.phases)
                received.append(report.received_bytes)
            elif i == 0:
                setup_seconds += dt
        peak = peak if hwm_ok else -1
        shmem = status_bytes("RssShmem") - shmem_before
    finally:
        dist.barrier()  # nobody tears down (unlinks shared memory, files) while a peer still reads
        method.close()
    out = {"seconds": times, "phases": phases, "first_sync_seconds": setup_seconds,
           "peak_extra_bytes": peak, "shared_mapped_bytes": shmem}
    if ctx.role == "reader":
        out |= {"received_bytes": received, "verified": all(verified) and len(verified) == warmup + reps,
                "verified_versions": verified, "mismatches": sorted(bad)[:5]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.apps.bench.worker")
    parser.add_argument("--spec", required=True, help="case spec (JSON)")
    parser.add_argument("--rank", type=int, required=True, help="global rank: writers first, then readers")
    args = parser.parse_args(argv)
    run_case(json.loads(args.spec), args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
